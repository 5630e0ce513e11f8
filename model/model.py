"""The DSv4 network (spec §3): embedding -> n_hc streams -> L blocks -> HyperHead -> norm -> head, + MTP.

    e = Embed(ids); X = [e]*n_hc                       [B, S, n, d]
    X = Block_l(X) for l < L                           mHC(attention) + mHC(FFN)   (model/block.py)
    logits = head(norm(HyperHead(X)))                  [B, S, V]
    mtp_logits = head(MTP(X, Embed(ids_next)))         depth 1 (model/mtp.py)

Labels follow Megatron: `labels[:, t]` is the target of position t (already shifted), -100 = ignored. The MTP
input at position t is token t+1 of t's document (`ids_next`; a document's last position gets id 0) and its
target is `labels[:, t+1]` of the same document (a document's last position is ignored).

loss = lm + mtp_loss_scaling_factor * mtp_1 + indexer + moe aux, formed by model/losses.assemble_losses (the
one assembler of every path); `losses` holds detached scalars under Megatron's metric names ("lm loss",
"mtp_1 loss" (unscaled CE), "indexer loss", "moe aux loss"). Every forward runs on a `Layout`
(model/layout.py): a plain [B, S] batch is B documents of S tokens, a packed row carries cu_seqlens.
Parameter names follow DeepSeek's official checkpoint (`embed.weight`, `layers.{i}.*`, `norm.weight`,
`hc_head_*`, `head.weight`, `mtp.0.*`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from dsv4.model.attention import ALL_PICKED, ATTN_FWDS, OUT_ROPES, DSv4Attention
from dsv4.model.block import Block
from dsv4.model.config import ConfigError, DSv4Config
from dsv4.model.indexer import INDEXER_FWDS, Indexer
from dsv4.model.layout import IGNORE, Layout, LayoutError
from dsv4.model.losses import AuxLosses, acc, assemble_losses
from dsv4.model.mhc import expand_streams, hc_head, mhc_parameters
import dsv4.kernels as kernels
from dsv4.kernels.cross_entropy import ce_dlogits, ce_lse
from dsv4.model.moe import EXPERT_GEMMS, Experts, Gate, MoE
from dsv4.model.mtp import MTPBlock
from dsv4.model.norm import RMSNorm
from dsv4.model.precision import autocast_operands, cast_model
from dsv4.model.recompute import checkpoint_block


@dataclass
class DSv4Output:
    logits: torch.Tensor | None                  # [B, S, V] (None when forward(..., return_logits=False))
    mtp_logits: torch.Tensor | None = None       # [B, S, V] (position t predicts token t+2)
    loss: torch.Tensor | None = None             # scalar, with graph
    losses: dict = field(default_factory=dict)   # Megatron metric name -> detached scalar
    aux: AuxLosses | None = None                 # this forward's auxiliary losses and indexer selections


def _check_mode(mode: str, known, setter: str) -> str:
    """`mode` if it is one of `known`, else a ValueError naming the setter and the known modes."""
    if mode not in known:
        raise ValueError(f"{setter}: unknown mode {mode!r}; known: {', '.join(known)}")
    return mode


class DSv4Model(nn.Module):
    def __init__(self, cfg: DSv4Config):
        super().__init__()
        if cfg.num_nextn_predict_layers not in (0, 1):
            raise ConfigError(f"DSv4Config.num_nextn_predict_layers: only 0 or 1 supported, got "
                              f"{cfg.num_nextn_predict_layers}")
        self.cfg = cfg
        d = cfg.hidden_size
        self.embed = nn.Embedding(cfg.vocab_size, d)
        nn.init.normal_(self.embed.weight, std=cfg.initializer_range)
        self.layers = nn.ModuleList([Block(cfg, i) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.hc_head_fn, self.hc_head_base, self.hc_head_scale = mhc_parameters(cfg, head=True)
        self.head = nn.Linear(d, cfg.vocab_size, bias=False)
        nn.init.normal_(self.head.weight, std=cfg.initializer_range)
        self.mtp = nn.ModuleList([MTPBlock(cfg, cfg.num_hidden_layers + k)
                                  for k in range(cfg.num_nextn_predict_layers)])
        self.backend = "naive"
        self.recompute = False
        self.head_ce = "grad_in_forward"   # set_head_ce: when the LM / MTP heads' cross-entropy gradients are formed

    # ------------------------------------------------------------------ forward
    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                return_logits: bool = True, cu_seqlens: torch.Tensor | None = None,
                cu_seqlens_padded: torch.Tensor | None = None, layout: Layout | None = None) -> DSv4Output:
        """input_ids [B, S] (int), labels [B, S] or None -> DSv4Output.

        The batch's documents: `cu_seqlens` (+ `cu_seqlens_padded`, Megatron's PackedSeqParams) over the B*S
        tokens, e.g. a packed row [1, T]; neither: B documents of S tokens; or a prepared `layout` (a parallel
        layout, model/context_parallel.py). Every document's logits / mtp_logits equal running it alone.
        Labels follow Megatron: labels[t] = target of t (already shifted inside each document), -100 ignored;
        the MTP labels are the labels rolled once inside each document (model/layout.py).
        return_logits=False (needs labels): the LM and MTP cross-entropies are computed by `head_cross_entropy`
        over row blocks, never holding the [B, S, V] logits (same loss; `logits`/`mtp_logits` are None)."""
        if not return_logits and labels is None:
            raise ValueError("DSv4Model.forward: return_logits=False needs labels")
        B, S = input_ids.shape
        if layout is None:
            layout = Layout.batch(B, S, input_ids.device) if cu_seqlens is None else \
                Layout.packed(cu_seqlens, (B, S), cu_seqlens_padded, input_ids.device)
        elif cu_seqlens is not None:
            raise ValueError("DSv4Model.forward: give cu_seqlens or a layout, not both")
        cfg = self.cfg
        aux = AuxLosses()
        e = self.embed(input_ids)                                               # [B, S, d]
        X = expand_streams(e, cfg.hc_mult)                                      # [B, S, n, d]
        ckpt = self.recompute and torch.is_grad_enabled()
        prepare_layout(layout, list(self.layers) + list(self.mtp))
        for layer in self.layers:
            X = run_block(ckpt, layer, aux, X, input_ids, layout)
        y = self.norm(hc_head(X, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, cfg, self.backend))

        y_mtp = None
        if len(self.mtp):
            ids_next = layout.roll_next(input_ids, 0)                           # [B, S]: token t+1 in the doc
            e_next = self.embed(ids_next)
            y_mtp = run_block(ckpt, self.mtp[0], aux, X, e_next, ids_next, layout)   # [B, S, d]

        if return_logits:
            out = DSv4Output(logits=self.head(y), mtp_logits=None if y_mtp is None else self.head(y_mtp))
        else:
            out = DSv4Output(logits=None)
        out.aux = aux
        if labels is not None:
            lm = self._ce(out.logits, y, labels)
            mtp = None
            if y_mtp is not None:
                mtp = self._ce(out.mtp_logits, y_mtp, layout.roll_next(labels, IGNORE))
            main, extra, out.losses = assemble_losses(cfg, aux, lm, mtp, layout.global_count)
            out.loss = main if extra is None else main + extra
        return out

    def forward_megatron(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                         attention_mask: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                         packed_seq_params=None, return_logits: bool = True) -> DSv4Output:
        """Megatron GPTModel's arguments: input_ids / position_ids / labels [b, s] ('thd': [1, t]) and a
        `PackedSeqParams` (duck-typed; see Layout.from_packed_seq_params) -> DSv4Output (logits [b, s, V], as
        GPTModel returns them). Converts at the edge: `forward` on the one Layout. DSv4's masks and RoPE positions
        follow from the documents, so attention_mask must be None and position_ids, if given, must be the
        positions inside each document on the real tokens (one line otherwise)."""
        if attention_mask is not None:
            raise LayoutError("attention_mask: must be None (DSv4's masks follow from packed_seq_params' documents)")
        B, S = input_ids.shape
        layout = Layout.from_packed_seq_params(packed_seq_params, (B, S), input_ids.device)
        if position_ids is not None:
            pid = torch.as_tensor(position_ids, device=input_ids.device).expand(B, S).reshape(-1)
            real = layout.seg >= 0
            if not torch.equal(pid[real].long(), layout.pos[real]):
                raise LayoutError("position_ids: DSv4 positions restart at each document of packed_seq_params; "
                                  "got other positions")
        return self(input_ids, labels, return_logits=return_logits, layout=layout)

    def _ce(self, logits, y, labels):
        """(CE sum over the non-ignored targets, their count) of the head's logits (or of y through the head)."""
        labels = labels.reshape(-1)
        n = (labels != IGNORE).sum()
        if logits is not None:
            V = self.cfg.vocab_size
            s = F.cross_entropy(acc(logits).reshape(-1, V), labels, ignore_index=IGNORE, reduction="sum")
        else:
            s = head_cross_entropy(y.reshape(-1, y.shape[-1]), self.head.weight, labels, reduction="sum",
                                   backend=self.backend, grads=self.head_ce)
        return s, n.to(s.dtype)

    # ------------------------------------------------------------------ training helpers
    def update_expert_bias(self) -> None:
        """Auxiliary-loss-free balancing step for every score-routed MoE layer (call after optimizer.step())."""
        for m in self.modules():
            if isinstance(m, Gate):
                m.update_expert_bias()

    def set_kernel_backend(self, backend: str) -> "DSv4Model":
        """Choose the kernel backend ("naive" | "triton") of every module that has one. The backend's ops are
        resolved now (`kernels.prepare`: imports and capability checks), before any torch.compile trace."""
        kernels.prepare(backend)
        for m in self.modules():
            if hasattr(m, "backend") and isinstance(m.backend, str):
                m.backend = backend
        return self

    def _set_on(self, kind: type, attr: str, mode: str) -> "DSv4Model":
        """Set `attr` = mode on every submodule of class `kind` (the per-layer switches below)."""
        for m in self.modules():
            if isinstance(m, kind):
                setattr(m, attr, mode)
        return self

    def set_attn_fwd(self, mode: str) -> "DSv4Model":
        """The sparse attention's forward on the "triton" kernel backend, every attention layer: "triton" (default)
        | "flashmla" (deepseek-ai/FlashMLA's SM90 sparse prefill forward + our Triton backward wherever the call
        qualifies -- flash_mla importable, SM90, bf16, H 64 / 128, head_dim 512 --, the Triton forward elsewhere;
        kernels/sparse_attn/flashmla.py) | "flashmla+cudnn" (the same forward + NVIDIA cudnn-frontend's SM90 DSA
        backward, kernels/sparse_attn/cudnn_bwd.py). Resolved now (the imports), before any torch.compile trace."""
        _check_mode(mode, ATTN_FWDS, "set_attn_fwd")
        if mode != "triton":
            kernels.get_op("sparse_attn", ATTN_FWDS[mode])
        return self._set_on(DSv4Attention, "attn_fwd", mode)

    def set_out_rope(self, mode: str) -> "DSv4Model":
        """Where every attention layer's inverse RoPE of its output runs (spec §5.4; `OUT_ROPES`): "fused"
        (default: inside the sparse attention op; on the "triton" backend in its kernels, keeping only the rotated
        output for the backward -- Megatron-LM dev #7036) | "separate" (kernels/rope after the attention; the
        attention keeps its unrotated output and the output projection the rotated copy). Same math; on "naive"
        bit for bit the same, on "triton" the forward rounds o to bf16 once instead of twice."""
        return self._set_on(DSv4Attention, "out_rope", _check_mode(mode, OUT_ROPES, "set_out_rope"))

    def set_all_picked(self, mode: str) -> "DSv4Model":
        """How every CSA layer's Triton attention reads a selection that lists every entry each query can see (no
        document longer than m (k + 1) - 1 tokens: DSv4Attention._lists_every_visible; `ALL_PICKED`):
        "contiguous" (default: each query's visible range, as HCA does -- the queries of a program share the key
        tiles) | "listed" (the listed rows, gathered one query at a time). The same keys; the summation order
        differs. Other backends always read the listed rows."""
        return self._set_on(DSv4Attention, "all_picked", _check_mode(mode, ALL_PICKED, "set_all_picked"))

    def set_indexer_fwd(self, mode: str) -> "DSv4Model":
        """The indexer's scoring forward on the "triton" kernel backend, every indexer: "triton" (default) | "cudnn"
        (NVIDIA cudnn-frontend's SM90 DSA indexer forward, bf16 or FP8 E4M3 at qk_precision "fp8", + our Triton
        backward wherever the call qualifies -- importable, SM90, cI 128, nI 16/32/64 --, the Triton forward
        elsewhere; kernels/indexer/cudnn_fwd.py). Resolved now (the import), before any torch.compile trace."""
        _check_mode(mode, INDEXER_FWDS, "set_indexer_fwd")
        if mode != "triton":
            kernels.get_op("indexer_scores", INDEXER_FWDS[mode])
        return self._set_on(Indexer, "scores_fwd", mode)

    def set_expert_gemm(self, mode: str) -> "DSv4Model":
        """How every MoE layer's routed-expert GEMMs run: "auto" (default) | "loop" | "grouped" | "dense"
        (`model/moe.py` EXPERT_GEMMS). Same math; "dense" is the static-shape variant for torch.compile."""
        return self._set_on(Experts, "gemm", _check_mode(mode, EXPERT_GEMMS, "set_expert_gemm"))

    def set_head_ce(self, mode: str) -> "DSv4Model":
        """When the head cross-entropy (forward(..., return_logits=False)) forms its gradients:
        "grad_in_forward" (default: the forward contracts each block's dlogits at once, 3 GEMMs a block instead
        of 4; each head (LM, MTP) holds an fp32 dW [V, d] from its forward to its backward, about one V*d*4 bytes
        more at the peak than recompute: +0.25 GiB for `proxy`, ~2 GiB for `flash`, `dsv4 plan --head-ce`;
        1.03-1.05x the step at 16K tokens on the H200, goldens/h200/D9/bench_train.json) | "recompute" (backward
        recomputes each row block's logits: the lower-memory choice for a large V x d head). Only where the loss
        goes through the blocked head CE (forward(..., return_logits=False): `dsv4 train`'s bf16 single-device
        runs, the bench). `HEAD_CE`, `_HeadCrossEntropy`. Same loss; the gradients differ by roundings only."""
        self.head_ce = _check_mode(mode, HEAD_CE, "set_head_ce")
        return self

    def compile_blocks(self, **compile_kwargs) -> "DSv4Model":
        """torch.compile every block and the MTP block in place (`nn.Module.compile`: parameter names and
        checkpoints unchanged); whole-block recompute wraps the compiled blocks. The Triton ops are custom ops,
        opaque to the compiler; a block traces without graph breaks when the expert GEMM is "grouped" or "dense"
        ("loop" reads the per-expert counts on the host)."""
        for b in list(self.layers) + list(self.mtp):
            b.compile(**compile_kwargs)
        return self

    def set_recompute(self, on: bool = True) -> "DSv4Model":
        """Recompute every block's (and the MTP block's) activations in backward (model/recompute.py): keeps
        only the streams between blocks, for long sequences on one GPU. Same math and gradients."""
        self.recompute = bool(on)
        return self

    # ------------------------------------------------------------------ selective FP32 (P1)
    def to(self, *args, **kwargs):
        device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
        if device is not None:
            super().to(device=device, non_blocking=non_blocking)
        if dtype is not None:
            cast_model(self, dtype)
        return self

    def to_bf16(self) -> "DSv4Model":
        return cast_model(self, torch.bfloat16)

    def bfloat16(self):
        return cast_model(self, torch.bfloat16)

    def half(self):
        return cast_model(self, torch.float16)

    def float(self):
        return cast_model(self, torch.float32)


