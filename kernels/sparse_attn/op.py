"""`dsv4::sparse_attn_fwd` / `dsv4::sparse_attn_bwd`: the Triton sparse attention as torch custom ops.

torch.compile sees each as one opaque node (Dynamo never traces the Triton code); the fake implementations give
output shapes, `register_autograd` connects them. The bodies run `triton._SparseAttn`'s forward / backward with a
plain ctx record (`FnCtx`), so the numerics are those of the autograd.Function. The backward op rebuilds the
ctx the forward filled (`triton.prepare`: the same saved tensors, `cfg`, `comp_none`) from its inputs.
Packed layout (the contract of `naive.sparse_attn`): q [Tq,H,c], kv [Tk,c], seg/pos [Tk], entries [N].
"""
import math
from typing import Optional

import torch

from dsv4.kernels._triton_util import FnCtx
from dsv4.kernels.sparse_attn import naive
from dsv4.kernels.sparse_attn import triton as T

Tensor = torch.Tensor


@torch.library.custom_op("dsv4::sparse_attn_fwd", mutates_args=())
def sparse_attn_fwd(q: Tensor, kv: Tensor, comp: Optional[Tensor], comp_idx: Optional[Tensor], sink: Tensor,
                    seg: Tensor, pos: Tensor, entry_seg: Optional[Tensor], entry_j: Optional[Tensor],
                    window: int, ratio: int, scale: float, q_off: int) -> tuple[Tensor, Tensor]:
    """-> (o [Tq,H,c] q.dtype, lse [Tq,H] fp32, log2 units)."""
    ctx = FnCtx()
    o = T._SparseAttn.forward(ctx, q, kv, comp, comp_idx, sink, window, ratio, scale, seg, pos, entry_seg,
                              entry_j, q_off)
    return o, ctx.saved_tensors[6]


@sparse_attn_fwd.register_fake
def _(q, kv, comp, comp_idx, sink, seg, pos, entry_seg, entry_j, window, ratio, scale, q_off):
    return q.new_empty(q.shape), q.new_empty(q.shape[:2], dtype=torch.float32)


def _ctx(q, kv, comp, comp_idx, sink, seg, pos, entry_seg, entry_j, o, lse, window, ratio, scale, q_off) -> FnCtx:
    """The ctx `_SparseAttn.forward` leaves (same saved tensors, same cfg)."""
    mode, nsel, ratio, comp_t, idx_t, seg, pos, eseg, ej, elo, ehi = T.prepare(
        q.contiguous(), kv.contiguous(), comp, comp_idx, ratio, seg, pos, entry_seg, entry_j, q_off)
    ctx = FnCtx()
    ctx.save_for_backward(q.contiguous(), kv.contiguous(), comp_t, idx_t, sink, o, lse, seg, pos, eseg, ej, elo, ehi)
    ctx.cfg = (mode, nsel, int(window), ratio, float(scale), int(q_off))
    ctx.comp_none = comp is None
    return ctx


@torch.library.custom_op("dsv4::sparse_attn_bwd", mutates_args=())
def sparse_attn_bwd(do: Tensor, q: Tensor, kv: Tensor, comp: Optional[Tensor], comp_idx: Optional[Tensor],
                    sink: Tensor, seg: Tensor, pos: Tensor, entry_seg: Optional[Tensor], entry_j: Optional[Tensor],
                    o: Tensor, lse: Tensor, window: int, ratio: int, scale: float,
                    q_off: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """-> (dq, dkv, dcomp (empty when comp is None), dsink)."""
    ctx = _ctx(q, kv, comp, comp_idx, sink, seg, pos, entry_seg, entry_j, o, lse, window, ratio, scale, q_off)
    dq, dkv, dcomp, _, dsink, *_ = T._SparseAttn.backward(ctx, do)
    if dcomp is None:
        dcomp = q.new_empty(0)
    return dq, dkv, dcomp, dsink


@sparse_attn_bwd.register_fake
def _(do, q, kv, comp, comp_idx, sink, seg, pos, entry_seg, entry_j, o, lse, window, ratio, scale, q_off):
    dcomp = comp.new_empty(comp.shape) if comp is not None else q.new_empty(0)
    return q.new_empty(q.shape), kv.new_empty(kv.shape), dcomp, sink.new_empty(sink.shape)


def _setup(ctx, inputs, output):
    q, kv, comp, comp_idx, sink, seg, pos, entry_seg, entry_j, window, ratio, scale, q_off = inputs
    ctx.save_for_backward(q, kv, comp, comp_idx, sink, seg, pos, entry_seg, entry_j, *output)
    ctx.args = (int(window), int(ratio), float(scale), int(q_off))
    ctx.comp_none = comp is None


def _backward(ctx, do, _dlse):
    q, kv, comp, comp_idx, sink, seg, pos, entry_seg, entry_j, o, lse = ctx.saved_tensors
    dq, dkv, dcomp, dsink = torch.ops.dsv4.sparse_attn_bwd(do, q, kv, comp, comp_idx, sink, seg, pos, entry_seg,
                                                           entry_j, o, lse, *ctx.args)
    return (dq, dkv, None if ctx.comp_none else dcomp, None, dsink) + (None,) * 8


sparse_attn_fwd.register_autograd(_backward, setup_context=_setup)


def sparse_attn(q: Tensor, kv: Tensor, comp: Optional[Tensor], comp_idx: Optional[Tensor], sink: Tensor,
                window: int, ratio: int, scale: float, seg: Tensor, pos: Tensor, entry_seg: Optional[Tensor] = None,
                entry_j: Optional[Tensor] = None, q_offset: int = 0) -> Tensor:
    """Triton sparse attention as a custom op; same contract as `naive.sparse_attn` / `triton.sparse_attn`."""
    naive.check_args(q, kv, comp, comp_idx, sink, window, ratio, seg, pos, entry_seg, entry_j, q_offset)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return torch.ops.dsv4.sparse_attn_fwd(q, kv, comp, comp_idx, sink, seg, pos, entry_seg, entry_j, int(window),
                                          int(ratio or 0), float(scale), int(q_offset))[0]
