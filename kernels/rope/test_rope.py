"""Triton rotary embedding vs the naive rotation (spec §3): forward and backward, both directions, rows sharing a
position (heads), a head that is all rope (no unrotated dims), odd sizes, and through model/rope.py `apply_rope`
(the model's call: YaRN scale, [S, B, H, c] layouts); fp64 gradcheck. bf16 is checked on the GPU only."""
from dsv4.kernels._testing import CUDA, assert_close, assert_rel, use_interpreter

use_interpreter()

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
from dsv4.kernels.rope import rope_rows  # noqa: E402

DEV = "cuda" if CUDA else "cpu"


def _angles(P, h, g):
    pos = torch.randint(0, 70000, (P,), generator=g, device=DEV)
    inv = torch.rand(h, generator=g, device=DEV)
    ang = pos.float()[:, None] * inv
    return ang.cos(), ang.sin()


@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("P,G,C,h", [(1, 1, 8, 4), (13, 3, 40, 4), (9, 2, 16, 8), (33, 5, 100, 6)]
                         + ([(8192, 16, 512, 32), (16384, 1, 512, 32)] if CUDA else []))
def test_triton_matches_naive(P, G, C, h, inverse):
    g = torch.Generator(device=DEV).manual_seed(P * 7 + C)
    dt = torch.bfloat16 if CUDA and P > 100 else torch.float32
    x = torch.randn(P, G, C, generator=g, device=DEV).to(dt).requires_grad_()
    cos, sin = _angles(P, h, g)
    dy = torch.randn(P, G, C, generator=g, device=DEV).to(dt)
    y = rope_rows(x, cos, sin, inverse, backend="triton")
    (dx,) = torch.autograd.grad(y, x, dy)
    ry = rope_rows(x, cos, sin, inverse, backend="naive")
    (rdx,) = torch.autograd.grad(ry, x, dy)
    assert y.dtype == dx.dtype == dt
    assert torch.equal(y[..., : C - 2 * h], x[..., : C - 2 * h].detach())             # unrotated dims: a copy
    if dt == torch.float32:             # interpreter, fp32: the same products (measured: bit-identical)
        assert_close("y", y, ry, 1e-6, 1e-6)
        assert_close("dx", dx, rdx, 1e-6, 1e-6)
    else:
        assert_rel("y", y, ry, 1e-2)
        assert_rel("dx", dx, rdx, 1e-2)
    # a rotation: the round trip returns x (fp32 rounding only), the backward is the inverse rotation
    back = rope_rows(y.detach(), cos, sin, not inverse, backend="triton")
    assert_close("round trip", back.float(), x.detach().float(), 1e-4 if dt == torch.float32 else 5e-2, 1e-4)


def test_bad_shapes_are_one_line():
    x = torch.randn(4, 2, 8, device=DEV)
    cos = torch.randn(4, 5, device=DEV)
    with pytest.raises(ValueError, match=r"x \[P, G, C\] with cos / sin \[P, h\], 2h <= C"):
        rope_rows(x, cos, cos, backend="triton")


def test_apply_rope_backends_agree():
    """model/rope.py `apply_rope` (positions a prefix of x's dims, the YaRN scale, inverse, no positions at all: an
    HCA layer shorter than its ratio has no entries) on both backends."""
    from dsv4.model.rope import apply_rope
    g = torch.Generator(device=DEV).manual_seed(5)
    inv = torch.rand(4, generator=g, device=DEV)
    for shape, pdims in (((11, 3, 2, 24), 1), ((11, 3, 24), 2), ((6, 24), 1), ((0, 24), 1), ((0, 2, 24), 1)):
        x = torch.randn(shape, generator=g, device=DEV, requires_grad=True)
        pos = torch.randint(0, 5000, shape[:pdims], generator=g, device=DEV)
        for inverse, scale in ((False, 1.0), (True, 1.3)):
            a = apply_rope(x, pos, inv, 8, inverse, scale, backend="triton")
            b = apply_rope(x, pos, inv, 8, inverse, scale, backend="naive")
            assert a.shape == x.shape
            assert_close(f"apply_rope {shape}", a, b, 1e-6, 1e-6)
            ga, = torch.autograd.grad(a, x, torch.ones_like(a))
            gb, = torch.autograd.grad(b, x, torch.ones_like(b))
            assert_close(f"apply_rope grad {shape}", ga, gb, 1e-6, 1e-6)


@pytest.mark.skipif(CUDA, reason="fp64 gradcheck through the CPU interpreter")
def test_gradcheck_fp64():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 2, 12, generator=g, dtype=torch.float64, requires_grad=True)
    ang = torch.rand(5, 3, generator=g, dtype=torch.float64) * 50
    assert torch.autograd.gradcheck(lambda a: rope_rows(a, ang.cos(), ang.sin(), True, backend="triton"), (x,))


def test_the_model_module_runs_one_kernel_each_way(monkeypatch):
    """model/rope.py RotaryTable on the triton backend, on its custom-op path (what torch.compile sees; eager calls
    run the same body through one autograd.Function): forward + backward dispatch the custom op twice and the
    angles (cast, product, cos, sin) (the eager rotation dispatches about 30 ops, one GPU launch each)."""
    from dsv4.kernels import _custom_op
    from dsv4.kernels._testing import dispatched_ops
    monkeypatch.setattr(_custom_op, "traced", lambda args: True)   # the custom ops, as torch.compile sees them
    from dsv4.model.config import get_config
    from dsv4.model.rope import RotaryTable
    rope = RotaryTable(get_config("debug"), "main").to(DEV)
    x = torch.randn(10, 2, 32, device=DEV, requires_grad=True)
    pos = torch.arange(10, device=DEV)

    def step(backend):
        rope.backend = backend
        return lambda: torch.autograd.backward(rope(x, pos), dy)
    dy = torch.randn_like(x)
    fused, eager = dispatched_ops(step("triton")), dispatched_ops(step("naive"))
    assert fused == {"rope_rows": 2, "_to_copy": 1, "mul": 1, "cos": 1, "sin": 1}, fused
    assert sum(eager.values()) >= 20, eager
