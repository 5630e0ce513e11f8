"""Triton compressor pooling vs the naive reference (spec §6.2/6.3): overlapping (CSA) and non-overlapping
(HCA) windows, trailing tokens, entry 0's empty slots; forward and gradients of kv, gate, ape."""
from dsv4.kernels._testing import CUDA, assert_close, assert_rel, use_interpreter

use_interpreter()

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
from dsv4.kernels.compressor import compress_pool  # noqa: E402

DEV = "cuda" if CUDA else "cpu"
CASES = [(37, 2, 5, 4, True), (37, 2, 7, 8, False), (13, 1, 6, 3, True), (3, 1, 4, 4, True)]
REAL = [(4096, 1, 512, 4, True), (4096, 1, 128, 4, True), (4096, 1, 512, 128, False)]


@pytest.mark.parametrize("S,B,D,m,overlap", CASES + (REAL if CUDA else []))
def test_triton_matches_naive(S, B, D, m, overlap):
    gen = torch.Generator(device=DEV).manual_seed(0)
    dt = torch.bfloat16 if S > 1000 else torch.float32
    W = 2 * D if overlap else D
    kv = torch.randn(S, B, W, generator=gen, device=DEV).to(dt).requires_grad_()
    gate = (2 * torch.randn(S, B, W, generator=gen, device=DEV)).to(dt).requires_grad_()
    ape = torch.randn(m, W, generator=gen, device=DEV).requires_grad_()
    y = compress_pool(kv, gate, ape, m, overlap, backend="triton")
    ref = compress_pool(kv, gate, ape, m, overlap, backend="naive")
    assert y.shape == ref.shape and y.dtype == ref.dtype
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
