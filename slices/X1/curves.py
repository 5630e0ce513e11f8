"""X1 loss curves in low precision against their baseline (issue 17): one `dsv4 train` run per precision recipe
(harness/train/loop.py `Recipe.precision`), and the check that compares each curve to the baseline's.

The check (`check_curve`): the lm loss averaged over windows of WINDOW steps (each step draws another batch, so
single steps are noisy: per step the stored curves differ from the baseline by up to 0.117, at step 30), then
    gap = max over windows |mean lm loss(recipe) - mean lm loss(baseline)|,   CURVE_MIN_GAP <= gap <= CURVE_TOL:
the quantisation's effect stays small, and the low-precision path really ran (a recipe that quantised nothing
would reproduce the baseline to the last bit). CURVE_TOL is the worst gap measured on the stored curves
(goldens/cpu/X1/lowp_curves_debug.json, made by `dsv4 goldens regen --slice X1 --case lowp_curves_debug`)
x a margin; slices/X1/test_lowp_curves.py shows it failing on an FP8 weight scale off by 2x (gap 0.22).
"""
from __future__ import annotations

import json
import tempfile
from dataclasses import replace

CURVE_RECIPE, CURVE_STEPS = "debug", 32
BASELINE = "fp32"                                    # the debug recipe in fp32, no precision recipe applied
LOWP = ("fp8_tensor", "fp8_block", "fp4_qat")        # model/lowp/recipe.py RECIPES
WINDOW = 8
# measured windowed gaps of the stored curves (4 windows of 8 steps): fp8_tensor 0.0015 0.0039 0.0147 0.0056,
# fp8_block 0.0065 0.0030 0.0071 0.0120, fp4_qat 0.0047 0.0053 0.0018 0.0039; worst 0.0147 x 3 = 0.045 for all.
# (The FP8 weight scale off by 2x: 0.024 0.104 0.129 0.223.)
CURVE_TOL = 0.045
CURVE_MIN_GAP = 1e-4


def lm_curve(precision: str | None, steps: int = CURVE_STEPS, seed: int = 1234) -> list[float]:
    """`dsv4 train --recipe debug --steps N [--precision P]` (CPU, fp32): the lm loss per step."""
    from dsv4.harness.train.loop import RECIPES, train
    r = replace(RECIPES[CURVE_RECIPE], steps=steps, precision=precision)
    with tempfile.TemporaryDirectory() as d:
        train(r, d, seed=seed, progress=False, save_final=False)
        return [json.loads(line)["lm loss"] for line in open(f"{d}/metrics.jsonl")]


def curve_gap(base: list[float], other: list[float], window: int = WINDOW) -> float:
    """max over windows of `window` steps of |mean(other) - mean(base)|."""
    if len(base) != len(other) or len(base) < window:
        raise ValueError(f"curve_gap: curves of {len(base)} and {len(other)} steps (need equal, >= {window})")
    n = len(base) // window * window
    return max(abs(sum(other[i:i + window]) - sum(base[i:i + window])) / window for i in range(0, n, window))


def check_curve(name: str, base: list[float], other: list[float]) -> tuple[bool, str]:
    """(passes, one line with the numbers) for recipe `name`'s curve against the baseline."""
    gap = curve_gap(base, other)
    ok = CURVE_MIN_GAP <= gap <= CURVE_TOL
    return ok, (f"{name}: max |d mean lm loss| over {WINDOW}-step windows of {len(base)} steps {gap:.4g} "
                f"({'within' if ok else 'OUTSIDE'} [{CURVE_MIN_GAP:g}, {CURVE_TOL:g}])")
