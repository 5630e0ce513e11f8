"""`dsv4 bench train` (issue 13) on the debug config on CPU (`--smoke`): rows of ours and of packed THD rows from
the P7 scheduler, the compiled impls' wiring, the profile summary, incremental atomic output, --append merging
by (impl, tokens, batch) with ratios over all rows, and one-line exit-2 refusals. The numbers mean nothing here;
what is checked is what the H200 run will store."""
from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner

from dsv4.harness.train import bench
from dsv4.harness.train.bench import bench_train_cmd, run
from dsv4.model.model import DSv4Model


def _run(tmp_path, impls, tokens, batch=1, **kw):
    kw.setdefault("steps", 1)
    kw.setdefault("warmup", 1)
    return run(None, tokens, batch, kw.pop("steps"), kw.pop("warmup"), impls, smoke=True,
               out=str(tmp_path / "b.json"), **kw)


def _rows(doc):
    return {(r["impl"], r["tokens"], r["batch"]): r for r in doc["results"]}


def test_ours_and_packed_rows(tmp_path, monkeypatch):
    seen = []
    orig = DSv4Model.forward

    def spy(self, *a, **kw):
        seen.append((kw.get("cu_seqlens"), kw.get("cu_seqlens_padded"), kw["input_ids"].shape))
        return orig(self, *a, **kw)
    monkeypatch.setattr(DSv4Model, "forward", spy)
    doc = _run(tmp_path, ["ours", "ours_packed"], [512], batch=2, doc_min=16)
    assert json.loads((tmp_path / "b.json").read_text()) == doc
    rows = _rows(doc)
    for r in rows.values():
        assert "error" not in r, r
        assert math.isfinite(r["tokens_per_s"]) and r["tokens_per_s"] > 0
        assert len(r["first_steps_s"]) == 1 and r["first_steps_s"][0] > 0
        assert r["git_sha"] and 0 < r["mfu_vs_989"] < 1
    assert all(cu is None for cu, _, _ in seen[:2])                 # ours: 2 plain documents of 256
    (cu, cup, shape), = set((tuple(c.tolist()), tuple(p.tolist()), s) for c, p, s in seen[2:])
    assert shape == (2, 256) and cup[-1] == 512 and 256 in cup     # no document crosses the row boundary
    lens = [b - a for a, b in zip(cu, cu[1:])]
    assert len(lens) >= 4 and len(set(lens)) >= 3, lens             # several documents of mixed lengths
    p = rows[("ours_packed", 512, 2)]["packing"]
    assert [n for row in p["doc_lengths"] for n in row] == lens and p["real_tokens"] == cu[-1]
    assert all(len(row) >= 2 for row in p["doc_lengths"]) and 0.8 < p["fill"] <= 1
    packed = rows[("ours_packed", 512, 2)]
    assert packed["tokens_per_s"] == pytest.approx(cu[-1] / packed["step_s"])    # real tokens, not slots
    assert doc["ratios"]["ours_packed_over_ours@512"] == \
        pytest.approx(packed["tokens_per_s"] / rows[("ours", 512, 2)]["tokens_per_s"])


def test_packed_graph_row_runs_the_static_buffer_step(tmp_path, monkeypatch):
    """ours_packed_graph (P11): the same packed rows as ours_packed, through PackedGraphStep (eager on CPU: its
    layout comes from the static buffer, not from cu_seqlens); a ratio over ours_packed."""
    from dsv4.harness.train import packed_graph
    made = []
    orig = packed_graph.PackedGraphStep.__init__

    def spy(self, model, shape, max_seqs, **kw):
        made.append((tuple(shape), max_seqs))
        return orig(self, model, shape, max_seqs, **kw)
    monkeypatch.setattr(packed_graph.PackedGraphStep, "__init__", spy)
    doc = _run(tmp_path, ["ours_packed", "ours_packed_graph"], [512], batch=2, doc_min=16)
    rows = _rows(doc)
    g, p = rows[("ours_packed_graph", 512, 2)], rows[("ours_packed", 512, 2)]
    assert "error" not in g and g["packing"] == p["packing"]             # the same documents
    assert made == [((2, 256), len([n for row in p["packing"]["doc_lengths"] for n in row]))]
    assert doc["ratios"]["ours_packed_graph_over_ours_packed@512"] == \
        pytest.approx(g["tokens_per_s"] / p["tokens_per_s"])


