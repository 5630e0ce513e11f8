"""Triton mHC hc_pre / hc_post vs the naive reference (spec §4.2): u, post, comb and hc_post's new streams,
gradients of every input (x, fn, base, scale; x, out, post, comb). fp32 math in both."""
from dsv4.kernels._testing import CUDA, assert_close, assert_rel, use_interpreter

use_interpreter()

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
from dsv4.kernels.mhc import hc_post, hc_pre  # noqa: E402

DEV = "cuda" if CUDA else "cpu"
CASES = [(13, 4, 20), (5, 3, 8)]
REAL = [(2048, 4, 4096)]


def _tols(dt):
    # fp32 (interpreter on CPU): measured worst 5.7e-6 abs (ATEN default), <= 1/15 of atol + rtol*|ref| over the 8
    # simulated hosts of harness/numerics.py; bf16 (GPU only): 2e-2 = 2.5 bf16 eps, not measured here
    return (lambda n, a, b: assert_close(n, a, b, 2e-5, 2e-5)) if dt == torch.float32 else \
        (lambda n, a, b: assert_rel(n, a, b, 2e-2))


@pytest.mark.parametrize("N,n,d", CASES + (REAL if CUDA else []))
def test_hc_pre_matches_naive(N, n, d):
    gen = torch.Generator(device=DEV).manual_seed(0)
    dt = torch.bfloat16 if N > 1000 else torch.float32
    check = _tols(dt)
    x = torch.randn(N, n, d, generator=gen, device=DEV).to(dt).requires_grad_()
    fn = (torch.randn((2 + n) * n, n * d, generator=gen, device=DEV) * (n * d) ** -0.5 * 3).requires_grad_()
    base = torch.randn((2 + n) * n, generator=gen, device=DEV).requires_grad_()
    scale = (torch.rand(3, generator=gen, device=DEV) + 0.5).requires_grad_()
    got = hc_pre(x, fn, base, scale, 20, 1e-6, 1e-6, backend="triton")
    want = hc_pre(x, fn, base, scale, 20, 1e-6, 1e-6, backend="naive")
    for name, a, b in zip(("u", "post", "comb"), got, want):
        assert a.dtype == b.dtype
        check(name, a, b)
    gs = [torch.randn_like(t) for t in got]
    ga = torch.autograd.grad(got, (x, fn, base, scale), gs)
    gb = torch.autograd.grad(want, (x, fn, base, scale), gs)
    for name, a, b in zip(("dx", "dfn", "dbase", "dscale"), ga, gb):
        check(name, a, b)


@pytest.mark.parametrize("N,n,d", CASES + (REAL if CUDA else []))
def test_hc_post_matches_naive(N, n, d):
    gen = torch.Generator(device=DEV).manual_seed(1)
    dt = torch.bfloat16 if N > 1000 else torch.float32
    check = _tols(dt)
    x = torch.randn(N, n, d, generator=gen, device=DEV).to(dt).requires_grad_()
    out = torch.randn(N, d, generator=gen, device=DEV).to(dt).requires_grad_()
    post = (2 * torch.rand(N, n, generator=gen, device=DEV)).requires_grad_()
    comb = torch.rand(N, n, n, generator=gen, device=DEV).requires_grad_()
    y = hc_post(x, out, post, comb, backend="triton")
    ref = hc_post(x, out, post, comb, backend="naive")
    check("y", y, ref)
    dy = torch.randn_like(y)
    ga = torch.autograd.grad(y, (x, out, post, comb), dy)
    gb = torch.autograd.grad(ref, (x, out, post, comb), dy)
    for name, a, b in zip(("dx", "dout", "dpost", "dcomb"), ga, gb):
        check(name, a, b)
