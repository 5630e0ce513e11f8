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

# relative to max(1, max |ref|): measured worst 4.1e-7 (MKL_CBWR=COMPATIBLE; 3.8e-7 under ATEN default+CBWR+DNNL
# SSE41, 2.1e-7 natively) over the 11 simulated hosts of harness/numerics.py; the old 1e-6 left x2.4 -> 3e-6 (x7)
TOL = 3e-6
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
@pytest.mark.parametrize("counts,static,megatron,capacity", [([7, 12], None, "ep", None), ([3, 11, 1, 6], 16, None, 24)],
                         ids=["ep2-megatron-max", "ep4-world-static16-cap24"])
def test_ep_equals_single_rank(counts, static, megatron, capacity):
    if megatron:
        from megatron.core import parallel_state  # noqa: F401  (imported once; forked ranks inherit it)
    per_rank = spawn(ep_worker, len(counts), counts, LAYERS, static, megatron, capacity)
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


def test_capacity_overflow_raises_on_every_rank():
    """A capacity below what a rank needs is refused on all ranks together (no rank left hanging)."""
    with pytest.raises(Exception, match="capacity"):
        spawn(ep_worker, 2, [7, 12], [1], None, None, 2)


def test_ep_model_packed_batches_of_different_lengths():
    """EP = 2 through the whole debug model (training mode, hash + score MoE layers, MTP): the two ranks feed
    packed THD batches of DIFFERENT lengths (29 and 17 tokens); each rank's logits and loss equal the
    single-rank packed run of its batch, and the expert / router gradients summed over ranks equal the sum of
    the two single-rank gradients."""
    from dsv4.slices.D8._workers import build_debug_model, ep_model_worker, packed_batch
    lens_per_rank = [[6, 21, 2], [9, 3, 5]]
    res = spawn(ep_model_worker, 2, lens_per_rank)
    model = build_debug_model(train=True)
    loss_sum = 0.0
    for r, lens in enumerate(lens_per_rank):
        cu, cup, T, seg, ids, labels = packed_batch(lens, lens, model.cfg.vocab_size)
        out = model(ids, labels, cu_seqlens=cu, cu_seqlens_padded=cup)
        e = (out.logits[0].detach() - res[r]["logits"]).abs().max().item()
        assert e <= 1e-5, (r, e)                                                 # measured 3.1e-7 (11 hosts), x32
        assert abs(out.loss.item() - res[r]["loss"].item()) <= 1e-5             # measured 9.5e-7 (11 hosts), x10
        loss_sum = loss_sum + out.loss
    loss_sum.backward()
    worst = 0.0
    for n, p in model.named_parameters():
        ref = p.grad if p.grad is not None else torch.zeros_like(p)
        e = (res[0]["grads"][n] - ref).abs().max().item() / max(1.0, ref.abs().max().item())
        assert e <= 1e-5, (n, e)                                                 # measured 5.2e-7 (11 hosts), x19
        worst = max(worst, e)
    print(f"EP=2 whole model, batches of 29 / 17 tokens: grads (rel) {worst:.2e}")
