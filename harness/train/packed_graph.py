"""P11: a packed (THD) micro-batch of a fixed token budget as ONE captured CUDA graph, through a static
PackedSeqParams buffer (#5672, model/packed_seq.py). This is Megatron's static-shape THD Transformer Engine CUDA
graphs (#4359, #5258, #5724, #8361) with torch.cuda.graphs: Transformer Engine is not installable on these machines,
so its capture path (te.make_graphed_callables) is not exercised or validated here.

A graph replays fixed shapes, fixed addresses and no host code. `PackedGraphStep` owns every input of the step at
a fixed address -- the token ids and labels [B, S] and the int32 buffer [4, max_seqs + 1] of cu_seqlens (+ padded)
that `packed_seq.copy_into` rewrites per micro-batch (fewer documents: zero-length ones at the end) -- and the
captured region derives everything else on the device:

    seg, pos [B*S]       Layout.from_static_buffer(buf)       (no host read of the offsets)
    compressor slots     DSv4Model.forward's prepare_layout    (static N = ceil(T / m) slots, empty ones masked)
    loss                 DSv4Model.forward(..., return_logits=False)
    .grad                loss.backward()

A micro-batch is then `load(ids, labels, cu_seqlens, cu_seqlens_padded)` (host-side checks and copies into the
static tensors) and `step()` (a replay). The first captured `step()` runs the region `warmup` times eagerly on a side
stream first (Triton's autotuning and compiles, cuBLAS workspaces), then captures it. After every step the
parameters' `.grad` hold that micro-batch's gradients, fresh, not accumulated; under capture they are the graph's
own tensors, which every replay rewrites and `step()` hands back even where code between steps (an optimizer's
`zero_grad(set_to_none=True)`) rebound `.grad` (copy or accumulate them elsewhere).

What the region reads on the host is fixed at capture: the config's scalars (the MTP loss weight, the indexer loss
mode), the model's switches (head_ce, out_rope, recompute), autocast. A schedule that changes one of them needs a
new PackedGraphStep (a recapture); this is why `dsv4 train --packing --cuda-graphs` (whose MTP weight and indexer
stage change per step) still runs Inductor's cudagraph trees over the blocks instead.

With capture off (CPU, or capture=False) the same region runs eagerly on every step. The tests compare it with the
dynamic layout (`Layout.packed`) per micro-batch, and trace it with torch.compile(fullgraph=True, dynamic=False)
across micro-batches: no graph break and no recompile means no host read and no data-dependent shape in the
region's forward and backward, the host-side conditions of a capture. The capture itself is tested on a GPU.
"""
from __future__ import annotations

import torch

from dsv4.model.layout import IGNORE, Layout
from dsv4.model.packed_seq import PackedSeqError, copy_into, stream_offsets


def _check_capturable(model) -> None:
    """Refuse, naming the fix, what reads device values on the host inside the region: routed experts on the "loop"
    GEMM (per-expert counts; `moe.expert_gemm` resolves "auto", seen with the expert weights' dtype)."""
    from dsv4.model.moe import Experts, expert_gemm
    for name, mod in model.named_modules():
        if isinstance(mod, Experts) and expert_gemm(mod.gemm, mod.w13, mod.w13) == "loop":
            raise PackedSeqError(f"PackedGraphStep: {name}.gemm {mod.gemm!r} reads the per-expert counts on the host, "
                                 "which a CUDA graph cannot; DSv4Model.set_expert_gemm('grouped' or 'dense')")


class PackedGraphStep:
    """The fwd + bwd of `model` on packed rows [B, S] = `shape` with at most `max_seqs` documents, captured once
    as a CUDA graph (capture: default on a CUDA model) and replayed per micro-batch (module doc)."""

    def __init__(self, model, shape: tuple[int, int], max_seqs: int, capture: bool | None = None, warmup: int = 2):
        p = next(model.parameters())
        B, S = (int(n) for n in shape)
        if B < 1 or S < 1 or max_seqs < 1:
            raise PackedSeqError(f"PackedGraphStep: shape {tuple(shape)} and max_seqs {max_seqs} must be positive")
        capture = p.is_cuda if capture is None else bool(capture)
        if capture and not p.is_cuda:
            raise PackedSeqError(f"PackedGraphStep: capture needs the model on a CUDA device, it is on {p.device}")
        if capture:
            _check_capturable(model)
        self.model, self.shape, self.max_seqs, self.capture, self.warmup = model, (B, S), int(max_seqs), capture, warmup
        self.params = [q for q in model.parameters() if q.requires_grad]
        self.ids = torch.zeros(B, S, dtype=torch.long, device=p.device)
        self.labels = torch.full((B, S), IGNORE, dtype=torch.long, device=p.device)
        self.buf = torch.zeros(4, self.max_seqs + 1, dtype=torch.int32, device=p.device)   # no documents yet
        self.graph = None
        self.loss = None
        self.grads: list = []

    def load(self, input_ids: torch.Tensor, labels: torch.Tensor, cu_seqlens, cu_seqlens_padded=None) -> None:
        """Copy a micro-batch into the static tensors: ids / labels [B, S], offsets into the B*S slots (host
        tensors, as a data loader yields them: checked on the host, no synchronisation)."""
        for name, t in (("input_ids", input_ids), ("labels", labels)):
            if tuple(t.shape) != self.shape:
                raise PackedSeqError(f"PackedGraphStep.load: {name} shape {tuple(t.shape)} != the static "
                                     f"{self.shape}")
        end = int(torch.as_tensor(cu_seqlens if cu_seqlens_padded is None else cu_seqlens_padded)[-1])
        if end > self.shape[0] * self.shape[1]:
            raise PackedSeqError(f"PackedGraphStep.load: cu_seqlens_padded ends at {end}, past the "
                                 f"{self.shape[0] * self.shape[1]} slots")
        copy_into(self.buf, stream_offsets(cu_seqlens, cu_seqlens_padded), self.shape[1])   # a document fits a row
        self.ids.copy_(input_ids, non_blocking=True)
        self.labels.copy_(labels, non_blocking=True)

    def forward(self) -> torch.Tensor:
        """The loaded micro-batch's loss: layout from the buffer, then the model's forward."""
        layout = Layout.from_static_buffer(self.buf, self.shape)               # seg / pos [B*S] on the device
        return self.model(self.ids, labels=self.labels, layout=layout, return_logits=False).loss

    def region(self) -> torch.Tensor:
        """What the graph holds: `forward`, then the backward into fresh .grad tensors (set to None first: under
        capture they are allocated in the graph's pool) -> the loss (detached)."""
        for q in self.params:
            q.grad = None
        loss = self.forward()
        loss.backward()
        return loss.detach()

    def step(self) -> torch.Tensor:
        """The loaded micro-batch's loss (under capture a static tensor, rewritten by the next step); every
        parameter's .grad is this micro-batch's gradient (under capture the graph's tensors, rebound after each
        replay)."""
        if not self.capture:
            return self.region()
        if self.graph is None:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):                                      # autotuning / compiles, not captured
                for _ in range(self.warmup):
                    self.region()
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.loss = self.region()
            self.grads = [q.grad for q in self.params]                         # allocated in the graph's pool
        self.graph.replay()
        for q, g in zip(self.params, self.grads):   # the replay wrote these; code between steps (an optimizer's
            q.grad = g                              # zero_grad(set_to_none=True), an eager run) may have rebound .grad
        return self.loss