def test_compiled_impls_call_compile_blocks_and_mark_cudagraph_steps(tmp_path, monkeypatch):
    """ours_compile -> compile_blocks(); ours_cudagraph -> compile_blocks(mode="reduce-overhead") and one
    cudagraph_mark_step_begin per step, at least 3 warm-up steps (spied: Inductor on CPU takes minutes)."""
    calls, marks = [], []
    monkeypatch.setattr(DSv4Model, "compile_blocks", lambda self, **kw: calls.append(kw) or self)
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    doc = _run(tmp_path, ["ours_compile", "ours_cudagraph"], [128], steps=2, warmup=1)
    assert calls == [{}, {"mode": "reduce-overhead"}]
    rows = _rows(doc)
    assert rows[("ours_compile", 128, 1)]["warmup"] == 1 and rows[("ours_cudagraph", 128, 1)]["warmup"] == 3
    assert len(marks) == 3 + 2
    assert set(rows[("ours_cudagraph", 128, 1)]["compile_stats"]) == {"graphs", "graph_breaks", "cudagraph_skips"}
    assert bench.parse_args("128", 1, "ours,ours_packed,hf_eager", 1, 1, True)[1] == \
        ["ours_compile", "ours_packed_compile", "hf_eager"]                  # the old --compile flag


def test_profile_summary_on_cpu(tmp_path):
    doc = _run(tmp_path, ["ours"], [128], profile=True)
    p = doc["results"][0]["profile"]
    assert p["launch_unit"] == "cpu_op" and p["launches_per_step"] == p["cpu_ops_per_step"] > 100
    assert p["device_ms"] is None and p["top_kernels"] == [] and p["host_ms"] > 0
    assert p["host_syncs"] is None                                       # counted on CUDA only
    ops = p["top_cpu_ops"]
    assert len(ops) == 15 and all(len(o["name"]) <= 80 and o["count"] >= 1 for o in ops)
    assert [o["ms"] for o in ops] == sorted((o["ms"] for o in ops), reverse=True)
    assert 0 < sum(o["share"] for o in ops) <= 1 + 1e-9
    assert any(o["name"] in ("aten::mm", "aten::addmm", "aten::bmm") for o in ops)


def test_device_idle_finds_the_gaps_and_the_host_op_in_them():
    """`device_idle` on a stand-in timeline: overlapping kernels on two streams merge into busy intervals; the
    gaps are ranked by length with the kernel that ended last before each, the next kernel, and the innermost host
    op at the gap's midpoint (None where the host ran no op)."""
    from dsv4.harness.train.profile_step import device_idle
    kernels = [(0, 10, "a"), (5, 30, "b"), (8, 12, "c"),               # busy 0-30 (b ends last)
               (50, 60, "d"),                                          # gap 30-50 (20 us)
               (61, 70, "e"), (100, 101, "f")]                         # gap 60-61 (1 us), 70-100 (30 us)
    ops = [(0, 200, "aten::step"), (35, 45, "cudaMalloc"), (80, 90, "aten::index_put_")]
    got = device_idle(kernels, ops, top=2)
    assert got["span_ms"] == pytest.approx(0.101) and got["busy_ms"] == pytest.approx(0.050)
    assert got["idle_ms"] == pytest.approx(0.051) and got["gaps"] == 3
    assert [(g["after"], g["before"], g["host_op"]) for g in got["top_gaps"]] == \
        [("e", "f", "aten::index_put_"), ("b", "d", "cudaMalloc")]
    assert [g["ms"] for g in got["top_gaps"]] == pytest.approx([0.030, 0.020])
    assert device_idle([(0, 5, "a"), (9, 10, "b")], [], top=5)["top_gaps"][0]["host_op"] is None
    assert device_idle([], ops) is None


