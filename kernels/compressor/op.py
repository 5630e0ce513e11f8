"""`dsv4::compress_slots_fwd`, `dsv4::compress_pool_fwd` / `dsv4::compress_pool_bwd`: the Triton compressor as
torch custom ops (opaque to torch.compile; fake implementations for shapes). `compress_slots_fwd` is the slot
metadata (integer outputs, no backward); the pool ops run `triton.pool_forward` / `triton.pool_backward`, the
bodies of `triton._CompressPool`, so the numerics are those of the autograd.Function."""
import torch

from dsv4.kernels._custom_op import autograd_op, backward_op
from dsv4.kernels.compressor import naive
from dsv4.kernels.compressor import triton as T

Tensor = torch.Tensor


@torch.library.custom_op("dsv4::compress_slots_fwd", mutates_args=())
def compress_slots_fwd(seg: Tensor, pos: Tensor, ratio: int, overlap: bool,
                       first: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """-> ends, entry_seg, j [N] long; r0, hp [N] int32 (see triton.slot_meta)."""
    return T.slot_meta(seg, pos, ratio, overlap, first)


@compress_slots_fwd.register_fake
def _(seg, pos, ratio, overlap, first):
    N = naive.num_slots(seg.shape[0], ratio, first)
    return (*(seg.new_empty(N, dtype=torch.long) for _ in range(3)),
            seg.new_empty(N, dtype=torch.int32), seg.new_empty(N, dtype=torch.int32))


def _compress_pool_fwd(kv: Tensor, gate: Tensor, ape: Tensor, r0: Tensor, hp: Tensor, pos: Tensor, ratio: int,
                       overlap: bool, first: int) -> Tensor:
    return T.pool_forward(kv.contiguous(), gate.contiguous(), ape.contiguous(), r0, hp, ratio, overlap)


compress_pool_fwd = torch.library.custom_op("dsv4::compress_pool_fwd", mutates_args=())(_compress_pool_fwd)


@compress_pool_fwd.register_fake
def _(kv, gate, ape, r0, hp, pos, ratio, overlap, first):
    return kv.new_empty(r0.shape[0], kv.shape[1] // 2 if overlap else kv.shape[1])


def _compress_pool_bwd(dout: Tensor, kv: Tensor, gate: Tensor, ape: Tensor, r0: Tensor, hp: Tensor, pos: Tensor,
                       ratio: int, overlap: bool, first: int) -> tuple[Tensor, Tensor, Tensor]:
    return T.pool_backward(dout, kv.contiguous(), gate.contiguous(), ape.contiguous(), r0, hp, pos, ratio, overlap,
                           first)


compress_pool_bwd = torch.library.custom_op("dsv4::compress_pool_bwd", mutates_args=())(_compress_pool_bwd)


@compress_pool_bwd.register_fake
def _(dout, kv, gate, ape, r0, hp, pos, ratio, overlap, first):
    return kv.new_empty(kv.shape), gate.new_empty(gate.shape), ape.new_empty(ape.shape)


def _setup(ctx, inputs, output):
    kv, gate, ape, r0, hp, pos, ratio, overlap, first = inputs
    ctx.save_for_backward(kv, gate, ape, r0, hp, pos)
    ctx.cfg = (int(ratio), bool(overlap), int(first))


def _backward(ctx, dout):
    kv, gate, ape, r0, hp, pos = ctx.saved_tensors
    bwd = backward_op(ctx, compress_pool_bwd, _compress_pool_bwd)
    dkv, dgate, dape = bwd(dout, kv, gate, ape, r0, hp, pos, *ctx.cfg)
    return dkv, dgate, dape, None, None, None, None, None, None


_compress_pool = autograd_op(compress_pool_fwd, _compress_pool_fwd, _setup, _backward)


def _meta(seg, pos, ratio, overlap, first):
    return torch.ops.dsv4.compress_slots_fwd(seg, pos, int(ratio), bool(overlap), int(first))


def _pool(kv, gate, ape, r0, hp, pos, ratio, overlap, first):
    return _compress_pool(kv, gate, ape, r0, hp, pos, int(ratio), bool(overlap), int(first))


def compress_slots(seg: Tensor, pos: Tensor, ratio: int, overlap: bool, first: int = 0):
    """`naive.Slots` of the stream on the custom op dsv4::compress_slots_fwd."""
    return T.compress_slots(seg, pos, ratio, overlap, first, meta=_meta)


def compress_pool(kv: Tensor, gate: Tensor, ape: Tensor, ratio: int, overlap: bool, seg: Tensor, pos: Tensor,
                  first: int = 0, slots=None):
    """Packed-stream pooling (the contract of `naive.compress_pool`) on the custom ops; `slots` precomputed
    (`compress_slots`) or None."""
    return T.compress_pool(kv, gate, ape, ratio, overlap, seg, pos, first, meta=_meta, pool=_pool, slots=slots)
