"""Golden cases: the deterministic computations whose outputs are stored under `goldens/<platform>/<slice>/`.

A slice declares its cases in `slices/<folder>/cases.py`:

    from dsv4.harness.cases import golden_case

    @golden_case("rope_yarn_forward", tol={"out": (1e-6, 1e-5)})
    def rope_yarn_forward(device="cpu"):
        ...
        return {"out": y, "selected": idx, "loss": 0.123}

Rules (enforced by `check_outputs`):
- a case returns a flat dict name -> torch.Tensor | float | int;
- integer / bool tensors and ints are compared EXACTLY (indices, routing, counts);
- every floating tensor / float must have an explicit (atol, rtol) in `tol` -- no silent default;
- tensors are stored whole, so keep them small (<= MAX_ELEMS elements); store a slice or a reduction
  of a big activation instead.
A case must be deterministic on its platform (seed everything inside the case).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

MAX_ELEMS = 16384


class CaseError(ValueError):
    """A malformed golden case (one line, naming the case and the field)."""


@dataclasses.dataclass
class GoldenCase:
    name: str
    fn: Callable
    tol: dict            # output name -> (atol, rtol) for floating outputs
    platforms: tuple     # platforms the case can run on
    doc: str

    def run(self, device: str = "cpu") -> dict:
        out = self.fn(device=device) if "device" in self.fn.__code__.co_varnames else self.fn()
        if not isinstance(out, dict) or not out:
            raise CaseError(f"golden case {self.name}: must return a non-empty dict of outputs")
        return out


_REGISTRY: list[GoldenCase] = []


def golden_case(name: str, tol: dict | None = None, platforms=("cpu",)):
    """Register a golden case. `tol` maps each floating output to (atol, rtol)."""
    def deco(fn):
        _REGISTRY.append(GoldenCase(name, fn, dict(tol or {}), tuple(platforms), (fn.__doc__ or "").strip()))
        return fn
    return deco


def collect(module_loader: Callable[[], object]) -> list[GoldenCase]:
    """Import a slice's cases module through `module_loader` and return the cases it registered."""
    start = len(_REGISTRY)
    module_loader()
    cases = _REGISTRY[start:]
    del _REGISTRY[start:]
    names = [c.name for c in cases]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise CaseError(f"golden case {sorted(dup)[0]}: defined twice")
    return cases
