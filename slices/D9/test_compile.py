"""torch.compile of the DSv4 blocks (issue 12 §4): compiled == eager (loss and gradients), no graph break inside
a block, and compile composes with whole-block recompute (router counts once per step).

Compile time on the 2-core CPU machine bounds what is compiled here: Inductor on the whole debug model took
~100 s of CPU (370 s wall under load), one block ~11 s on the host of then (145 s scalar / 235 s vectorised on the
AVX2 CI host of 2026-12-01, below). So the Inductor test compiles the debug model's CSA
block (compressor, indexer, sparse attention, MoE, mHC: every op kind) inside the full model; the recompute
test and the Triton-backend test (interpreter) compile with `aot_eager` (same graphs, eager kernels). Both use hc_sinkhorn_iters=2 (the
Sinkhorn loop is unrolled into the graph; 20 iterations triple the trace) and the "dense" expert GEMM, the
static-shape variant ("loop" reads per-expert counts on the host, a graph break by design).
"""
from __future__ import annotations

from dsv4.kernels._testing import CUDA, use_interpreter

use_interpreter()

import os  # noqa: E402
import tempfile  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from dsv4.model import moe  # noqa: E402
from dsv4.model.config import get_config  # noqa: E402
from dsv4.model.model import DSv4Model  # noqa: E402

torch._inductor.config.compile_threads = 1        # no compile worker pool on the 2-core machine
# A private Inductor cache per test process: the shared /tmp/torchinductor_<user> cache is keyed on code and
# config, and kernels built by another process (another ATEN_CPU_CAPABILITY, another checkout) were seen to be
# loaded here and fail ("tuple args required") when two test runs overlapped.
os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="dsv4-inductor-")
# Under ATEN_CPU_CAPABILITY=default (a simulated host without AVX, harness/numerics.py) torch 2.13's Inductor still
# emits at::vec code that the headers then do not declare (CppCompileError "'at::vec' has not been declared"):
# compile scalar C++ there (simdlen 1 = no vectorisation), as ATen itself runs scalar kernels on such a host.
# Elsewhere on CPU too: the vectorised C++ of the one compiled block took 235 s to build on the 2-core CI host
# (AMD EPYC, AVX2; scalar: 145 s); the test asks whether Inductor's fused graph of our block matches eager, which
# the scalar code answers the same way (fusion and reduction reordering are decided before the C++ is emitted).
if not CUDA:
    torch._inductor.config.cpp.simdlen = 1


def _model(**over) -> DSv4Model:
    torch.manual_seed(0)
    return DSv4Model(get_config("debug", hc_sinkhorn_iters=2, **over)).train().set_expert_gemm("dense")


def _ids():
    return torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))


def _step(m):
    m.zero_grad(set_to_none=True)
    out = m(_ids(), labels=_ids())
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


def _counts(m):
    return [g.tokens_per_expert.clone() for g in m.modules() if isinstance(g, moe.Gate)]


def test_block_has_no_graph_break():
    m = _model()
    X = torch.randn(2, 24, m.cfg.hc_mult, m.cfg.hidden_size, requires_grad=True)
    for i, blk in enumerate(m.layers):
        ex = torch._dynamo.explain(blk)(X, _ids())                  # default layout: 2 documents of 24
        assert ex.graph_break_count == 0 and ex.graph_count == 1, (i, [b.reason for b in ex.break_reasons])


def test_debug_model_with_inductor_block_matches_eager():
    ref = _model()
    loss0, g0 = _step(ref)
    m = _model()
    m.layers[1].compile(backend="inductor", fullgraph=True)      # the CSA block; fullgraph: no break inside
    loss1, g1 = _step(m)
    # fp32, Inductor fuses and reorders reductions: measured |dloss| 9.5e-7 (loss ~5.5) and max |dgrad| 5.6e-8
    # (whole model, all blocks compiled); tolerances 10x those.
    torch.testing.assert_close(loss1, loss0, atol=1e-5, rtol=0)
    assert g1.keys() == g0.keys()
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], atol=6e-7, rtol=1e-4, msg=n)


def test_triton_block_compiles_as_opaque_custom_ops():
    """The Triton backend (CPU: the interpreter) under torch.compile: fullgraph (Dynamo never traces into Triton:
    the kernels are dsv4:: custom ops), aot_eager (the same kernels run) == eager Triton, bit for bit measured."""
    dev = "cuda" if CUDA else "cpu"
    m = _model().to(dev).set_kernel_backend("triton")
    blk = m.layers[1]                                               # CSA: every Triton op kind
    X = torch.randn(2, 12, m.cfg.hc_mult, m.cfg.hidden_size, device=dev, requires_grad=True)
    ids = _ids()[:, :12].to(dev)

    def run(f):
        blk.zero_grad(set_to_none=True)
        X.grad = None
        y = f(X, ids)                                      # default layout: 2 documents of 12
        y.square().sum().backward()
        # None -> 0: the compiled block also back-propagates zeros from its stashed indexer loss (unused here)
        return [y.detach(), X.grad] + [torch.zeros_like(p) if p.grad is None else p.grad for p in blk.parameters()]

    ref = run(blk)
    got = run(torch.compile(blk, backend="aot_eager", fullgraph=True))
    assert len(got) == len(ref)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=1e-6 if CUDA else 0, rtol=1e-5 if CUDA else 0)


