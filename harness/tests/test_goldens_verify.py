"""Golden store and verify: a fake slice with one case goes through regen -> verify pass -> perturbed golden ->
regression (exit 1) -> missing golden -> cannot judge (exit 2); comparisons report exact numbers."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from dsv4.harness import goldens as G
from dsv4.harness import thresholds as T
from dsv4.harness.registry import REPO, Registry
from dsv4.harness.testing import fake_slice


CASES = textwrap.dedent('''
    import torch
    from dsv4.harness.cases import golden_case

    @golden_case("lin", tol={"y": (1e-6, 1e-5), "s": (0.0, 1e-6)})
    def lin():
        g = torch.Generator().manual_seed(0)
        x = torch.randn(3, 5, generator=g)
        return {"y": x * 2.0, "idx": x.argmax(-1), "s": float(x.sum()), "n": 7}
''')


def _fake_slice(tmp_path, cases=CASES):
    s = fake_slice("Z1", tmp_path / "slices" / "Z1", golden_cases=["lin"], cases=cases)
    return Registry([s]), s


@pytest.fixture()
def gold_dir(tmp_path, monkeypatch):
    d = tmp_path / "goldens"
    monkeypatch.setattr(G, "GOLDENS", d)
    return d


def test_regen_verify_perturb_missing(tmp_path, gold_dir):
    from dsv4.harness import verify as V
    reg, s = _fake_slice(tmp_path)
    # missing golden: cannot judge, never a pass
    doc = V.verify(reg, ["Z1"], "cpu", "deterministic", run_tests=False)
    assert doc["exit_code"] == 2 and doc["slices"][0]["checks"][0]["verdict"] == "missing"
    changes = V.regen(reg, s, "cpu")
    assert changes[0]["diff"][0].startswith("  + new golden")
    g = json.loads((gold_dir / "cpu" / "Z1" / "lin.json").read_text())
    assert g["provenance"]["platform"] == "cpu" and g["provenance"]["git_sha"]
    assert g["outputs"]["idx"]["dtype"] == "int64" and g["outputs"]["n"] == {"kind": "int", "value": 7}
    doc = V.verify(reg, ["Z1"], "cpu", "deterministic", run_tests=False)
    assert doc["exit_code"] == 0, doc
    recs = {r["check"]: r for r in doc["slices"][0]["checks"]}
    assert recs["lin.y"]["max_abs"] == 0.0 and recs["lin.idx"]["exact"] is True
    # perturb one float by more than its tolerance -> regression, exit 1
    g["outputs"]["y"]["values"][4] += 1e-3
    (gold_dir / "cpu" / "Z1" / "lin.json").write_text(json.dumps(g))
    doc = V.verify(reg, ["Z1"], "cpu", "deterministic", run_tests=False)
    assert doc["exit_code"] == 1
    bad = [r for r in doc["slices"][0]["checks"] if r["verdict"] == "fail"]
    assert [r["check"] for r in bad] == ["lin.y"] and abs(bad[0]["max_abs"] - 1e-3) < 1e-9
    # an index off by one is a regression even though it is "close"
    g["outputs"]["y"]["values"][4] -= 1e-3
    g["outputs"]["idx"]["values"][0] = (g["outputs"]["idx"]["values"][0] + 1) % 5
    (gold_dir / "cpu" / "Z1" / "lin.json").write_text(json.dumps(g))
    assert V.verify(reg, ["Z1"], "cpu", "deterministic", run_tests=False)["exit_code"] == 1
    # regen shows the diff of what it rewrites
    changes = V.regen(reg, s, "cpu")
    assert any("idx" in line and "1/3 values changed" in line for line in changes[0]["diff"])


def test_zero_checks_is_not_a_pass(tmp_path, gold_dir):
    from dsv4.harness import verify as V
    reg, s = _fake_slice(tmp_path)
    s.golden_cases = []
    (s.folder / "cases.py").write_text("")
    doc = V.verify(reg, ["Z1"], "cpu", "deterministic", run_tests=False)
    assert doc["slices"][0]["verdict"] == "cannot-judge" and doc["exit_code"] == 2


def test_float_output_without_tolerance_is_refused(tmp_path, gold_dir):
    from dsv4.harness import verify as V
    from dsv4.harness.cases import CaseError
    reg, s = _fake_slice(tmp_path, CASES.replace('tol={"y": (1e-6, 1e-5), "s": (0.0, 1e-6)}', 'tol={"s": (0, 0)}'))
    with pytest.raises(CaseError, match="floating output 'y' has no tolerance"):
        V.regen(reg, s, "cpu")
    assert not (gold_dir / "cpu" / "Z1").exists()      # nothing half-written


def test_compare_output_tolerances_and_nonfinite():
    enc = G.encode_outputs({"a": torch.tensor([1.0, float("nan"), 3.0])}, 100)
    assert enc["a"]["values"][1] == "nan"
    ok = G.compare_output("a", enc["a"], torch.tensor([1.0 + 1e-7, float("nan"), 3.0]), {"a": (1e-6, 0)})
    assert ok["verdict"] == "pass"
    bad = G.compare_output("a", enc["a"], torch.tensor([1.0, 2.0, 3.0]), {"a": (1e-6, 0)})
    assert bad["verdict"] == "fail" and bad["detail"] == "non-finite mismatch"
    shape = G.compare_output("a", enc["a"], torch.zeros(4), {"a": (1, 1)})
    assert shape["verdict"] == "fail" and "shape" in shape["detail"]


def test_atomic_write_keeps_old_file_on_failure(tmp_path, monkeypatch):
    p = tmp_path / "g.json"
    G.atomic_write_json(p, {"v": 1})

    def boom(*a, **k):
        raise OSError("disk full")
    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        G.atomic_write_json(p, {"v": 2})
    assert json.loads(p.read_text()) == {"v": 1}
    assert [x.name for x in tmp_path.iterdir()] == ["g.json"]    # no temp file left behind


def _curve(vals, start=1):
    return {"start_step": start, "end_step": start + len(vals) - 1, "step_interval": 1,
            "values": {str(start + i): v for i, v in enumerate(vals)}}


def test_thresholds_like_megatron():
    g = _curve([10.0] * 200)
    assert T.compare_metric("lm loss", g, _curve([10.0] * 200), "deterministic")["verdict"] == "pass"
    one_off = _curve([10.0] * 199 + [10.0000001])
    assert T.compare_metric("lm loss", g, one_off, "deterministic")["verdict"] == "fail"
    # approximate: rtol 5%, allowed failures min(max(n//100,1),50) = 2 for 200 steps
    two_bad = _curve([10.0] * 198 + [11.0, 11.0])
    three_bad = _curve([10.0] * 197 + [11.0, 11.0, 11.0])
    assert T.compare_metric("lm loss", g, two_bad, "approximate")["verdict"] == "pass"
    assert T.compare_metric("lm loss", g, three_bad, "approximate")["verdict"] == "fail"
    # a missing step ("nan") never passes
    miss = _curve([10.0] * 199 + ["nan"])
    assert T.compare_metric("lm loss", g, miss, "deterministic")["verdict"] == "fail"
    # iteration-time: median over the steady window 5..20 (short runs), one value at rtol 5%
    it = _curve(["nan"] + [1.0] * 24)
    slow_warmup = _curve(["nan", 9.0, 9.0, 9.0] + [1.04] * 21)
    r = T.compare_metric("iteration-time", it, slow_warmup, "deterministic")
    assert r["verdict"] == "pass" and r["window"] == [5, 20]
    assert T.compare_metric("iteration-time", it, _curve(["nan"] + [1.06] * 24), "approximate")["verdict"] == "fail"
    assert T.allowed_failures(50) == 1 and T.allowed_failures(9535) == 50


def test_cli_bad_slice_exits_2_with_one_line():
    r = subprocess.run([sys.executable, "-m", "dsv4.harness.cli", "verify", "--slice", "NOPE"],
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stdout == ""
    err = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("dsv4: error: slice 'NOPE': unknown")
    # under --json the error is the one JSON document on stdout: test_cli_output.py


def test_cli_slices_json_is_one_document():
    r = subprocess.run([sys.executable, "-m", "dsv4.harness.cli", "slices", "--json"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    ids = {s["id"]: s for s in doc["slices"]}
    assert len(ids) == len(list((REPO / "slices").glob("*/manifest.toml"))) and ids["D2"]["depends_on"] == ["D1", "P6"]


def test_cli_verify_real_slice_p6_passes_then_fails_on_a_perturbed_golden(tmp_path):
    """The 'done when' of the harness issue, on the real P6 goldens: pass (0), one value perturbed (1)."""
    import shutil
    gold = tmp_path / "goldens"
    shutil.copytree(G.GOLDENS / "cpu" / "P6", gold / "cpu" / "P6")
    env = dict(os.environ, DSV4_GOLDENS_DIR=str(gold))
    cmd = [sys.executable, "-m", "dsv4.harness.cli", "verify", "--slice", "P6", "--skip-tests", "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["slices"][0]["n_pass"] >= 2
    p = sorted((gold / "cpu" / "P6").glob("*.json"))[0]
    g = json.loads(p.read_text())
    name, out = next((k, o) for k, o in g["outputs"].items() if o["kind"] == "tensor" and o["dtype"].startswith("float"))
    out["values"][0] += 1e-3
    p.write_text(json.dumps(g))
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert r.returncode == 1
    bad = [c for c in json.loads(r.stdout)["slices"][0]["checks"] if c["verdict"] == "fail"]
    assert [c["check"] for c in bad] == [f"{p.stem}.{name}"]
    p.unlink()                                                   # a missing golden: cannot judge
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert r.returncode == 2


@pytest.mark.parametrize("edit,field", [
    (lambda g: g["outputs"]["y"].update(kind="blob"), "outputs.y.kind: 'blob' is not one of"),
    (lambda g: g.update(slice="Z2"), "slice: is 'Z2' but its path says 'Z1'"),
    (lambda g: g.update(case="other"), "case: is 'other' but its path says 'lin'"),
    (lambda g: g.update(platform="h200"), "platform: is 'h200' but its path says 'cpu'"),
    (lambda g: g["outputs"]["y"]["values"].pop(), "outputs.y.values: holds 14 values, shape [3, 5] needs 15"),
    (lambda g: g["outputs"]["y"].pop("shape"), "outputs.y.shape: missing"),
    (lambda g: g["outputs"]["y"].update(dtype="float33"), "outputs.y.dtype: 'float33' is not a torch dtype"),
    (lambda g: g["outputs"]["y"]["values"].__setitem__(2, "1.5"), "outputs.y.values[2]: '1.5' is not a float32"),
    (lambda g: g["outputs"]["idx"]["values"].__setitem__(0, 1.5), "outputs.idx.values[0]: 1.5 is not a int64"),
    (lambda g: g["outputs"]["s"].update(value="big"), "outputs.s.value: 'big' is not a number"),
    (lambda g: g.pop("outputs"), "outputs: missing"),
])
def test_golden_that_cannot_be_judged_is_one_line_exit_2(tmp_path, gold_dir, edit, field):
    from dsv4.harness import verify as V
    reg, s = _fake_slice(tmp_path)
    V.regen(reg, s, "cpu")
    p = gold_dir / "cpu" / "Z1" / "lin.json"
    g = json.loads(p.read_text())
    edit(g)
    p.write_text(json.dumps(g))
    doc = V.verify(reg, ["Z1"], "cpu", "deterministic", run_tests=False)
    assert doc["exit_code"] == 2, doc
    (rec,) = doc["slices"][0]["checks"]
    assert rec["verdict"] == "error" and rec["detail"].startswith(str(p)) and field in rec["detail"], rec["detail"]
    assert "\n" not in rec["detail"]
    # regen is how such a golden is fixed: it replaces it, saying so
    assert V.regen(reg, s, "cpu")[0]["diff"][0].startswith("  ! replaces a golden that cannot be judged")
    assert V.verify(reg, ["Z1"], "cpu", "deterministic", run_tests=False)["exit_code"] == 0


def test_files_are_written_0644_not_0600(tmp_path):
    old = os.umask(0o022)
    try:
        G.atomic_write_text(tmp_path / "a.md", "x")
        assert (tmp_path / "a.md").stat().st_mode & 0o777 == 0o644
        os.umask(0o077)
        G.atomic_write_text(tmp_path / "b.md", "x")        # the umask is respected
        assert (tmp_path / "b.md").stat().st_mode & 0o777 == 0o600
    finally:
        os.umask(old)


def test_verify_streams_progress_removes_its_temp_dir_and_summarises_failures_first(tmp_path, monkeypatch, capsys):
    import tempfile
    from dsv4.harness import verify as V
    t = tmp_path / "test_tiny.py"
    t.write_text("def test_a():\n    assert True\n\ndef test_b():\n    assert 1 == 2\n")
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    cases = V.run_pytest([str(t)])
    assert {c["name"]: c["verdict"] for c in cases} == {"test_a": "pass", "test_b": "fail"}
    err = capsys.readouterr().err
    assert "test_tiny.py::test_a PASSED" in err and "test_tiny.py::test_b FAILED" in err   # per-test progress
    assert list(scratch.iterdir()) == []                                                  # temp dir removed
    doc = {"platform": "cpu", "verdict": "regression", "elapsed_s": 1.0, "mode": "deterministic",
           "provenance": {"git_sha": "0" * 40, "torch": "x"},
           "slices": [{"id": "A1", "verdict": "pass", "checks": [{"check": "a", "kind": "test", "verdict": "pass"}]},
                      {"id": "B2", "verdict": "cannot-judge", "checks": [
                          {"check": "g", "kind": "golden", "verdict": "missing", "detail": "no golden"}]},
                      {"id": "C3", "verdict": "regression", "checks": [
                          {"check": "t::x", "kind": "test", "verdict": "fail", "detail": "assert 1 == 2"}]}]}
    lines = V.summary_lines(doc)
    assert lines[0] == "REGRESSION C3: t::x (assert 1 == 2)" and lines[1] == "CANNOT-JUDGE B2: g (no golden)"
    assert lines[-1].startswith("verify cpu: REGRESSION (1 pass, 1 regression, 1 cannot judge")
    md = V.write_report(doc, tmp_path / "rep").read_text()
    assert md.index("REGRESSION C3") < md.index("| slice | verdict")


def test_regen_diff_lines_are_results_not_progress(tmp_path, gold_dir, capsys):
    from dsv4.harness import verify as V
    reg, s = _fake_slice(tmp_path)
    said = []
    V.regen(reg, s, "cpu", say=said.append)          # the CLI passes click.echo to stdout (stderr under --json)
    assert said[0] == "goldens/cpu/Z1/lin.json" and said[1].startswith("  + new golden")
    err = capsys.readouterr().err
    assert "running case Z1/lin" in err and "new golden" not in err
