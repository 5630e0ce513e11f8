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
A case must be deterministic on its platform (seed everything inside the case); the harness also seeds the
global RNG with `numerics.CASE_SEED` and applies the numerics contract (harness/numerics.py) before each run.

Scope: "portable" (default) goldens must pass on every host under the contract, so their float tolerances cover
the cross-host spread measured by `dsv4 goldens spread` (times a margin, named beside the tolerance).
"same-host" goldens (long curves, where MoE routing and top-k flips amplify rounding) are exact evidence on
the host that made them (same `numerics.fingerprint`) and are reported as not judged elsewhere.
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
    scope: str = "portable"   # "portable" | "same-host" (see the module doc)

    def run(self, device: str = "cpu") -> dict:
        out = self.fn(device=device) if "device" in self.fn.__code__.co_varnames else self.fn()
        if not isinstance(out, dict) or not out:
            raise CaseError(f"golden case {self.name}: must return a non-empty dict of outputs")
        return out


_REGISTRY: list[GoldenCase] = []


SCOPES = ("portable", "same-host")


def golden_case(name: str, tol: dict | None = None, platforms=("cpu",), scope: str = "portable"):
    """Register a golden case. `tol` maps each floating output to (atol, rtol)."""
    if scope not in SCOPES:
        raise CaseError(f"golden case {name}: scope must be one of {SCOPES}, got {scope!r}")

    def deco(fn):
        _REGISTRY.append(GoldenCase(name, fn, dict(tol or {}), tuple(platforms), (fn.__doc__ or "").strip(),
                                    scope))
        return fn
    return deco


def case_hash(case: GoldenCase) -> str:
    """The golden's config hash: the case function's own source (from its `def`, so the decorator's tolerances are
    not part of it: they are judged against the stored spread instead), platforms and scope."""
    import hashlib
    import inspect
    import json
    try:
        src = inspect.getsource(case.fn)
        src = src[src.index("def "):]
    except (OSError, TypeError, ValueError):
        src = case.fn.__qualname__
    blob = json.dumps({"src": src, "platforms": list(case.platforms), "scope": case.scope}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


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