def test_compiled_blocks_with_recompute_match_eager_and_count_once():
    over = dict(num_hidden_layers=1, compress_ratios=[4, 0])           # a CSA block and the MTP block
    ref = _model(**over)
    loss0, g0 = _step(ref)
    m = _model(**over).set_recompute(True).compile_blocks(backend="aot_eager", fullgraph=True)
    loss1, g1 = _step(m)
    # aot_eager runs the same ATen kernels as eager: measured bit-identical; 1e-6 relative leaves host margin
    torch.testing.assert_close(loss1, loss0, atol=0, rtol=1e-6)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], atol=1e-9, rtol=1e-6, msg=n)
    for a, b in zip(_counts(m), _counts(ref)):
        assert torch.equal(a, b)


def test_train_and_bench_have_compile_flags(tmp_path, monkeypatch):
    """`dsv4 train --compile` calls DSv4Model.compile_blocks (spied: a real Inductor compile of the debug model
    takes minutes on this CPU; the compiled math is checked above); `dsv4 bench train --compile` exists."""
    from click.testing import CliRunner

    from dsv4.harness.train.bench import bench_train_cmd
    from dsv4.harness.train.loop import train_cmd
    calls = []
    monkeypatch.setattr(DSv4Model, "compile_blocks", lambda self, **kw: calls.append(kw) or self)
    r = CliRunner().invoke(train_cmd, ["--recipe", "debug", "--steps", "1", "--compile", "--json",
                                       "--out", str(tmp_path / "run")])
    assert r.exit_code == 0, r.output
    assert calls == [{}]
    assert "--compile" in CliRunner().invoke(bench_train_cmd, ["--help"]).output


def test_train_cuda_graphs_needs_cuda(tmp_path, monkeypatch):
    """`dsv4 train --cuda-graphs`: on CPU one line naming the field, exit 2, nothing compiled or written (the CUDA run,
    compile_blocks(mode="reduce-overhead"), is measured on the H200 as `dsv4 bench train --impls ours_cudagraph`
    and the curve of harness/device/final_h200.sh)."""
    from click.testing import CliRunner

    from dsv4.harness.train import loop
    calls = []
    monkeypatch.setattr(DSv4Model, "compile_blocks", lambda self, **kw: calls.append(kw) or self)
    r = CliRunner().invoke(loop.train_cmd, ["--recipe", "debug", "--steps", "1", "--cuda-graphs",
                                            "--out", str(tmp_path / "run")])
    assert r.exit_code == 2, r.output
    assert "train.cuda_graphs" in r.output and "--device cuda" in r.output and calls == []
    assert len(r.output.strip().splitlines()) == 1 and not (tmp_path / "run").exists(), r.output
    with pytest.raises(loop.TrainError, match="cuda_graphs"):
        loop.train(loop.Recipe(**{**loop.asdict(loop.RECIPES["debug"]), "steps": 1, "cuda_graphs": True}),
                   str(tmp_path / "run2"), progress=False)


def test_blocks_of_one_kind_share_one_compiled_graph():
    """Four CSA layers (layer 0 hash-routed) and the MTP block compile to 3 graphs: hash CSA, score CSA (layers
    1-3 share it) and MTP. Each block gets its own empty loss container (model.run_block) and the attention
    does not read its layer index, so nothing per-layer is guarded; before, the shared container's length
    and the layer index forced one recompile per layer (and eager fall-back past Dynamo's cache limit of 8)."""
    from torch._dynamo.testing import CompileCounter
    torch._dynamo.reset()
    m = _model(num_hidden_layers=4, compress_ratios=[4, 4, 4, 4, 0])
    cnt = CompileCounter()
    m.compile_blocks(backend=cnt, fullgraph=True)
    for _ in range(2):                                   # a second step compiles nothing new
        _step(m)
    assert cnt.frame_count == 3, cnt.frame_count
    torch._dynamo.reset()


def test_expert_counts_compile_without_the_sort_based_index_put():
    """Inductor has no int64 atomic add, so an int64 index_add in a compiled block falls back to ATen's index_put
    (on CUDA a sort of the indices: `indexing_backward_kernel_stride_1<long>`, 0.67 ms a 4K CUDA-graph step at
    69c89cb). expert_counts sums in int32: the scatter is fused into an Inductor kernel; the same counts as
    bincount (ties, empty experts)."""
    from torch._inductor.utils import run_and_get_code
    idx = torch.tensor([[0, 3], [3, 5], [5, 3], [0, 1]])                   # expert 2, 4, 6, 7 empty
    det = torch.are_deterministic_algorithms_enabled()   # the tests' contract turns it on; Inductor then falls back
    torch.use_deterministic_algorithms(False)            # to index_put for every accumulate, int32 or not (the bench
    try:                                                 # runs without it)
        f = torch.compile(moe.expert_counts, fullgraph=True, backend="inductor")
        got, (code, *_) = run_and_get_code(f, idx, 8)
    finally:
        torch.use_deterministic_algorithms(det)
    assert torch.equal(got, torch.bincount(idx.reshape(-1), minlength=8)) and got.dtype == torch.long
    assert "aten.index_put" not in code              # the scatter inside an Inductor kernel, no ATen fallback
