"""P10: variable-token expert-parallel MoE dispatch (EP = 2 and 4, gloo all_to_all) == the single-rank MoE.

Ranks hold different numbers of tokens (padded to a static count inside the dispatcher). Oracle: the
`model.moe.MoE` layer run once on all tokens in this process. Routing identical (exact), outputs and
gradients <= 1e-6 (fp32; relative to max(1, max |reference|) per tensor), for a hash-routed layer (0) and a score-routed layer (1) of the debug config.
"""
import pytest
import torch

from dsv4.model.config import get_config
from dsv4.model.moe import MoE
from dsv4.slices.D8._workers import ep_worker, randomize, spawn

TOL = 1e-6
LAYERS = [0, 1]


def _oracle(layer, n_all):
    cfg = get_config("debug")
    torch.manual_seed(0)
    moe = MoE(cfg, layer)
    randomize(moe, seed=3, std=0.1)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, n_all, cfg.hidden_size, generator=g).requires_grad_()
    ids = torch.randint(0, cfg.vocab_size, (1, n_all), generator=g)
    r = torch.randn(1, n_all, cfg.hidden_size, generator=g)
    y = moe(x, ids)
    _, idx, _ = moe.gate(x.detach()[0], ids)
    (y * r).sum().backward()
    return y.detach()[0], idx, x.grad[0], {n: p.grad for n, p in moe.named_parameters()}


# (counts per rank, static token count or None = max over ranks, Megatron EP group or plain WORLD)
@pytest.mark.parametrize("counts,static,megatron", [([7, 12], None, "ep"), ([3, 11, 1, 6], 16, None)],
                         ids=["ep2-megatron-max", "ep4-world-static16"])
def test_ep_equals_single_rank(counts, static, megatron):
    if megatron:
        from megatron.core import parallel_state  # noqa: F401  (imported once; forked ranks inherit it)
    per_rank = spawn(ep_worker, len(counts), counts, LAYERS, static, megatron)
    for i, layer in enumerate(LAYERS):
        y_ref, idx_ref, xg_ref, g_ref = _oracle(layer, sum(counts))
        idx = torch.cat([r[i]["idx"] for r in per_rank])
        assert torch.equal(idx, idx_ref)                                        # identical routing
        y = torch.cat([r[i]["y"] for r in per_rank])
        xg = torch.cat([r[i]["x_grad"] for r in per_rank])
        e_y = (y - y_ref).abs().max().item() / max(1.0, y_ref.abs().max().item())
        e_x = (xg - xg_ref).abs().max().item() / max(1.0, xg_ref.abs().max().item())
        assert e_y <= TOL and e_x <= TOL, (layer, e_y, e_x)
        for n, g in per_rank[0][i]["grads"].items():
            e = (g - g_ref[n]).abs().max().item() / max(1.0, g_ref[n].abs().max().item())
            assert e <= TOL, (layer, n, e)
        print(f"EP={len(counts)} layer {layer}: max |dy| {e_y:.2e}, |dx grad| {e_x:.2e}, "
              f"|y| max {y_ref.abs().max().item():.2f}")
