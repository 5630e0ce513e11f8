"""`dsv4 goldens import` reads TensorBoard events written like Megatron's, and `dsv4 compare` gives
per-metric verdicts with a report whose PNGs exist."""
import json
import math
import subprocess
import sys

import pytest

from dsv4.harness import goldens as G
from dsv4.harness import report as R
from dsv4.harness import tbimport as TB


def _write_events(d, losses, iter_times):
    from torch.utils.tensorboard import SummaryWriter
    w = SummaryWriter(str(d))
    for i, (l, t) in enumerate(zip(losses, iter_times), start=1):
        w.add_scalar("lm loss", l, i)
        w.add_scalar("iteration-time", t, i)
        if i != 3:                      # a step Megatron did not log: must become "nan"
            w.add_scalar("num-zeros", float(100 + i), i)
        w.add_scalar("learning-rate", 1e-3, i)   # not a golden metric: not exported
    w.close()


def test_import_matches_megatron_format(tmp_path, monkeypatch):
    monkeypatch.setattr(G, "GOLDENS", tmp_path / "goldens")
    losses = [10.0 - 0.1234567 * i for i in range(12)]
    _write_events(tmp_path / "tb", losses, [1.0] * 12)
    from dsv4.harness.registry import Registry
    sl = Registry.load().get("D9")
    path, doc, diff = TB.import_run(tmp_path / "tb", "h100", sl, "run1", 1)
    assert diff[0].startswith("  + new golden")
    assert path == tmp_path / "goldens" / "h100" / "D9" / "run1.golden_values.json"
    assert set(doc) == {"lm loss", "iteration-time", "num-zeros"}
    assert doc["lm loss"]["values"]["2"] == round(losses[1], 5)
    assert doc["num-zeros"]["values"]["3"] == "nan"
    assert doc["lm loss"]["start_step"] == 1 and doc["lm loss"]["end_step"] == 12
    prov = json.loads(path.with_name("run1.golden_values.provenance.json").read_text())
    assert prov["platform"] == "h100" and prov["source_logdir"].endswith("tb") and "torch" in prov["imported_by"]
    # step interval 5 samples step 1 and multiples of 5, as Megatron's convergence goldens
    doc5 = TB.to_golden(TB.read_scalars(tmp_path / "tb"), 5)
    assert list(doc5["lm loss"]["values"]) == ["1", "5", "10"]


def test_import_refuses_empty_dir(tmp_path):
    with pytest.raises(G.GoldenError, match="no TensorBoard event files"):
        TB.read_scalars(tmp_path)


def _golden(vals):
    return {"lm loss": {"start_step": 1, "end_step": len(vals), "step_interval": 1,
                        "values": {str(i + 1): v for i, v in enumerate(vals)}}}


def test_compare_cli_and_report(tmp_path):
    gold = tmp_path / "golden.json"
    gold.write_text(json.dumps(_golden([5.0 - 0.01 * i for i in range(30)])))
    same = tmp_path / "run_same"
    same.mkdir()
    (same / "golden_values.json").write_text(gold.read_text())
    drift = tmp_path / "drift.json"
    drift.write_text(json.dumps(_golden([5.0 - 0.01 * i + (0.5 if i > 20 else 0.0) for i in range(30)])))
    cli = [sys.executable, "-m", "dsv4.harness.cli", "compare"]
    r = subprocess.run(cli + [str(same), str(gold), "--json", "--report", str(tmp_path / "rep")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["verdict"] == "pass" and doc["checks"][0]["max_abs"] == 0.0
    assert (tmp_path / "rep" / "report.md").exists() and (tmp_path / "rep" / "plot_lm_loss.png").stat().st_size > 5000
    r = subprocess.run(cli + [str(drift), str(gold), "--mode", "approximate", "--json"], capture_output=True, text=True)
    assert r.returncode == 1
    c = json.loads(r.stdout)["checks"][0]
    assert c["n_failing"] == 9 and c["allowed_failures"] == 1 and math.isclose(c["max_abs"], 0.5, rel_tol=1e-9)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"lm loss": {"values": {}}}))
    r = subprocess.run(cli + [str(bad), str(gold)], capture_output=True, text=True)
    assert r.returncode == 2 and "bad.json" in r.stderr and "Megatron golden-values format" in r.stderr


