"""Pipeline and virtual-pipeline parallelism with mHC streams (slice P3; spec §3, §4, §10.1).

With mHC the residual state between two layers is the n_hc streams X [B, S, n, d], not one hidden state, so what
crosses a pipeline-stage boundary (forward) and its gradient (backward) are [B, S, n, d] tensors. The HyperHead
collapse (spec §4.3) runs only on the last stage, right before the final norm, and the MTP block (spec §10.1)
also sits on the last stage because it reads the final streams X_L before the HyperHead.

    chunk 0          : ids -> Embed -> expand_streams -> layers            -> X  [B, S, n, d]  --send-->
    chunk k (middle) : X (recv)                       -> layers            -> X  [B, S, n, d]  --send-->
    chunk last       : X (recv)                       -> layers -> HyperHead -> norm -> head -> lm loss
                                                                -> MTP(X_L, Embed(ids_next)) -> head -> mtp loss

Model chunks (Megatron "virtual pipeline stages"): the layer list is cut into pp * vpp chunks; rank r owns chunks
r, r + pp, r + 2 pp, ... (Megatron's interleaved assignment). A HybridModel pattern gives the cuts with `|`
(megatron_dsv4.md §2.2); with VPP it has pp * vpp parts. The embedding is shared by chunk 0 (input) and the last
chunk (MTP input, spec §10.1): when those live on different ranks each rank keeps a copy and their gradients are
summed after backward (`allreduce_embedding_grads`, Megatron's embedding group).

Schedule (`build_schedule`): all forwards, then all backwards (GPipe order), each phase in Megatron's interleaved
order: micro-batches go in groups of pp, and inside a group a rank runs its chunks in turn (forward: chunk
r, r + pp, ...; backward: the reverse). With vpp > 1 the number of micro-batches must be a multiple of pp (as in
Megatron's interleaved schedule). Every micro-batch's objective is divided by M (gradient accumulation).

Losses: every chunk forms its part with model/losses.assemble_losses (the assembler of DSv4Model): the last
chunk lm + mtp_loss_scaling_factor * mtp; the indexer and MoE auxiliary losses are returned by the layers of
whichever chunk holds them (its forward's AuxLosses) and back-propagated by that chunk (the whole-model loss
is their sum). Reported metrics are reduced over
the pipeline ranks.

Transports: `P2PTransport` (torch.distributed send/recv, e.g. gloo on CPU) and `LoopbackTransport` (one process
plays every rank: `run_local`). Both check that every tensor crossing a boundary has the static shape
[B, S, n_hc, d]; shapes are known from the config and the micro-batch size, as in Megatron's p2p communication.
(Megatron-Core sends the streams flattened as [s, b, n*h]; here they keep the model's [B, S, n, d] layout.)
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dsv4.model.config import ConfigError
from dsv4.model.mhc import expand_streams, hc_head
from dsv4.model.layout import Layout
from dsv4.model.losses import AuxLosses, assemble_losses
from dsv4.model.model import IGNORE, DSv4Model

FWD, BWD = 0, 1            # message tags: streams forward, their gradient backward
METRICS = ("lm loss", "mtp_1 loss", "indexer loss", "moe aux loss")


# ---------------------------------------------------------------------------------------------------------
# stages
# ---------------------------------------------------------------------------------------------------------

class ModelChunk(nn.Module):
    """One virtual pipeline stage: a contiguous range of the model's blocks plus, on the ends, embed / head.

    Submodules are the model's own objects (no copies), registered under the model's names, so
    `chunk.named_parameters()` yields `embed.weight`, `layers.{i}.*`, `norm.weight`, `hc_head_*`, `head.weight`,
    `mtp.0.*` exactly as in the whole model.
    """

    def __init__(self, model: DSv4Model, layer_ids: list[int], chunk_id: int, num_chunks: int):
        super().__init__()
        self.cfg, self.chunk_id, self.num_chunks = model.cfg, chunk_id, num_chunks
        self.is_first, self.is_last = chunk_id == 0, chunk_id == num_chunks - 1
        self.layer_ids = list(layer_ids)
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layer_ids})
        self.backend = model.backend
        if self.is_first or (self.is_last and len(model.mtp)):
            self.embed = model.embed                       # chunk 0: input; last chunk: MTP input (shared)
        if self.is_last:
            self.norm, self.head, self.mtp = model.norm, model.head, model.mtp
            self.hc_head_fn, self.hc_head_base, self.hc_head_scale = (model.hc_head_fn, model.hc_head_base,
                                                                      model.hc_head_scale)

    def set_kernel_backend(self, backend: str) -> "ModelChunk":
        """As `DSv4Model.set_kernel_backend`, for this chunk's modules (incl. its own HyperHead call)."""
        for m in self.modules():
            if hasattr(m, "backend") and isinstance(m.backend, str):
                m.backend = backend
        return self

    def forward(self, X: torch.Tensor | None, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                layout: Layout | None = None):
        """X [B, S, n, d] streams (None on chunk 0), input_ids [B, S], labels [B, S] (last chunk).

        Returns (out, aux, metrics): out = the streams [B, S, n, d] (not last) or the scalar lm + lambda * mtp
        loss (last); aux = this chunk's indexer + MoE aux losses (scalar with graph, or None); metrics = detached
        scalars under Megatron's names.
        """
        cfg = self.cfg
        B, S = input_ids.shape
        if layout is None:
            layout = Layout.batch(B, S, input_ids.device)                          # B documents of S tokens
        aux = AuxLosses()
        if self.is_first:
            X = expand_streams(self.embed(input_ids), cfg.hc_mult)                 # [B, S, d] -> [B, S, n, d]
        for i in self.layer_ids:
            X = self.layers[str(i)](X, input_ids, layout, aux)                     # [B, S, n, d]
        lm = mtp = None
        out = X
        if self.is_last:
            if labels is None:
                raise ValueError("ModelChunk.forward: the last chunk needs labels")
            y = self.norm(hc_head(X, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, cfg, self.backend))
            lm = _ce_sum(self.head(y), labels)                                     # [B, S, V] logits
            if len(self.mtp):                                                      # MTP reads the final streams X
                ids_next = layout.roll_next(input_ids, 0)                          # [B, S]: token t+1
                y_mtp = self.mtp[0](X, self.embed(ids_next), ids_next, layout, aux)
                mtp = _ce_sum(self.head(y_mtp), layout.roll_next(labels, IGNORE))
        main, extra, metrics = assemble_losses(cfg, aux, lm, mtp)
        return (main if self.is_last else out), extra, metrics