def test_profile_summary_of_device_events():
    """The GPU path of `summarize` on a stand-in profiler: kernels counted and ranked, memcpy / annotations left
    out, runtime launch calls counted on the host."""
    from torch.autograd import DeviceType

    from dsv4.harness.train.profile_step import summarize

    def ev(name, dev, us, act="kernel", ann=False):
        return SimpleNamespace(name=name, device_type=dev, time_range=SimpleNamespace(start=0, end=us),
                               self_cpu_time_total=us, is_user_annotation=ann, activity_type=act)
    C, G = DeviceType.CPU, DeviceType.CUDA
    evs = [ev("k" * 300, G, 300), ev("gemm", G, 100), ev("gemm", G, 100), ev("Memcpy HtoD", G, 50, "gpu_memcpy"),
           ev("## block ##", G, 900, "gpu_user_annotation", True), ev("cudaLaunchKernel", C, 5, "cuda_runtime"),
           ev("cudaGraphLaunch", C, 7, "cuda_runtime"), ev("aten::mm", C, 20, "cpu_op")]
    s = summarize(SimpleNamespace(events=lambda: evs), 0.002)
    assert s["launch_unit"] == "kernel" and s["launches_per_step"] == 3 and s["device_ms"] == pytest.approx(0.5)
    assert s["host_launch_calls"] == 2 and s["host_ms"] == pytest.approx(2.0) and s["cpu_ops_per_step"] == 3
    assert [(k["name"], k["count"]) for k in s["top_kernels"]] == [("k" * 240, 1), ("gemm", 2)]
    assert s["top_kernels"][1]["share"] == pytest.approx(0.4)
    assert s["top_cpu_ops"][0]["name"] == "aten::mm"
    assert s["device_idle"]["idle_ms"] == 0.0 and s["device_idle"]["gaps"] == 0      # every kernel starts at 0 here


def test_incremental_write_keeps_finished_rows(tmp_path, monkeypatch):
    """After each row --out holds every finished row: a run killed in its second row leaves a valid file."""
    orig, n = bench._row, []

    def row(*a, **kw):
        n.append(1)
        if len(n) == 2:
            raise KeyboardInterrupt                         # not caught as a failed row: the process dies here
        return orig(*a, **kw)
    monkeypatch.setattr(bench, "_row", row)
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path, ["ours"], [128, 256])
    doc = json.loads((tmp_path / "b.json").read_text())
    assert [(r["impl"], r["tokens"]) for r in doc["results"]] == [("ours", 128)]
    assert doc["bench"] == "train" and doc["provenance"]["git_sha"]


def test_timed_row_is_written_before_its_profile_step(tmp_path, monkeypatch):
    """--profile: the row's timing is on disk (profile marked missing) before the extra profiled step runs, so a
    time limit that kills the process inside that step keeps the row; a finished profile replaces the mark."""
    from dsv4.harness.train import profile_step
    seen = []

    def killed(step, device):
        seen.append(json.loads((tmp_path / "b.json").read_text()))
        raise KeyboardInterrupt                                 # the caller's timeout, inside the profile step
    monkeypatch.setattr(profile_step, "profile_summary", killed)
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path, ["ours"], [128], profile=True)
    (r,) = json.loads((tmp_path / "b.json").read_text())["results"]
    assert seen and r["profile_missing"] == bench.PROFILE_PENDING and "profile" not in r
    assert r["tokens_per_s"] > 0 and r["git_sha"] and r["impl"] == "ours"
    monkeypatch.undo()
    (r,) = _run(tmp_path, ["ours"], [128], profile=True)["results"]
    assert "profile_missing" not in r and r["profile"]["launches_per_step"] > 0
    assert json.loads((tmp_path / "b.json").read_text())["results"] == [r]


