"""`dsv4::clamped_swiglu_fwd` / `dsv4::clamped_swiglu_bwd`: the fused Triton clamped SwiGLU as torch custom ops
(opaque to torch.compile; fake implementations for shapes). The bodies run `triton._ClampedSwiGLU`'s forward /
backward with a plain ctx record (`FnCtx`), so the numerics are those of the autograd.Function."""
from typing import Optional

import torch

from dsv4.kernels._triton_util import FnCtx
from dsv4.kernels.swiglu import triton as T

Tensor = torch.Tensor


@torch.library.custom_op("dsv4::clamped_swiglu_fwd", mutates_args=())
def clamped_swiglu_fwd(gate: Tensor, up: Tensor, limit: Optional[float]) -> Tensor:
    return T._ClampedSwiGLU.forward(FnCtx(), gate, up, limit)


@clamped_swiglu_fwd.register_fake
def _(gate, up, limit):
    return gate.new_empty(gate.shape)


@torch.library.custom_op("dsv4::clamped_swiglu_bwd", mutates_args=())
def clamped_swiglu_bwd(dy: Tensor, gate: Tensor, up: Tensor, limit: Optional[float]) -> tuple[Tensor, Tensor]:
    ctx = FnCtx()                                      # what _ClampedSwiGLU.forward leaves
    ctx.save_for_backward(gate.contiguous(), up.contiguous())
    ctx.cfg = (limit is not None, float(limit) if limit is not None else 0.0)
    dg, du, _ = T._ClampedSwiGLU.backward(ctx, dy)
    return dg, du


@clamped_swiglu_bwd.register_fake
def _(dy, gate, up, limit):
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


def _setup(ctx, inputs, output):
    gate, up, limit = inputs
    ctx.save_for_backward(gate, up)
    ctx.limit = limit


def _backward(ctx, dy):
    gate, up = ctx.saved_tensors
    dg, du = torch.ops.dsv4.clamped_swiglu_bwd(dy, gate, up, ctx.limit)
    return dg, du, None


clamped_swiglu_fwd.register_autograd(_backward, setup_context=_setup)


def clamped_swiglu(gate: Tensor, up: Tensor, limit: Optional[float]) -> Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit); any shape (gate and up alike), Triton custom op."""
    if gate.shape != up.shape:
        raise ValueError(f"clamped_swiglu: gate shape {tuple(gate.shape)} != up shape {tuple(up.shape)}")
    return torch.ops.dsv4.clamped_swiglu_fwd(gate, up, None if limit is None else float(limit))
