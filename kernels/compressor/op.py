"""`dsv4::compress_pool_fwd` / `dsv4::compress_pool_bwd`: the Triton compressor pooling as torch custom ops
(opaque to torch.compile; fake implementations for shapes). The bodies run `triton._CompressPool`'s forward /
backward with a plain ctx record (`FnCtx`), so the numerics are those of the autograd.Function."""
import torch

from dsv4.kernels._triton_util import FnCtx
from dsv4.kernels.compressor import triton as T

Tensor = torch.Tensor


@torch.library.custom_op("dsv4::compress_pool_fwd", mutates_args=())
def compress_pool_fwd(kv: Tensor, gate: Tensor, ape: Tensor, ratio: int, overlap: bool) -> Tensor:
    return T._CompressPool.forward(FnCtx(), kv, gate, ape, ratio, overlap)


@compress_pool_fwd.register_fake
def _(kv, gate, ape, ratio, overlap):
    S, B, W = kv.shape
    return kv.new_empty(S // ratio, B, W // 2 if overlap else W)


@torch.library.custom_op("dsv4::compress_pool_bwd", mutates_args=())
def compress_pool_bwd(dout: Tensor, kv: Tensor, gate: Tensor, ape: Tensor, ratio: int,
                      overlap: bool) -> tuple[Tensor, Tensor, Tensor]:
    ctx = FnCtx()                                      # what _CompressPool.forward leaves
    ctx.save_for_backward(kv.contiguous(), gate.contiguous(), ape.contiguous())
    ctx.cfg = (ratio, overlap)
    dkv, dgate, dape, _, _ = T._CompressPool.backward(ctx, dout)
    return dkv, dgate, dape


@compress_pool_bwd.register_fake
def _(dout, kv, gate, ape, ratio, overlap):
    return kv.new_empty(kv.shape), gate.new_empty(gate.shape), ape.new_empty(ape.shape)


def _setup(ctx, inputs, output):
    kv, gate, ape, ratio, overlap = inputs
    ctx.save_for_backward(kv, gate, ape)
    ctx.cfg = (int(ratio), bool(overlap))


def _backward(ctx, dout):
    kv, gate, ape = ctx.saved_tensors
    dkv, dgate, dape = torch.ops.dsv4.compress_pool_bwd(dout, kv, gate, ape, *ctx.cfg)
    return dkv, dgate, dape, None, None


compress_pool_fwd.register_autograd(_backward, setup_context=_setup)


def _pool(kv: Tensor, gate: Tensor, ape: Tensor, ratio: int, overlap: bool) -> Tensor:
    return torch.ops.dsv4.compress_pool_fwd(kv, gate, ape, int(ratio), bool(overlap))


def compress_pool(kv: Tensor, gate: Tensor, ape: Tensor, ratio: int, overlap: bool, seg: Tensor, pos: Tensor,
                  first: int = 0):
    """Packed-stream pooling (the contract of `naive.compress_pool`): the row gather of `triton.compress_pool`
    around the window kernel as the custom op dsv4::compress_pool_fwd."""
    return T.compress_pool(kv, gate, ape, ratio, overlap, seg, pos, first, pool=_pool)
