"""The one threshold table, as Megatron-LM's functional tests (`CHECK_THRESHOLDS`, megatron_dsv4.md §3.3).

Two modes:
- deterministic: every golden step must equal exactly (rtol = atol = 0); used for CPU goldens, which are
  bit-exact run to run, and for the H200 curve when a run is made with deterministic algorithms;
- approximate: per-metric rtol, and a number of failing steps allowed: min(max(n // 100, 1), 50).
`iteration-time` is compared as one value, the median over a steady window (steps 5..20 when the last golden
step is <= 25, else 30..45; fallback: the first 4 finite steps after the window start). FLOPs are exact.

Non-finite values (a NaN or Inf, or "nan": Megatron's mark for a step that was not logged) mean:
- in the run: a failure, at any step and in either mode (iteration-time: in its window); it is never one of
  the allowed approximate failures;
- in the golden: the golden cannot judge that step, which is left out and listed (`unjudged_steps`).
Verdicts are pass | fail | cannot-judge: cannot-judge when the golden has no values, no finite value (so no
step is judged), or ends before the run does (the run's later steps have nothing to be compared with), and
when the run lacks the metric.
"""
from __future__ import annotations

import math
import statistics

# metric -> {mode: (atol, rtol)}; "deterministic" entries are exact.
CHECK_THRESHOLDS: dict[str, dict[str, tuple[float, float]]] = {
    "iteration-time": {"approximate": (0.0, 0.05)},
    "mem-allocated-bytes": {"approximate": (0.0, 0.05)},
    "mem-max-allocated-bytes": {"approximate": (0.0, 0.05)},
    "lm loss": {"deterministic": (0.0, 0.0), "approximate": (0.0, 0.05)},
    "mtp_1 loss": {"deterministic": (0.0, 0.0), "approximate": (0.0, 0.05)},
    "mtp_2 loss": {"deterministic": (0.0, 0.0), "approximate": (0.0, 0.05)},
    "total loss": {"deterministic": (0.0, 0.0), "approximate": (0.0, 0.05)},
    "indexer loss": {"deterministic": (0.0, 0.0), "approximate": (0.0, 0.05)},
    "num-zeros": {"deterministic": (0.0, 0.0), "approximate": (0.0, 0.20)},
    # DSv4 additions (not in Megatron's table): auxiliary losses behave like losses, grad norm like num-zeros
    "moe aux loss": {"deterministic": (0.0, 0.0), "approximate": (0.0, 0.05)},
    "grad-norm": {"deterministic": (0.0, 0.0), "approximate": (0.0, 0.20)},
    "flops": {"deterministic": (0.0, 0.0), "approximate": (0.0, 0.0)},   # FLOPs are always exact
}
DEFAULT_METRICS = ("lm loss", "num-zeros", "mtp_1 loss")   # Megatron's default METRICS (+ MTP when present)
MODES = ("deterministic", "approximate")
CANNOT_JUDGE = "cannot-judge"


def allowed_failures(n: int) -> int:
    return min(max(n // 100, 1), 50)


def _num(v) -> float:
    return float(v)              # "nan" / "inf" / "-inf" strings included


def _isclose(a: float, b: float, atol: float, rtol: float) -> bool:
    if math.isinf(a) or math.isinf(b):
        return a == b            # as np.isclose: inf matches only inf
    return abs(a - b) <= atol + rtol * abs(b)


def steady_window(golden_steps: list[int]) -> list[int]:
    finite = sorted(golden_steps)
    if not finite:
        return []
    lo, hi = (5, 21) if finite[-1] <= 25 else (30, 46)
    win = [s for s in finite if lo <= s < hi]
    return win or [s for s in finite if s >= lo][:4]


def compare_metric(metric: str, golden: dict, actual: dict | None, mode: str) -> dict:
    """Compare one metric (Megatron golden format). Returns a check record with a verdict pass|fail."""
    if mode not in MODES:
        raise ValueError(f"mode: {mode!r} is not one of {MODES}")
    rec = {"check": metric, "kind": "curve", "mode": mode}
    if metric not in CHECK_THRESHOLDS:
        rec.update(verdict="fail", detail=f"no threshold for metric {metric!r} in CHECK_THRESHOLDS")
        return rec
    table = CHECK_THRESHOLDS[metric]
    if mode not in table:       # e.g. iteration-time has no deterministic test: it is approximate always
        mode = "approximate"
        rec["mode"] = mode
    atol, rtol = table[mode]
    gvals = {int(k): _num(v) for k, v in golden["values"].items()}
    avals = {int(k): _num(v) for k, v in (actual or {}).get("values", {}).items()}
    rec.update(atol=atol, rtol=rtol)
    judged = sorted(s for s, v in gvals.items() if math.isfinite(v))
    if actual is None:
        return _cannot(rec, "metric missing from the run")
    if not judged:
        return _cannot(rec, "golden has no values" if not gvals else "golden has no finite value")
    if avals and max(avals) > max(gvals):
        return _cannot(rec, f"golden ends at step {max(gvals)}, the run goes on to step {max(avals)}")
    nonfinite = sorted(s for s, v in avals.items() if not math.isfinite(v))
    unjudged = sorted(set(gvals) - set(judged))
    rec.update(unjudged_steps=unjudged[:20], n_unjudged=len(unjudged))
    if metric == "iteration-time":
        win = steady_window(judged)
        g = statistics.median(gvals[s] for s in win)
        a = statistics.median(avals.get(s, math.inf) for s in win)
        nonfinite = [s for s in win if not math.isfinite(avals.get(s, math.inf))]     # only the window counts
        ok = _isclose(a, g, atol, rtol) and not nonfinite
        rec.update(verdict="pass" if ok else "fail", golden=g, actual=a, window=[win[0], win[-1]],
                   max_abs=abs(a - g) if math.isfinite(a) else math.inf,
                   max_rel=abs(a - g) / abs(g) if math.isfinite(a) and g else math.inf)
        if nonfinite:
            rec["detail"] = f"run is missing or not finite at step {nonfinite[0]}"
        return rec
    bad, max_abs, max_rel = [], 0.0, 0.0
    for s in judged:
        g, a = gvals[s], avals.get(s, math.inf)
        if math.isfinite(a):
            max_abs = max(max_abs, abs(a - g))
            max_rel = max(max_rel, abs(a - g) / abs(g) if g else (0.0 if a == g else math.inf))
        else:
            max_abs = max_rel = math.inf
        if not _isclose(a, g, atol, rtol):
            bad.append(s)
    allowed = 0 if (mode == "deterministic" or len(judged) == 1) else allowed_failures(len(judged))
    missing = [s for s in judged if not math.isfinite(avals.get(s, math.inf))]
    ok = len(bad) <= allowed and not nonfinite and not missing
    failing = sorted(set(bad) | set(nonfinite))
    rec.update(verdict="pass" if ok else "fail", steps=len(judged), failing_steps=failing,
               n_failing=len(failing), allowed_failures=allowed, max_abs=max_abs, max_rel=max_rel)
    if nonfinite or missing:
        s0 = min(nonfinite + missing)
        rec["detail"] = f"run is {'missing' if s0 not in avals else 'not finite'} at step {s0}"
    return rec


def _cannot(rec: dict, why: str) -> dict:
    rec.update(verdict=CANNOT_JUDGE, detail=f"cannot judge: {why}")
    return rec