def prepare_layout(layout: Layout, blocks) -> None:
    """The layout's metadata that the blocks share (the compressors' slot metadata, `Layout.compress_slots`),
    computed once, eagerly, before the blocks run: every layer of a kind reuses it, and compiled blocks
    (compile_blocks, their CUDA graphs under reduce-overhead) only read it -- no memo is filled inside a graph."""
    for b in blocks:
        b.attn.prepare_layout(layout)


def run_block(ckpt: bool, block, aux: AuxLosses, *args):
    """block(*args, local) with a fresh container per block, merged into the forward's `aux` afterwards. A
    block therefore always starts from the same (empty) container: under torch.compile two blocks of one kind
    share one compiled graph (a shared container would be guarded by its length, one recompile per block).
    Under whole-block recompute (`ckpt`) the container is an output of the checkpointed call (discarded with the
    re-run's outputs), so the re-run computes exactly what the forward did -- the same graph, the same saved
    tensors -- and the forward's terms are merged once."""
    if not ckpt:
        local = AuxLosses()
        y = block(*args, local)
        aux.merge(local, block.layer_idx)
        return y

    def run(*a):
        local = AuxLosses(always=True)
        return block(*a, local), local
    y, local = checkpoint_block(run, *args)
    aux.merge(local, block.layer_idx)
    return y


