"""X3: `parallelize(model, mesh, plan)` over gloo CPU processes == one rank.

Each mesh shape trains the `debug` model (fp32, seeded, non-trivial mHC biases / sinks / ape) for 2 steps on a
global batch [4, 16] with the harness's optimiser (Muon + AdamW unless noted); the oracle is the same step
code on the plain model in this process (`single`). Compared: every step's metrics, the first step's gradient
of every parameter the rank holds (FSDP shards gathered), and the Muon-updated matrices after the first step.

Tolerances (fp32; measured worst over all shapes below on this 2-core host):
  LOSS_TOL  3e-5  metrics incl. grad-norm, both steps: measured 5.3e-6 (pp2_ep2; 2.8e-6 for the others), x5.7
  GRAD_TOL  5e-7  step-1 gradients: measured 4.4e-8 (dp2_cp2; reduce / accumulation order), x11
  MUON_TOL  2e-4  Muon matrices after step 1: measured 3.8e-5 (dp2_ep2), x5.2. The update is ~6e-3 per entry,
                  so this is a 3% bound, set by Newton–Schulz, not by the sharding: the quintic step's slope at
                  small singular values is 3.4445, so 8 steps amplify a relative gradient difference of 1e-6
                  (the 1e-9 reduce-order differences) by up to ~2e4 in the directions of small singular values.
                  The sharded Muon step itself is checked BIT-EQUAL on identical gradients
                  (test_dp2_muon_step_is_the_one_rank_step).
AdamW parameters are not compared after a step: Adam's first update is ~lr * sign(g), so parameters whose
gradient is ~0 (mHC base terms) flip by 2 lr on 1e-8 differences; their gradients are compared instead.
"""
import pytest
import torch

from dsv4.harness.train.optim import build_optimizer, param_group_of
from dsv4.model.config import get_config
from dsv4.model.parallel import ParallelPlan, PlanError, single
from dsv4.slices.X3 import _workers as W

B, S, STEPS = 4, 16, 2
LOSS_TOL, GRAD_TOL, MUON_TOL = 3e-5, 5e-7, 2e-4
L4 = dict(num_hidden_layers=4, compress_ratios=[0, 4, 16, 0, 0])          # 4 layers: pp2 x vpp2 chunks

CASES = {                                                                  # id: (world, plan, config overrides)
    "dp2": (2, dict(dp=2), {}),
    "pp2_1f1b": (2, dict(pp=2, schedule="1f1b", microbatches=2), {}),
    "pp2_gpipe": (2, dict(pp=2, schedule="gpipe", microbatches=2), {}),
    "pp2_vpp2": (2, dict(pp=2, vpp=2, schedule="interleaved1f1b", microbatches=2), L4),
    "cp2": (2, dict(cp=2), dict(seq_aux_loss_coeff=0.0)),                 # CP: the chunk is the MoE "sequence"
    "ep2": (2, dict(ep=2), {}),
    "dp2_pp2": (4, dict(dp=2, pp=2, schedule="1f1b", microbatches=2), {}),
    "dp2_cp2": (4, dict(dp=2, cp=2), dict(seq_aux_loss_coeff=0.0)),
    "dp2_ep2": (4, dict(dp=2, ep=2), {}),
    "pp2_ep2": (4, dict(pp=2, ep=2, schedule="1f1b", microbatches=2), {}),
}


_ORACLES: dict = {}


def _oracle(cfg_kw, optimizer):
    key = (tuple(sorted((k, str(v)) for k, v in cfg_kw.items())), optimizer)
    if key not in _ORACLES:
        model = W.build(**cfg_kw)
        par = single(model)
        opt = build_optimizer(W._ParamsView(par), lr=1e-2, muon=optimizer == "muon")
        _ORACLES[key] = W.train_steps(par, opt, W.batches(model.cfg, B, S, STEPS))
    return _ORACLES[key]


def _errors(res, cfg_kw, optimizer="muon"):
    hist, grads, params = _oracle(cfg_kw, optimizer)
    e_loss = max(abs(r["hist"][s][k] - hist[s][k]) for r in res for s in range(STEPS) for k in hist[s])
    e_grad, e_muon, seen = 0.0, 0.0, set()
    for r in res:
        assert set(r["hist"][0]) == set(hist[0]), "the same metrics on every rank"
        for n, g in r["grads"].items():
            seen.add(n)
            ref = grads[n]
            if ref is None or g is None:
                assert ref is None and g is None, n
                continue
            e_grad = max(e_grad, (g - ref).abs().max().item())
        for n, p in r["params"].items():
            if optimizer == "muon" and param_group_of(n, p) == "muon":
                e_muon = max(e_muon, (p - params[n]).abs().max().item())
    assert seen == set(grads), f"parameters held by no rank: {sorted(set(grads) - seen)[:3]}"
    return e_loss, e_grad, e_muon


