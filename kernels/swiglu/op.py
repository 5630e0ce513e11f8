"""`dsv4::clamped_swiglu_fwd` / `_bwd` and `dsv4::clamped_swiglu_packed_fwd` / `_bwd`: the fused Triton clamped
SwiGLU as torch custom ops (opaque to torch.compile; fake implementations for shapes). The bodies run the launch
code of `triton.py` (`swiglu_fwd` / `swiglu_bwd` through its autograd.Functions' forward with a plain ctx record,
`FnCtx`), so the numerics are those of the autograd.Functions."""
from typing import Optional

import torch

from dsv4.kernels._custom_op import autograd_op, backward_op
from dsv4.kernels._triton_util import FnCtx
from dsv4.kernels.swiglu import triton as T

Tensor = torch.Tensor


def _clamped_swiglu_fwd(gate: Tensor, up: Tensor, limit: Optional[float]) -> Tensor:
    return T._ClampedSwiGLU.forward(FnCtx(), gate, up, limit)


clamped_swiglu_fwd = torch.library.custom_op("dsv4::clamped_swiglu_fwd", mutates_args=())(_clamped_swiglu_fwd)


@clamped_swiglu_fwd.register_fake
def _(gate, up, limit):
    return gate.new_empty(gate.shape)


def _clamped_swiglu_bwd(dy: Tensor, gate: Tensor, up: Tensor, limit: Optional[float]) -> tuple[Tensor, Tensor]:
    ctx = FnCtx()                                      # what _ClampedSwiGLU.forward leaves
    ctx.save_for_backward(gate.contiguous(), up.contiguous())
    ctx.limit = limit
    dg, du, _ = T._ClampedSwiGLU.backward(ctx, dy)
    return dg, du


clamped_swiglu_bwd = torch.library.custom_op("dsv4::clamped_swiglu_bwd", mutates_args=())(_clamped_swiglu_bwd)


@clamped_swiglu_bwd.register_fake
def _(dy, gate, up, limit):
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


def _setup(ctx, inputs, output):
    gate, up, limit = inputs
    ctx.save_for_backward(gate, up)
    ctx.limit = limit


def _backward(ctx, dy):
    gate, up = ctx.saved_tensors
    dg, du = backward_op(ctx, clamped_swiglu_bwd, _clamped_swiglu_bwd)(dy, gate, up, ctx.limit)
    return dg, du, None


_swiglu = autograd_op(clamped_swiglu_fwd, _clamped_swiglu_fwd, _setup, _backward)


def _clamped_swiglu_packed_fwd(gu: Tensor, limit: Optional[float]) -> Tensor:
    return T._ClampedSwiGLUPacked.forward(FnCtx(), gu, limit)


clamped_swiglu_packed_fwd = torch.library.custom_op("dsv4::clamped_swiglu_packed_fwd",
                                                    mutates_args=())(_clamped_swiglu_packed_fwd)


@clamped_swiglu_packed_fwd.register_fake
def _(gu, limit):
    return gu.new_empty(*gu.shape[:-1], gu.shape[-1] // 2)


def _clamped_swiglu_packed_bwd(dy: Tensor, gu: Tensor, limit: Optional[float]) -> Tensor:
    ctx = FnCtx()                                      # what _ClampedSwiGLUPacked.forward leaves
    ctx.save_for_backward(gu)
    ctx.limit = limit
    return T._ClampedSwiGLUPacked.backward(ctx, dy)[0]


clamped_swiglu_packed_bwd = torch.library.custom_op("dsv4::clamped_swiglu_packed_bwd",
                                                    mutates_args=())(_clamped_swiglu_packed_bwd)


@clamped_swiglu_packed_bwd.register_fake
def _(dy, gu, limit):
    return gu.new_empty(gu.shape)


def _setup_packed(ctx, inputs, output):
    gu, limit = inputs
    ctx.save_for_backward(gu)
    ctx.limit = limit


def _backward_packed(ctx, dy):
    gu, = ctx.saved_tensors
    return backward_op(ctx, clamped_swiglu_packed_bwd, _clamped_swiglu_packed_bwd)(dy, gu, ctx.limit), None


_swiglu_packed = autograd_op(clamped_swiglu_packed_fwd, _clamped_swiglu_packed_fwd, _setup_packed, _backward_packed)


def clamped_swiglu(gate: Tensor, up: Tensor, limit: Optional[float]) -> Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit); any shape (gate and up alike), Triton custom op."""
    if gate.shape != up.shape:
        raise ValueError(f"clamped_swiglu: gate shape {tuple(gate.shape)} != up shape {tuple(up.shape)}")
    return _swiglu(gate, up, None if limit is None else float(limit))


def clamped_swiglu_packed(gu: Tensor, limit: Optional[float]) -> Tensor:
    """clamped_swiglu of the halves of gu [..., 2f] (gate | up), read in place; Triton custom op."""
    if gu.dim() == 0 or gu.shape[-1] % 2:
        raise ValueError(f"clamped_swiglu_packed: last dim must be even (gate | up), got {tuple(gu.shape)}")
    return _swiglu_packed(gu, None if limit is None else float(limit))
