"""Triton RMSNorm vs the naive reference (spec §5.1): forward, dx and dw at odd widths and row counts, with and
without a weight, bf16 rows with an fp32 weight (P1), empty input, fp64 gradcheck. bf16 is checked on the GPU
only (Triton 3.9's interpreter computes bf16 `tl.dot` wrongly; this kernel has no dot, but its bf16 rounding is
the GPU's to judge)."""
from dsv4.kernels._testing import CUDA, assert_close, assert_rel, use_interpreter

use_interpreter()

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
from dsv4.kernels.rmsnorm import rms_norm  # noqa: E402

DEV = "cuda" if CUDA else "cpu"


def _case(shape, weighted, dt, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = (torch.randn(shape, generator=g, device=DEV) * 3 + 0.5).to(dt).requires_grad_()
    w = (torch.randn(shape[-1], generator=g, device=DEV) * 0.5 + 1).requires_grad_() if weighted else None
    dy = torch.randn(shape, generator=g, device=DEV).to(dt)
    return x, w, dy


@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("shape", [(1, 7), (13, 37), (3, 5, 96), (70, 512)]
                         + ([(8192, 2048), (4096, 16, 512)] if CUDA else []))
def test_triton_matches_naive(shape, weighted):
    dt = torch.bfloat16 if CUDA and shape[0] > 100 else torch.float32
    x, w, dy = _case(shape, weighted, dt, seed=len(shape) * 100 + shape[-1])
    leaves = (x, w) if weighted else (x,)
    outs = {}
    for be in ("triton", "naive"):
        y = rms_norm(x, w, 1e-6, backend=be)
        outs[be] = (y, *torch.autograd.grad(y, leaves, dy))
    (y, dx, *dw), (ry, rdx, *rdw) = outs["triton"], outs["naive"]
    assert y.dtype == x.dtype and dx.dtype == x.dtype and (not weighted or dw[0].dtype == torch.float32)
    if dt == torch.float32:     # interpreter, fp32: the same sums in another order (measured <= 1/7 of atol + rtol|ref|)
        assert_close("y", y, ry, 1e-5, 1e-5)
        assert_close("dx", dx, rdx, 1e-5, 1e-5)
        if weighted:
            assert_close("dw", dw[0], rdw[0], 1e-4, 1e-5)
    else:                       # bf16 rows, fp32 math in both: rounding only
        assert_rel("y", y, ry, 1e-2)
        assert_rel("dx", dx, rdx, 1e-2)
        if weighted:
            assert_rel("dw", dw[0], rdw[0], 1e-3)


def test_empty_and_bad_weight():
    x = torch.empty(0, 64, device=DEV, requires_grad=True)
    w = torch.ones(64, device=DEV, requires_grad=True)
    y = rms_norm(x, w, 1e-6, backend="triton")
    dx, dw = torch.autograd.grad(y, (x, w), torch.empty_like(y))
    assert y.shape == dx.shape == (0, 64) and torch.equal(dw, torch.zeros(64, device=DEV))
    with pytest.raises(ValueError, match="weight shape"):
        rms_norm(torch.randn(4, 8, device=DEV), torch.ones(7, device=DEV), 1e-6, backend="triton")


@pytest.mark.skipif(CUDA, reason="fp64 gradcheck through the CPU interpreter")
@pytest.mark.parametrize("weighted", [True, False])
def test_gradcheck_fp64(weighted):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 19, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(19, generator=g, dtype=torch.float64, requires_grad=True)
    # torch's default fp64 gradcheck tolerances (atol 1e-5, rtol 1e-3)
    if weighted:
        assert torch.autograd.gradcheck(lambda a, b: rms_norm(a, b, 1e-6, backend="triton"), (x, w))
    else:
        assert torch.autograd.gradcheck(lambda a: rms_norm(a, None, 1e-6, backend="triton"), (x,))


def test_the_model_module_runs_one_kernel_each_way(monkeypatch):
    """model/norm.py RMSNorm on the triton backend, on its custom-op path (what torch.compile sees; eager calls run
    the same bodies through one autograd.Function, kernels/test_custom_ops.py): forward + backward dispatch the two
    custom ops only (inside them: one Triton kernel each and the dw row sum; the eager composite dispatches about
    24 ops, one GPU launch each)."""
    from dsv4.kernels import _custom_op
    from dsv4.kernels._testing import dispatched_ops
    monkeypatch.setattr(_custom_op, "traced", lambda args: True)   # the custom ops, as torch.compile sees them
    from dsv4.model.norm import RMSNorm
    norm = RMSNorm(32).to(DEV)
    x = torch.randn(6, 32, device=DEV, requires_grad=True)
    dy = torch.randn(6, 32, device=DEV)

    def step(backend):
        norm.backend = backend
        return lambda: torch.autograd.backward(norm(x), dy)
    fused, eager = dispatched_ops(step("triton")), dispatched_ops(step("naive"))
    assert fused == {"rms_norm_fwd": 1, "rms_norm_bwd": 1}, fused
    assert sum(eager.values()) >= 15, eager