def test_compare_reads_a_cut_run_from_its_metrics_jsonl(tmp_path):
    """A run killed at its time limit has metrics.jsonl (one record per step, maybe a torn last line) and no
    golden_values.json: compare reads the complete records; a bad line elsewhere is refused, naming it."""
    run = tmp_path / "run"
    run.mkdir()
    recs = [{"step": i, "lm loss": 10.0 - 0.5 * i, "num-zeros": 7.0} for i in range(1, 6)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"step": 6, "lm lo')
    (run / "run.json").write_text(json.dumps({"git_sha": "abc"}))
    curves, prov = R.load_curves(run)
    assert curves["lm loss"]["end_step"] == 5 and curves["lm loss"]["values"]["5"] == 7.5 and prov["git_sha"] == "abc"
    gold = tmp_path / "g.json"
    gold.write_text(json.dumps(_golden([9.5, 9.0, 8.5, 8.0, 7.5])))
    assert R.compare_files(run, gold, "deterministic", ["lm loss"])["verdict"] == "pass"
    (run / "metrics.jsonl").write_text(json.dumps(recs[0]) + "\nnot json\n" + json.dumps(recs[1]) + "\n")
    with pytest.raises(G.GoldenError, match=r"metrics.jsonl:2: not a JSON metrics record"):
        R.load_curves(run)
    (run / "metrics.jsonl").unlink()
    with pytest.raises(G.GoldenError, match="no golden_values.json or metrics.jsonl"):
        R.load_curves(run)


def test_compare_steps_window(tmp_path):
    """--steps judges only that window of both curves: a 5-step run against a 10-step golden over steps 1..5;
    a window the golden lacks and bad text are one-line errors (exit 2)."""
    run, gold = tmp_path / "r.json", tmp_path / "g.json"
    run.write_text(json.dumps(_golden([9.5, 9.0, 8.5, 8.0, 7.5])))
    gold.write_text(json.dumps(_golden([9.5, 9.0, 8.5, 8.0, 7.5, 7.0, 6.5, 6.0, 5.5, 5.0])))
    assert R.compare_files(run, gold, "deterministic", ["lm loss"])["verdict"] == "regression"   # run too short
    doc = R.compare_files(run, gold, "deterministic", ["lm loss"], R.parse_steps("5"))
    assert doc["verdict"] == "pass" and doc["checks"][0]["steps"] == 5
    assert R.compare_files(run, gold, "deterministic", ["lm loss"], R.parse_steps("2:4"))["checks"][0]["steps"] == 3
    for bad, msg in (("x", "expected N or A:B"), ("4:2", "need 1 <= A <= B"), ("20:30", "has no step there")):
        with pytest.raises(G.GoldenError, match=msg):
            R.compare_files(run, gold, "deterministic", ["lm loss"], R.parse_steps(bad))
    r = subprocess.run([sys.executable, "-m", "dsv4.harness.cli", "compare", str(run), str(gold), "--steps", "x"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "--steps" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_import_of_a_run_dir_without_event_files_reads_metrics_jsonl(tmp_path, monkeypatch):
    monkeypatch.setattr(G, "GOLDENS", tmp_path / "goldens")
    run = tmp_path / "run"
    run.mkdir()
    recs = [{"step": i, "lm loss": 10.0 - 0.5 * i, "iteration-time": 0.1} for i in range(1, 5)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (run / "run.json").write_text(json.dumps({"git_sha": "abc123", "torch": "2.11.0+cu130", "seed": 1234}))
    from dsv4.harness.registry import Registry
    path, doc, _ = TB.import_run(run, "h200", Registry.load().get("D9"), "cut", 1)
    assert doc["lm loss"]["end_step"] == 4 and doc["lm loss"]["values"]["4"] == 8.0
    prov = json.loads(path.with_name("cut.golden_values.provenance.json").read_text())
    assert prov["source"] == "dsv4 train metrics.jsonl" and prov["run_git_sha"] == "abc123" and prov["run_steps"] == 4
