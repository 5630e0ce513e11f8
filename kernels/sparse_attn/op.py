"""`dsv4::sparse_attn_fwd` / `dsv4::sparse_attn_bwd`: the Triton sparse attention as torch custom ops.

torch.compile sees each as one opaque node (Dynamo never traces the Triton code); the fake implementations give
output shapes, `register_autograd` connects them. The bodies run `triton._SparseAttn`'s forward / backward with a
plain ctx record (`FnCtx`), so the numerics are those of the autograd.Function. The backward op rebuilds the
ctx the forward filled (`triton.prepare`: the same saved tensors, `cfg`, `comp_none`) from its inputs.
Packed layout (the contract of `naive.sparse_attn`): q [Tq,H,c], kv [Tk,c], seg/pos [Tk], entries [N].

Backend "triton+flashmla" (`sparse_attn_flashmla`, kernels/sparse_attn/flashmla.py): FlashMLA's SM90 sparse prefill
forward when `flash_mla` is importable and the call qualifies, as custom op `dsv4::sparse_attn_flashmla_fwd` with
the same outputs as `dsv4::sparse_attn_fwd` (o, lse in log2 units with the sink) and the same registered backward
(`dsv4::sparse_attn_bwd`); otherwise the Triton forward above.

Backend "triton+flashmla+cudnn" (`sparse_attn_flashmla_cudnn`, kernels/sparse_attn/cudnn_bwd.py): FlashMLA's forward
(`dsv4::sparse_attn_fmla_cudnn_fwd`, which also returns FlashMLA's own lse and its index rows) and cuDNN's SM90 DSA
backward (`dsv4::sparse_attn_cudnn_bwd`) when both are importable and the call qualifies; otherwise backend
"triton+flashmla" (then the Triton forward and backward).
"""
import math
from typing import Optional

import torch

from dsv4.kernels._custom_op import autograd_op, backward_op, traced
from dsv4.kernels._triton_util import FnCtx
from dsv4.kernels.sparse_attn import cudnn_bwd as CB
from dsv4.kernels.sparse_attn import flashmla as FM
from dsv4.kernels.sparse_attn import naive
from dsv4.kernels.sparse_attn import triton as T

Tensor = torch.Tensor