def test_append_merges_and_replaces_by_key(tmp_path, monkeypatch):
    out = tmp_path / "b.json"
    old = {"bench": "train", "config": "debug", "provenance": {"git_sha": "0" * 40},    # older format: no row sha
           "results": [{"impl": "hf_eager", "tokens": 128, "batch": 1, "seq": 128, "tokens_per_s": 100.0}]}
    out.write_text(json.dumps(old))
    args = ["--smoke", "--batch", "1", "--steps", "1", "--warmup", "0", "--impls", "ours",
            "--out", str(out), "--append"]
    monkeypatch.setenv("DSV4_GIT_SHA", "a" * 40)
    r = CliRunner().invoke(bench_train_cmd, args + ["--tokens", "128,256"])
    assert r.exit_code == 0, r.output
    monkeypatch.setenv("DSV4_GIT_SHA", "b" * 40)
    r = CliRunner().invoke(bench_train_cmd, args + ["--tokens", "256"])
    assert r.exit_code == 0, r.output
    doc = json.loads(out.read_text())
    assert [(x["impl"], x["tokens"], x["git_sha"][0]) for x in doc["results"]] == \
        [("hf_eager", 128, "0"), ("ours", 128, "a"), ("ours", 256, "b")]        # 256 replaced, nothing doubled
    assert doc["ratios"] == {}                  # the HF row is of another commit ("0"): no ratio across commits
    old["results"][0]["git_sha"] = "a" * 40
    out.write_text(json.dumps(old))
    monkeypatch.setenv("DSV4_GIT_SHA", "a" * 40)
    r = CliRunner().invoke(bench_train_cmd, args + ["--tokens", "128"])
    assert r.exit_code == 0, r.output
    doc = json.loads(out.read_text())
    ours128 = _rows(doc)[("ours", 128, 1)]["tokens_per_s"]
    assert doc["ratios"] == {"ours_over_hf_eager@128": pytest.approx(ours128 / 100.0)}


def test_platform_is_the_gpu_s_name_and_append_refuses_another(tmp_path, monkeypatch):
    """An H100 run is filed as h100, not h200 (session 23's H100 rows were first written as 'h200'), and --append
    refuses to add a run of one platform to a file of another."""
    from dsv4.harness.goldens import platform_of
    assert platform_of("cpu") == "cpu"
    for name, want in [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"), ("NVIDIA GB200", "gb200"),
                       ("NVIDIA A100-SXM4-80GB", "cuda")]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None, n=name: n)
        assert platform_of(torch.device("cuda")) == want
    out = tmp_path / "b.json"
    out.write_text(json.dumps({"bench": "train", "config": "debug", "provenance": {"platform": "h200"}, "results": []}))
    r = CliRunner().invoke(bench_train_cmd, ["--smoke", "--batch", "1", "--steps", "1", "--warmup", "0", "--impls",
                                             "ours", "--tokens", "128", "--out", str(out), "--append"])
    assert r.exit_code == 2 and "measured on platform 'h200', this run is 'cpu'" in r.output, r.output


def _spy(monkeypatch, setter: str) -> list:
    """The modes DSv4Model.<setter> is called with, in order (the setter still runs)."""
    seen, orig = [], getattr(DSv4Model, setter)

    def spy(self, mode):
        seen.append(mode)
        return orig(self, mode)
    monkeypatch.setattr(DSv4Model, setter, spy)
    return seen


def test_head_ce_modes_are_rows_with_a_ratio(tmp_path, monkeypatch):
    """--head-ce grad_in_forward,recompute: one ours row per mode (the model really switched: DSv4Model.set_head_ce
    sees each), each carrying its head_ce, HF rows once, and the ratio of the non-default row over the default one."""
    seen = _spy(monkeypatch, "set_head_ce")
    doc = _run(tmp_path, ["ours"], [256], switch_modes={"head_ce": ("grad_in_forward", "recompute")})
    assert seen == ["grad_in_forward", "recompute"]
    rows = {(r["impl"], r.get("head_ce")): r for r in doc["results"]}
    assert set(rows) == {("ours", "grad_in_forward"), ("ours", "recompute")}
    assert all("error" not in r and r["tokens_per_s"] > 0 for r in rows.values())
    assert doc["ratios"] == {"ours[head_ce=recompute]_over_ours@256": pytest.approx(
        rows[("ours", "recompute")]["tokens_per_s"] / rows[("ours", "grad_in_forward")]["tokens_per_s"])}
    again = bench.merge_results(doc["results"], [dict(rows[("ours", "recompute")], tokens_per_s=1.0)])
    assert len(again) == 2 and [r["tokens_per_s"] for r in again if r["head_ce"] == "recompute"] == [1.0]


