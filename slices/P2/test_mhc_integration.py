"""P2: FP32 mHC in every sublayer, HyperHead collapse, streams initialised as embedding copies, MTP with mHC.

Oracles are written here in fp64 with explicit loops over streams (spec §3, §4.2, §4.3, §10.1). The model runs
in fp64 too, RMSNorm included (`model/norm.py` promotes to at least fp32), so the comparisons allow fp64
summation-order differences (NORM_TOL); wiring mistakes are O(1e-2) and larger.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn

from dsv4.model.config import get_config
from dsv4.model.model import DSv4Model

CFG = get_config("debug")
# fp64 model vs fp64 oracle: measured worst 6.3e-15 (ATEN default; |out| <= 4.3) over the 11 simulated hosts of
# harness/numerics.py (native, ATEN default/avx2/avx512, MKL_CBWR=COMPATIBLE/AVX2, MKL_ENABLE_INSTRUCTIONS=SSE4_2/AVX2,
# DNNL_MAX_CPU_ISA=AVX2, 2 combinations), x16 (was rtol 1e-5 / atol 2e-6, a bound for fp32 norms)
NORM_TOL = dict(rtol=0, atol=1e-13)


def _rms(x, w=None, eps=1e-6):
    y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    return y * w if w is not None else y


def _oracle_weights(X, fn, base, scale, cfg):
    """Per token fp64: pre [n], post [n], comb [n, n] with Sinkhorn in DeepSeek's order."""
    n = cfg.hc_mult
    flat = _rms(X.flatten(-2), eps=cfg.rms_norm_eps)
    mix = flat @ fn.double().t()
    pre = torch.sigmoid(mix[..., :n] * scale[0] + base[:n]) + cfg.hc_eps
    post = 2 * torch.sigmoid(mix[..., n:2 * n] * scale[1] + base[n:2 * n])
    C = torch.softmax((mix[..., 2 * n:] * scale[2] + base[2 * n:]).unflatten(-1, (n, n)), -1) + cfg.hc_eps
    C = C / (C.sum(-2, keepdim=True) + cfg.hc_eps)
    for _ in range(cfg.hc_sinkhorn_iters - 1):
        C = C / (C.sum(-1, keepdim=True) + cfg.hc_eps)
        C = C / (C.sum(-2, keepdim=True) + cfg.hc_eps)
    return pre, post, C


def _oracle_sublayer(X, fn, base, scale, f, cfg, transpose=True):
    n = cfg.hc_mult
    pre, post, C = _oracle_weights(X, fn.double(), base.double(), scale.double(), cfg)
    u = sum(pre[..., j:j + 1] * X[..., j, :] for j in range(n))
    out = f(u)
    streams = []
    for k in range(n):
        if transpose:
            mixed = sum(C[..., j, k:k + 1] * X[..., j, :] for j in range(n))
        else:
            mixed = sum(C[..., k, j:j + 1] * X[..., j, :] for j in range(n))
        streams.append(post[..., k:k + 1] * out + mixed)
    return torch.stack(streams, -2)


def _oracle_head(X, fn, base, scale, cfg):
    flat = _rms(X.flatten(-2), eps=cfg.rms_norm_eps)
    pre = torch.sigmoid(flat @ fn.double().t() * scale.double() + base.double()) + cfg.hc_eps
    return sum(pre[..., j:j + 1] * X[..., j, :] for j in range(cfg.hc_mult))


class _StandInAttn(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d, bias=False)

    def forward(self, h, layout=None, aux=None):
        return torch.tanh(self.lin(h))


def _randomise(module, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in module.named_parameters():
            if "base" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.7)
            elif "scale" in n:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            elif "hc_" in n and "fn" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def test_block_matches_stream_oracle_and_comb_is_transposed():
    from dsv4.model.block import Block
    torch.manual_seed(0)
    cfg = CFG
    blk = Block(cfg, 0).double()
    blk.attn = _StandInAttn(cfg.hidden_size).double()
    blk.ffn = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False).double()
    _randomise(blk)
    X = torch.randn(2, 13, cfg.hc_mult, cfg.hidden_size, dtype=torch.float64)
    got = blk(X, torch.zeros(2, 13, dtype=torch.long))

    def sub(X, which, transpose=True):
        fn, base, scale = (getattr(blk, f"hc_{which}_{s}") for s in ("fn", "base", "scale"))
        norm = blk.attn_norm if which == "attn" else blk.ffn_norm
        f = (lambda u: blk.attn(_rms(u, norm.weight.double()))) if which == "attn" else \
            (lambda u: blk.ffn(_rms(u, norm.weight.double())))
        return _oracle_sublayer(X, fn, base, scale, f, cfg, transpose)

    with torch.no_grad():
        ref = sub(sub(X, "attn"), "ffn")
        wrong = sub(sub(X, "attn", False), "ffn", False)
    torch.testing.assert_close(got.detach(), ref, **NORM_TOL)
    assert (wrong - ref).abs().max() > 1e-3                  # an un-transposed comb would be caught


def _model(seed=0):
    torch.manual_seed(seed)
    m = DSv4Model(CFG)
    _randomise(m, seed)
    return m


def test_streams_start_as_embedding_copies_and_head_collapse():
    m = _model().double()
    ids = torch.randint(0, CFG.vocab_size, (2, 21), generator=torch.Generator().manual_seed(1))
    seen = {}
    m.layers[0].register_forward_pre_hook(lambda mod, args: seen.__setitem__("X0", args[0]))
    m.layers[-1].register_forward_hook(lambda mod, args, out: seen.__setitem__("XL", out))
    out = m(ids)
    e = m.embed.weight[ids]
    X0 = seen["X0"]
    assert X0.shape == (2, 21, CFG.hc_mult, CFG.hidden_size)
    for j in range(CFG.hc_mult):
        assert torch.equal(X0[:, :, j], e)
    with torch.no_grad():
        y = _rms(_oracle_head(seen["XL"], m.hc_head_fn, m.hc_head_base, m.hc_head_scale, CFG), m.norm.weight)
        ref = y @ m.head.weight.t()
    torch.testing.assert_close(out.logits.detach(), ref, **NORM_TOL)


