"""The harness never passes what it cannot judge (issue 11 §2): NaN/empty/short curves, golden and event files
that cannot be judged, and `dsv4 compare` / `dsv4 goldens import` on them (exit 2, one line)."""
import json
import math

import pytest
from click.testing import CliRunner

from dsv4.harness import goldens as G
from dsv4.harness import report as R
from dsv4.harness import tbimport as TB
from dsv4.harness import thresholds as T
from dsv4.harness.cli import main


def _curve(vals, start=1):
    return {"start_step": start, "end_step": start + len(vals) - 1, "step_interval": 1,
            "values": {str(start + i): v for i, v in enumerate(vals)}}


# ------------------------------------------------------------------------------------------- thresholds
def test_one_nan_step_of_the_run_fails_even_in_approximate_mode():
    g = _curve([10.0] * 200)                       # approximate allows 2 failing steps here
    for bad in (float("nan"), float("inf"), "nan"):
        r = T.compare_metric("lm loss", g, _curve([10.0] * 150 + [bad] + [10.0] * 49), "approximate")
        assert r["verdict"] == "fail" and "step 151" in r["detail"], (bad, r)


def test_golden_nan_against_run_nan_is_not_a_pass():
    g = _curve([10.0] * 9 + ["nan"])
    for run_v in (float("nan"), float("inf"), "nan"):
        r = T.compare_metric("lm loss", g, _curve([10.0] * 9 + [run_v]), "deterministic")
        assert r["verdict"] == "fail" and r["failing_steps"] == [10], (run_v, r)
    # a golden "nan" against a finite run value: that step is not judged, and listed
    r = T.compare_metric("lm loss", g, _curve([10.0] * 10), "deterministic")
    assert r["verdict"] == "pass" and r["unjudged_steps"] == [10] and r["steps"] == 9
    # a golden with no finite value judges nothing
    r = T.compare_metric("lm loss", _curve(["nan"] * 3), _curve([1.0] * 3), "approximate")
    assert r["verdict"] == "cannot-judge"


@pytest.mark.parametrize("golden,run,why", [
    ({"start_step": 1, "end_step": 0, "step_interval": 1, "values": {}}, _curve([1.0]), "golden has no values"),
    (_curve([1.0] * 5), _curve([1.0] * 10), "golden ends at step 5"),
    (_curve([1.0] * 5), None, "metric missing from the run"),
])
def test_cannot_judge_is_never_a_pass(golden, run, why):
    r = T.compare_metric("lm loss", golden, run, "approximate")
    assert r["verdict"] == "cannot-judge" and why in r["detail"]


# ------------------------------------------------------------------------------------------- compare
def _files(tmp_path, golden, run):
    g, r = tmp_path / "golden.json", tmp_path / "run.json"
    g.write_text(json.dumps(golden))
    r.write_text(json.dumps(run))
    return str(r), str(g)


@pytest.mark.parametrize("golden,run,say", [
    ({}, {"lm loss": _curve([1.0] * 3)}, "no metrics: cannot judge"),
    ({"lm loss": {"start_step": 1, "end_step": 0, "step_interval": 1, "values": {}}},
     {"lm loss": _curve([1.0] * 3)}, "golden has no values"),
    ({"lm loss": _curve([1.0] * 3)}, {"lm loss": _curve([1.0] * 6)}, "golden ends at step 3"),
    ({"lm loss": _curve([1.0] * 3), "num-zeros": _curve([5.0] * 3)}, {"lm loss": _curve([1.0] * 3)},
     "metric missing from the run"),
])
def test_compare_cannot_judge_exits_2(tmp_path, golden, run, say):
    r = CliRunner().invoke(main, ["compare", *_files(tmp_path, golden, run)])
    assert r.exit_code == 2, r.output
    last = r.output.strip().splitlines()[-1]
    assert "cannot judge" in last.lower() and say in last, r.output
    assert "compare: PASS" not in r.output