def test_rows_without_switch_fields_read_as_their_day_s_modes():
    """A stored ours row without head_ce ran "recompute" (the default before session 21): it is keyed apart from
    a grad_in_forward row and gets the non-default ratio; HF rows have no switches and pair with the default row."""
    new = dict(head_ce="grad_in_forward", out_rope="fused", all_picked="contiguous")
    rows = [dict(impl="ours", tokens=64, batch=2, tokens_per_s=90.0, all_picked="contiguous"),  # old: recompute
            dict(impl="ours", tokens=64, batch=2, tokens_per_s=100.0, **new),
            dict(impl="hf_eager", tokens=64, batch=2, tokens_per_s=20.0)]
    assert len(bench.merge_results(rows[:1], rows[1:2])) == 2
    assert bench.ratios(rows) == {"ours_over_hf_eager@64": pytest.approx(5.0),
                                  "ours[head_ce=recompute]_over_hf_eager@64": pytest.approx(4.5),
                                  "ours[head_ce=recompute]_over_ours@64": pytest.approx(0.9)}
    cg = dict(impl="ours_cudagraph", tokens=64, batch=2, tokens_per_s=180.0, all_picked="contiguous")  # recompute
    assert bench.ratios(rows + [cg])["ours_cudagraph[head_ce=recompute]_over_ours[head_ce=recompute]@64"] == \
        pytest.approx(2.0)
    other = [dict(r, git_sha="b") if r["impl"] == "hf_eager" else dict(r, git_sha="a") for r in rows]
    assert bench.ratios(other) == {"ours[head_ce=recompute]_over_ours@64": pytest.approx(0.9)}   # one commit only
    # a row of sessions 21-23 (head_ce, out_rope, no all_picked) read the listed CSA rows, the only way then
    s23 = dict(impl="ours", tokens=64, batch=2, tokens_per_s=95.0, head_ce="grad_in_forward", out_rope="fused")
    assert bench.ratios([s23, rows[1]]) == {"ours[all_picked=listed]_over_ours@64": pytest.approx(0.95)}


def test_switch_modes_cross_into_rows_keyed_by_their_non_default_fields(tmp_path, monkeypatch):
    """--head-ce and --out-rope together: one ours row per combination (the model really switched), each keyed by
    its non-default fields, and each non-default row's ratio over the all-default row."""
    seen = _spy(monkeypatch, "set_out_rope")
    doc = _run(tmp_path, ["ours"], [128], switch_modes={"head_ce": ("grad_in_forward", "recompute"),
                                                        "out_rope": ("fused", "separate")})
    assert seen == ["fused", "separate"] * 2
    keys = {(r["head_ce"], r["out_rope"]) for r in doc["results"]}
    assert keys == {("grad_in_forward", "fused"), ("grad_in_forward", "separate"), ("recompute", "fused"),
                    ("recompute", "separate")}
    assert set(doc["ratios"]) == {"ours[out_rope=separate]_over_ours@128",
                                  "ours[head_ce=recompute]_over_ours@128",
                                  "ours[head_ce=recompute][out_rope=separate]_over_ours[out_rope=separate]@128",
                                  "ours[head_ce=recompute][out_rope=separate]_over_ours[head_ce=recompute]@128"}


@pytest.mark.parametrize("args,names", [
    (["--impls", "ours,bogus"], "--impls: unknown implementation 'bogus'"),
    (["--tokens", "1001", "--batch", "2"], "--tokens: 1001 is not a positive multiple of --batch 2"),
    (["--append"], "--append: needs --out"),
    (["--append", "--out", "{bad}"], "--append: cannot read"),
    (["--append", "--out", "{other}"], "is not a `dsv4 bench train` result"),
    (["--append", "--out", "{proxy}"], "was measured on config 'proxy', this run is 'debug'"),
    (["--append", "--out", "{h200}"], "was measured on platform 'h200', this run is 'cpu'"),
    (["--head-ce", "recompute,fused"], "--head-ce: a comma list of distinct modes"),
    (["--head-ce", "recompute,recompute"], "--head-ce: a comma list of distinct modes"),
    (["--out-rope", "fused,inside"], "--out-rope: a comma list of distinct modes from fused, separate"),
])
def test_bad_input_exits_2_with_one_line(tmp_path, args, names):
    files = {"{bad}": "not json", "{other}": json.dumps({"bench": "kernels", "ops": {}}),
             "{proxy}": json.dumps({"bench": "train", "config": "proxy", "results": []}),
             "{h200}": json.dumps({"bench": "train", "config": "debug", "results": [],
                                   "provenance": {"platform": "h200"}})}
    for k, text in files.items():
        (tmp_path / k.strip("{}")).write_text(text)
    args = [str(tmp_path / a.strip("{}")) if a in files else a for a in args]
    r = CliRunner().invoke(bench_train_cmd, ["--smoke", "--tokens", "128", "--batch", "1"] + args)
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dsv4: error: ") and names in lines[0], r.stderr


