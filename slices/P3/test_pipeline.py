"""P3: mHC pipeline / virtual-pipeline stages (model/pipeline.py over model/parallel/pipeline.py).

Oracle: the same DSv4Model with the same weights run whole in this process (gradient accumulation over the same
micro-batches, objective / M). The pipelined runs -- torch.distributed.pipelining through `parallelize`: PP=2
with Schedule1F1B and ScheduleGPipe, PP=2 x VPP=2 with ScheduleInterleaved1F1B, over 2 gloo processes; and
the one-process reference `run_local` -- must give the same metrics and every parameter gradient within 1e-6
(fp32), and every tensor crossing a stage boundary must be the n_hc streams [B, S, n_hc, d].
"""
import pytest
import torch

from dsv4.model import pipeline as P
from dsv4.model.config import ConfigError
from dsv4.model.hybrid import parse_pattern
from dsv4.model.model import DSv4Model

PAT_PP2 = "WEC-|HEW-/WE"           # 4 main layers in 2 stages, MTP (W + MoE) on the last stage
PAT_VPP = "WE|C-|HE|W-/WE"         # the same model in 4 chunks: PP=2 x VPP=2
B, S, M = 2, 13, 2                 # odd S; M micro-batches (a multiple of pp for VPP)
# measured worst over harness/numerics.py's 11 simulated hosts (native, ATEN default/avx2/avx512,
# MKL_CBWR=COMPATIBLE/AVX2, MKL_ENABLE_INSTRUCTIONS=SSE4_2/AVX2, DNNL_MAX_CPU_ISA=AVX2, 2 combinations):
# grads 1.5e-8 (x67), metrics 1.8e-7 (x5.6)
GRAD_TOL = 1e-6                    # max |grad_pipe - grad_whole| per tensor, fp32
LOSS_TOL = 1e-6                    # per metric (averages of fp32 scalars, summed in fp64)


def _cfg(pattern=PAT_PP2):
    return parse_pattern(pattern, base="debug").cfg


def _weights(cfg, seed=0):
    torch.manual_seed(seed)
    m = DSv4Model(cfg)
    with torch.no_grad():                       # non-zero mHC biases: non-uniform mixing, distinct streams
        for n, p in m.named_parameters():
            if "hc_" in n and "base" in n:
                p.add_(torch.randn(p.shape) * 0.5)
    return {k: v.clone() for k, v in m.state_dict().items()}


