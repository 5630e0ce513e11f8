"""D1: DSv4 attention (window / CSA / HCA) on a plain batch (B documents of S tokens) vs independent oracles.

Oracles: `slices/D1/oracle.py` (fp64 per-query loop of the whole layer, written from the spec) and the per-window /
per-query loops below for the kernels. Odd lengths throughout (37, 13, 5, 3, 1: not multiples of 4 or 16).
"""
import pytest
import torch

from dsv4.kernels.compressor import compress_pool
from dsv4.kernels.sparse_attn import sparse_attn
from dsv4.model.attention import DSv4Attention
from dsv4.model.config import get_config
from dsv4.model.losses import AuxLosses
from dsv4.slices.D1.oracle import oracle_layer

KINDS = {"window": 0, "csa": 1, "hca": 2}        # layer index of each kind in the debug config [0, 4, 16, 0]
# fp32 module vs fp64 oracle, outputs O(1): measured worst 1.1e-6 (MKL_CBWR=COMPATIBLE) over the 11 simulated hosts of
# harness/numerics.py (native, ATEN default/avx2/avx512, MKL_CBWR=COMPATIBLE/AVX2, MKL_ENABLE_INSTRUCTIONS=SSE4_2/AVX2,
# DNNL_MAX_CPU_ISA=AVX2, 2 combinations), x18
TOL_OUT_FP32 = 2e-5


def make_layer(kind, seed=0, dtype=torch.float32, **over):
    cfg = get_config("debug", **over)
    torch.manual_seed(seed)
    attn = DSv4Attention(cfg, KINDS[kind])
    with torch.no_grad():                         # O(1) outputs and non-trivial sink / ape / norm weights
        for n, p in attn.named_parameters():
            if p.dim() == 1 or n.endswith("ape"):
                p.copy_(torch.randn_like(p) * 0.3 + (1.0 if "norm" in n else 0.0))
            else:
                p.normal_(0.0, p.shape[1] ** -0.5)
    return cfg, attn.to(dtype)


# ------------------------------------------------------------------------------------ whole layer vs oracle

@pytest.mark.parametrize("kind", ["window", "csa", "hca"])
@pytest.mark.parametrize("S", [37, 3])
def test_forward_matches_loop_oracle(kind, S):
    cfg, attn = make_layer(kind, seed=S)
    attn.eval()
    h = torch.randn(2, S, cfg.hidden_size, generator=torch.Generator().manual_seed(S))
    aux = AuxLosses()
    with torch.no_grad():
        y = attn(h, aux=aux)
    ref = oracle_layer(cfg, KINDS[kind], attn.state_dict(), h)
    err = (y.double() - ref["out"]).abs().max().item()
    assert err <= TOL_OUT_FP32, f"{kind} S={S}: max |out - oracle| = {err:.3g}"
    assert ref["out"].abs().max() > 0.1                     # the comparison is not vacuous
    if kind == "csa":                                       # indices exact (k = 4 < T = 9 for S = 37)
        sel = aux.picks(None, (2, S))
        for b in range(2):
            for t in range(S):
                got = [j for j in sel[b, t].tolist() if j >= 0]
                assert got == ref["sel"][b][t], f"b={b} t={t}: {got} != {ref['sel'][b][t]}"


def test_forward_positions_offset_matches_oracle():
    """Explicit positions (a chunk starting at 100) feed RoPE; compressed entries rotate at their first token."""
    cfg, attn = make_layer("csa", seed=5)
    attn.eval()
    S = 13
    pos = torch.arange(100, 100 + S)
    h = torch.randn(1, S, cfg.hidden_size)
    with torch.no_grad():
        y = attn(h, positions=pos)
    ref = oracle_layer(cfg, 1, attn.state_dict(), h, positions=pos)
    assert (y.double() - ref["out"]).abs().max().item() <= TOL_OUT_FP32


# ------------------------------------------------------------------------------------ kernels vs loops

def one_doc(S):
    """Document metadata of one sequence of S tokens (seg 0, pos 0..S-1)."""
    return torch.zeros(S, dtype=torch.long), torch.arange(S)


