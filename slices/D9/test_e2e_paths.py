"""The memory/speed paths `dsv4 bench train` uses compute the same math as the plain ones (CPU, debug sizes).

Oracles are written here: the plain cross-entropy over materialised logits, the dense [S, B, H, S] joint
teacher, the masked log-softmax KL, the per-expert loop; compared with named tolerances.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dsv4.model.moe as moe
from dsv4.kernels._testing import assert_rel
from dsv4.model import DSv4Model
from dsv4.model.config import get_config
from dsv4.model.indexer import candidates_from_idx, indexer_kl_loss, indexer_teacher
from dsv4.model.model import HEAD_CE, head_cross_entropy

# fp64 paths that differ only in summation order: measured worst 8.9e-16 (|loss| 5.7; the same on all 11 simulated
# hosts of harness/numerics.py: native, ATEN default/avx2/avx512, MKL_CBWR=COMPATIBLE/AVX2,
# MKL_ENABLE_INSTRUCTIONS=SSE4_2/AVX2, DNNL_MAX_CPU_ISA=AVX2, 2 combinations), x34 (was atol 1e-12 / rtol 1e-10,
# > 6e4 x the worst)
TOL_F64 = dict(atol=3e-14, rtol=0)
# The expert GEMM modes in bf16 (|y| <= 7.5e-3, so an elementwise atol would hide a wrong path): relative norm
# ||got - ref|| / ||ref|| <= 1e-2 = 2.5 bf16 unit roundoffs (2^-8), room for another accumulation order in
# _grouped_mm / F.linear. Measured 0 (bit-equal to the loop) for dense and grouped, plain and under autocast, on all
# 11 simulated CPU hosts of harness/numerics.py (grouped: through the naive kernels.moe_combine); a wrong weight or
# expert is O(1) off
REL_BF16 = 1e-2


@pytest.mark.parametrize("grads", HEAD_CE)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_head_cross_entropy_matches_materialised_logits(grads, reduction):
    """Both gradient modes of the blocked head loss against F.cross_entropy over materialised logits, under an
    upstream gradient of 0.37 (so "grad_in_forward"'s backward must scale its kept dy / dW by it)."""
    g = torch.Generator().manual_seed(0)
    N, d, V = 53, 24, 97
    y = torch.randn(N, d, generator=g, dtype=torch.float64, requires_grad=True)
    W = (torch.randn(V, d, generator=g, dtype=torch.float64) * 0.3).requires_grad_()
    lab = torch.randint(0, V, (N,), generator=g)
    lab[[0, 7, 52]] = -100
    ref = F.cross_entropy(F.linear(y, W), lab, ignore_index=-100, reduction=reduction)
    gy, gW = torch.autograd.grad(0.37 * ref, (y, W))
    got = head_cross_entropy(y, W, lab, chunk=10, reduction=reduction, grads=grads)   # 6 blocks, the last short
    hy, hW = torch.autograd.grad(0.37 * got, (y, W))
    # the summed loss is ~50x the mean (286): its summation-order bound is relative, measured 2.0e-16 (x50 -> 1e-14)
    torch.testing.assert_close(got, ref, **(TOL_F64 if reduction == "mean" else dict(atol=0, rtol=1e-14)))
    torch.testing.assert_close(hy, gy, **TOL_F64)
    torch.testing.assert_close(hW, gW, **TOL_F64)


def test_head_cross_entropy_grad_in_forward_only_when_a_backward_can_follow():
    """Under no_grad "grad_in_forward" forms no gradients (the same loss, nothing kept); with grad mode on it keeps
    exactly dy and dW (not y, W or the log-sum-exp)."""
    g = torch.Generator().manual_seed(2)
    y = torch.randn(12, 8, generator=g, dtype=torch.float64, requires_grad=True)
    W = torch.randn(20, 8, generator=g, dtype=torch.float64, requires_grad=True)
    lab = torch.randint(0, 20, (12,), generator=g)
    with torch.no_grad():
        a = head_cross_entropy(y, W, lab, chunk=5, grads="grad_in_forward")
    assert a.grad_fn is None
    b = head_cross_entropy(y, W, lab, chunk=5, grads="grad_in_forward")
    torch.testing.assert_close(a, b.detach(), **TOL_F64)
    saved = b.grad_fn.saved_tensors
    assert [tuple(t.shape) for t in saved] == [(12, 8), (20, 8)]
    with pytest.raises(ValueError, match="grads must be one of"):
        head_cross_entropy(y, W, lab, grads="fused")


@pytest.mark.parametrize("grads", HEAD_CE)
def test_head_cross_entropy_bf16_like_float_upcast(grads):
    g = torch.Generator().manual_seed(1)
    y = torch.randn(40, 32, generator=g).to(torch.bfloat16).requires_grad_()
    W = (torch.randn(64, 32, generator=g) * 0.2).to(torch.bfloat16).requires_grad_()
    lab = torch.randint(0, 64, (40,), generator=g)
    ref = F.cross_entropy(F.linear(y, W).float(), lab)
    gy, gW = torch.autograd.grad(ref, (y, W))
    got = head_cross_entropy(y, W, lab, chunk=16, grads=grads)
    hy, hW = torch.autograd.grad(got, (y, W))
    # loss: same fp32 math per row; measured 4.8e-7 with ATEN_CPU_CAPABILITY=avx2 (bit-equal on the other hosts), x12
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-6)
    # bf16 grads, block-summed dW: rtol 2e-2 = 2.5 bf16 eps (2^-7); measured dy bit-equal, dW 4.9e-4 (x4, 11 hosts)
    torch.testing.assert_close(hy.float(), gy.float(), atol=1e-3, rtol=2e-2)
    torch.testing.assert_close(hW.float(), gW.float(), atol=1e-3, rtol=2e-2)


