"""The fused query norm + rotation (kernels/norm_rope) against the two reference ops in sequence (rmsnorm then rope):
values and gradients at odd sizes (rows sharing a position, all-rope rows, C not a power of two), a YaRN-scaled
table (cos² + sin² != 1, where the backward's 1 / k term matters), fp64 gradcheck, what autograd keeps (y and rstd,
not x), and the model's query path on both backends. bf16 is checked on the GPU only (Triton 3.9's interpreter
truncates fp32 -> bf16 stores, kernels/PERF_NOTES.md)."""
from dsv4.kernels._testing import CUDA, assert_close, assert_rel, use_interpreter

use_interpreter()

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
from dsv4.kernels.norm_rope import norm_rope_rows  # noqa: E402

DEV = "cuda" if CUDA else "cpu"
EPS = 1e-6


def _case(P, G, C, h, dt, seed, scale=1.0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = (torch.randn(P, G, C, generator=g, device=DEV) * 2).to(dt)
    pos = torch.randint(0, 70000, (P,), generator=g, device=DEV)
    ang = pos.to(torch.float64 if dt == torch.float64 else torch.float32)[:, None] * torch.rand(h, generator=g, device=DEV).to(
        torch.float64 if dt == torch.float64 else torch.float32)
    dy = torch.randn(P, G, C, generator=g, device=DEV).to(dt)
    return x, ang.cos() * scale, ang.sin() * scale, dy


@pytest.mark.parametrize("scale", [1.0, 1.3])
@pytest.mark.parametrize("P,G,C,h", [(1, 1, 8, 4), (13, 3, 40, 4), (9, 2, 16, 8), (33, 5, 100, 6)]
                         + ([(8192, 16, 512, 32)] if CUDA else []))
def test_triton_matches_the_two_reference_ops(P, G, C, h, scale):
    dt = torch.bfloat16 if CUDA and P > 100 else torch.float32
    x, cos, sin, dy = _case(P, G, C, h, dt, P * 7 + C, scale)
    out = {}
    for backend in ("triton", "naive"):
        xx = x.clone().requires_grad_()
        y = norm_rope_rows(xx, cos, sin, EPS, backend=backend)
        out[backend] = (y, *torch.autograd.grad(y, xx, dy))
    (y, dx), (ry, rdx) = out["triton"], out["naive"]
    assert y.dtype == dx.dtype == dt
    if dt == torch.float32:
        # fp32 on the interpreter: the same products, but the fused kernel keeps n in fp32 where the reference
        # rounds it between its two ops (a no-op in fp32) and its backward forms dx from y instead of x (another
        # order of the same fp32 sums): measured max |diff| 7.2e-7 (y, |y| <= ~5) / 4.8e-7 (dx) over these cases
        # and both scales, x5
        assert_close("y", y, ry, 3.6e-6, 0)
        assert_close("dx", dx, rdx, 2.4e-6, 0)
    else:
        assert_rel("y", y, ry, 1e-2)
        assert_rel("dx", dx, rdx, 1e-2)


def test_gradcheck_fp64_with_a_scaled_table():
    x, cos, sin, _ = _case(5, 3, 12, 2, torch.float64, 3, scale=1.25)
    assert torch.autograd.gradcheck(lambda a: norm_rope_rows(a, cos, sin, EPS, backend="triton"),
                                    (x.requires_grad_(),))


def test_autograd_keeps_the_output_not_the_input():
    """The memory point of the fusion: the backward reads y (which the attention keeps as its q anyway) and rstd,
    never x -- so x can be freed after the forward (the unfused pair kept x for the norm's backward)."""
    x, cos, sin, dy = _case(6, 2, 24, 4, torch.float32, 5)
    x.requires_grad_()
    packed = []

    def pack(t):
        packed.append(t)
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = norm_rope_rows(x, cos, sin, EPS, backend="triton")
    ptrs = {t.untyped_storage().data_ptr() for t in packed}
    assert y.untyped_storage().data_ptr() in ptrs and x.untyped_storage().data_ptr() not in ptrs
    assert sorted(tuple(t.shape) for t in packed) == sorted([(6, 2, 24), (12,), (6, 4), (6, 4)])


def test_a_wrong_backward_term_fails():
    """Dropping the mean term of the backward is caught (the comparison above is not vacuous)."""
    from dsv4.kernels.norm_rope import triton as T
    x, cos, sin, dy = _case(7, 2, 20, 4, torch.float32, 9)
    y, rstd = T.norm_rope_fwd(x, cos, sin, EPS)
    xx = x.clone().requires_grad_()
    (rdx,) = torch.autograd.grad(norm_rope_rows(xx, cos, sin, EPS, backend="naive"), xx, dy)
    wrong = T.norm_rope_bwd(dy, torch.zeros_like(y), rstd, cos, sin)           # y = 0 drops y * mean
    with pytest.raises(AssertionError):
        assert_close("dx", wrong, rdx, 2.4e-6, 0)


def test_bad_shapes_are_one_line():
    x = torch.randn(4, 2, 8, device=DEV)
    cos = torch.randn(4, 5, device=DEV)
    with pytest.raises(ValueError, match=r"norm_rope_rows: x \[P, G, C\] with cos / sin \[P, h\], 2h <= C"):
        norm_rope_rows(x, cos, cos, EPS, backend="triton")
