"""D9 optimiser recipe (spec §10.4): hybrid Newton–Schulz, Muon step, parameter groups, LR schedule."""
import math

import pytest
import torch

from dsv4.harness.train.optim import (NS_STEPS, Muon, build_optimizer, hybrid_newton_schulz, lr_at, param_group_of)

SHAPES = [(64, 64), (32, 128), (128, 32), (7, 13), (100, 100), (3, 5, 17)]   # incl. odd and batched [E, n, m]


def _svals(X):
    return torch.linalg.svdvals(X.double())


@pytest.mark.parametrize("shape", SHAPES)
def test_hybrid_ns_singular_values(shape):
    g = torch.Generator().manual_seed(sum(shape))
    G = torch.randn(*shape, generator=g, dtype=torch.float64)
    s = _svals(hybrid_newton_schulz(G, dtype=torch.float64))
    # measured: [1.00000, 1.00054] for Gaussian matrices -> the honest claim is "within 1e-3 of 1"
    assert s.min() > 1 - 1e-3 and s.max() < 1 + 1e-3, (s.min().item(), s.max().item())
    # the first 8 steps alone leave them spread in about [0.68, 1.14]; the last 2 polish them
    s8 = _svals(hybrid_newton_schulz(G, steps=NS_STEPS[:8], dtype=torch.float64))
    assert 0.6 < s8.min() < 0.9 and 1.05 < s8.max() < 1.2
    # fp32 gives the same bound; the singular vectors are those of G (polar factor U V^T)
    s32 = _svals(hybrid_newton_schulz(G.float()))
    assert (s32 - 1).abs().max() < 1e-3                                  # algorithmic; measured 5.0e-4 (11 hosts)
    U, _, Vh = torch.linalg.svd(G, full_matrices=False)
    assert (hybrid_newton_schulz(G, dtype=torch.float64) - U @ Vh).abs().max() < 2e-3   # algorithmic; 2e-4 measured


def test_hybrid_ns_bf16_and_ill_conditioned_bounds():
    G = torch.randn(256, 512, generator=torch.Generator().manual_seed(0))
    s = _svals(hybrid_newton_schulz(G, dtype=torch.bfloat16))
    assert (s - 1).abs().max() < 1e-2                                    # measured 6.2-6.3e-3 in bf16 (11 hosts)
    # directions with sigma_i / ||G||_F below ~1e-5 are NOT driven to 1 in 10 steps (measured 0.42 at 5.5e-6)
    U, _, Vh = torch.linalg.svd(torch.randn(64, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(1)))
    S = torch.logspace(0, -5, 64, dtype=torch.float64)
    s = _svals(hybrid_newton_schulz(U @ torch.diag(S) @ Vh, dtype=torch.float64))
    assert s.min() < 0.9 and s.max() < 1.003


def test_muon_step_matches_oracle():
    torch.manual_seed(0)
    W0 = torch.randn(12, 20, dtype=torch.float64)
    grads = [torch.randn(12, 20, dtype=torch.float64) for _ in range(3)]
    p = torch.nn.Parameter(W0.clone())
    opt = Muon([p], lr=0.05, momentum=0.95, weight_decay=0.1, ns_dtype=torch.float64)
    # oracle written from §10.4 independently (plain loop, own NS)
    W, M = W0.clone(), torch.zeros_like(W0)

    def ns(X):
        X = X / X.norm()                                                 # 12 x 20: already wide
        for a, b, c in [(3.4445, -4.7750, 2.0315)] * 8 + [(2, -1.5, 0.5)] * 2:
            A = X @ X.T
            X = a * X + (b * A + c * A @ A) @ X
        return X
    for G in grads:
        p.grad = G.clone()
        opt.step()
        M = 0.95 * M + G
        O = ns(0.95 * M + G) * math.sqrt(20) * 0.18
        W = W * (1 - 0.05 * 0.1) - 0.05 * O
    # the code adds eps=1e-7 to the norm; measured 4.9e-9 (11 hosts), x20
    assert (p.detach() - W).abs().max() < 1e-7
    # update RMS is 0.18: 12 unit singular values -> ||O'||_F^2 = 12; x sqrt(20) * 0.18 over 240 entries
    O = hybrid_newton_schulz(grads[0]) * math.sqrt(20) * 0.18
    assert abs(O.pow(2).mean().sqrt().item() - 0.18) < 0.18 * 1e-3    # NS singular values within 1e-3: 4.7e-5 measured


def test_parameter_groups_on_the_model():
    from dsv4.model.config import get_config
    from dsv4.model.model import DSv4Model
    m = DSv4Model(get_config("debug"))
    opt = build_optimizer(m, lr=1e-3)
    where = {n: g for g, ns in opt.names.items() for n in ns}
    assert set(where) == {n for n, _ in m.named_parameters()}            # every parameter exactly once
    assert sum(len(v) for v in opt.names.values()) == len(list(m.parameters()))
    expect = {"embed.weight": "adamw_embedding", "head.weight": "adamw_head", "norm.weight": "adamw_norm",
              "layers.0.attn_norm.weight": "adamw_norm", "layers.0.attn.q_norm.weight": "adamw_norm",
              "layers.1.attn.compressor.norm.weight": "adamw_norm", "mtp.0.enorm.weight": "adamw_norm",
              "layers.0.hc_attn_base": "adamw_mhc_base_scale", "layers.0.hc_ffn_scale": "adamw_mhc_base_scale",
              "hc_head_base": "adamw_mhc_base_scale", "layers.0.attn.attn_sink": "adamw_attn_sink",
              "layers.1.attn.compressor.ape": "adamw_compressor_ape",
              "layers.1.attn.indexer.compressor.ape": "adamw_compressor_ape",
              "layers.0.hc_attn_fn": "muon", "hc_head_fn": "muon", "layers.0.attn.wq_a.weight": "muon",
              "layers.0.attn.wo_a.weight": "muon", "layers.1.attn.indexer.wq_b.weight": "muon",
              "layers.0.ffn.gate.weight": "muon", "mtp.0.e_proj.weight": "muon"}
    for n, g in expect.items():
        assert where[n] == g, (n, where[n])
    for n, p in m.named_parameters():                                   # no vector on Muon, no matrix forgotten
        assert (where[n] == "muon") == (p.ndim >= 2 and where[n] == "muon")
        if p.ndim < 2:
            assert where[n] != "muon"
    decay = {g["name"]: g["weight_decay"] for g in opt.param_groups}
    assert decay["muon"] == decay["adamw_embedding"] == decay["adamw_head"] == 0.1
    assert decay["adamw_norm"] == decay["adamw_attn_sink"] == decay["adamw_mhc_base_scale"] == 0.0
    assert param_group_of("layers.3.ffn.gate.bias", torch.zeros(4)) == "adamw_router_bias"


def test_lr_schedule():
    f = lambda s: lr_at(s, peak=1.0, warmup=10, total=110, min_lr=0.1)   # noqa: E731
    assert f(1) == pytest.approx(0.1) and f(10) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.1 + 0.9 * 0.5) and f(110) == pytest.approx(0.1) and f(500) == 0.1
    vals = [f(s) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(vals, vals[1:]))                   # monotone decay after warm-up
