"""`dsv4::rms_norm_fwd` / `dsv4::rms_norm_bwd`: the Triton RMSNorm as torch custom ops (opaque to torch.compile,
fake implementations for shapes), with autograd; eager calls skip the dispatcher (kernels/_custom_op.py)."""
from typing import Optional

import torch

from dsv4.kernels._custom_op import autograd_op, backward_op
from dsv4.kernels.rmsnorm import triton as T

Tensor = torch.Tensor


def _fwd(x: Tensor, weight: Optional[Tensor], eps: float) -> Tensor:
    return T.rms_norm_fwd(x, weight, eps)


rms_norm_fwd = torch.library.custom_op("dsv4::rms_norm_fwd", mutates_args=())(_fwd)


@rms_norm_fwd.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape)


def _bwd(dy: Tensor, x: Tensor, weight: Optional[Tensor], eps: float) -> tuple[Tensor, Tensor]:
    dx, dw = T.rms_norm_bwd(dy, x, weight, eps)
    return dx, (dw if dw is not None else x.new_empty(0))     # custom ops return tensors: empty = no weight


rms_norm_bwd = torch.library.custom_op("dsv4::rms_norm_bwd", mutates_args=())(_bwd)


@rms_norm_bwd.register_fake
def _(dy, x, weight, eps):
    return x.new_empty(x.shape), (weight.new_empty(weight.shape) if weight is not None else x.new_empty(0))


def _setup(ctx, inputs, output):
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps = eps


def _backward(ctx, dy):
    x, weight = ctx.saved_tensors
    dx, dw = backward_op(ctx, rms_norm_bwd, _bwd)(dy, x, weight, ctx.eps)
    return dx, (dw if weight is not None else None), None


_rms_norm = autograd_op(rms_norm_fwd, _fwd, _setup, _backward)


def rms_norm(x: Tensor, weight: Optional[Tensor], eps: float) -> Tensor:
    """`naive.rms_norm` as one Triton kernel each way (custom op)."""
    if weight is not None and weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm: weight shape {tuple(weight.shape)} != last dim of x {tuple(x.shape[-1:])}")
    return _rms_norm(x, weight, float(eps))
