"""`dsv4::norm_rope_fwd` / `dsv4::norm_rope_bwd`: the fused query norm + rotation as torch custom ops (opaque to
torch.compile, fake implementations for shapes), with autograd; eager calls skip the dispatcher
(kernels/_custom_op.py). The forward returns (y, rstd); autograd keeps y, rstd and the angles (not x)."""
import torch

from dsv4.kernels._custom_op import autograd_op, backward_op
from dsv4.kernels.norm_rope import triton as T

Tensor = torch.Tensor


def _fwd(x: Tensor, cos: Tensor, sin: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return T.norm_rope_fwd(x, cos, sin, eps)


norm_rope_fwd = torch.library.custom_op("dsv4::norm_rope_fwd", mutates_args=())(_fwd)


@norm_rope_fwd.register_fake
def _(x, cos, sin, eps):
    dt = torch.float64 if torch.float64 in (x.dtype, cos.dtype) else torch.float32
    return x.new_empty(x.shape), x.new_empty(x.shape[0] * x.shape[1], dtype=dt)


def _bwd(dy: Tensor, y: Tensor, rstd: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return T.norm_rope_bwd(dy, y, rstd, cos, sin)


norm_rope_bwd = torch.library.custom_op("dsv4::norm_rope_bwd", mutates_args=())(_bwd)


@norm_rope_bwd.register_fake
def _(dy, y, rstd, cos, sin):
    return y.new_empty(y.shape)


def _setup(ctx, inputs, output):
    _, cos, sin, _ = inputs
    y, rstd = output
    ctx.save_for_backward(y, rstd, cos, sin)


def _backward(ctx, dy, _drstd):
    y, rstd, cos, sin = ctx.saved_tensors      # the angles carry no gradient (positions and frequencies)
    return backward_op(ctx, norm_rope_bwd, _bwd)(dy, y, rstd, cos, sin), None, None, None


_norm_rope = autograd_op(norm_rope_fwd, _fwd, _setup, _backward)


def norm_rope_rows(x: Tensor, cos: Tensor, sin: Tensor, eps: float) -> Tensor:
    """`naive.norm_rope_rows` as one Triton kernel each way (custom op)."""
    if x.dim() != 3 or cos.shape != sin.shape or cos.shape != (x.shape[0], cos.shape[-1]) or 2 * cos.shape[-1] > x.shape[-1]:
        raise ValueError(f"norm_rope_rows: x [P, G, C] with cos / sin [P, h], 2h <= C; got x {tuple(x.shape)}, "
                         f"cos {tuple(cos.shape)}, sin {tuple(sin.shape)}")
    return _norm_rope(x, cos, sin, float(eps))[0]