def _ce_sum(logits, labels):
    labels = labels.reshape(-1)
    s = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels, ignore_index=IGNORE, reduction="sum")
    return s, (labels != IGNORE).sum().to(s.dtype)


def _stages_from(model: DSv4Model, stages) -> list[list[int]]:
    if isinstance(stages, str):
        from dsv4.model.hybrid import parse_pattern
        stages = parse_pattern(stages, base=model.cfg).stages
    elif hasattr(stages, "stages"):                                                # HybridLayout
        stages = stages.stages
    return [list(s) for s in stages]


def split_stages(model: DSv4Model, stages) -> list[ModelChunk]:
    """Cut `model` into model chunks (virtual pipeline stages), in pipeline order.

    `stages`: a list of layer-index lists (one per chunk; contiguous, covering 0..L-1 in order; a middle chunk
    may be empty), a HybridModel pattern string whose `|` cuts give the chunks, or a `HybridLayout`. With
    pipeline size pp and VPP size v there are pp * v chunks; rank r owns `chunks_of_rank(chunks, r, pp)`.
    Hash-routed layers must be on chunk 0 (with the embedding), as Megatron requires for PP > 1.
    """
    stages = _stages_from(model, stages)
    L = model.cfg.num_hidden_layers
    flat = [i for s in stages for i in s]
    if flat != list(range(L)):
        raise ConfigError(f"pipeline stages: {stages} must list layers 0..{L - 1} contiguously, in order")
    if len(stages) > 1 and any(model.cfg.is_hash(i) for s in stages[1:] for i in s):
        raise ConfigError(f"pipeline stages: hash layers (num_hash_layers={model.cfg.num_hash_layers}) must be "
                          f"on the first stage with the embedding, got stages {stages}")
    return [ModelChunk(model, s, k, len(stages)) for k, s in enumerate(stages)]


