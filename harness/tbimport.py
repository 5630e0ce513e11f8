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


def read_events(path: Path) -> list[tuple[int, str, float]]:
    """(step, tag, value) of every scalar in one event file, in file order.

    TensorBoard's own reader stops silently at a truncated or corrupt record (half a run imports as if it were
    all of it); this one checks every record's length and CRCs and refuses the file naming the byte offset.
    """
    import struct

    from google.protobuf.message import DecodeError
    from tensorboard.compat.proto import event_pb2
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c
    from tensorboard.util import tensor_util

    data, pos, out = Path(path).read_bytes(), 0, []

    def bad(why):
        raise G.GoldenError(f"{path}: corrupt or truncated event file: record at byte {pos}: {why}")
    while pos < len(data):
        if len(data) - pos < 12:
            bad(f"{len(data) - pos} bytes left, a record header needs 12")
        (n,), (crc,) = struct.unpack("<Q", data[pos:pos + 8]), struct.unpack("<I", data[pos + 8:pos + 12])
        if masked_crc32c(data[pos:pos + 8]) != crc:
            bad("length CRC mismatch")
        if len(data) - pos < n + 16:
            bad(f"{len(data) - pos} bytes left, the record needs {n + 16}")
        body = data[pos + 12:pos + 12 + n]
        if masked_crc32c(body) != struct.unpack("<I", data[pos + 12 + n:pos + 16 + n])[0]:
            bad("data CRC mismatch")
        try:
            ev = event_pb2.Event.FromString(body)
        except DecodeError as e:
            bad(f"not an Event ({e})")
        for v in ev.summary.value:
            if v.HasField("simple_value"):
                out.append((int(ev.step), v.tag, float(v.simple_value)))
            elif v.HasField("tensor") and v.metadata.plugin_data.plugin_name == "scalars":
                out.append((int(ev.step), v.tag, float(tensor_util.make_ndarray(v.tensor).item())))
        pos += n + 16
    return out


def read_scalars(logdir: Path) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} of a log dir holding one run: its event files (several when the run was resumed)
    must not overlap, and within a file a tag's steps must go forward. Otherwise the dir holds two runs."""
    files = sorted(Path(logdir).rglob("events.out.tfevents.*"))
    if not files:
        raise G.GoldenError(f"{logdir}: no TensorBoard event files (events.out.tfevents.*)")
    out: dict[str, dict[int, float]] = {}
    owner: dict[tuple[str, int], Path] = {}
    for f in files:
        last: dict[str, int] = {}
        for step, tag, value in read_events(f):
            if tag in last and step <= last[tag]:
                raise G.GoldenError(f"{f}: {tag!r} goes from step {last[tag]} back to step {step}: the file holds "
                                    f"two runs; import one run at a time")
            if (tag, step) in owner and owner[tag, step] != f:
                raise G.GoldenError(f"{logdir}: two runs: {owner[tag, step]} and {f} both hold step {step} of "
                                    f"{tag!r}; import one run at a time")
            last[tag] = step
            owner[tag, step] = f
            out.setdefault(tag, {})[step] = value
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


def read_metrics_jsonl(logdir: Path) -> dict[str, dict[int, float]]:
    """{metric: {step: value}} of a `dsv4 train` run dir without event files (e.g. one brought back from a GPU
    machine without its tensorboard/ folder, or cut at a time limit): its per-step metrics.jsonl."""
    from dsv4.harness.report import metrics_records
    out: dict[str, dict[int, float]] = {}
    for r in metrics_records(Path(logdir) / "metrics.jsonl"):
        for m, v in r.items():
            if m != "step" and isinstance(v, (int, float)):
                out.setdefault(m, {})[int(r["step"])] = float(v)
    return out


def import_run(logdir: Path, platform: str, sl, name: str, step_interval: int, metrics=None, force: bool = False,
               note: str | None = None):
    """Write the golden; returns (path, doc, diff lines). An existing golden is only replaced with `force`.
    `logdir`: Megatron / dsv4 TensorBoard event files, or a dsv4 run dir with only metrics.jsonl (+ run.json,
    whose sha, versions and command become the provenance)."""
    if step_interval < 1:
        raise G.GoldenError(f"--step-interval: must be >= 1, got {step_interval}")
    logdir = Path(logdir)
    from_jsonl = not any(logdir.rglob("events.out.tfevents.*")) and (logdir / "metrics.jsonl").exists()
    doc = to_golden(read_metrics_jsonl(logdir) if from_jsonl else read_scalars(logdir), step_interval, metrics)
    path = G.GOLDENS / platform / sl.name / f"{name}.golden_values.json"
    old = G.read_json(path) if path.exists() else None
    if old is not None and not force:
        raise G.GoldenError(f"{G._rel(path)}: already exists; pass --force to replace it (the diff is printed)")
    diff = [f"  + new golden ({len(doc)} metrics: {', '.join(doc)})"] if old is None else \
        ([f"  ~ {line}" for line in G.diff_curves(old, doc)] or ["  = unchanged"])
    importer = G.provenance(platform, command=f"dsv4 goldens import {logdir} --platform {platform} --slice {sl.id}")
    # the run was made elsewhere: its software versions are not ours; keep the importer's apart
    prov = {"platform": platform, "source_logdir": str(logdir), "source": "Megatron TensorBoard event files",
            "run_git_sha": None, "run_torch": None, "imported_by": importer}
    if from_jsonl:
        run = G.read_json(logdir / "run.json") if (logdir / "run.json").exists() else {}
        prov.update(source="dsv4 train metrics.jsonl", run_git_sha=run.get("git_sha"), run_torch=run.get("torch"),
                    run_python=run.get("python"), run_device=run.get("device_name"), run_seed=run.get("seed"),
                    run_config=run.get("config"), run_config_hash=run.get("config_hash"),
                    run_recipe=run.get("recipe"), run_deterministic=run.get("deterministic"),
                    run_data=run.get("data"), run_steps=doc[next(iter(doc))]["end_step"])
    if note:
        prov["note"] = note
    G.atomic_write_json(path.with_name(f"{name}.golden_values.provenance.json"), prov)
    G.atomic_write_json(path, doc)
    return path, doc, diff
