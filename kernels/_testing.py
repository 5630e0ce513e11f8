"""Shared helpers of the Triton-vs-naive kernel tests (`kernels/<op>/test_<op>.py`).

On a machine without CUDA the tests run Triton's CPU interpreter: `use_interpreter()` must be called at the top
of a test module, BEFORE the op's `triton` module is imported (the @triton.jit decorator reads the switch).
"""
from __future__ import annotations

import os

import torch

CUDA = torch.cuda.is_available()


def use_interpreter() -> None:
    """Select Triton's CPU interpreter when no GPU is present (must precede importing any kernels/*/triton.py)."""
    if not CUDA:
        os.environ["TRITON_INTERPRET"] = "1"


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of t (1-byte dtypes as uint8, 4-byte as int32): for bit-for-bit equality incl. NaN / -0."""
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t.view(torch.int32)


def assert_rel(name: str, got: torch.Tensor, ref: torch.Tensor, rel: float) -> None:
    """‖got - ref‖ / ‖ref‖ <= rel (bf16 GPU checks); NaN never passes; names the tensor on failure."""
    got, ref = got.double(), ref.double()
    if not torch.isfinite(got).all():
        raise AssertionError(f"{name}: non-finite values in the Triton result")
    err = (got - ref).norm() / ref.norm().clamp_min(1e-30)
    if not err <= rel:
        raise AssertionError(f"{name}: relative error {err:.3e} > {rel:.1e}")


def assert_close(name: str, got: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float) -> None:
    """Elementwise allclose with a per-tensor name in the message (fp32 interpreter checks)."""
    torch.testing.assert_close(got, ref, atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")


def packed_meta(lens, pads=None, device="cpu"):
    """(seg [T], pos [T]) of documents of lengths `lens` packed back to back, each followed by pads[i]
    padding tokens (seg -1): the document metadata the kernels take (model/layout.py builds it in the model)."""
    seg, pos = [], []
    for i, L in enumerate(lens):
        seg += [i] * L + [-1] * (pads[i] if pads else 0)
        pos += list(range(L)) + [0] * (pads[i] if pads else 0)
    return torch.tensor(seg, device=device), torch.tensor(pos, device=device)


def dispatched_ops(fn) -> dict[str, int]:
    """{aten op: count} that fn() dispatches, allocations and views left out: a proxy for the kernel launches of
    an eager GPU step (a `dsv4::` custom op counts once: its Triton launches are not aten ops)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    skip = {"empty", "empty_like", "empty_strided", "new_empty", "view", "_unsafe_view", "reshape", "t",
            "transpose", "as_strided", "detach", "unsqueeze", "squeeze", "expand", "permute", "select", "slice",
            "alias", "split", "unbind", "lift_fresh", "_local_scalar_dense", "promote_types"}
    seen: dict[str, int] = {}

    class _Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__.split(".")[0]
            if name not in skip:
                seen[name] = seen.get(name, 0) + 1
            return func(*args, **(kwargs or {}))

    with _Count():
        fn()
    return seen