def even_stages(num_layers: int, num_chunks: int) -> list[list[int]]:
    """Layers 0..L-1 cut into num_chunks contiguous chunks, sizes differing by at most one (earlier ones larger)."""
    if not 1 <= num_chunks <= num_layers:
        raise ConfigError(f"pipeline: num_chunks={num_chunks} must be in 1..num_layers={num_layers}")
    q, r = divmod(num_layers, num_chunks)
    out, start = [], 0
    for k in range(num_chunks):
        n = q + (k < r)
        out.append(list(range(start, start + n)))
        start += n
    return out


def chunk_owner(chunk: int, pp: int) -> int:
    """Rank holding global chunk `chunk` (interleaved: rank r owns r, r + pp, ...)."""
    return chunk % pp


def chunks_of_rank(chunks: list, rank: int, pp: int) -> dict[int, "ModelChunk"]:
    """{global chunk id: chunk} owned by `rank`, in local (virtual-stage) order."""
    if len(chunks) % pp:
        raise ConfigError(f"pipeline: {len(chunks)} chunks is not a multiple of pipeline size pp={pp}")
    return {k: chunks[k] for k in range(rank, len(chunks), pp)}


# ---------------------------------------------------------------------------------------------------------
# schedule
# ---------------------------------------------------------------------------------------------------------

