"""X4 / issue 18 §3: `dsv4 plan` against the peaks measured on the H200, and its scaling against measurement.

Measured peaks (`torch.cuda.max_memory_allocated` of `dsv4 bench train`, proxy, bf16, Triton kernels, no optimizer:
fwd + bwd, gradients set to None after each step) at fd78196, the commit of the stored saved-tensor measurement
(the sparse-mode indexer loss keeps [T, k] tensors):
  goldens/h200/D9/bench_train_peers.json  4K tokens, batch 1, no recompute: 10.21 GiB
  goldens/h200/D9/bench_train_long.log    64K tokens, batch 1, recompute: 52.2 GiB (128K did not finish in its time
                                          limit: not judged)
Tolerance: 15%, issue 18's done-when ("matches the measured peaks within 15%"). The activations come from the stored measurement of the proxy's saved tensors
(slices/X4/measured/saved_<config hash>.json, `dsv4 plan --config proxy --measure`); its scaling from the measured
sequence to others is checked live on the debug config against a second measurement (exact but for HCA's
partial compressed slots: worst 0.66% measured, tolerance 1%).
"""
import json
import os
import re

import pytest
from click.testing import CliRunner

from dsv4.harness.plan import GIB, H200_BYTES, block_activation_bytes, measured_path, plan, plan_cmd
from dsv4.model.config import get_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
H200 = os.path.join(ROOT, "goldens", "h200", "D9")
TOL = 0.15                      # issue 18 done-when
SCALING_TOL = 0.01              # measured worst 0.66% (HCA layer, debug) x 1.5


def h200_points():
    """[(tokens, batch, recompute, peak bytes, source)] measured on the H200 at the commit of the stored
    saved-tensor measurement (goldens/h200/D9: bench_train_peers.json, bench_train_long.log + its provenance)."""
    pts = []
    with open(os.path.join(H200, "bench_train_peers.json")) as f:
        doc = json.load(f)
    assert doc["config"] == "proxy"
    sha = doc["provenance"]["git_sha"]
    for r in doc["results"]:
        if r["impl"] == "ours":
            pts.append((r["tokens"], r["batch"], r["recompute"], r["peak_mem_bytes"], "bench_train_peers.json"))
    with open(os.path.join(H200, "bench_train_long.provenance.json")) as f:
        assert json.load(f)["provenance"]["git_sha"] == sha
    with open(os.path.join(H200, "bench_train_long.log")) as f:
        for line in f:
            m = re.match(r"ours\s+(\d+) tokens: [\d,]+ tok/s, ([\d.]+) GiB", line)
            if m:     # bench_train's recompute threshold: 32768 tokens
                pts.append((int(m.group(1)), 1, int(m.group(1)) >= 32768, float(m.group(2)) * GIB,
                            "bench_train_long.log"))
    return pts, sha


def test_plan_matches_h200_peaks():
    cfg = get_config("proxy")
    path = measured_path(cfg)
    assert os.path.isfile(path), f"cannot judge: no stored measurement {path} (dsv4 plan --config proxy --measure)"
    with open(path) as f:
        m = json.load(f)
    pts, sha = h200_points()
    assert m["provenance"]["git_sha"] == sha, "the measurement and the H200 peaks come from different commits"
    assert len(pts) >= 2 and any(p[2] for p in pts), pts        # one plain and one recompute point at least
    for tokens, batch, rec, peak, src in pts:
        r = plan(cfg, tokens, batch, rec, "bf16", "none", m=m, head_ce="recompute")   # measured before grad_in_forward
        rel = r["peak_bytes"] / peak - 1
        print(f"{src}: {tokens} tokens B={batch} recompute={rec}: plan {r['peak_gib']:.2f} GiB, "
              f"measured {peak / GIB:.2f} GiB ({100 * rel:+.1f}%)")
        assert abs(rel) <= TOL, (tokens, batch, rec, r["peak_gib"], peak / GIB)


def test_grad_in_forward_holds_a_dw_per_head():
    """The head CE's default (grad_in_forward) holds an fp32 dW [V, d] per head (LM + MTP) from the forward to the
    backward; recompute forms one in the backward: the plans differ by exactly MTP-count x V x d x 4 bytes."""
    cfg = get_config("proxy")
    a, b = (plan(cfg, 4096, 2, False, "bf16", "none", head_ce=h) for h in ("grad_in_forward", "recompute"))
    extra = cfg.num_nextn_predict_layers * cfg.vocab_size * cfg.hidden_size * 4
    assert cfg.num_nextn_predict_layers >= 1 and a["peak_bytes"] - b["peak_bytes"] == pytest.approx(extra)


def test_scaling_equals_a_second_measurement():
    """Saved bytes per block measured at (S=200, k=11), scaled by shape class to (S=152, k=10), equal the bytes
    measured there (debug config: window, CSA, HCA and MTP blocks, and the top)."""
    from dsv4.harness.plan_measure import run_measure
    cfg = get_config("debug")
    m1 = run_measure(cfg.to_dict(), 200, 11)
    m2 = run_measure(cfg.to_dict(), 152, 10)
    # the CSA terms exist; in sparse mode they scale with T*k (the [T, N] scores keep no graph, model/indexer.py)
    assert m1["labels"]["layers.1"]["topk"] > 0
    for lab, d in m2["labels"].items():
        meas = d["token"] + d["entry"] + d["topk"] + d["const"]
        pred = block_activation_bytes(m1, lab, 1, 152, cfg.replace(index_topk=10))
        assert abs(pred / meas - 1) <= SCALING_TOL, (lab, pred, meas)


def test_plan_cli_json_plot_and_bad_input(tmp_path):
    cfg = get_config("proxy")
    if not os.path.isfile(measured_path(cfg)):
        pytest.fail("cannot judge: no stored proxy measurement")
    r = CliRunner().invoke(plan_cmd, ["--config", "proxy", "--tokens", "131072", "--recompute", "--optimizer",
                                      "adamw", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert not doc["fits"] and any("--cp" in s for s in doc["suggestions"])
    assert set(doc["breakdown_gib"]) == {"parameters", "gradients", "optimizer", "activations", "workspace"}
    assert doc["breakdown_gib"]["optimizer"] == pytest.approx(2 * doc["breakdown_gib"]["parameters"])
    assert doc["flops_per_step"] > 0 and doc["generation_cache_gib"] > 0
    png = tmp_path / "plan.png"
    r = CliRunner().invoke(plan_cmd, ["--config", "proxy", "--tokens", "65536", "--recompute", "--plot", str(png)])
    assert r.exit_code == 0 and png.read_bytes()[:4] == b"\x89PNG", r.output
    one = plan(get_config("proxy"), 16384, 4, optimizer="none")
    split = plan(get_config("proxy"), 16384, 4, optimizer="none", dp=2, ep=2)     # dp and ep split the 4 rows
    assert split["breakdown_gib"]["activations"] < one["breakdown_gib"]["activations"] / 3
    for args, field in ((["--tokens", "4096", "--cp", "3"], "cp"), (["--tokens", "4096", "--batch", "2", "--dp", "4"],
                                                                   "batch")):
        r = CliRunner().invoke(plan_cmd, ["--config", "proxy"] + args)
        assert r.exit_code == 2 and field in r.output and len(r.output.strip().splitlines()) == 1, r.output