def _sparse_attn_fwd(q: Tensor, kv: Tensor, comp: Optional[Tensor], comp_idx: Optional[Tensor], sink: Tensor,
                     seg: Tensor, pos: Tensor, entry_seg: Optional[Tensor], entry_j: Optional[Tensor],
                     window: int, ratio: int, scale: float, q_off: int, rope_cos: Optional[Tensor] = None,
                     rope_sin: Optional[Tensor] = None, want_probs: bool = False,
                     probs_idx: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """-> (o [Tq,H,c] q.dtype, lse [Tq,H] fp32, log2 units, probs); with rope_cos / rope_sin [Tq, r/2] o's last r
    dims rotated back by them (the output's inverse RoPE, fused). probs: with want_probs and listed entries the
    attention's mass on each listed entry summed over heads [Tq, k] fp32 (`entry_probs`, from the forward's own
    logits); without comp_idx, the same for the entries probs_idx [Tq, k] lists (a listing of every visible entry:
    `triton._SparseAttn.forward`); else an empty [0] tensor."""
    ctx = FnCtx()
    o = T._SparseAttn.forward(ctx, q, kv, comp, comp_idx, sink, window, ratio, scale, seg, pos, entry_seg,
                              entry_j, q_off, rope_cos, rope_sin, want_probs, probs_idx)
    probs = ctx.probs if ctx.probs is not None else q.new_empty(0, dtype=torch.float32)
    return o, ctx.saved_tensors[6], probs


sparse_attn_fwd = torch.library.custom_op("dsv4::sparse_attn_fwd", mutates_args=())(_sparse_attn_fwd)


@sparse_attn_fwd.register_fake
def _(q, kv, comp, comp_idx, sink, seg, pos, entry_seg, entry_j, window, ratio, scale, q_off, rope_cos=None,
      rope_sin=None, want_probs=False, probs_idx=None):
    has_comp = comp is not None and comp.shape[0] > 0
    listed = has_comp and comp_idx is not None                                            # MODE_IDX (T.prepare)
    ranged = has_comp and comp_idx is None and probs_idx is not None                      # MODE_ALL, probs_idx's order
    k = comp_idx.shape[-1] if listed else probs_idx.shape[-1] if ranged else 0
    stored = T.stores_logits(want_probs, listed or ranged, q.shape[0], k, q.shape[1])
    probs = q.new_empty((q.shape[0], k) if stored else (0,), dtype=torch.float32)
    return q.new_empty(q.shape), q.new_empty(q.shape[:2], dtype=torch.float32), probs


def _ctx(q, kv, comp, comp_idx, sink, seg, pos, entry_seg, entry_j, o, lse, window, ratio, scale, q_off,
         rope_cos=None, rope_sin=None) -> FnCtx:
    """The ctx `_SparseAttn.forward` leaves (same saved tensors, same cfg)."""
    mode, nsel, ratio, comp_t, idx_t, seg, pos, eseg, ej, elo, ehi = T.prepare(
        q.contiguous(), kv.contiguous(), comp, comp_idx, ratio, seg, pos, entry_seg, entry_j, q_off)
    cs, sn, rd = T._out_rope(q, rope_cos, rope_sin)
    ctx = FnCtx()
    ctx.save_for_backward(q.contiguous(), kv.contiguous(), comp_t, idx_t, sink, o, lse, seg, pos, eseg, ej, elo, ehi,
                          cs, sn)
    ctx.cfg = (mode, nsel, int(window), ratio, float(scale), int(q_off), rd)
    ctx.comp_none = comp is None
    return ctx


def _sparse_attn_bwd(do: Tensor, q: Tensor, kv: Tensor, comp: Optional[Tensor], comp_idx: Optional[Tensor],
                     sink: Tensor, seg: Tensor, pos: Tensor, entry_seg: Optional[Tensor], entry_j: Optional[Tensor],
                     o: Tensor, lse: Tensor, window: int, ratio: int, scale: float,
                     q_off: int, rope_cos: Optional[Tensor] = None,
                     rope_sin: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """-> (dq, dkv, dcomp (empty when comp is None), dsink); with the tables, o / do are the rotated output's."""
    ctx = _ctx(q, kv, comp, comp_idx, sink, seg, pos, entry_seg, entry_j, o, lse, window, ratio, scale, q_off,
               rope_cos, rope_sin)
    dq, dkv, dcomp, _, dsink, *_ = T._SparseAttn.backward(ctx, do)
    if dcomp is None:
        dcomp = q.new_empty(0)
    return dq, dkv, dcomp, dsink


sparse_attn_bwd = torch.library.custom_op("dsv4::sparse_attn_bwd", mutates_args=())(_sparse_attn_bwd)


@sparse_attn_bwd.register_fake
def _(do, q, kv, comp, comp_idx, sink, seg, pos, entry_seg, entry_j, o, lse, window, ratio, scale, q_off,
      rope_cos=None, rope_sin=None):
    dcomp = comp.new_empty(comp.shape) if comp is not None else q.new_empty(0)
    return q.new_empty(q.shape), kv.new_empty(kv.shape), dcomp, sink.new_empty(sink.shape)


def _setup(ctx, inputs, output):
    q, kv, comp, comp_idx, sink, seg, pos, entry_seg, entry_j, window, ratio, scale, q_off = inputs[:13]
    cos, sin = (tuple(inputs[13:15]) + (None, None))[:2]              # the fused output rotation's tables
    o, lse = output[:2]                                               # (probs: no gradient, not kept)
    ctx.save_for_backward(q, kv, comp, comp_idx, sink, seg, pos, entry_seg, entry_j, o, lse, cos, sin)
    ctx.args = (int(window), int(ratio), float(scale), int(q_off))
    ctx.comp_none, ctx.n_inputs = comp is None, len(inputs)


def _backward(ctx, do, _dlse, _dprobs=None):
    q, kv, comp, comp_idx, sink, seg, pos, entry_seg, entry_j, o, lse, cos, sin = ctx.saved_tensors
    bwd = backward_op(ctx, sparse_attn_bwd, _sparse_attn_bwd)
    dq, dkv, dcomp, dsink = bwd(do, q, kv, comp, comp_idx, sink, seg, pos, entry_seg, entry_j, o, lse, *ctx.args,
                                cos, sin)
    return (dq, dkv, None if ctx.comp_none else dcomp, None, dsink) + (None,) * (ctx.n_inputs - 5)


_sparse_attn = autograd_op(sparse_attn_fwd, _sparse_attn_fwd, _setup, _backward)


def sparse_attn(q: Tensor, kv: Tensor, comp: Optional[Tensor], comp_idx: Optional[Tensor], sink: Tensor,
                window: int, ratio: int, scale: float, seg: Tensor, pos: Tensor, entry_seg: Optional[Tensor] = None,
                entry_j: Optional[Tensor] = None, q_offset: int = 0, return_lse: bool = False, out_rope=None,
                return_probs: bool = False, probs_idx: Optional[Tensor] = None):
    """Triton sparse attention as a custom op; same contract as `naive.sparse_attn` / `triton.sparse_attn`
    (return_lse: also the log-sum-exp [Tq,H] in natural log, no gradient; with return_probs as well, a third
    element: `entry_probs` of the listed entries [Tq,k] fp32 from the forward's own logits -- without comp_idx,
    of the entries probs_idx lists, which must be visible ones and at most k a query -- else None). out_rope
    (cos, sin) [Tq, r/2]: the output's last r dims rotated back by them inside the kernel
    (kernels/sparse_attn/__init__.py)."""
    naive.check_args(q, kv, comp, comp_idx, sink, window, ratio, seg, pos, entry_seg, entry_j, q_offset)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    cos, sin = (None, None) if out_rope is None else (out_rope[0].detach(), out_rope[1].detach())
    want = bool(return_lse and return_probs)
    o, lse2, probs = _sparse_attn(q, kv, comp, comp_idx, sink, seg, pos, entry_seg, entry_j, int(window),
                                  int(ratio or 0), float(scale), int(q_offset), cos, sin, want, probs_idx)
    if not return_lse:
        return o
    lse = lse2.detach() * math.log(2.0)
    if not return_probs:
        return o, lse
    return o, lse, (probs.detach() if want and probs.dim() == 2 else None)


# ------------------------------------------------------------- backend "triton+flashmla": FlashMLA's forward
def _sparse_attn_flashmla_fwd(q: Tensor, kv: Tensor, comp: Optional[Tensor], comp_idx: Optional[Tensor],
                              sink: Tensor, seg: Tensor, pos: Tensor, entry_seg: Optional[Tensor],
                              entry_j: Optional[Tensor], window: int, ratio: int, scale: float, q_off: int,
                              use_topk_length: bool) -> tuple[Tensor, Tensor]:
    """FlashMLA's sparse prefill forward (flashmla.forward) -> (o [Tq,H,c] bf16, lse [Tq,H] fp32, log2 units, sink
    included): the outputs of `dsv4::sparse_attn_fwd`, so `dsv4::sparse_attn_bwd` is its backward."""
    fn, why = FM.load()
    if fn is None:
        raise RuntimeError(f"dsv4::sparse_attn_flashmla_fwd: {why}")
    return FM.forward(fn, q, kv, comp, comp_idx, sink, seg, pos, entry_seg, entry_j, window, ratio, scale, q_off,
                      use_topk_length)


sparse_attn_flashmla_fwd = torch.library.custom_op("dsv4::sparse_attn_flashmla_fwd",
                                                   mutates_args=())(_sparse_attn_flashmla_fwd)


@sparse_attn_flashmla_fwd.register_fake
def _(q, kv, comp, comp_idx, sink, seg, pos, entry_seg, entry_j, window, ratio, scale, q_off, use_topk_length):
    return q.new_empty(q.shape), q.new_empty(q.shape[:2], dtype=torch.float32)


def _setup_flashmla(ctx, inputs, output):
    _setup(ctx, inputs[:13], output)                    # the Triton forward's record: its backward is ours


def _backward_flashmla(ctx, do, dlse):
    return _backward(ctx, do, dlse) + (None,)           # no gradient for use_topk_length


sparse_attn_flashmla_fwd.register_autograd(_backward_flashmla, setup_context=_setup_flashmla)


class _FlashMLAEager(torch.autograd.Function):
    """The eager call (as `_custom_op.autograd_op`'s, skipping the dispatcher), with the forward function `fn` an
    explicit argument: flash_mla_sparse_fwd, or a stand-in with its signature and returns (the CPU tests)."""

    @staticmethod
    def forward(ctx, fn, *args):
        out = FM.forward(fn, *args)
        _setup_flashmla(ctx, args, out)
        ctx.eager = True
        return out

    @staticmethod
    def backward(ctx, do, dlse):
        return (None,) + _backward_flashmla(ctx, do, dlse)


def sparse_attn_flashmla(q: Tensor, kv: Tensor, comp: Optional[Tensor], comp_idx: Optional[Tensor], sink: Tensor,
                         window: int, ratio: int, scale: float, seg: Tensor, pos: Tensor,
                         entry_seg: Optional[Tensor] = None, entry_j: Optional[Tensor] = None, q_offset: int = 0,
                         return_lse: bool = False, *, fwd_fn=None, capability=None, topk_length: bool = True):
    """Backend "triton+flashmla": FlashMLA's forward + our Triton backward when the call qualifies
    (`flashmla.unqualified`: flash_mla importable, SM90, bf16, H in (64, 128), c = 512), else `sparse_attn` (the
    Triton forward and backward). Same contract and returns as `sparse_attn`.
    fwd_fn: the forward function (None: flash_mla.flash_mla_sparse_fwd when importable); a stand-in with its
    signature and returns runs eagerly only (tests). capability: the device's (major, minor) (None: read from
    q's device; tests give (9, 0) with a stand-in on CPU tensors). topk_length: pass FlashMLA the live index
    count per query (it skips the dead tail blocks) -- False: every padded slot is visited, as the issue 14 peer."""
    naive.check_args(q, kv, comp, comp_idx, sink, window, ratio, seg, pos, entry_seg, entry_j, q_offset)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    fn = FM.load()[0] if fwd_fn is None else fwd_fn
    cap = FM.capability(q) if capability is None else capability
    if FM.unqualified(q, kv, comp, fn, cap) is not None:
        return sparse_attn(q, kv, comp, comp_idx, sink, window, ratio, scale, seg, pos, entry_seg, entry_j,
                           q_offset, return_lse)
    args = (q, kv, comp, comp_idx, sink, seg, pos, entry_seg, entry_j, int(window), int(ratio or 0), float(scale),
            int(q_offset), bool(topk_length))
    if traced(args):
        if fwd_fn is not None:
            raise ValueError("sparse_attn_flashmla: a stand-in fwd_fn runs eagerly only, not under torch.compile")
        o, lse2 = sparse_attn_flashmla_fwd(*args)
    else:
        o, lse2 = _FlashMLAEager.apply(fn, *args)
    return (o, lse2.detach() * math.log(2.0)) if return_lse else o


# ---------------------------------------------- backend "triton+flashmla+cudnn": FlashMLA forward + cuDNN backward
def _fmla_cudnn_fwd(q: Tensor, kv: Tensor, comp: Optional[Tensor], comp_idx: Optional[Tensor], sink: Tensor,
                    seg: Tensor, pos: Tensor, entry_seg: Optional[Tensor], entry_j: Optional[Tensor], window: int,
                    ratio: int, scale: float, q_off: int) -> tuple[Tensor, Tensor, Tensor]:
    """-> (o [Tq,H,c], lse [Tq,H] fp32 FlashMLA's: natural log, no sink, ix [Tq,K] int32 into kv_all)."""
    fn, why = FM.load()
    if fn is None:
        raise RuntimeError(f"dsv4::sparse_attn_fmla_cudnn_fwd: {why}")
    return FM.forward_raw(fn, q, kv, comp, comp_idx, sink, seg, pos, entry_seg, entry_j, window, ratio, scale, q_off)


sparse_attn_fmla_cudnn_fwd = torch.library.custom_op("dsv4::sparse_attn_fmla_cudnn_fwd",
                                                     mutates_args=())(_fmla_cudnn_fwd)


@sparse_attn_fmla_cudnn_fwd.register_fake
def _(q, kv, comp, comp_idx, sink, seg, pos, entry_seg, entry_j, window, ratio, scale, q_off):
    K = window + (comp_idx.shape[1] if comp_idx is not None else (comp.shape[0] if comp is not None else 0))
    return (q.new_empty(q.shape), q.new_empty(q.shape[:2], dtype=torch.float32),
            q.new_empty((q.shape[0], FM.padded(K)), dtype=torch.int32))


def _cudnn_bwd(do: Tensor, q: Tensor, kv: Tensor, comp: Optional[Tensor], sink: Tensor, o: Tensor, lse: Tensor,
               ix: Tensor, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """-> (dq [Tq,H,c], dkv_all [Tk+N,c] (key stream rows, then the entries), dsink [H] fp32): cuDNN's backward."""
    fn, why = CB.load()
    if fn is None:
        raise RuntimeError(f"dsv4::sparse_attn_cudnn_bwd: {why}")
    return CB.backward(fn, q, FM.kv_all(kv, comp)[:, 0], o, do, lse, sink, ix, scale)


sparse_attn_cudnn_bwd = torch.library.custom_op("dsv4::sparse_attn_cudnn_bwd", mutates_args=())(_cudnn_bwd)


@sparse_attn_cudnn_bwd.register_fake
def _(do, q, kv, comp, sink, o, lse, ix, scale):
    N = 0 if comp is None else comp.shape[0]
    return q.new_empty(q.shape), kv.new_empty((kv.shape[0] + N, kv.shape[1])), sink.new_empty(sink.shape,
                                                                                               dtype=torch.float32)


def _setup_cudnn(ctx, inputs, output):
    q, kv, comp, _comp_idx, sink = inputs[:5]
    o, lse, ix = output
    ctx.save_for_backward(q, kv, comp, sink, o, lse, ix)
    ctx.scale, ctx.comp_none = float(inputs[11]), comp is None


def _backward_cudnn(ctx, do, _dlse, _dix):
    q, kv, comp, sink, o, lse, ix = ctx.saved_tensors
    bwd_fn = getattr(ctx, "bwd_fn", None)                   # eager: the backward function given explicitly
    if bwd_fn is not None:
        dq, dkv_all, dsink = CB.backward(bwd_fn, q, FM.kv_all(kv, comp)[:, 0], o, do, lse, sink, ix, ctx.scale)
    else:
        dq, dkv_all, dsink = sparse_attn_cudnn_bwd(do, q, kv, comp, sink, o, lse, ix, ctx.scale)
    Tk = kv.shape[0]                                        # dkv_all [Tk + N, c] -> the stream rows, the entries
    return (dq, dkv_all[:Tk], None if ctx.comp_none else dkv_all[Tk:], None, dsink.to(sink.dtype)) + (None,) * 8


sparse_attn_fmla_cudnn_fwd.register_autograd(_backward_cudnn, setup_context=_setup_cudnn)


class _FlashMLACudnnEager(torch.autograd.Function):
    """The eager call, with both functions explicit arguments: FlashMLA's forward and cuDNN's backward wrapper, or
    stand-ins with their signatures and returns (the CPU tests)."""

    @staticmethod
    def forward(ctx, fwd_fn, bwd_fn, *args):
        out = FM.forward_raw(fwd_fn, *args)
        _setup_cudnn(ctx, args, out)
        ctx.bwd_fn = bwd_fn
        ctx.mark_non_differentiable(out[1], out[2])
        return out

    @staticmethod
    def backward(ctx, do, dlse, dix):
        return (None, None) + _backward_cudnn(ctx, do, dlse, dix)


def sparse_attn_flashmla_cudnn(q: Tensor, kv: Tensor, comp: Optional[Tensor], comp_idx: Optional[Tensor],
                               sink: Tensor, window: int, ratio: int, scale: float, seg: Tensor, pos: Tensor,
                               entry_seg: Optional[Tensor] = None, entry_j: Optional[Tensor] = None,
                               q_offset: int = 0, return_lse: bool = False, *, fwd_fn=None, bwd_fn=None,
                               capability=None):
    """Backend "triton+flashmla+cudnn": FlashMLA's forward + cuDNN's SM90 backward when both can run the call
    (`cudnn_bwd.unqualified`), else backend "triton+flashmla" (which falls back to the Triton path). Same contract
    and returns as `sparse_attn`. fwd_fn / bwd_fn: stand-ins with the signatures and returns of
    flash_mla_sparse_fwd / cuDNN's sparse_attention_backward_wrapper (tests; eager only); None: the real ones.
    capability: the device's (major, minor) (None: read from q's device)."""
    naive.check_args(q, kv, comp, comp_idx, sink, window, ratio, seg, pos, entry_seg, entry_j, q_offset)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    fn = FM.load()[0] if fwd_fn is None else fwd_fn
    bfn = CB.load()[0] if bwd_fn is None else bwd_fn
    cap = FM.capability(q) if capability is None else capability
    if CB.unqualified(q, kv, comp, fn, bfn, cap) is not None:
        return sparse_attn_flashmla(q, kv, comp, comp_idx, sink, window, ratio, scale, seg, pos, entry_seg, entry_j,
                                    q_offset, return_lse, fwd_fn=fwd_fn, capability=capability)
    args = (q, kv, comp, comp_idx, sink, seg, pos, entry_seg, entry_j, int(window), int(ratio or 0), float(scale),
            int(q_offset))
    if traced(args):
        if fwd_fn is not None or bwd_fn is not None:
            raise ValueError("sparse_attn_flashmla_cudnn: stand-in functions run eagerly only, not under torch.compile")
        o, lse, _ix = sparse_attn_fmla_cudnn_fwd(*args)
    else:
        o, lse, _ix = _FlashMLACudnnEager.apply(fn, bfn, *args)
    return (o, FM.lse_ours(lse.detach(), sink.detach()) * math.log(2.0)) if return_lse else o


@torch.library.custom_op("dsv4::sparse_attn_entry_probs", mutates_args=())
def entry_probs_op(q: Tensor, comp: Tensor, comp_idx: Tensor, lse: Tensor, seg: Tensor, pos: Tensor,
                   entry_seg: Tensor, entry_j: Tensor, ratio: int, scale: float, q_off: int) -> Tensor:
    """-> P [Tq,k] fp32, the attention's mass on each listed entry summed over heads (`naive.entry_probs`)."""
    return T.entry_probs(q, comp, comp_idx, lse, ratio, scale, seg, pos, entry_seg, entry_j, q_off)


@entry_probs_op.register_fake
def _(q, comp, comp_idx, lse, seg, pos, entry_seg, entry_j, ratio, scale, q_off):
    return q.new_empty(comp_idx.shape, dtype=torch.float32)


def entry_probs(q: Tensor, comp: Tensor, comp_idx: Tensor, lse: Tensor, ratio: int, scale: float, seg: Tensor,
                pos: Tensor, entry_seg: Tensor, entry_j: Tensor, q_offset: int = 0) -> Tensor:
    """Triton `naive.entry_probs` as a custom op (no gradient)."""
    return torch.ops.dsv4.sparse_attn_entry_probs(q.detach(), comp.detach(), comp_idx, lse.detach(), seg, pos,
                                                  entry_seg, entry_j, int(ratio), float(scale), int(q_offset))