HEAD_CE = ("grad_in_forward", "recompute")      # DSv4Model.set_head_ce's modes, its default first


_MM_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype") and hasattr(torch.ops.aten.addmm, "dtype_out")   # torch >= 2.8


def _dw_add(acc: torch.Tensor | None, gl: torch.Tensor, yb: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    """acc + glᵀ yb [V, d] in dt, the first block taken as it is. On CUDA with bf16 / fp16 operands the GEMM itself
    writes (mm) or adds into acc (addmm) in dt (`out_dtype`): no [V, d] product rounded to bf16, no cast and no
    separate add (at 16K tokens, two heads of two blocks: ~1.3 GB a step). CPU has no `mm.dtype` kernel, and fp32 /
    fp64 operands need none (nor a torch before `out_dtype`): there the product is formed in its dtype and added in
    place."""
    if gl.is_cuda and gl.dtype != dt and _MM_OUT_DTYPE:
        if acc is None:
            return torch.mm(gl.t(), yb, out_dtype=dt)
        return torch.addmm(acc, gl.t(), yb, out_dtype=dt, out=acc)
    part = gl.t() @ yb
    return part.to(dt) if acc is None else acc.add_(part)


def _or_zeros(acc: torch.Tensor | None, like: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    """The accumulated dW, or zeros of `like`'s shape in dt when no block (no rows) was added."""
    return torch.zeros(like.shape, dtype=dt, device=like.device) if acc is None else acc


class _HeadCrossEntropy(torch.autograd.Function):
    """mean over non-ignored rows of CE(y @ W^T, labels), the logits formed in W's dtype and upcast to fp32 as
    `F.cross_entropy(head(y).float(), labels)` does, over blocks of `chunk` rows, never holding [N, V]. The rows'
    softmax math is the kernel op `ce_lse` / `ce_dlogits` (kernels/cross_entropy: naive, or one Triton pass over
    the block). When the gradients are formed (`HEAD_CE`):
      "recompute"        backward recomputes each block's logits: y, W, labels and the per-row log-sum-exp are
                         kept; 4 GEMMs a block (logits, logits again, dy, dW);
      "grad_in_forward"  the forward forms each block's dlogits right after its log-sum-exp and contracts them at
                         once (dy = dlogits W, dW += dlogitsᵀ y) for a unit upstream gradient; backward only scales
                         the kept dy [N, d] and dW [V, d] (fp32) by the upstream scalar. 3 GEMMs a block, and
                         dW [V, d] fp32 is held from the forward to the backward (y is not kept). The loss is a
                         scalar, so dLoss/dy = g * (dLoss/dy at g = 1) exactly; only the roundings of the
                         bf16 dlogits differ (scaled by 1/n rather than g/n).
    Both are Liger-style blocked cross-entropy; only "grad_in_forward" is its fused-linear form."""

    @staticmethod
    def forward(ctx, y, weight, labels, chunk, mean, backend, grad_in_forward):
        N = y.shape[0]
        dt = torch.promote_types(y.dtype, torch.float32)                       # fp32 (fp64 stays fp64)
        valid = labels != IGNORE
        n = valid.sum()
        lse = torch.empty(N, dtype=dt, device=y.device)
        total = torch.zeros((), dtype=dt, device=y.device)
        safe = torch.where(valid, labels, torch.zeros_like(labels))
        if grad_in_forward:                                                    # only the gradients asked for
            need_dy, need_dw = grad_in_forward                                 # the caller's requires_grad (below)
            dy = torch.empty_like(y) if need_dy else None
            dw = None                                                          # [V, d] in dt once a block is in
            unit = valid.to(dt) / n if mean else valid.to(dt)                  # [N]: dLoss of each row at g = 1
        for a in range(0, N, chunk):
            rows = slice(a, a + chunk)
            logits = F.linear(y[rows], weight)                                 # [C, V] in W's dtype
            l, tgt = ce_lse(logits, safe[rows], backend=backend)               # [C] each
            # out of place: with "sum" the Function returns `total`, and torch 2.11's Dynamo routes the gradient
            # of a returned tensor that its forward mutated in place to the wrong output slot (zero gradients:
            # pytorch#180642, fixed in 2.12); the same adds in the same order as `+=`
            total = total + torch.where(valid[rows], l - tgt, torch.zeros_like(l)).sum()
            lse[rows] = l
            if grad_in_forward:
                gl = ce_dlogits(logits, l, safe[rows], unit[rows], backend=backend)   # dlogits [C, V]
                if need_dy:
                    torch.mm(gl, weight, out=dy[rows])                         # into dy's rows, no copy
                if need_dw:
                    dw = _dw_add(dw, gl, y[rows], dt)
        if grad_in_forward:
            ctx.save_for_backward(dy, _or_zeros(dw, weight, dt) if need_dw else None)   # None where not asked for
        else:
            ctx.save_for_backward(y, weight, safe, valid, lse, n)
        ctx.chunk, ctx.mean, ctx.backend = chunk, mean, backend
        ctx.grad_in_forward, ctx.w_dtype, ctx.acc_dtype = grad_in_forward, weight.dtype, dt
        return total / n if mean else total                                    # mean: nan if all are ignored

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        if ctx.grad_in_forward:
            dy, dw = ctx.saved_tensors                                         # at g = 1 (dw in fp32); None if unasked
            g = g.to(ctx.acc_dtype).reshape(1)       # [1], not 0-d: the product is formed in g's dtype (type promotion)
            gy = None if dy is None else torch.mul(dy, g, out=torch.empty_like(dy))        # one pass, stored in dy's
            gw = None if dw is None else torch.mul(dw, g, out=torch.empty_like(dw, dtype=ctx.w_dtype))   # dtypes
            return gy, gw, None, None, None, None, None
        y, weight, safe, valid, lse, n = ctx.saved_tensors
        dy = torch.empty_like(y)
        dt = lse.dtype
        dw = None
        scale = valid.to(dt) * (g.to(dt) / n if ctx.mean else g.to(dt))       # [N]: dLoss of each row, 0 if ignored
        for a in range(0, y.shape[0], ctx.chunk):
            yc, rows = y[a:a + ctx.chunk], slice(a, a + ctx.chunk)
            gl = ce_dlogits(F.linear(yc, weight), lse[rows], safe[rows], scale[rows], backend=ctx.backend)
            torch.mm(gl, weight, out=dy[rows])                                 # gl: dlogits [C, V], logits' dtype
            dw = _dw_add(dw, gl, yc, dt)
        return dy, _or_zeros(dw, weight, dt).to(weight.dtype), None, None, None, None, None


def head_cross_entropy(y: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                       chunk: int = 8192, reduction: str = "mean", backend: str = "naive",
                       grads: str = "recompute") -> torch.Tensor:
    """y [N, d], weight [V, d], labels [N] (IGNORE = -100) -> mean (or "sum") CE of the logits y @ weight^T
    (fp32 softmax), never materialising [N, V]: the memory of one block of `chunk` rows. Under autocast the
    logits are formed in the autocast dtype, as `head(y)` is there (model.precision.autocast_operands).
    backend: the rows' softmax kernels (kernels/cross_entropy), the model's kernel backend. grads: `HEAD_CE`
    ("grad_in_forward" only where a backward can follow: grad mode on and y or weight requiring grad)."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"head_cross_entropy: reduction must be mean|sum, got {reduction!r}")
    if grads not in HEAD_CE:
        raise ValueError(f"head_cross_entropy: grads must be one of {', '.join(HEAD_CE)}, got {grads!r}")
    y, weight = autocast_operands(y, weight)
    # grad_in_forward: which gradients the forward forms, (dy?, dW?), from the inputs' requires_grad at the call
    need = (y.requires_grad, weight.requires_grad)
    in_fwd = need if grads == "grad_in_forward" and torch.is_grad_enabled() and any(need) else False
    return _HeadCrossEntropy.apply(y, weight, labels, chunk, reduction == "mean", backend, in_fwd)


def build_model(cfg: DSv4Config | str, device: str | torch.device | None = None, **overrides) -> DSv4Model:
    """DSv4Model from a config or a named config (`get_config` names); device="meta" builds without memory."""
    from dsv4.model.config import get_config
    if isinstance(cfg, str):
        cfg = get_config(cfg, **overrides)
    elif overrides:
        cfg = cfg.replace(**overrides)
    if device is None:
        return DSv4Model(cfg)
    with torch.device(device):
        return DSv4Model(cfg)
