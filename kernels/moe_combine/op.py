"""`dsv4::moe_combine_fwd` / `dsv4::moe_combine_bwd`: the Triton MoE combine as torch custom ops (opaque to
torch.compile, fake implementations for shapes), with autograd for y and w (none for tok); eager calls skip the
dispatcher (kernels/_custom_op.py)."""
import torch

from dsv4.kernels._custom_op import autograd_op, backward_op
from dsv4.kernels.moe_combine import triton as tri

Tensor = torch.Tensor


def _fwd(y: Tensor, w: Tensor, tok: Tensor, T: int, out_dtype: torch.dtype) -> Tensor:
    return tri.moe_combine_fwd(y, w, tok, T, out_dtype)


moe_combine_fwd = torch.library.custom_op("dsv4::moe_combine_fwd", mutates_args=())(_fwd)


@moe_combine_fwd.register_fake
def _(y, w, tok, T, out_dtype):
    return y.new_empty((T, y.shape[1]), dtype=out_dtype)


def _bwd(g: Tensor, y: Tensor, w: Tensor, tok: Tensor) -> tuple[Tensor, Tensor]:
    return tri.moe_combine_bwd(g, y, w, tok)


moe_combine_bwd = torch.library.custom_op("dsv4::moe_combine_bwd", mutates_args=())(_bwd)


@moe_combine_bwd.register_fake
def _(g, y, w, tok):
    return y.new_empty(y.shape), w.new_empty(w.shape)


def _setup(ctx, inputs, output):
    y, w, tok = inputs[:3]
    ctx.save_for_backward(y, w, tok)


def _backward(ctx, g):
    y, w, tok = ctx.saved_tensors
    dy, dw = backward_op(ctx, moe_combine_bwd, _bwd)(g, y, w, tok)
    return dy, dw, None, None, None


_moe_combine = autograd_op(moe_combine_fwd, _fwd, _setup, _backward)


def moe_combine(y: Tensor, w: Tensor, tok: Tensor, T: int, out_dtype: torch.dtype) -> Tensor:
    """`naive.moe_combine` as one Triton gather kernel each way (custom op). Each token must own exactly
    K = len(tok) / T slots (the grouped expert path's layout: tok = argsort(idx.flatten()) // K)."""
    N = tok.numel()
    whole = N % T == 0 if T else N == 0                                   # K = N / T slots per token
    if y.dim() != 2 or y.shape[0] != N or w.shape != (N,) or not whole:
        raise ValueError(f"moe_combine: need y [T*K, d], w [T*K], tok [T*K] with T = {T}; got y "
                         f"{tuple(y.shape)}, w {tuple(w.shape)}, tok {tuple(tok.shape)}")
    return _moe_combine(y, w, tok, T, out_dtype)