def test_time_by_source_line_forward_and_backward():
    """`by_source` on a CPU profile of one `debug` step (naive kernels): the time lands on lines of model/ and
    kernels/, forward and backward apart; the MoE expert line has both phases (its backward is native autograd,
    found through the autograd sequence number); shares add up to at most 1."""
    from dsv4.harness.train.profile_step import by_source, profile_once
    from dsv4.model.config import get_config
    cfg = get_config("debug")
    model = bench.build_ours(cfg, "naive", torch.device("cpu"))
    step = bench.make_step(model, bench.lm_inputs(2, 32, cfg.vocab_size, torch.device("cpu"), False))
    step()
    prof, _ = profile_once(step, "cpu", with_stack=True)
    r = by_source(prof, 200)
    assert r["unit"] == "cpu" and r["total_ms"] > 0
    rows = r["rows"]
    assert 0.99 <= sum(x["share"] for x in rows) <= 1 + 1e-9           # top 200 covers every row of `debug`
    srcs = {(x["phase"], x["source"].split(":")[0].split("(")[0]) for x in rows}
    assert ("fwd", "model/moe.py") in srcs and ("bwd", "model/moe.py") in srcs
    assert any(s.startswith("kernels/") for _, s in srcs)
    assert all(x["ops"] for x in rows)
    unknown = sum(x["ms"] for x in rows if x["source"].startswith("("))
    assert unknown < 0.25 * r["total_ms"], [x for x in rows if x["source"].startswith("(")]


def test_time_by_source_line_of_device_kernels():
    """The GPU weighting of `by_source` on stand-in events: each CPU op's kernels' device time, the forward line
    found through the Python-frame parents, the backward op under a native node mapped to that line by its
    sequence number, a Python backward (an autograd.Function's) under its own line with phase bwd, an engine-only op
    (AccumulateGrad) kept apart."""
    from torch.autograd import DeviceType

    from dsv4.harness.train.profile_step import by_source

    def ev(name, parent=None, seq=-1, kern=()):
        return SimpleNamespace(name=name, device_type=DeviceType.CPU, cpu_parent=parent, sequence_nr=seq,
                               kernels=[SimpleNamespace(duration=d) for d in kern], self_cpu_time_total=1.0)
    f = ev("/x/dsv4/model/ffn.py(12): forward")
    node = ev("MulBackward0", ev("autograd::engine::evaluate_function: MulBackward0", seq=7), seq=7)
    engine = ev("autograd::engine::evaluate_function: torch::autograd::AccumulateGrad")
    acc = ev("torch::autograd::AccumulateGrad", engine)
    py_node = ev("_SparseAttnBackward", seq=9)                # an autograd.Function: its backward is Python
    py_bwd = ev("/x/dsv4/kernels/sparse_attn/triton.py(450): backward", py_node)
    evs = [f, ev("aten::mul", f, seq=7, kern=(300,)), ev("aten::add", f, kern=(100,)), node,
           ev("aten::mul", node, kern=(200, 100)), acc, ev("aten::add_", acc, kern=(50,)),
           py_node, py_bwd, ev("cuLaunchKernel", py_bwd, kern=(400,)),
           SimpleNamespace(name="k", device_type=DeviceType.CUDA)]
    r = by_source(SimpleNamespace(events=lambda: evs), 10)
    got = {(x["phase"], x["source"]): x["ms"] for x in r["rows"]}
    assert r["unit"] == "device" and r["total_ms"] == pytest.approx(1.15)
    assert got == {("fwd", "model/ffn.py(12): forward"): pytest.approx(0.4),
                   ("bwd", "model/ffn.py(12): forward"): pytest.approx(0.3),
                   ("bwd", "kernels/sparse_attn/triton.py(450): backward"): pytest.approx(0.4),
                   ("bwd", "(no repo frame) torch::autograd::AccumulateGrad"): pytest.approx(0.05)}