@pytest.mark.parametrize("case", list(CASES))
def test_mesh_equals_one_rank(case):
    world, plan, cfg_kw = CASES[case]
    res = W.spawn(W.plan_worker, world, plan, cfg_kw, B, S, STEPS, "muon")
    e_loss, e_grad, e_muon = _errors(res, cfg_kw)
    print(f"{case}: loss {e_loss:.2e} grad {e_grad:.2e} muon {e_muon:.2e}")
    if plan.get("ep", 1) > 1:                    # each ep rank stores only its experts (Shard(0) over ep)
        E = get_config("debug").n_routed_experts
        for r in res:
            rows = r["ep_local_rows"]
            assert rows and all(n.endswith(("experts.w13", "experts.w2")) for n in rows), rows
            assert set(rows.values()) == {E // plan["ep"]}, rows
    assert e_loss <= LOSS_TOL and e_grad <= GRAD_TOL and e_muon <= MUON_TOL, (e_loss, e_grad, e_muon)


def test_dp2_muon_step_is_the_one_rank_step():
    """FSDP2 shards, the same seeded gradients, 2 optimizer steps (Muon gathers each update, NS on the whole
    matrix, keeps its shard; AdamW on shards): every parameter bit-equal to the unsharded step."""
    res = W.spawn(W.muon_step_worker, 2)
    par = single(W.build())
    opt = build_optimizer(W._ParamsView(par), lr=1e-2)
    for k in range(2):
        W.seeded_grads(list(par.named_parameters()), seed=7 + k)
        opt.step()
    ref = W.params_of(par)
    for r in res:
        bad = [n for n, p in r["params"].items() if not torch.equal(p, ref[n])]
        assert not bad, bad[:5]


def test_dp2_adamw_equals_one_rank():
    res = W.spawn(W.plan_worker, 2, dict(dp=2), {}, B, S, STEPS, "adamw")
    e_loss, e_grad, _ = _errors(res, {}, "adamw")
    print(f"dp2 adamw: loss {e_loss:.2e} grad {e_grad:.2e}")
    assert e_loss <= LOSS_TOL and e_grad <= GRAD_TOL, (e_loss, e_grad)


@pytest.mark.parametrize("plan,world,msg", [
    (dict(dp=2), 4, "does not equal the world size 4"),
    (dict(pp=2), 2, "needs an explicit schedule"),
    (dict(pp=2, vpp=2, schedule="1f1b"), 2, "interleaved1f1b needs vpp >= 2"),
    (dict(pp=4, schedule="gpipe", microbatches=4), 4, "cannot split num_hidden_layers=3"),
    (dict(ep=3), 3, "n_routed_experts=8 is not divisible by ep=3"),
    (dict(pp=2, schedule="1f1b", microbatches=1), 2, "1f1b needs >= pp = 2 micro-batches"),
    (dict(cp=2, ep=2), 4, "is not implemented"),
    (dict(pp=2, cp=2, schedule="1f1b", microbatches=2), 4, "is not implemented"),
    (dict(dp=3), 3, "batch_size=4 is not divisible by dp"),
])
def test_plan_refusals(plan, world, msg):
    with pytest.raises(PlanError, match=msg) as e:
        ParallelPlan(**plan).validate(get_config("debug"), world, B, S)
    assert "\n" not in str(e.value)


def test_killed_rank_is_an_error_not_a_hang():
    """Rank 1 dies before a collective; rank 0's all_reduce fails (gloo: peer closed) well inside the timeout."""
    res = W.spawn(W.dead_peer_worker, 2)
    assert res[0]["error"] and res[0]["seconds"] < W.TIMEOUT_S, res[0]


def test_stuck_rank_times_out_on_mesh_groups():
    """A live rank that never joins: the mesh group's collective fails after its 3 s timeout."""
    res = W.spawn(W.stuck_peer_worker, 2)
    assert res[0]["error"] and 2.5 < res[0]["seconds"] < 8.0, res[0]


def test_dp2_fsdp_bf16_equals_p1_bf16_cast():
    """FSDP2's own mixed precision (bf16 all-gather / compute, FP32 reduce) with P1's FP32-kept parameters left
    out of FSDP == the one-rank P1 bf16 cast of the same weights (model.to_bf16()), one forward + backward.
    Tolerances: losses 5e-6 (measured 4.8e-7: fp32 reductions of bf16 terms in another order, x10);
    gradients 2e-2 of each tensor's largest entry (measured 5.9e-3: the one-rank gradients are bf16-rounded
    whole-batch sums, FSDP's are fp32 means of bf16 half-batch gradients; bf16 ulp = 2^-8 = 3.9e-3, x3.4)."""
    from dsv4.model.precision import fp32_kept_names
    res = W.spawn(W.fsdp_bf16_worker, 2)
    model = W.build().to_bf16()
    met = single(model).forward_backward(*W.batches(model.cfg, B, S, 1)[0])
    ref = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
    kept = set(fp32_kept_names(model))
    for r in res:
        assert max(abs(r["metrics"][k] - met[k]) for k in met) <= 5e-6, (r["metrics"], met)
        assert set(r["grads"]) == set(ref)
        assert set(r["kept"]) <= kept and len(r["kept"]) > 0                 # FP32-kept: outside FSDP, FP32
        assert all(r["dtypes"][n] == "torch.float32" for n in r["kept"])
        worst = max(((r["grads"][n].float() - g).abs().max() / g.abs().max().clamp_min(1e-30)).item()
                    for n, g in ref.items())
        assert worst <= 2e-2, worst
