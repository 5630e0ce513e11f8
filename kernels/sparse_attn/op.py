"""`dsv4::sparse_attn_fwd` / `dsv4::sparse_attn_bwd`: the Triton sparse attention as torch custom ops.

torch.compile sees each as one opaque node (Dynamo never traces the Triton code); the fake implementations give
output shapes, `register_autograd` connects them. The bodies run `triton._SparseAttn`'s forward / backward with a
plain ctx record (`FnCtx`), so the numerics are those of the autograd.Function. The backward op rebuilds the
ctx the forward filled (saved tensors in the same order, `cfg`, `comp_none`) from its inputs.
"""
import math
from typing import Optional

import torch

from dsv4.kernels._triton_util import FnCtx
from dsv4.kernels.sparse_attn import triton as T

Tensor = torch.Tensor


@torch.library.custom_op("dsv4::sparse_attn_fwd", mutates_args=())
def sparse_attn_fwd(q: Tensor, kv: Tensor, comp: Optional[Tensor], comp_idx: Optional[Tensor], sink: Tensor,
                    window: int, ratio: int, scale: float) -> tuple[Tensor, Tensor]:
    """-> (o [S,B,H,c] q.dtype, lse [S,B,H] fp32, log2 units)."""
    ctx = FnCtx()
    o = T._SparseAttn.forward(ctx, q, kv, comp, comp_idx, sink, window, ratio, scale)
    return o, ctx.saved_tensors[6]


@sparse_attn_fwd.register_fake
def _(q, kv, comp, comp_idx, sink, window, ratio, scale):
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)


def _ctx(q, kv, comp, comp_idx, sink, o, lse, window, ratio, scale) -> FnCtx:
    """The ctx `_SparseAttn.forward` leaves (same saved tensors, same cfg)."""
    _, _, _, _, mode, nsel = T._launch_args(q, kv, comp, comp_idx, window, ratio)
    q, kv = q.contiguous(), kv.contiguous()
    comp_t = comp.contiguous() if mode != T.MODE_NONE else kv
    idx_t = comp_idx.contiguous() if mode == T.MODE_IDX else torch.zeros(1, 1, 1, dtype=torch.long, device=q.device)
    ctx = FnCtx()
    ctx.save_for_backward(q, kv, comp_t, idx_t, sink, o, lse)
    ctx.cfg = (mode, nsel, int(window), max(int(ratio or 1), 1), float(scale), mode != T.MODE_NONE)
    ctx.comp_none = comp is None
    return ctx


@torch.library.custom_op("dsv4::sparse_attn_bwd", mutates_args=())
def sparse_attn_bwd(do: Tensor, q: Tensor, kv: Tensor, comp: Optional[Tensor], comp_idx: Optional[Tensor],
                    sink: Tensor, o: Tensor, lse: Tensor, window: int, ratio: int,
                    scale: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """-> (dq, dkv, dcomp (empty when comp is None), dsink)."""
    ctx = _ctx(q, kv, comp, comp_idx, sink, o, lse, window, ratio, scale)
    dq, dkv, dcomp, _, dsink, *_ = T._SparseAttn.backward(ctx, do)
    if dcomp is None:
        dcomp = q.new_empty(0)
    return dq, dkv, dcomp, dsink


@sparse_attn_bwd.register_fake
def _(do, q, kv, comp, comp_idx, sink, o, lse, window, ratio, scale):
    dcomp = comp.new_empty(comp.shape) if comp is not None else q.new_empty(0)
    return q.new_empty(q.shape), kv.new_empty(kv.shape), dcomp, sink.new_empty(sink.shape)


def _setup(ctx, inputs, output):
    q, kv, comp, comp_idx, sink, window, ratio, scale = inputs
    ctx.save_for_backward(q, kv, comp, comp_idx, sink, *output)
    ctx.args = (int(window), int(ratio), float(scale))
    ctx.comp_none = comp is None


def _backward(ctx, do, _dlse):
    q, kv, comp, comp_idx, sink, o, lse = ctx.saved_tensors
    dq, dkv, dcomp, dsink = torch.ops.dsv4.sparse_attn_bwd(do, q, kv, comp, comp_idx, sink, o, lse, *ctx.args)
    return dq, dkv, None if ctx.comp_none else dcomp, None, dsink, None, None, None


sparse_attn_fwd.register_autograd(_backward, setup_context=_setup)


def sparse_attn(q: Tensor, kv: Tensor, comp: Optional[Tensor], comp_idx: Optional[Tensor], sink: Tensor,
                window: int, ratio: int, scale: float) -> Tensor:
    """Triton sparse attention as a custom op; same contract as `naive.sparse_attn` / `triton.sparse_attn`."""
    if q.dim() != 4 or kv.dim() != 3 or kv.shape[0] != q.shape[0] or kv.shape[-1] != q.shape[-1]:
        raise ValueError(f"sparse_attn: q {tuple(q.shape)} / kv {tuple(kv.shape)} must be [S,B,H,c] / [S,B,c]")
    if comp_idx is not None and comp_idx.shape[:2] != q.shape[:2]:
        raise ValueError(f"sparse_attn: comp_idx {tuple(comp_idx.shape)} must be [S,B,k]")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return torch.ops.dsv4.sparse_attn_fwd(q, kv, comp, comp_idx, sink, int(window), int(ratio or 0),
                                          float(scale))[0]