def build_schedule(pp: int, vpp: int, num_microbatches: int) -> list[list[tuple[str, int, int]]]:
    """Per rank, the ordered actions ("F" | "B", micro-batch, global chunk): all forwards, then all backwards.

    Megatron's interleaved order: the k-th forward of rank r runs micro-batch (k // (pp*vpp)) * pp + k % pp on
    local chunk (k // pp) % vpp; the k-th backward runs the same micro-batch on local chunk vpp - 1 - that.
    """
    M = num_microbatches
    if pp < 1 or vpp < 1 or M < 1:
        raise ConfigError(f"pipeline schedule: pp={pp}, vpp={vpp}, num_microbatches={M} must all be >= 1")
    if vpp > 1 and M % pp:
        raise ConfigError(f"pipeline schedule: num_microbatches={M} must be a multiple of pp={pp} with vpp={vpp}")
    out = []
    for r in range(pp):
        fwd, bwd = [], []
        for k in range(M * vpp):
            mb = (k // (pp * vpp)) * pp + k % pp if vpp > 1 else k
            v = (k // pp) % vpp if vpp > 1 else 0
            fwd.append(("F", mb, v * pp + r))
            bwd.append(("B", mb, (vpp - 1 - v) * pp + r))
        out.append(fwd + bwd)
    return out


# ---------------------------------------------------------------------------------------------------------
# transports
# ---------------------------------------------------------------------------------------------------------

class _Transport:
    """Checks the static streams shape of everything sent; records (direction, shape) in `self.log`."""

    def __init__(self, shape: tuple, dtype: torch.dtype):
        self.shape, self.dtype = tuple(shape), dtype
        self.log: list[tuple[str, tuple]] = []

    def _check(self, t: torch.Tensor, what: str):
        if tuple(t.shape) != self.shape or t.dtype != self.dtype:
            raise ValueError(f"pipeline {what}: tensor {tuple(t.shape)} {t.dtype} is not the streams shape "
                             f"[B, S, n_hc, d] = {self.shape} {self.dtype}")

    def can_recv(self, src: int, dst: int, tag: int) -> bool:
        return True


class P2PTransport(_Transport):
    """torch.distributed point-to-point (gloo on CPU): isend (kept alive until `wait`), blocking recv."""

    def __init__(self, shape, dtype, group=None):
        super().__init__(shape, dtype)
        self.group, self.pending = group, []

    def _global(self, r):
        return r if self.group is None else dist.get_global_rank(self.group, r)

    def send(self, t: torch.Tensor, src: int, dst: int, tag: int):
        self._check(t, "send")
        t = t.detach().contiguous()
        self.log.append(("send", tuple(t.shape)))
        self.pending.append((dist.isend(t, self._global(dst), group=self.group, tag=tag), t))

    def recv(self, src: int, dst: int, tag: int) -> torch.Tensor:
        buf = torch.empty(self.shape, dtype=self.dtype)
        dist.recv(buf, self._global(src), group=self.group, tag=tag)
        self.log.append(("recv", tuple(buf.shape)))
        return buf

    def wait(self):
        for work, _ in self.pending:
            work.wait()
        self.pending = []


class LoopbackTransport(_Transport):
    """One process plays every rank: FIFO queues per (src, dst, tag) holding detached copies."""

    def __init__(self, shape, dtype):
        super().__init__(shape, dtype)
        self.queues: dict[tuple, deque] = {}

    def send(self, t, src, dst, tag):
        self._check(t, "send")
        self.log.append(("send", tuple(t.shape)))
        self.queues.setdefault((src, dst, tag), deque()).append(t.detach().clone())

    def can_recv(self, src, dst, tag):
        return bool(self.queues.get((src, dst, tag)))

    def recv(self, src, dst, tag):
        t = self.queues[(src, dst, tag)].popleft()
        self._check(t, "recv")
        self.log.append(("recv", tuple(t.shape)))
        return t

    def wait(self):
        pass


# ---------------------------------------------------------------------------------------------------------
# one rank's execution
# ---------------------------------------------------------------------------------------------------------

@dataclass
class _RankState:
    rank: int
    chunks: dict                                   # global chunk id -> ModelChunk
    actions: list
    pos: int = 0
    saved: dict = field(default_factory=dict)      # (mb, chunk) -> (input leaf | None, output, aux)
    metrics: list = field(default_factory=list)    # per forward: dict of detached scalars


def _ready(st: _RankState, transport, pp: int, num_chunks: int) -> bool:
    kind, mb, c = st.actions[st.pos]
    if kind == "F" and c > 0:
        return transport.can_recv(chunk_owner(c - 1, pp), st.rank, FWD)
    if kind == "B" and c < num_chunks - 1:
        return transport.can_recv(chunk_owner(c + 1, pp), st.rank, BWD)
    return True


def _step(st: _RankState, transport, batches, pp: int, num_chunks: int):
    kind, mb, c = st.actions[st.pos]
    st.pos += 1
    ids, labels, *lay = batches[mb]                                # (ids, labels[, layout]): a packed micro-batch
    chunk, M = st.chunks[c], len(batches)
    if kind == "F":
        X = None
        if c > 0:
            X = transport.recv(chunk_owner(c - 1, pp), st.rank, FWD).requires_grad_(True)   # [B, S, n, d]
        out, aux, metrics = chunk(X, ids, labels if chunk.is_last else None, lay[0] if lay else None)
        st.metrics.append(metrics)
        if not chunk.is_last:
            transport.send(out, st.rank, chunk_owner(c + 1, pp), FWD)
        st.saved[(mb, c)] = (X, out, aux)
        return
    X, out, aux = st.saved.pop((mb, c))
    tensors, grads = [], []
    if chunk.is_last:
        obj = out if aux is None else out + aux
        tensors, grads = [obj / M], [None]
    else:
        g = transport.recv(chunk_owner(c + 1, pp), st.rank, BWD)                         # [B, S, n, d]
        tensors, grads = [out], [g]
        if aux is not None:
            tensors.append(aux / M)
            grads.append(None)
    torch.autograd.backward(tensors, grads)
    if X is not None:
        transport.send(X.grad, st.rank, chunk_owner(c - 1, pp), BWD)


def _reduce_metrics(states: list[_RankState]) -> tuple[torch.Tensor, torch.Tensor]:
    """(sums, seen) over the ranks' forwards: per metric of METRICS, its sum and whether any chunk reported it."""
    sums = torch.zeros(len(METRICS), dtype=torch.float64)
    seen = torch.zeros(len(METRICS), dtype=torch.float64)
    for st in states:
        for m in st.metrics:
            for j, k in enumerate(METRICS):
                if k in m:
                    sums[j] += float(m[k])
                    seen[j] = 1
    return sums, seen


def _finish_metrics(sums, seen, M, cfg) -> dict[str, float]:
    """Metrics averaged over the M micro-batches, plus "loss" = lm + lambda * mtp + indexer + moe aux."""
    out = {k: sums[j].item() / M for j, k in enumerate(METRICS) if seen[j] > 0}
    loss = out["lm loss"] + cfg.mtp_loss_scaling_factor * out.get("mtp_1 loss", 0.0)
    out["loss"] = loss + out.get("indexer loss", 0.0) + out.get("moe aux loss", 0.0)
    return out


def run_rank(chunks: dict, batches: list, pp: int, vpp: int, rank: int, transport: P2PTransport,
             group=None) -> dict[str, float]:
    """Run this rank's part of one pipelined step (forwards + backwards of all micro-batches).

    chunks: `chunks_of_rank(...)` for this rank; batches: [(input_ids [B, S], labels [B, S])] * M, the same on
    every rank. Gradients accumulate into `.grad` (call `allreduce_embedding_grads` afterwards). Returns the
    metrics averaged over micro-batches (reduced over `group`), incl. "loss".
    """
    num_chunks = pp * vpp
    st = _RankState(rank, chunks, build_schedule(pp, vpp, len(batches))[rank])
    while st.pos < len(st.actions):
        _step(st, transport, batches, pp, num_chunks)
    transport.wait()
    sums, seen = _reduce_metrics([st])
    dist.all_reduce(sums, group=group)
    dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=group)
    cfg = next(iter(chunks.values())).cfg
    return _finish_metrics(sums, seen, len(batches), cfg)


def run_local(chunks: list[ModelChunk], batches: list, pp: int, vpp: int = 1,
              transport: LoopbackTransport | None = None) -> dict[str, float]:
    """Play every rank of a pp x vpp pipeline in one process through a `LoopbackTransport` (same step code).

    Ranks advance round-robin; a rank whose next action waits for a message yields to the next rank.
    """
    num_chunks = pp * vpp
    if len(chunks) != num_chunks:
        raise ConfigError(f"pipeline: {len(chunks)} chunks, expected pp * vpp = {pp} * {vpp}")
    B, S = batches[0][0].shape
    cfg = chunks[0].cfg
    if transport is None:
        transport = LoopbackTransport((B, S, cfg.hc_mult, cfg.hidden_size), chunks[0].embed.weight.dtype)
    sched = build_schedule(pp, vpp, len(batches))
    states = [_RankState(r, chunks_of_rank(chunks, r, pp), sched[r]) for r in range(pp)]
    while any(st.pos < len(st.actions) for st in states):
        progressed = False
        for st in states:
            while st.pos < len(st.actions) and _ready(st, transport, pp, num_chunks):
                _step(st, transport, batches, pp, num_chunks)
                progressed = True
        if not progressed:
            raise RuntimeError("pipeline run_local: deadlock (no rank can make progress)")
    sums, seen = _reduce_metrics(states)
    return _finish_metrics(sums, seen, len(batches), cfg)


def embedding_group(pp: int, vpp: int, mtp: bool):
    """Collective (every rank calls it): the process group of the ranks holding the embedding -- chunk 0 and,
    with MTP, the last chunk -- or None when one rank holds every copy. Megatron's embedding group."""
    ranks = sorted({chunk_owner(0, pp), chunk_owner(pp * vpp - 1, pp) if mtp else chunk_owner(0, pp)})
    return dist.new_group(ranks) if len(ranks) > 1 else None


def allreduce_embedding_grads(chunks: dict, group) -> None:
    """Sum `embed.weight.grad` of the first and last chunk's copies (shared embedding, spec §10.1)."""
    if group is None:
        return
    embeds = {id(c.embed): c.embed for c in chunks.values() if hasattr(c, "embed")}
    for e in embeds.values():
        if e.weight.grad is None:
            e.weight.grad = torch.zeros_like(e.weight)
        dist.all_reduce(e.weight.grad, group=group)
