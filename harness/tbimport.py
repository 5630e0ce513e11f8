"""Import a Megatron training run's TensorBoard event files into a golden (Megatron golden-values JSON).

Follows Megatron's `get_test_results_from_tensorboard_logs.py` (megatron_dsv4.md §3.2): only the golden
metrics are exported, values rounded to 5 decimals, sampled at step 1 and multiples of the step interval,
every grid step filled and a missing one written as "nan".
"""
from __future__ import annotations

import math
from pathlib import Path

from . import goldens as G

GOLDEN_METRICS = ("iteration-time", "mem-allocated-bytes", "mem-max-allocated-bytes", "lm loss", "num-zeros",
                  "mtp_1 loss", "mtp_2 loss", "total loss")


def read_scalars(logdir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = sorted(Path(logdir).rglob("events.out.tfevents.*"))
    if not files:
        raise G.GoldenError(f"{logdir}: no TensorBoard event files (events.out.tfevents.*)")
    out: dict[str, dict[int, float]] = {}
    for f in files:
        acc = EventAccumulator(str(f), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags().get("scalars", []):
            for ev in acc.Scalars(tag):
                out.setdefault(tag, {})[int(ev.step)] = float(ev.value)
    return out


def to_golden(scalars: dict[str, dict[int, float]], step_interval: int, metrics=None) -> dict:
    names = list(metrics) if metrics else [m for m in GOLDEN_METRICS if m in scalars]
    if not names:
        raise G.GoldenError(f"no Megatron golden metric found (have: {', '.join(sorted(scalars)) or 'none'})")
    doc = {}
    for m in names:
        if m not in scalars:
            raise G.GoldenError(f"metric {m!r}: not in the event files")
        steps = scalars[m]
        end = max(steps)
        grid = [1] + list(range(step_interval, end + 1, step_interval)) if step_interval > 1 else \
            list(range(1, end + 1))
        grid = sorted(set(grid))
        vals = {}
        for s in grid:
            v = steps.get(s)
            vals[str(s)] = "nan" if v is None or not math.isfinite(v) else round(v, 5)
        doc[m] = {"start_step": grid[0], "end_step": grid[-1], "step_interval": step_interval, "values": vals}
    return doc


def import_run(logdir: Path, platform: str, sl, name: str, step_interval: int, metrics=None):
    if step_interval < 1:
        raise G.GoldenError(f"--step-interval: must be >= 1, got {step_interval}")
    doc = to_golden(read_scalars(logdir), step_interval, metrics)
    path = G.GOLDENS / platform / sl.name / f"{name}.golden_values.json"
    importer = G.provenance(platform, command=f"dsv4 goldens import {logdir} --platform {platform} --slice {sl.id}")
    # the run was made elsewhere: its software versions are not ours; keep the importer's apart
    prov = {"platform": platform, "source_logdir": str(logdir), "source": "Megatron TensorBoard event files",
            "run_git_sha": None, "run_torch": None, "imported_by": importer}
    G.atomic_write_json(path.with_name(f"{name}.golden_values.provenance.json"), prov)
    G.atomic_write_json(path, doc)
    return path, doc