def test_mtp_wiring_vs_oracle():
    from dsv4.model.block import Block
    m = _model(1).double()
    ids = torch.randint(0, CFG.vocab_size, (2, 23), generator=torch.Generator().manual_seed(2))
    seen = {}
    m.layers[-1].register_forward_hook(lambda mod, args, out: seen.__setitem__("XL", out))
    out = m(ids)
    mtp = m.mtp[0]
    with torch.no_grad():
        ids_next = torch.cat([ids[:, 1:], torch.zeros(2, 1, dtype=torch.long)], 1)
        e = _rms(m.embed.weight[ids_next], mtp.enorm.weight)
        X0 = (e @ mtp.e_proj.weight.t()).unsqueeze(2) + _rms(seen["XL"], mtp.hnorm.weight) @ mtp.h_proj.weight.t()
        X1 = Block.forward(mtp, X0, ids_next)                      # default layout: 2 documents of 23
        y = _rms(_oracle_head(X1, mtp.hc_head_fn, mtp.hc_head_base, mtp.hc_head_scale, CFG), mtp.norm.weight)
        ref = y @ m.head.weight.t()
    assert mtp.layer_idx == CFG.num_hidden_layers and not mtp.ffn.gate.hash
    torch.testing.assert_close(out.mtp_logits.detach(), ref, **NORM_TOL)


def test_loss_composition_and_metric_names():
    m = _model(2).train()
    ids = torch.randint(0, CFG.vocab_size, (2, 29), generator=torch.Generator().manual_seed(3))
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
    out = m(ids, labels=labels)
    V = CFG.vocab_size
    lm = F.cross_entropy(out.logits.reshape(-1, V), labels.reshape(-1), ignore_index=-100)
    mtp_labels = torch.cat([labels[:, 1:], torch.full((2, 1), -100)], 1)
    mtp = F.cross_entropy(out.mtp_logits.reshape(-1, V), mtp_labels.reshape(-1), ignore_index=-100)
    assert set(out.losses) == {"lm loss", "mtp_1 loss", "indexer loss", "moe aux loss"}
    # torch's fp32 default tolerances (rtol 1.3e-6, atol 1e-5); measured bit-equal on all 11 hosts
    torch.testing.assert_close(out.losses["lm loss"], lm.detach())
    torch.testing.assert_close(out.losses["mtp_1 loss"], mtp.detach())
    expected = lm + CFG.mtp_loss_scaling_factor * mtp + out.losses["indexer loss"] + out.losses["moe aux loss"]
    # fp32 model: measured bit-equal on all 11 hosts; 1e-6 + 1e-6 * |loss| (7.2) ~ 17 fp32 ulps
    torch.testing.assert_close(out.loss.detach(), expected.detach(), rtol=1e-6, atol=1e-6)
    assert all(not v.requires_grad for v in out.losses.values())
    assert math.isfinite(out.loss.item())
    out.loss.backward()
    assert m.mtp[0].e_proj.weight.grad is not None and m.hc_head_fn.grad is not None


def test_mhc_stays_fp32_under_bf16():
    m = _model(3).to(torch.bfloat16)
    from dsv4.model.mhc import hc_pre
    X = torch.randn(1, 9, CFG.hc_mult, CFG.hidden_size).bfloat16()
    blk = m.layers[0]
    u, post, comb = hc_pre(X, blk.hc_attn_fn, blk.hc_attn_base, blk.hc_attn_scale, CFG)
    assert blk.hc_attn_fn.dtype == torch.float32 and u.dtype == torch.bfloat16
    assert post.dtype == torch.float32 and comb.dtype == torch.float32
    assert (comb.sum(-2) - 1).abs().max() < 1e-4                       # fp32 Sinkhorn: 1.1e-6 measured (11 hosts), x93
    out = m(torch.randint(0, CFG.vocab_size, (1, 17)))
    assert out.logits.dtype == torch.bfloat16 and torch.isfinite(out.logits.float()).all()


def test_mhc_and_router_stay_fp32_under_autocast():
    """torch.autocast(bf16) must not lower the mHC projections / Sinkhorn or the router scores to bf16."""
    from dsv4.model.mhc import hc_head, hc_pre
    from dsv4.model.moe import MoE
    torch.manual_seed(4)
    blk = _model(4).layers[1]
    X = torch.randn(1, 9, CFG.hc_mult, CFG.hidden_size)
    ref = hc_pre(X, blk.hc_attn_fn, blk.hc_attn_base, blk.hc_attn_scale, CFG)
    href = hc_head(X, blk.hc_attn_fn[:4], blk.hc_attn_base[:4], blk.hc_attn_scale[:1], CFG)
    moe = MoE(CFG, 1)
    h = torch.randn(9, CFG.hidden_size)
    sref = moe.gate(h, None)[2]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = hc_pre(X, blk.hc_attn_fn, blk.hc_attn_base, blk.hc_attn_scale, CFG)
        hgot = hc_head(X, blk.hc_attn_fn[:4], blk.hc_attn_base[:4], blk.hc_attn_scale[:1], CFG)
        sgot = moe.gate(h, None)[2]
    for a, b in zip(ref + (href, sref), got + (hgot, sgot)):
        assert b.dtype == torch.float32 and torch.equal(a, b)
