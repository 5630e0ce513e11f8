"""`dsv4::rope_rows`: the Triton rotary embedding as a torch custom op (opaque to torch.compile, a fake
implementation for shapes), whose backward is the same op with the opposite angles; eager calls skip the
dispatcher (kernels/_custom_op.py)."""
import torch

from dsv4.kernels._custom_op import autograd_op, backward_op
from dsv4.kernels.rope import triton as T

Tensor = torch.Tensor


def _rope(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool) -> Tensor:
    return T.rope_rows(x, cos, sin, inverse)


rope_rows_op = torch.library.custom_op("dsv4::rope_rows", mutates_args=())(_rope)


@rope_rows_op.register_fake
def _(x, cos, sin, inverse):
    return x.new_empty(x.shape)


def _setup(ctx, inputs, output):
    _, cos, sin, inverse = inputs
    ctx.save_for_backward(cos, sin)
    ctx.inverse = inverse


def _backward(ctx, dy):
    cos, sin = ctx.saved_tensors                 # the angles carry no gradient (positions and frequencies)
    return backward_op(ctx, rope_rows_op, _rope)(dy, cos, sin, not ctx.inverse), None, None, None


_rope_rows = autograd_op(rope_rows_op, _rope, _setup, _backward)


def rope_rows(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool = False) -> Tensor:
    """`naive.rope_rows` as one Triton kernel each way (custom op)."""
    if x.dim() != 3 or cos.shape != sin.shape or cos.shape != (x.shape[0], cos.shape[-1]) or 2 * cos.shape[-1] > x.shape[-1]:
        raise ValueError(f"rope_rows: x [P, G, C] with cos / sin [P, h], 2h <= C; got x {tuple(x.shape)}, "
                         f"cos {tuple(cos.shape)}, sin {tuple(sin.shape)}")
    return _rope_rows(x, cos, sin, bool(inverse))
