"""Triton compressor pooling vs the naive reference (spec §6.2/6.3) on packed streams: overlapping (CSA) and
non-overlapping (HCA) windows, documents of odd lengths with padding (trailing tokens, entry 0's empty previous
slots in every document), a left halo; forward, entry metadata and gradients of kv, gate, ape."""
from dsv4.kernels._testing import CUDA, assert_close, assert_rel, packed_meta, use_interpreter

use_interpreter()

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
from dsv4.kernels.compressor import compress_pool  # noqa: E402

DEV = "cuda" if CUDA else "cpu"
CASES = [([37], None, 0, 5, 4, True), ([37], None, 0, 7, 8, False), ([13], None, 0, 6, 3, True),
         ([3], None, 0, 4, 4, True), ([9, 14, 2, 11], [1, 0, 3, 2], 0, 5, 4, True),
         ([9, 20, 17], [0, 3, 0], 0, 7, 8, False), ([6, 13, 9], [0, 1, 0], 5, 5, 3, True)]
REAL = [([4096], None, 0, 512, 4, True), ([1500, 2596], None, 0, 128, 4, True), ([4096], None, 0, 512, 128, False)]


@pytest.mark.parametrize("lens,pads,first,D,m,overlap", CASES + (REAL if CUDA else []))
def test_triton_matches_naive(lens, pads, first, D, m, overlap):
    gen = torch.Generator(device=DEV).manual_seed(0)
    seg, pos = packed_meta(lens, pads, DEV)
    T = seg.numel()
    if first:                                      # a halo: the first rows are context (their doc starts before)
        pos = torch.where(seg == 0, pos + 2 * m, pos)
    dt = torch.bfloat16 if T > 1000 else torch.float32
    W = 2 * D if overlap else D
    kv = torch.randn(T, W, generator=gen, device=DEV).to(dt).requires_grad_()
    gate = (2 * torch.randn(T, W, generator=gen, device=DEV)).to(dt).requires_grad_()
    ape = torch.randn(m, W, generator=gen, device=DEV).requires_grad_()
    y, s, j, e = compress_pool(kv, gate, ape, m, overlap, seg, pos, first, backend="triton")
    ref, s0, j0, e0 = compress_pool(kv, gate, ape, m, overlap, seg, pos, first, backend="naive")
    assert y.shape == ref.shape and y.dtype == ref.dtype
    assert torch.equal(s, s0) and torch.equal(j, j0) and torch.equal(e, e0)
    if y.numel() == 0:
        return
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, (kv, gate, ape), dy)
    want = torch.autograd.grad(ref, (kv, gate, ape), dy)
    for n, a, b in zip(("dkv", "dgate", "dape"), got, want):
        if dt == torch.float32:                    # measured <= 1/26 of atol + rtol*|ref| (11 simulated hosts)
            assert_close(n, a, b, 1e-5, 1e-5)
        else:
            assert_rel(n, a, b, 1e-2)
    if dt == torch.float32:                        # measured 2.4e-7, <= 1/90 of the bound (11 hosts)
        assert_close("out", y, ref, 1e-5, 1e-5)
    else:                                          # bf16, GPU only: 1.3 bf16 eps, unmeasured
        assert_rel("out", y, ref, 1e-2)