def test_headless_loss_under_autocast_with_fp32_masters():
    """`dsv4 train --dtype bf16` (FP32 masters under autocast): return_logits=False runs (its backward used to
    meet a bf16 y and an fp32 W: "expected m1 and m2 to have the same dtype") and equals the materialised
    logits' loss, which autocast also forms in bf16; the masters' gradients stay fp32."""
    torch.manual_seed(0)
    cfg = get_config("debug")
    m = DSv4Model(cfg).train()
    ids = torch.randint(0, cfg.vocab_size, (2, 23))
    res = {}
    for rl in (True, False):
        m.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = m(ids, labels=ids, return_logits=rl)
        out.loss.backward()
        res[rl] = (out.loss.detach(), m.head.weight.grad.clone())
    assert res[False][1].dtype == torch.float32
    # the same bf16 logits, an fp32 log-softmax either way: measured |dloss| 4.8e-7 (loss ~5.5) and head-grad max
    # |diff| 2.4e-4 (|g| <= 0.12: bf16 rounding of dlogits in two orders); bounds as the bf16 grads test above
    torch.testing.assert_close(res[False][0], res[True][0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(res[False][1], res[True][1], atol=1e-3, rtol=2e-2)


def _kl_oracle(scores, target, cand):
    valid = cand.any(-1)
    if not bool(valid.any()):
        return scores.sum() * 0.0
    c, tgt = cand[valid], target[valid]
    logq = torch.log_softmax(scores[valid].masked_fill(~c, float("-inf")), -1).masked_fill(~c, 0.0)
    return torch.where(c, torch.xlogy(tgt, tgt) - tgt * logq, torch.zeros_like(logq)).sum(-1).mean()


@pytest.mark.parametrize("chunk", [5, 4096])
def test_candidate_kl_matches_log_softmax_oracle(chunk):
    g = torch.Generator().manual_seed(2)
    S, B, T = 19, 2, 7
    scores = torch.randn(S, B, T, generator=g, dtype=torch.float64, requires_grad=True)
    cand = torch.rand(S, B, T, generator=g) < 0.5
    cand[:3] = False                                                    # rows without candidates
    target = torch.rand(S, B, T, generator=g, dtype=torch.float64) * cand
    target = target / target.sum(-1, keepdim=True).clamp_min(1e-300)
    ref = _kl_oracle(scores, target, cand)
    (gr,) = torch.autograd.grad(ref, scores)
    got = indexer_kl_loss(scores, target, cand, chunk=chunk)
    (gg,) = torch.autograd.grad(got, scores)
    torch.testing.assert_close(got, ref, **TOL_F64)
    torch.testing.assert_close(gg, gr, **TOL_F64)
    empty = indexer_kl_loss(scores[:, :, :0], target[:, :, :0], cand[:, :, :0])
    assert empty.item() == 0.0


def _teacher_oracle(q, kv, comp, cand, sink, window, scale):
    """Dense joint teacher: [S, S] band and [S, B, H, T] compressed logits, one logsumexp."""
    S, B, H, _ = q.shape
    lc = torch.einsum("sbhc,tbc->sbht", q, comp) * scale
    lc = lc.masked_fill(~cand[:, :, None, :], float("-inf"))
    t = torch.arange(S)
    band = (t[None, :] <= t[:, None]) & (t[None, :] > t[:, None] - window)
    lw = (torch.einsum("sbhc,ubc->sbhu", q, kv) * scale).masked_fill(~band[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(torch.cat([lw, lc, sink.view(1, 1, H, 1).expand(S, B, H, 1)], -1), -1, keepdim=True)
    P = torch.exp(lc - lse).sum(2)
    tot = P.sum(-1, keepdim=True)
    return torch.where(tot > 0, P / tot.clamp_min(1e-300), torch.zeros_like(P))


@pytest.mark.parametrize("chunk", [4, 13, None])
def test_teacher_chunked_and_topk_only_match_dense(chunk):
    g = torch.Generator().manual_seed(3)
    S, B, H, c, T, k, W = 41, 2, 3, 8, 10, 4, 6
    q = torch.randn(S, B, H, c, generator=g, dtype=torch.float64)
    kv = torch.randn(S, B, c, generator=g, dtype=torch.float64)
    comp = torch.randn(T, B, c, generator=g, dtype=torch.float64)
    sink = torch.randn(H, generator=g, dtype=torch.float64)
    idx = torch.stack([torch.randperm(T, generator=g)[:k] for _ in range(S * B)]).view(S, B, k)
    idx[:4] = -1
    idx[9, :, 1] = -1
    cand = candidates_from_idx(idx, T)
    ref = _teacher_oracle(q, kv, comp, cand, sink, W, 0.37)
    seg, pos = torch.zeros(S, dtype=torch.long), torch.arange(S)          # each batch column: one document
    dense = torch.stack([indexer_teacher(q[:, b], kv[:, b], comp[:, b], cand[:, b], sink, W, 0.37, "joint", seg, pos,
                                         chunk=chunk) for b in range(B)], 1)
    sparse = torch.stack([indexer_teacher(q[:, b], kv[:, b], comp[:, b], cand[:, b], sink, W, 0.37, "joint", seg,
                                          pos, chunk=chunk, idx=idx[:, b]) for b in range(B)], 1)
    torch.testing.assert_close(dense, ref, **TOL_F64)
    torch.testing.assert_close(sparse, ref, **TOL_F64)


def _grads(m, ids, **kw):
    for p in m.parameters():
        p.grad = None
    out = m(ids, labels=ids, **kw)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


def test_recompute_and_headless_loss_same_loss_and_grads():
    torch.manual_seed(0)
    cfg = get_config("debug")
    m = DSv4Model(cfg).double().train()
    ids = torch.randint(0, cfg.vocab_size, (2, 23))
    ref, g_ref = _grads(m, ids)
    # both paths keep fp64 losses in an fp64 model (the materialised one no longer rounds logits to fp32); they
    # differ only in summation order: measured |diff| 8.9e-16 (worst of 11 simulated hosts), tolerance 1e-13 (x112)
    base, g_base = _grads(m, ids, return_logits=False)
    assert base.logits is None and base.mtp_logits is None
    assert base.loss.dtype == ref.loss.dtype == torch.float64
    torch.testing.assert_close(base.loss, ref.loss, atol=1e-13, rtol=0)
    counts = [g.tokens_per_expert.clone() for g in m.modules() if isinstance(g, moe.Gate)]
    m.set_recompute(True)
    rc, g_rc = _grads(m, ids, return_logits=False)
    after = [g.tokens_per_expert.clone() for g in m.modules() if isinstance(g, moe.Gate)]
    assert all(int((b - a).sum()) == 2 * 23 * cfg.num_experts_per_tok for a, b in zip(counts, after))  # once
    torch.testing.assert_close(rc.loss, base.loss, **TOL_F64)
    assert g_rc.keys() == g_base.keys()
    for n in g_base:
        # measured bit-equal on all 11 hosts; TOL_F64 as the summation-order bound (was atol 1e-12 / rtol 1e-9)
        torch.testing.assert_close(g_rc[n], g_base[n], **TOL_F64, msg=n)
    for k in base.losses:
        torch.testing.assert_close(rc.losses[k], base.losses[k], **TOL_F64)


def test_head_ce_grad_in_forward_same_loss_and_grads():
    """DSv4Model.set_head_ce: the default "grad_in_forward" against "recompute": the LM and MTP heads share W and
    reach the loss with different weights (the MTP coefficient), so each call's kept dW must be scaled by its own
    upstream gradient; every parameter's gradient agrees in fp64."""
    torch.manual_seed(0)
    cfg = get_config("debug")
    assert cfg.num_nextn_predict_layers >= 1
    m = DSv4Model(cfg).double().train()
    assert m.head_ce == "grad_in_forward"                     # the default (1.03-1.05x the H200 step at 16K)
    ids = torch.randint(0, cfg.vocab_size, (2, 23))
    got, g_got = _grads(m, ids, return_logits=False)
    m.set_head_ce("recompute")
    base, g_base = _grads(m, ids, return_logits=False)
    torch.testing.assert_close(got.loss, base.loss, **TOL_F64)
    assert g_got.keys() == g_base.keys()
    for n in g_base:
        # the same products in another order (g applied after the contraction): measured bit-equal or 1 ulp; TOL_F64
        torch.testing.assert_close(g_got[n], g_base[n], **TOL_F64, msg=n)
    with pytest.raises(ValueError, match="set_head_ce: unknown mode"):
        m.set_head_ce("fused")


def test_grouped_expert_path_matches_loop():
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm missing")
    torch.manual_seed(0)
    cfg = get_config("debug", moe_intermediate_size=32, hidden_size=64)
    ex = moe.Experts(cfg).to(torch.bfloat16)
    T, K, E = 61, cfg.num_experts_per_tok, cfg.n_routed_experts
    x = torch.randn(T, cfg.hidden_size).to(torch.bfloat16).requires_grad_()
    idx = torch.stack([torch.randperm(E - 1)[:K] for _ in range(T)])      # expert E-1 gets no token
    w = torch.rand(T, K)

    def run():
        ex.zero_grad(set_to_none=True)
        x.grad = None
        y = ex(x, w, idx)
        (y.float() ** 2).sum().backward()
        return y.detach().float(), x.grad.float(), ex.w13.grad.float(), ex.w2.grad.float()

    ex.gemm = "loop"
    ref = run()
    ex.gemm = "dense"                                                   # static-shape variant (torch.compile)
    for name, a, b in zip(("y", "dx", "dw13", "dw2"), run(), ref):
        assert_rel(name, a, b, REL_BF16)
    ex.gemm = "grouped"
    try:
        got = run()
    except RuntimeError as e:                                           # CPU grouped GEMM unsupported here
        pytest.skip(f"CPU torch._grouped_mm: {e}")
    for name, a, b in zip(("y", "dx", "dw13", "dw2"), got, ref):
        assert_rel(name, a, b, REL_BF16)


def test_expert_slot_order_and_weight_gradient_are_the_int64_index_paths():
    """model/moe.py: the slots' stable argsort on narrowed keys (`_sort_keys`: int16 up to 32,767 experts, else
    int32) is the int64 argsort's permutation exactly, and wk = w.gather(0, order) (backward: a scatter into zeros,
    no sort) equals the indexing form w[order] (backward: index_put with accumulate, a sort of the T*K indices)
    in value and in gradient, bit for bit."""
    g = torch.Generator().manual_seed(0)
    for E in (7, 256, 40_000):
        idx = torch.randint(0, E, (97, 6), generator=g)
        keys = moe._sort_keys(idx, E)
        assert keys.dtype == (torch.int16 if E <= 32_767 else torch.int32)
        order = torch.argsort(keys, stable=True)
        assert torch.equal(order, torch.argsort(idx.reshape(-1), stable=True)), E
        w = torch.rand(97, 6, generator=g, requires_grad=True)
        dy = torch.randn(97 * 6, generator=g)
        a = w.reshape(-1).gather(0, order)
        (ga,) = torch.autograd.grad(a, w, dy)
        b = w.reshape(-1)[order]
        (gb,) = torch.autograd.grad(b, w, dy)
        assert torch.equal(a, b) and torch.equal(ga, gb), E


def test_experts_under_autocast_cast_once_and_grouped_runs():
    """bf16 autocast over FP32 masters (`dsv4 train --precision bf16`): Experts.forward casts w13, w2 to the
    autocast dtype once and chooses the mode for the autocast dtype of x (model/moe.py's autocast rule), so "auto"
    = "grouped" on CUDA (it used to see fp32 and fall back to "loop"; forcing "grouped" raised KernelUnavailable).
    The loop path equals a per-expert F.linear-under-autocast oracle (the old path's casts) bit for bit, values
    and gradients (x is cast after the gather: dx still sums a token's K slots in fp32); "grouped" equals the
    loop within the bf16 tolerance of test_grouped_expert_path_matches_loop."""
    torch.manual_seed(0)
    cfg = get_config("debug", moe_intermediate_size=32, hidden_size=64)
    ex = moe.Experts(cfg)                                               # fp32 masters
    T, K, E = 61, cfg.num_experts_per_tok, cfg.n_routed_experts
    x = torch.randn(T, cfg.hidden_size, requires_grad=True)            # fp32 stream
    idx = torch.stack([torch.randperm(E - 1)[:K] for _ in range(T)])   # expert E-1 gets no token
    w = torch.rand(T, K)
    from dsv4.model.precision import autocast_dtype
    assert autocast_dtype(x) is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert autocast_dtype(x) == torch.bfloat16 and autocast_dtype(x.double()) is None
        w13c = ex.w13.to(torch.bfloat16)
        assert moe.grouped_gemm_missing(x, w13c, torch.bfloat16) is None   # "auto"'s rule: grouped iff this + CUDA
        assert moe.grouped_gemm_missing(x, ex.w13, torch.bfloat16) is not None
        assert moe.expert_gemm("grouped", x, w13c, torch.bfloat16) == "grouped"

    def oracle():                                                       # the old loop: casts inside F.linear
        out = torch.zeros(T, cfg.hidden_size)
        for e in range(E):
            t, k = (idx == e).nonzero(as_tuple=True)
            if t.numel():
                gate, up = F.linear(x[t], ex.w13[e]).chunk(2, dim=-1)
                y = F.linear(moe.clamped_swiglu(gate, up, ex.limit), ex.w2[e])
                out.index_add_(0, t, y.float() * w[t, k, None])
        return out

    def run(fn):
        ex.zero_grad(set_to_none=True)
        x.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = fn()
        assert y.dtype == torch.float32
        (y ** 2).sum().backward()
        return y.detach(), x.grad, ex.w13.grad, ex.w2.grad

    ref = run(oracle)
    ex.gemm = "loop"
    for name, a, b in zip(("y", "dx", "dw13", "dw2"), run(lambda: ex(x, w, idx)), ref):
        assert torch.equal(a, b), name
    ex.gemm = "grouped"
    for name, a, b in zip(("y", "dx", "dw13", "dw2"), run(lambda: ex(x, w, idx)), ref):
        assert_rel(name, a, b, REL_BF16)