def loop_compress(kv, gate, ape, m, overlap):
    """Per-window oracle of compress_pool (spec §6.2 / §6.3), one (window, batch) at a time."""
    S, B, W = kv.shape
    D = W // 2 if overlap else W
    out = torch.zeros(S // m, B, D, dtype=torch.float64)
    for w in range(S // m):
        for b in range(B):
            vals, lg = [], []
            if overlap and w > 0:
                for j in range((w - 1) * m, w * m):
                    vals.append(kv[j, b, :D]); lg.append(gate[j, b, :D] + ape[j - (w - 1) * m, :D])
            for j in range(w * m, (w + 1) * m):
                sl = slice(D, 2 * D) if overlap else slice(0, D)
                vals.append(kv[j, b, sl]); lg.append(gate[j, b, sl] + ape[j - w * m, sl])
            a = torch.softmax(torch.stack(lg).double(), 0)
            out[w, b] = (a * torch.stack(vals).double()).sum(0)
    return out


@pytest.mark.parametrize("overlap,m", [(True, 4), (False, 4), (False, 16), (True, 16)])
@pytest.mark.parametrize("S", [37, 3, 16])
def test_compress_pool_vs_window_loop(overlap, m, S):
    g = torch.Generator().manual_seed(S * 7 + m)
    D = 6
    W = 2 * D if overlap else D
    kv, gate = torch.randn(S, 2, W, generator=g), torch.randn(S, 2, W, generator=g)
    ape = torch.randn(m, W, generator=g)
    seg, pos = one_doc(S)
    got = torch.stack([compress_pool(kv[:, b], gate[:, b], ape, m, overlap, seg, pos)[0] for b in range(2)], 1)
    n = S // m
    assert got.shape == (-(-S // m), 2, D) and got[n:].abs().max().item() == 0 if got[n:].numel() else True
    ref = loop_compress(kv, gate, ape, m, overlap)
    # fp32 pooling vs loop: measured worst 2.1e-7 (11 hosts), x5
    assert (got[:n].double() - ref).abs().max().item() <= 1e-6 if S >= m else got[:n].numel() == 0


def loop_sparse_attn(q, kv, comp, idx, sink, window, ratio, scale):
    """Per-query oracle of sparse_attn: explicit visible key list, softmax with the sink."""
    S, B, H, c = q.shape
    o = torch.zeros(S, B, H, c, dtype=torch.float64)
    for t in range(S):
        for b in range(B):
            keys = [kv[s, b] for s in range(max(0, t - window + 1), t + 1)]
            if comp is not None:
                n_ok = (t + 1) // ratio
                ents = range(n_ok) if idx is None else sorted({j for j in idx[t, b].tolist() if 0 <= j < n_ok})
                keys += [comp[j, b] for j in ents]
            K = torch.stack(keys).double()
            lg = q[t, b].double() @ K.T * scale
            p = torch.softmax(torch.cat([lg, sink.double()[:, None]], 1), 1)[:, :-1]
            o[t, b] = p @ K
    return o


@pytest.mark.parametrize("mode", ["window", "selected", "all"])
def test_sparse_attn_vs_query_loop(mode):
    g = torch.Generator().manual_seed(3)
    S, B, H, c, m, win = 23, 2, 3, 8, 4, 5
    q, kv = torch.randn(S, B, H, c, generator=g), torch.randn(S, B, c, generator=g)
    comp = torch.randn(S // m, B, c, generator=g) if mode != "window" else None
    idx = None
    if mode == "selected":      # random distinct picks incl. -1 and non-causal entries (ignored)
        idx = torch.rand(S, B, S // m, generator=g).argsort(-1)[..., :3]
        idx = torch.where(torch.rand(S, B, 3, generator=g) < 0.2, torch.full_like(idx, -1), idx)
    sink = torch.randn(H, generator=g)
    seg, pos = one_doc(S)
    ent = (torch.zeros(S // m, dtype=torch.long), torch.arange(S // m))
    got = torch.stack([sparse_attn(q[:, b], kv[:, b], None if comp is None else comp[:, b],
                                   None if idx is None else idx[:, b], sink, win, m, c ** -0.5, seg, pos, *ent)
                       for b in range(B)], 1)
    ref = loop_sparse_attn(q, kv, comp, idx, sink, win, m, c ** -0.5)
    assert (got.double() - ref).abs().max().item() <= 1e-5          # measured 4.3e-7 (ATEN default; 11 hosts), x24


# ------------------------------------------------------------------------------------ gradcheck (fp64)

def test_gradcheck_sparse_attn():
    g = torch.Generator().manual_seed(0)
    S, H, c, m = 7, 2, 4, 2
    d = dict(dtype=torch.float64)
    q = torch.randn(S, H, c, generator=g, **d).requires_grad_()
    kv = torch.randn(S, c, generator=g, **d).requires_grad_()
    comp = torch.randn(S // m, c, generator=g, **d).requires_grad_()
    sink = torch.randn(H, generator=g, **d).requires_grad_()
    idx = torch.tensor([[0, -1]] * S)
    idx[5:, 1] = 2
    meta = (*one_doc(S), torch.zeros(S // m, dtype=torch.long), torch.arange(S // m))
    # torch's default fp64 gradcheck tolerances (atol 1e-5, rtol 1e-3); measured |analytic - numeric| <= 3.6e-10
    assert torch.autograd.gradcheck(lambda *a: sparse_attn(*a[:3], idx, a[3], 3, m, 0.5, *meta), (q, kv, comp, sink))
    assert torch.autograd.gradcheck(lambda *a: sparse_attn(*a[:3], None, a[3], 3, m, 0.5, *meta), (q, kv, comp, sink))


@pytest.mark.parametrize("overlap", [True, False])
def test_gradcheck_compress_pool(overlap):
    g = torch.Generator().manual_seed(1)
    S, D, m = 9, 3, 4
    W = 2 * D if overlap else D
    kv = torch.randn(S, W, generator=g, dtype=torch.float64).requires_grad_()
    gate = torch.randn(S, W, generator=g, dtype=torch.float64).requires_grad_()
    ape = torch.randn(m, W, generator=g, dtype=torch.float64).requires_grad_()
    seg, pos = one_doc(S)
    # torch's default fp64 gradcheck tolerances (atol 1e-5, rtol 1e-3); measured |analytic - numeric| <= 1.6e-10
    assert torch.autograd.gradcheck(lambda a, b, c: compress_pool(a, b, c, m, overlap, seg, pos)[0], (kv, gate, ape))


@pytest.mark.parametrize("kind", ["window", "csa", "hca"])
def test_gradcheck_attention_module(kind):
    """Gradients w.r.t. the input and the sink / a compressor ape through the whole layer (k >= T: no top-k
    boundary inside the finite-difference step)."""
    cfg = get_config("debug", hidden_size=16, num_attention_heads=2, head_dim=8, qk_rope_head_dim=4,
                     q_lora_rank=8, o_lora_rank=4, sliding_window=3, index_n_heads=2, index_head_dim=4,
                     index_topk=8, compress_ratios=[0, 2, 4, 0], csa_ratio=2, hca_ratio=4)
    torch.manual_seed(0)
    attn = DSv4Attention(cfg, KINDS[kind]).double().eval()
    with torch.no_grad():
        for n, p in attn.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if (p.dim() == 1 or n.endswith("ape")) else 0.5)
                    + (1.0 if "norm" in n else 0.0))
    names = ["attn_sink"] + (["compressor.ape"] if kind != "window" else [])
    params = dict(attn.named_parameters())
    h = torch.randn(1, 9, 16, dtype=torch.float64, requires_grad=True)

    def f(h, *leaves):
        over = dict(zip(names, leaves))
        return torch.func.functional_call(attn, {**params, **over}, (h,))

    leaves = [params[n].detach().clone().requires_grad_() for n in names]
    # fp64 gradcheck: atol 1e-6 (tighter than torch's default 1e-5), default rtol 1e-3; measured |analytic -
    # numeric| <= 2.6e-9 on all 11 hosts, x380
    assert torch.autograd.gradcheck(f, (h, *leaves), eps=1e-6, atol=1e-6, fast_mode=True)


# ------------------------------------------------------------------------------------ causality

@pytest.mark.parametrize("kind", ["window", "csa", "hca"])
def test_no_future_leakage(kind):
    """Changing tokens > t changes nothing at positions <= t (outputs and indexer selections), for t at and
    around window / ratio boundaries; and it does change position t+1 (the test can fail)."""
    cfg, attn = make_layer(kind, seed=11)
    attn.eval()
    S = 37
    h = torch.randn(1, S, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        aux0 = AuxLosses()
        y0 = attn(h, aux=aux0)
        for t in [0, 2, 3, 4, 7, 14, 15, 16, 19, 31, 32, 35]:
            h1 = h.clone()
            h1[:, t + 1:] = torch.randn(1, S - t - 1, cfg.hidden_size, generator=torch.Generator().manual_seed(t))
            aux1 = AuxLosses()
            y1 = attn(h1, aux=aux1)
            # measured bit-equal on all 11 hosts; 1e-6 = a few fp32 ulps of O(1) outputs, 1e-4 below the next check
            assert (y1[:, : t + 1] - y0[:, : t + 1]).abs().max().item() <= 1e-6, f"{kind}: leak into t<={t}"
            assert (y1[:, t + 1] - y0[:, t + 1]).abs().max().item() > 1e-4
            if kind == "csa":
                assert torch.equal(aux1.picks(None)[: t + 1], aux0.picks(None)[: t + 1]), f"selection leak t<={t}"


# ------------------------------------------------------------------------------------ short / odd / bf16

@pytest.mark.parametrize("kind", ["window", "csa", "hca"])
@pytest.mark.parametrize("S", [1, 3, 5])
def test_shorter_than_ratio(kind, S):
    """S < m (or < m') gives zero compressed entries: the layer is then a window layer; no NaN."""
    cfg, attn = make_layer(kind, seed=S)
    attn.train()
    h = torch.randn(2, S, cfg.hidden_size)
    aux = AuxLosses()
    y = attn(h, aux=aux)
    assert y.shape == (2, S, cfg.hidden_size) and torch.isfinite(y).all()
    ref = oracle_layer(cfg, KINDS[kind], attn.state_dict(), h)
    assert (y.detach().double() - ref["out"]).abs().max().item() <= TOL_OUT_FP32
    y.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in attn.parameters() if p.grad is not None)
    if kind == "csa" and S < 4:                              # no entry: every pick is -1
        assert (aux.picks(None) == -1).all() and all(float(l) == 0 and float(n) == 0 for l, n in aux.indexer)


@pytest.mark.parametrize("kind", ["window", "csa", "hca"])
def test_bf16_runs_close_to_fp32(kind):
    cfg, attn = make_layer(kind, seed=2)
    attn.eval()
    h = torch.randn(2, 37, cfg.hidden_size)
    with torch.no_grad():
        y32 = attn(h)
        attn16 = attn.to(torch.bfloat16)
        y16 = attn16(h.to(torch.bfloat16))
    assert y16.dtype == torch.bfloat16 and torch.isfinite(y16).all()
    rel = ((y16.float() - y32).norm() / y32.norm()).item()
    # bf16 rounding (eps 2^-7 = 7.8e-3) through the layer: measured 7.5e-3 on all 11 hosts, x4
    assert rel <= 3e-2, f"bf16 vs fp32 relative error {rel:.3g}"
    attn16.train()
    aux = AuxLosses()
    y = attn16(h.to(torch.bfloat16).requires_grad_(), aux=aux)
    (y.float().square().mean() + sum(l for l, _ in aux.indexer)).backward()
    assert all(torch.isfinite(p.grad.float()).all() for p in attn16.parameters() if p.grad is not None)


def test_grouped_out_proj_against_a_loop_oracle_and_gradcheck():
    """The grouped output projection (spec §5.5, Megatron's BatchedLinear): z[t, k] = o[t, k] @ w[k]^T, written
    here as a loop over tokens and groups in fp64; its gradients by fp64 gradcheck; the autocast dtype under
    autocast (the einsum it replaced computed there in bf16); no gradient for an input that needs none."""
    from dsv4.model.attention import grouped_out_proj
    g = torch.Generator().manual_seed(0)
    o = torch.randn(7, 3, 5, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 4, 5, generator=g, dtype=torch.float64, requires_grad=True)
    ref = torch.stack([torch.stack([w[k] @ o[t, k] for k in range(3)]) for t in range(7)])   # [T, g, r]
    torch.testing.assert_close(grouped_out_proj(o, w), ref, rtol=0, atol=1e-14)   # 5-term sums, fp64 order only
    assert torch.autograd.gradcheck(grouped_out_proj, (o, w))
    dz = torch.randn(7, 3, 4, generator=g, dtype=torch.float64)
    (do,) = torch.autograd.grad(grouped_out_proj(o, w.detach()), o, dz)
    torch.testing.assert_close(do, torch.einsum("tgr,gri->tgi", dz, w.detach()), rtol=0, atol=1e-14)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        zb = grouped_out_proj(o.float(), w.float())
    assert zb.dtype == torch.bfloat16


@pytest.mark.parametrize("mode", ["sparse", "dense"])
def test_batch_selection_equals_each_row_alone(mode):
    """A [2, S] CSA batch in training: the recorded selection (one index tensor over the rows' concatenated
    entries, shared with the attention's in sparse mode) names, row by row, the entries each row picks alone."""
    cfg, attn = make_layer("csa", seed=5, indexer_loss_mode=mode)
    attn.train()
    S = 29
    h = torch.randn(2, S, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    aux = AuxLosses()
    attn(h, aux=aux)
    both = aux.picks(None, (2, S))
    for r in range(2):
        one = AuxLosses()
        attn(h[r:r + 1], aux=one)
        assert torch.equal(both[r], one.picks(None, (1, S))[0]), r
    idx, es, _ = aux.selections[None]
    assert es.shape[0] == 2 * (es.shape[0] // 2) and int(idx.max()) >= es.shape[0] // 2   # row 1 offset past row 0
