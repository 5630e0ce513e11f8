"""What a person sees (issue 11 §7): results on stdout and progress on stderr, one JSON document under --json
(errors too), pictures written atomically (a full disk: one line, exit 2, the old file intact), graph labels."""
import errno
import json
import os

import pytest
from click.testing import CliRunner

from dsv4.harness import graph as GR
from dsv4.harness.cli import main
from dsv4.harness.registry import Registry
from dsv4.harness.testing import fake_slice


def _run(*args):
    return CliRunner().invoke(main, list(args))


def test_results_on_stdout_progress_on_stderr(tmp_path):
    r = _run("graph", "--rounds")
    assert r.exit_code == 0 and r.stdout.startswith("round 0: ") and r.stderr == ""
    r = _run("flops", "--config", "debug", "--seq", "64")
    assert r.exit_code == 0 and "TOTAL" in r.stdout


def test_train_result_on_stdout_and_its_provenance_reaches_compare(tmp_path):
    out = tmp_path / "run"
    r = _run("train", "--recipe", "debug", "--steps", "1", "--out", str(out), "--save-interval", "0")
    assert r.exit_code == 0, r.output
    assert "debug: 1 steps, lm loss" in r.stdout and "train" in r.stderr          # the tqdm bar: stderr
    prov = json.loads((out / "provenance.json").read_text())                      # train writes provenance
    assert prov["seed"] == 1234 and prov["config_hash"] and prov["git_sha"]
    r = _run("compare", str(out), str(out / "golden_values.json"), "--report", str(tmp_path / "rep"), "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)                                                    # --json: one document
    assert doc["run_provenance"]["config_hash"] == prov["config_hash"]
    assert prov["config_hash"] in (tmp_path / "rep" / "report.md").read_text()


@pytest.mark.parametrize("args", [["graph", "--format", "nope", "--json"], ["verify", "--slice", "NOPE", "--json"],
                                  ["compare", "/nonexistent", "/nonexistent", "--json"]])
def test_json_errors_are_one_json_document(args):
    r = _run(*args)
    assert r.exit_code == 2
    doc = json.loads(r.stdout)
    assert set(doc) == {"error", "exit_code"} and doc["exit_code"] == 2 and "\n" not in doc["error"]
    assert len([ln for ln in r.stderr.splitlines() if ln.strip()]) == 1


def test_graph_png_on_a_full_disk_keeps_the_old_file(tmp_path, monkeypatch):
    png = tmp_path / "existing.png"
    png.write_bytes(b"old picture")

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "fsync", full)
    r = _run("graph", "--format", "png", "--out", str(png))
    assert r.exit_code == 2
    err = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(err) == 1 and "No space left on device" in err[0] and "existing.png" in err[0]
    assert png.read_bytes() == b"old picture" and [p.name for p in tmp_path.iterdir()] == ["existing.png"]


def _quoted_registry(tmp_path):
    return Registry([fake_slice("A1", tmp_path / "A1", title='the "quoted" \\ title'),
                     fake_slice("B2", tmp_path / "B2", title="plain", depends_on=["A1"])])


def test_graph_labels_and_quotes_in_titles(tmp_path):
    reg = _quoted_registry(tmp_path)
    ids = reg.order()
    dot = GR.dot(reg, ids, labels=True)
    node = next(ln for ln in dot.splitlines() if ln.startswith('  "A1"'))
    assert 'label="A1\\nthe \\"quoted\\" \\\\ title"' in node
    for ln in dot.splitlines():       # every string closes: an even number of unescaped quotes per line
        assert ln.replace('\\\\', '').replace('\\"', '').count('"') % 2 == 0, ln
    assert "quoted" not in GR.dot(reg, ids)                                    # titles only with --labels
    mer = GR.mermaid(reg, ids, labels=True)
    assert 'A1["A1: the #quot;quoted#quot; \\ title"]' in mer
    r = _run("graph", "--format", "dot", "--labels")
    assert r.exit_code == 0 and "Static-CP DSv4 attention" in r.stdout
    png = tmp_path / "g.png"
    assert GR.draw(reg, ids, png, labels=True) == png and png.stat().st_size > 1000


def test_verify_verdicts_on_stdout():
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "dsv4.harness.cli", "verify", "--slice", "P6", "--skip-tests"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    assert out[0].startswith("P6 ") and out[1].startswith("  [PASS   ] tensor") and out[-1].startswith("verify cpu: PASS (1 pass")


def test_json_error_from_a_command_itself_and_no_leak_between_invocations():
    from dsv4.harness.train.flops import flops_cmd
    r = _run("flops", "--config", "nope", "--json")
    assert r.exit_code == 2 and json.loads(r.stdout)["error"].startswith("config: unknown name 'nope'")
    r = CliRunner().invoke(flops_cmd, ["--config", "nope"])          # no --json: nothing on stdout
    assert r.exit_code == 2 and r.stdout == "" and r.stderr.startswith("dsv4: error: config: unknown name")