def test_compare_report_carries_run_provenance_and_marks_failing_steps(tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    (run / "golden_values.json").write_text(json.dumps({"lm loss": _curve([2.0, 1.9, 1.8000001, 1.7])}))
    (run / "provenance.json").write_text(json.dumps({"git_sha": "abc123", "seed": 7}))
    gold = tmp_path / "g.json"
    gold.write_text(json.dumps({"lm loss": _curve([2.0, 1.9, 1.8, 1.7])}))
    figs = []

    def capture(fig, path, **kw):
        ax = fig.axes[0]
        figs.append((ax.get_title(), [list(map(tuple, c.get_offsets())) for c in ax.collections if len(c.get_offsets())]))
        path.write_bytes(b"png")
        return path
    monkeypatch.setattr(G, "atomic_savefig", capture)
    r = CliRunner().invoke(main, ["compare", str(run), str(gold), "--report", str(tmp_path / "rep")])
    assert r.exit_code == 1
    md = (tmp_path / "rep" / "report.md").read_text()
    assert '"git_sha": "abc123"' in md
    title, marks = figs[0]
    assert "FAIL" in title and "first failing step 3" in title
    assert any(abs(x - 3) < 1e-9 for pts in marks for x, _ in pts)      # the failing step is drawn


# ------------------------------------------------------------------------------------------- import
def _events(d, n=12, start=1):
    from torch.utils.tensorboard import SummaryWriter
    w = SummaryWriter(str(d))
    for i in range(start, start + n):
        w.add_scalar("lm loss", 10.0 - 0.1 * i, i)
    w.close()
    return sorted(d.glob("events.out.tfevents.*"))


def _import(logdir, *extra):
    return CliRunner().invoke(main, ["goldens", "import", str(logdir), "--platform", "h100", "--slice", "D9",
                                     "--name", "run1", *extra])


def test_import_refuses_to_overwrite_unless_force_then_prints_the_diff(tmp_path, monkeypatch):
    monkeypatch.setattr(G, "GOLDENS", tmp_path / "goldens")
    _events(tmp_path / "a")
    assert _import(tmp_path / "a").exit_code == 0
    path = tmp_path / "goldens" / "h100" / "D9" / "run1.golden_values.json"
    before = path.read_text()
    _events(tmp_path / "b", n=10)
    r = _import(tmp_path / "b")
    assert r.exit_code == 2 and "already exists" in r.stderr and "--force" in r.stderr
    assert path.read_text() == before
    r = _import(tmp_path / "b", "--force")
    assert r.exit_code == 0, r.output
    assert "lm loss: 2/12 steps changed" in r.stdout and "1..12 -> 1..10" in r.stdout


def test_import_refuses_a_truncated_event_file_naming_it(tmp_path):
    (f,) = _events(tmp_path / "tb")
    data = f.read_bytes()
    f.write_bytes(data[:len(data) // 2 + 5])        # tensorboard's reader would import 6 of 12 steps
    with pytest.raises(G.GoldenError, match=rf"{f.name}: corrupt or truncated event file"):
        TB.read_scalars(tmp_path / "tb")
    f.write_bytes(data[:-3] + bytes([data[-3] ^ 0xFF]) + data[-2:])   # one flipped byte: a CRC mismatch
    with pytest.raises(G.GoldenError, match="CRC mismatch"):
        TB.read_scalars(tmp_path / "tb")


def test_import_refuses_a_log_dir_holding_two_runs(tmp_path):
    _events(tmp_path / "two" / "r1")
    _events(tmp_path / "two" / "r2", n=5)           # a second run: steps 1..5 again
    with pytest.raises(G.GoldenError, match="two runs"):
        TB.read_scalars(tmp_path / "two")
    from torch.utils.tensorboard import SummaryWriter
    w = SummaryWriter(str(tmp_path / "back"))
    for i in (1, 2, 3, 1, 2):                        # one file whose steps go backwards
        w.add_scalar("lm loss", 1.0, i)
    w.close()
    with pytest.raises(G.GoldenError, match="from step 3 back to step 1"):
        TB.read_scalars(tmp_path / "back")
    _events(tmp_path / "resumed" / "r1", n=6)        # a resumed run (steps go on) is one run
    _events(tmp_path / "resumed" / "r2", n=6, start=7)
    assert sorted(TB.read_scalars(tmp_path / "resumed")["lm loss"]) == list(range(1, 13))