def test_time_by_source_falls_back_to_module_ranges_and_recorded_stacks():
    """Where a build links no Python frames as the ops' parents (torch 2.11 on the H200 at c456743): an op takes the
    innermost `_label` module range above it, its backward (a custom op's node, by sequence number) the same range;
    an op with a recorded stack (`FunctionEvent.stack`) takes that stack's innermost repo frame."""
    from torch.autograd import DeviceType

    from dsv4.harness.train.profile_step import by_source

    def ev(name, parent=None, seq=-1, kern=(), stack=None):
        return SimpleNamespace(name=name, device_type=DeviceType.CPU, cpu_parent=parent, sequence_nr=seq,
                               kernels=[SimpleNamespace(duration=d) for d in kern], self_cpu_time_total=1.0,
                               stack=stack)
    attn = ev("layers.1.attn", ev("layers.1.attn.indexer.compressor.unrelated_thing",
                                   ev("/r/dsv4/model/block.py(50): forward")))     # the nearer range wins
    fwd = ev("dsv4::sparse_attn_fwd", attn, seq=5)
    node = ev("EagerBackward", ev("autograd::engine::evaluate_function: EagerBackward", seq=5), seq=5,
              stack=["/r/dsv4/harness/train/loop.py(538): _train"])    # the engine's stack: not the source
    stacked = ev("aten::mm", None, kern=(70,), stack=["torch/nn/functional.py(10): linear",
                                                      "/r/dsv4/model/moe.py(140): forward", "/r/dsv4/harness/x.py(1): f"])
    evs = [attn, fwd, ev("Eager_sparse_attn_fwd", fwd, kern=(100,)), node, ev("_sparse_attn_bwd", node, kern=(300,)),
           ev("aten::add", ev("record_param_comms"), kern=(30,)), stacked]
    got = {(x["phase"], x["source"]): x["ms"] for x in by_source(SimpleNamespace(events=lambda: evs), 10)["rows"]}
    assert got == {("fwd", "[layers.1.attn]"): pytest.approx(0.1), ("bwd", "[layers.1.attn]"): pytest.approx(0.3),
                   ("fwd", "model/moe.py(140): forward"): pytest.approx(0.07),
                   ("fwd", "(no repo frame) record_param_comms"): pytest.approx(0.03)}


def test_traffic_counts_bytes_by_source_line():
    """`traffic` on a step of known ops (the naive clamped SwiGLU, fp32 [10, 8], no limit): forward silu reads and
    writes one [10, 8] (640 B), the product reads two and writes one (960 B), both on the naive file's line;
    the backward's ops carry that line with their autograd node; the `out=` buffer is counted as written, not
    read; a cast is kind "copy"; views move nothing."""
    from dsv4.harness.train.profile_step import traffic
    from dsv4.kernels.swiglu import naive
    g = torch.randn(10, 8, requires_grad=True)
    u = torch.randn(10, 8, requires_grad=True)

    def step():
        y = naive.clamped_swiglu(g, u, None)
        y.view(80).sum().backward()
        torch.mul(g.detach(), 2.0, out=torch.empty(10, 8, dtype=torch.bfloat16))   # read 320, written 160
        u.detach().to(torch.bfloat16)                                               # a cast: the same bytes

    r = traffic(step, 100)
    rows = {(x["phase"], x["op"], x["source"].split(" ")[0].rsplit(":", 1)[0]): x for x in r["rows"]}
    line = "kernels/swiglu/naive.py"
    assert rows[("fwd", "silu", line)]["bytes"] == 640 and rows[("fwd", "silu", line)]["kind"] == "other"
    assert rows[("fwd", "mul", line)]["bytes"] == 960
    bwd = [x for x in r["rows"] if x["phase"] == "bwd"]
    assert any(x["source"].startswith(line) and "[MulBackward0]" in x["source"] for x in bwd), bwd
    assert any("[SiluBackward0]" in x["source"] for x in bwd), bwd
    own = [x for x in r["rows"] if x["phase"] == "fwd" and x["op"] == "mul" and x["source"] == "(no repo frame)"]
    assert [x["bytes"] for x in own] == [480]
    cast = [x for x in r["rows"] if x["op"] == "_to_copy"]
    assert [(x["kind"], x["bytes"]) for x in cast] == [("copy", 480)]
    assert not any(x["op"] in ("view", "empty") for x in r["rows"])
    assert r["total"] == sum(x["bytes"] for x in r["rows"]) and set(r["by_kind"]) <= {"gemm", "copy", "other",
                                                                                       "kernel"}
