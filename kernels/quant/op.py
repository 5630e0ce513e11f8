"""`dsv4::fp8_quantize`: the fused Triton FP8 quantiser (kernels/quant/triton.py) as a torch custom op (opaque to
torch.compile; a fake implementation for shapes). No autograd: quantisation is not differentiable here; the FP8
linear's autograd.Function (model/lowp/fp8_linear.py) owns the gradients.

Custom ops return tensors only, so the block is passed as (block_r, block_c) with (0, 0) = per tensor, and
without `transpose` the transposed outputs are empty [0] tensors (the wrapper drops them)."""
import torch

from dsv4.kernels.quant import triton as T
from dsv4.kernels.quant.naive import TORCH_FP8

Tensor = torch.Tensor


def _block(block_r: int, block_c: int):
    return None if (block_r, block_c) == (0, 0) else (block_r, block_c)


@torch.library.custom_op("dsv4::fp8_quantize", mutates_args=())
def fp8_quantize_op(x: Tensor, fmt: str, block_r: int, block_c: int, scale_format: str,
                    transpose: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    out = T.fp8_quantize(x, fmt, _block(block_r, block_c), scale_format, transpose)
    if transpose:
        return out
    q, s = out
    return q, s, q.new_empty(0), s.new_empty(0)


@fp8_quantize_op.register_fake
def _(x, fmt, block_r, block_c, scale_format, transpose):
    R, C = x.shape
    cd = lambda n: -(-n // 128)                                     # noqa: E731
    shapes = {(1, 128): ((R, cd(C)), (C, cd(R))), (128, 128): ((cd(R), cd(C)), (cd(C), cd(R))),
              (0, 0): ((), ())}[(block_r, block_c)]
    q = x.new_empty(R, C, dtype=TORCH_FP8[fmt])
    s = x.new_empty(shapes[0], dtype=torch.float32)
    if not transpose:
        return q, s, q.new_empty(0), s.new_empty(0)
    return q, s, x.new_empty(C, R, dtype=q.dtype), x.new_empty(shapes[1], dtype=torch.float32)


def fp8_quantize(x: Tensor, fmt: str = "e4m3", block=(1, 128), scale_format: str = "ue8m0",
                 transpose: bool = False):
    """As kernels/quant/naive.py `fp8_quantize`, through the custom op."""
    br, bc = (0, 0) if block is None else block
    q, s, qt, st = torch.ops.dsv4.fp8_quantize(x, fmt, int(br), int(bc), scale_format, bool(transpose))
    return (q, s, qt, st) if transpose else (q, s)
