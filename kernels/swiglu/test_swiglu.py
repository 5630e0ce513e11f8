"""Triton clamped SwiGLU vs the naive reference (spec §9.2): forward, gradients, clamp boundaries, gradcheck."""
from dsv4.kernels._testing import CUDA, assert_close, assert_rel, use_interpreter

use_interpreter()

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
from dsv4.kernels.swiglu import clamped_swiglu, clamped_swiglu_packed  # noqa: E402

DEV = "cuda" if CUDA else "cpu"


@pytest.mark.parametrize("limit", [None, 10.0, 2.0])
@pytest.mark.parametrize("shape", [(13, 37)] + ([(4096, 2048)] if CUDA else []))
def test_triton_matches_naive(shape, limit):
    gen = torch.Generator(device=DEV).manual_seed(0)
    dt = torch.bfloat16 if shape[0] > 100 else torch.float32
    g = (torch.randn(shape, generator=gen, device=DEV) * 6).to(dt).requires_grad_()
    u = (torch.randn(shape, generator=gen, device=DEV) * 6).to(dt).requires_grad_()
    if limit is not None:                           # exact boundary values: gradient passes at |x| == limit
        g.data.view(-1)[:3] = torch.tensor([limit, limit + 1, -limit], dtype=dt)
        u.data.view(-1)[:3] = torch.tensor([-limit, limit, limit + 1], dtype=dt)
    y = clamped_swiglu(g, u, limit, backend="triton")
    ref = clamped_swiglu(g, u, limit, backend="naive")
    dy = torch.randn_like(y)
    dg, du = torch.autograd.grad(y, (g, u), dy)
    rg, ru = torch.autograd.grad(ref, (g, u), dy)
    if dt == torch.float32:                         # interpreter, fp32: measured <= 1/52 of atol+rtol*|ref| (11 hosts)
        assert_close("y", y, ref, 1e-5, 1e-5)
        assert_close("dgate", dg, rg, 1e-5, 1e-5)
        assert_close("dup", du, ru, 1e-5, 1e-5)
    else:                                           # bf16 storage, fp32 math in both: rounding only (GPU, unmeasured)
        assert_rel("y", y, ref, 1e-2)
        assert_rel("dgate", dg, rg, 1e-2)
        assert_rel("dup", du, ru, 1e-2)
    if limit is not None:
        assert (dg.view(-1)[1] == 0) and (du.view(-1)[2] == 0)          # clamped: zero gradient


@pytest.mark.skipif(CUDA, reason="fp64 gradcheck through the CPU interpreter")
def test_gradcheck_fp64():
    gen = torch.Generator().manual_seed(1)
    g = (torch.randn(2, 7, generator=gen, dtype=torch.float64) * 4).requires_grad_()
    u = (torch.randn(2, 7, generator=gen, dtype=torch.float64) * 4).requires_grad_()
    # torch's default fp64 gradcheck tolerances (atol 1e-5, rtol 1e-3); measured |analytic - numeric| <= 4.8e-10
    assert torch.autograd.gradcheck(lambda a, b: clamped_swiglu(a, b, 3.0, backend="triton"), (g, u))


@pytest.mark.parametrize("limit", [None, 2.0])
@pytest.mark.parametrize("shape", [(13, 37), (3, 5, 19)] + ([(8192, 1024)] if CUDA else []))
def test_packed_matches_naive_halves(shape, limit):
    """gu [..., 2f] (gate | up) read in place: y and d(gu) against the naive form of the two halves (chunk + the
    naive op, whose autograd concatenates the halves' gradients), odd widths, a 3-d batch; a swapped half, a
    missing half's gradient or a wrong row stride fails this."""
    gen = torch.Generator(device=DEV).manual_seed(2)
    dt = torch.bfloat16 if shape[0] > 100 else torch.float32
    gu = (torch.randn(*shape[:-1], 2 * shape[-1], generator=gen, device=DEV) * 4).to(dt).requires_grad_()
    y = clamped_swiglu_packed(gu, limit, backend="triton")
    g, u = gu.chunk(2, dim=-1)
    ref = clamped_swiglu(g, u, limit, backend="naive")
    assert y.shape == ref.shape
    dy = torch.randn_like(y)
    d, = torch.autograd.grad(y, gu, dy)
    rd, = torch.autograd.grad(ref, gu, dy)
    if dt == torch.float32:                         # interpreter, fp32: the same elementwise math as the test above
        assert_close("y", y, ref, 1e-5, 1e-5)
        assert_close("d(gu)", d, rd, 1e-5, 1e-5)
    else:                                           # bf16 storage, fp32 math in both: rounding only (GPU, unmeasured)
        assert_rel("y", y, ref, 1e-2)
        assert_rel("d(gu)", d, rd, 1e-2)
    assert torch.equal(clamped_swiglu_packed(gu, limit, backend="naive"), ref)   # naive packed = naive halves


def test_packed_reads_a_strided_input():
    """A non-contiguous gu (a column slice of a wider tensor) gives the values of its contiguous copy."""
    gen = torch.Generator(device=DEV).manual_seed(3)
    wide = torch.randn(9, 30, generator=gen, device=DEV)
    gu = wide[:, 2:24]                              # [9, 22], row stride 30
    assert_close("y", clamped_swiglu_packed(gu, 1.5, backend="triton"),
                 clamped_swiglu_packed(gu.contiguous(), 1.5, backend="naive"), 1e-5, 1e-5)
    with pytest.raises(ValueError, match="last dim must be even"):
        clamped_swiglu_packed(wide[:, :7], 1.5, backend="triton")


@pytest.mark.skipif(CUDA, reason="fp64 gradcheck through the CPU interpreter")
def test_packed_gradcheck_fp64():
    gen = torch.Generator().manual_seed(4)
    gu = (torch.randn(3, 10, generator=gen, dtype=torch.float64) * 4).requires_grad_()
    # torch's default fp64 gradcheck tolerances, as test_gradcheck_fp64
    assert torch.autograd.gradcheck(lambda a: clamped_swiglu_packed(a, 3.0, backend="triton"), (gu,))