def _batches(cfg, m=M, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(m):
        ids = torch.randint(0, cfg.vocab_size, (B, S), generator=g)
        labels = torch.randint(0, cfg.vocab_size, (B, S), generator=g)
        labels[0, 4] = labels[1, -2] = -100
        out.append((ids, labels))
    return out


def _whole(cfg, sd, batches):
    """The oracle: the model run whole; metrics averaged over micro-batches; grads of (loss / M) summed."""
    model = DSv4Model(cfg)
    model.load_state_dict(sd)
    met = {}
    for ids, labels, *lay in batches:                 # (ids, labels[, layout])
        out = model(ids, labels, layout=lay[0] if lay else None)
        (out.loss / len(batches)).backward()
        for k, v in list(out.losses.items()) + [("loss", out.loss.detach())]:
            met[k] = met.get(k, 0.0) + v.item() / len(batches)
    return met, {n: p.grad for n, p in model.named_parameters()}


def _compare(met, grads, ref_met, ref_grads):
    assert set(met) == set(ref_met), (set(met), set(ref_met))
    for k in ref_met:
        assert abs(met[k] - ref_met[k]) <= LOSS_TOL, (k, met[k], ref_met[k])
    assert set(grads) == set(ref_grads)
    worst = 0.0
    for n, g in ref_grads.items():
        assert (grads[n] is None) == (g is None), n
        if g is not None:
            d = (grads[n] - g).abs().max().item()
            assert d <= GRAD_TOL, (n, d)
            worst = max(worst, d)
    return worst


@pytest.fixture(scope="module")
def setup():
    cfg = _cfg()
    assert _cfg(PAT_VPP) == cfg
    sd, batches = _weights(cfg), _batches(cfg)
    ref_met, ref_grads = _whole(cfg, sd, batches)
    assert {"lm loss", "mtp_1 loss", "indexer loss", "moe aux loss"} <= set(ref_met)   # every loss term is live
    return cfg, sd, batches, ref_met, ref_grads


@pytest.fixture(scope="module")
def gloo_results(setup):
    from dsv4.slices.P3._workers import pipeline_worker, spawn
    cfg, sd, batches, _, _ = setup
    return spawn(pipeline_worker, 2, cfg, sd, batches,
                 [(PAT_PP2, 1, "1f1b"), (PAT_PP2, 1, "gpipe"), (PAT_VPP, 2, "interleaved1f1b")])


def _merge(per_rank):
    grads = {}
    for r in per_rank:
        for n, g in r["grads"].items():
            if n in grads:                      # the shared embedding: both copies must agree after all-reduce
                assert torch.equal(grads[n], g), n
            grads[n] = g
    return grads


@pytest.mark.parametrize("run,vpp", [(0, 1), (1, 1), (2, 2)], ids=["pp2_1f1b", "pp2_gpipe", "pp2_vpp2"])
def test_gloo_matches_whole_model(setup, gloo_results, run, vpp):
    cfg, _, _, ref_met, ref_grads = setup
    per_rank = [res[run] for res in gloo_results]
    assert [r["chunks"] for r in per_rank] == ([[0], [1]] if vpp == 1 else [[0, 2], [1, 3]])
    for r in per_rank:
        assert r["metrics"] == per_rank[0]["metrics"]            # reduced over the ranks
    grads = _merge(per_rank)
    _compare(per_rank[0]["metrics"], grads, ref_met, ref_grads)
    # MTP on the last stage is live: its loss is reported and its block, e_proj / h_proj and the shared
    # embedding (through Embed(ids_next)) receive non-zero gradients equal to the whole model's
    assert per_rank[1]["metrics"]["mtp_1 loss"] > 0
    for n in ("mtp.0.e_proj.weight", "mtp.0.h_proj.weight", "mtp.0.hc_head_fn", "mtp.0.attn.wq_a.weight"):
        assert grads[n].abs().max() > 0, n
    # what crossed the boundaries: only the n_hc streams (forward; the PipelineStage's gradient buffers take
    # the same static shape, model/parallel/pipeline.stage_io)
    streams = (B, S, cfg.hc_mult, cfg.hidden_size)
    log = [e for r in per_rank for e in r["log"]]
    boundaries = 2 * vpp - 1
    assert sorted(d for d, _ in log) == ["recv"] * (M * boundaries) + ["send"] * (M * boundaries)
    assert all(s == streams for _, s in log), {s for _, s in log}
    assert cfg.hc_mult > 1


@pytest.mark.parametrize("pattern,pp,vpp,m", [(PAT_PP2, 2, 1, 2), (PAT_VPP, 2, 2, 4), (PAT_VPP, 4, 1, 2)])
def test_local_matches_whole_model(setup, pattern, pp, vpp, m):
    cfg, sd, _, _, _ = setup
    batches = _batches(cfg, m, seed=2)
    ref_met, ref_grads = _whole(cfg, sd, batches)
    model = DSv4Model(cfg)
    model.load_state_dict(sd)
    chunks = P.split_stages(model, pattern)
    met = P.run_local(chunks, batches, pp, vpp)
    _compare(met, {n: p.grad for n, p in model.named_parameters()}, ref_met, ref_grads)


def test_local_recompute_matches_whole_model(setup):
    """Whole-block recompute inside the chunks (the model's `set_recompute`) == the whole model."""
    cfg, sd, batches, ref_met, ref_grads = setup
    model = DSv4Model(cfg)
    model.load_state_dict(sd)
    model.set_recompute(True)
    met = P.run_local(P.split_stages(model, PAT_PP2), batches, 2)
    _compare(met, {n: p.grad for n, p in model.named_parameters()}, ref_met, ref_grads)


def test_local_packed_layout_matches_whole_model(setup):
    """Packed micro-batches (a Layout per micro-batch: documents in one row) through the pipeline == the whole
    model on the same layouts: the stages run the same layout-driven attention and the one loss assembler."""
    from dsv4.model.layout import Layout
    cfg, sd, _, _, _ = setup
    g = torch.Generator().manual_seed(4)
    T = B * S
    batches = []
    for cu, cup in (([0, 5, 19, T - 2], [0, 6, 21, T]), ([0, 11, T], None)):
        ids = torch.randint(0, cfg.vocab_size, (1, T), generator=g)
        labels = torch.randint(0, cfg.vocab_size, (1, T), generator=g)
        batches.append((ids, labels, Layout.packed(torch.tensor(cu), (1, T), None if cup is None else torch.tensor(cup))))
    ref_met, ref_grads = _whole(cfg, sd, batches)
    model = DSv4Model(cfg)
    model.load_state_dict(sd)
    met = P.run_local(P.split_stages(model, PAT_PP2), batches, 2, 1)
    _compare(met, {n: p.grad for n, p in model.named_parameters()}, ref_met, ref_grads)


def test_collapsed_hidden_state_is_refused(setup):
    """A stage that sends one hidden state [B, S, d] (streams collapsed) instead of [B, S, n, d] must fail."""
    cfg, sd, batches, _, _ = setup
    model = DSv4Model(cfg)
    model.load_state_dict(sd)
    chunks = P.split_stages(model, PAT_PP2)
    fwd = chunks[0].forward
    chunks[0].forward = lambda x, input_ids, labels, layout=None: fwd(x, input_ids, labels, layout).mean(2)  # test
    with pytest.raises(ValueError, match=r"streams shape \[B, S, n_hc, d\]"):
        P.run_local(chunks, batches, 2)
    from dsv4.model.parallel.pipeline import stage_io
    inp, out = stage_io(P.split_stages(model, PAT_PP2)[1], B, S, torch.float32, "cpu")
    assert inp.shape == (B, S, cfg.hc_mult, cfg.hidden_size) and inp.requires_grad and out.shape == ()


def test_stage_ownership(setup):
    cfg, sd, _, _, _ = setup
    model = DSv4Model(cfg)
    chunks = P.split_stages(model, PAT_VPP)
    assert [c.layer_ids for c in chunks] == [[0], [1], [2], [3]]
    names = [{n for n, _ in c.named_parameters()} for c in chunks]
    layer = lambda ns: {n.split(".")[1] for n in ns if n.startswith("layers.")}   # noqa: E731
    assert [layer(ns) for ns in names] == [{"0"}, {"1"}, {"2"}, {"3"}]
    top = [{n for n in ns if not n.startswith("layers.")} for ns in names]
    assert top[0] == {"embed.weight"}
    assert top[1] == top[2] == set()
    last_top = {n for n in top[3] if not n.startswith("mtp.")}
    assert last_top == {"embed.weight", "norm.weight", "head.weight", "hc_head_fn", "hc_head_base", "hc_head_scale"}
    assert any(n.startswith("mtp.0.") for n in top[3])
    # the chunks together hold every parameter of the model, under its own names, as the same objects
    full = dict(model.named_parameters())
    for c in chunks:
        for n, p in c.named_parameters():
            assert full[n] is p, n
    assert set().union(*names) == set(full)
    # interleaved ownership: rank r holds chunks r, r + pp
    assert list(P.chunks_of_rank(chunks, 0, 2)) == [0, 2] and list(P.chunks_of_rank(chunks, 1, 2)) == [1, 3]
    # without MTP the last stage has no embedding copy
    no_mtp = DSv4Model(_cfg("WEC-|HEW-"))
    last = P.split_stages(no_mtp, "WEC-|HEW-")[-1]
    assert not hasattr(last, "embed") and len(last.mtp) == 0


def test_stage_refusals(setup):
    cfg, _, _, _, _ = setup
    model = DSv4Model(cfg)
    with pytest.raises(ConfigError, match="contiguously"):
        P.split_stages(model, [[0, 2], [1, 3]])
    with pytest.raises(ConfigError, match="contiguously"):
        P.split_stages(model, [[0, 1], [2]])
    with pytest.raises(ConfigError, match="hash layers"):
        P.split_stages(DSv4Model(cfg.replace(num_hash_layers=2)), [[0], [1, 2, 3]])
    with pytest.raises(ConfigError, match="multiple of pipeline size"):
        P.chunks_of_rank(P.split_stages(model, PAT_VPP), 0, 3)
    assert P.even_stages(4, 3) == [[0, 1], [2], [3]]


def test_schedules_are_torch_pipelining():
    """The plan's schedule names map to torch.distributed.pipelining's schedules (no home-made executor)."""
    import importlib
    import inspect
    from torch.distributed import pipelining
    par_mod = importlib.import_module("dsv4.model.parallel.parallelize")
    src = inspect.getsource(par_mod._schedule)
    for name in ("ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B"):
        assert hasattr(pipelining, name) and name in src
    assert not hasattr(P, "build_schedule") and not hasattr(P, "P2PTransport")


def test_local_bf16_streams(setup):
    """bf16 model: the streams cross in bf16; every gradient is bit-equal to the whole model's except the shared
    embedding, whose contributions (chunk 0 and MTP, per micro-batch) are summed in another order in bf16:
    there |diff| <= 2 bf16 ulps of the row's largest entry."""
    cfg, sd, batches, _, _ = setup
    whole, piped = DSv4Model(cfg), DSv4Model(cfg)
    whole.load_state_dict(sd)
    piped.load_state_dict(sd)
    whole.to_bf16()
    piped.to_bf16()
    for ids, labels in batches:
        (whole(ids, labels).loss / len(batches)).backward()
    P.run_local(P.split_stages(piped, PAT_PP2), batches, 2, 1)                  # checks bf16 streams
    for (n, a), (_, b) in zip(whole.named_parameters(), piped.named_parameters()):
        assert (a.grad is None) == (b.grad is None), n
        if a.grad is None:
            continue
        if n == "embed.weight":
            ulp = a.grad.float().abs().amax(1, keepdim=True) * 2.0 ** -7                      # [V, 1]
            assert ((a.grad.float() - b.grad.float()).abs() <= 2 * ulp).all(), n
        else:
            assert torch.equal(a.grad, b.grad), n
