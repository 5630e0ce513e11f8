"""Triton indexer scoring / top-k vs the naive reference (spec §7.2) on packed streams: scores (incl. the -inf
mask of other documents and not-yet-complete entries), gradients of qI, kI, w; top-k indices EXACTLY equal (ties
-> lower index first, -1 for not visible picks); the chunked `indexer_select` equals top-k of the full scores."""
from dsv4.kernels._testing import CUDA, assert_close, assert_rel, packed_meta, use_interpreter

use_interpreter()

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
from dsv4.kernels.compressor.naive import entry_slots  # noqa: E402
from dsv4.kernels.indexer import indexer_scores, indexer_topk  # noqa: E402
from dsv4.kernels.indexer import triton as tri  # noqa: E402
from dsv4.kernels.indexer.naive import causal_entry_mask  # noqa: E402

DEV = "cuda" if CUDA else "cpu"
CASES = [([13], None, 3, 20, 4), ([37], None, 2, 16, 3), ([9, 21, 3, 14], [1, 0, 2, 3], 3, 20, 4),
         ([40, 1, 23], [3, 0, 0], 2, 16, 3)]
REAL = [([2048], None, 64, 128, 4), ([700, 1348], None, 64, 128, 4)]


def _inputs(lens, pads, nI, cI, ratio, dt, seed=0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    seg, pos = packed_meta(lens, pads, DEV)
    T = seg.numel()
    ends, valid, ej = entry_slots(seg, pos, ratio)
    eseg = torch.where(valid, seg[ends], torch.full_like(ends, -1))
    q = torch.randn(T, nI, cI, generator=gen, device=DEV).to(dt).requires_grad_()
    k = torch.randn(ends.numel(), cI, generator=gen, device=DEV).to(dt).requires_grad_()
    w = torch.randn(T, nI, generator=gen, device=DEV).to(dt).requires_grad_()
    return q, k, w, (seg, pos, eseg, ej)


@pytest.mark.parametrize("lens,pads,nI,cI,ratio", CASES + (REAL if CUDA else []))
def test_scores_match_naive(lens, pads, nI, cI, ratio):
    dt = torch.bfloat16 if sum(lens) > 1000 else torch.float32
    q, k, w, meta = _inputs(lens, pads, nI, cI, ratio, dt)
    I = indexer_scores(q, k, w, ratio, *meta, backend="triton")
    ref = indexer_scores(q, k, w, ratio, *meta, backend="naive")
    fin = torch.isfinite(ref)
    assert torch.equal(fin, torch.isfinite(I)) and (I[~fin] == float("-inf")).all()
    dI = torch.randn_like(I)
    got = torch.autograd.grad(I, (q, k, w), dI)
    want = torch.autograd.grad(ref, (q, k, w), dI)
    if dt == torch.float32:
        assert_close("I", I[fin], ref[fin], 1e-5, 1e-5)
        for n, a, b in zip(("dqI", "dkI", "dw"), got, want):
            assert_close(n, a, b, 1e-5, 1e-5)
    else:
        assert_rel("I", I[fin], ref[fin], 1e-2)
        for n, a, b in zip(("dqI", "dkI", "dw"), got, want):
            assert_rel(n, a, b, 2e-2)


def _topk_oracle(I: torch.Tensor, k: int) -> torch.Tensor:
    """Independent of torch.sort / topk: per row, k times pick the max of the remaining entries, scanning indices
    upwards and replacing only on a strictly larger score (so equal scores, -0.0 == +0.0 included, go to the lower
    index first); a pick whose score is -inf (not visible) is -1."""
    Tq, N = I.shape
    kk = min(k, N)
    out = torch.empty(Tq, kk, dtype=torch.long)
    for s, row in enumerate(I.detach().cpu().tolist()):
        left = list(range(N))
        for j in range(kk):
            best = left[0]
            for t in left[1:]:
                if row[t] > row[best]:
                    best = t
            left.remove(best)
            out[s, j] = -1 if row[best] == float("-inf") else best
    return out


def test_topk_oracle_is_sharp():
    """The oracle itself: a hand-made row, and it disagrees with an unstable (higher-index-first) tie order."""
    I = torch.tensor([[1.0, 3.0, 3.0, -0.0, 0.0, float("-inf")]])
    assert _topk_oracle(I, 6).tolist() == [[1, 2, 0, 3, 4, -1]]
    N = I.shape[-1]
    flipped = N - 1 - torch.sort(I.flip(-1), dim=-1, descending=True, stable=True).indices   # ties: higher first
    assert not torch.equal(torch.where(torch.isneginf(I.sort(-1, descending=True).values), -1, flipped),
                           _topk_oracle(I, 6))


@pytest.mark.parametrize("backend", ["naive", "triton"])
@pytest.mark.parametrize("k", [1, 3, 6, 50])
def test_topk_exact_with_ties(k, backend):
    seg, pos = packed_meta([17, 20], [0, 3], DEV)
    ratio = 4
    ends, valid, ej = entry_slots(seg, pos, ratio)
    eseg = torch.where(valid, seg[ends], torch.full_like(ends, -1))
    gen = torch.Generator(device=DEV).manual_seed(2)
    I = torch.randint(-3, 3, (seg.numel(), ends.numel()), generator=gen, device=DEV).float()   # many ties
    I[5, :4] = -0.0                                                            # -0.0 ties with +0.0
    I[9, 1:] = 0.0                                                             # a row of equal scores
    I = I.masked_fill(~causal_entry_mask(seg, pos, eseg, ej, ratio), float("-inf"))
    assert torch.equal(indexer_topk(I, k, backend=backend).cpu(), _topk_oracle(I, k))


def test_select_equals_topk_of_scores():
    q, k, w, meta = _inputs([15, 22], [2, 0], 2, 16, 3, torch.float32, seed=3)
    with torch.no_grad():
        want = _topk_oracle(indexer_scores(q, k, w, 3, *meta, backend="naive"), 5)
        got = tri.indexer_select(q, k, w, 3, 5, *meta, chunk=16)
    assert torch.equal(got.cpu(), want)


def test_listed_scores_chunked_op_matches_naive_with_gradients():
    """The sparse-mode loss re-forms the scores at the listed entries: the chunked custom op (the "triton"
    backend, plain PyTorch with recompute in backward) == the reference einsum, values and gradients, with -1
    picks and repeated entries across queries; both == the dense scores gathered at the picks."""
    from dsv4.kernels.indexer import indexer_scores_listed
    from dsv4.kernels.indexer import op as iop
    g = torch.Generator().manual_seed(5)
    Tq, nI, cI, N, k = 1100, 3, 8, 37, 6                       # > one 512-query chunk, odd sizes
    q = torch.randn(Tq, nI, cI, generator=g, requires_grad=True)
    kI = torch.randn(N, cI, generator=g, requires_grad=True)
    w = torch.randn(Tq, nI, generator=g, requires_grad=True)
    idx = torch.rand(Tq, N, generator=g).topk(k, -1).indices
    idx = torch.where(torch.rand(Tq, k, generator=g) < 0.2, -1, idx)
    ref = indexer_scores_listed(q, kI, w, idx, backend="naive")
    got = iop.indexer_scores_listed(q, kI, w, idx)
    seg = torch.zeros(Tq, dtype=torch.long)
    dense = indexer_scores(q, kI, w, 1, seg, torch.arange(Tq) + N, torch.zeros(N, dtype=torch.long), torch.arange(N))
    fin = idx >= 0
    assert torch.isneginf(ref[~fin]).all() and torch.isneginf(got[~fin]).all()
    assert_close("listed vs dense gathered", ref[fin], dense.gather(-1, idx.clamp(min=0))[fin], 1e-5, 1e-6)
    assert_close("listed op", got[fin], ref[fin], 1e-5, 1e-6)            # fp32: summation order only
    dI = torch.randn(Tq, k, generator=g) * fin
    want = torch.autograd.grad(ref.masked_fill(~fin, 0), (q, kI, w), dI)
    have = torch.autograd.grad(got.masked_fill(~fin, 0), (q, kI, w), dI)
    for n, a, b in zip(("dq", "dk", "dw"), have, want):
        assert_close(n, a, b, 1e-5, 1e-5)


def test_listed_scores_backward_adds_only_valid_picks(monkeypatch):
    """dk of the listed-scores backward: the -1 picks never reach a real row of dk (they once all went to row 0,
    which CUDA's deterministic index_add_ -- a sorted index_put_(accumulate=True) -- walks serially: ~500K adds on
    one row per CSA layer at 4K), and are not compacted away either (nonzero: a host sync per chunk): they go to
    spill rows past the end, no spill row more than once per chunk here. Each valid pick reaches its
    row exactly once, and dk equals the old formula's (all slots, -1 -> row 0 with a zero dks) bit for bit on
    CPU: the moved adds are +0."""
    from dsv4.kernels.indexer import op as iop
    g = torch.Generator().manual_seed(7)
    Tq, nI, cI, N, k = 1100, 3, 8, 37, 6                       # > one 512-query chunk
    q, kI, w = torch.randn(Tq, nI, cI, generator=g), torch.randn(N, cI, generator=g), torch.randn(Tq, nI, generator=g)
    idx = torch.rand(Tq, N, generator=g).topk(k, -1).indices
    idx = torch.where(torch.rand(Tq, k, generator=g) < 0.3, -1, idx)
    dI = torch.randn(Tq, k, generator=g)
    monkeypatch.setattr(iop, "_DENSE_DK", 0)                   # the index_add_ route (many entries per pick)
    seen, real = [], torch.Tensor.index_add_

    def spy(self, dim, index, source, *a, **kw):
        seen.append(index.clone())
        return real(self, dim, index, source, *a, **kw)
    monkeypatch.setattr(torch.Tensor, "index_add_", spy)
    _, dk, _ = torch.ops.dsv4.indexer_scores_listed_bwd(dI, q, kI, w, idx)
    monkeypatch.setattr(torch.Tensor, "index_add_", real)
    got = torch.cat(seen)
    assert (got >= 0).all() and got.numel() == idx.numel()
    real_rows, spill = got[got < N], got[got >= N]
    assert torch.equal(real_rows.bincount(minlength=N), idx[idx >= 0].bincount(minlength=N))
    assert spill.numel() == int((idx < 0).sum())
    chunks, per_chunk = -(-Tq // iop._CHUNK), -(-iop._CHUNK * k // min(iop._CHUNK * k, iop._SPILL_ROWS))
    assert int(spill.bincount().max()) <= chunks * per_chunk                  # 3 chunks x once here
    old = torch.zeros(N, cI)                                   # the old formula, dk only
    s, dIz = (nI * cI) ** -0.5, torch.where(idx >= 0, dI, torch.zeros_like(dI))
    for a in range(0, Tq, iop._CHUNK):
        e = min(a + iop._CHUNK, Tq)
        K, d = iop._dots(q[a:e], kI, idx[a:e])
        dd = (dIz[a:e, :, None] * w[a:e, None, :] * s) * (d > 0)
        dks = torch.bmm(dd, q[a:e])
        old.index_add_(0, torch.where(idx[a:e] >= 0, idx[a:e], 0).flatten(), dks.flatten(0, 1))
    assert torch.equal(dk, old)


@pytest.mark.parametrize("sub_bytes", [1 << 26, 3 * 37 * 4 * 7])             # one S per chunk | S of 7 queries
def test_listed_scores_gemm_dk_equals_index_add_route(monkeypatch, sub_bytes):
    """dk of the listed-scores backward by GEMM over dense scattered rows (N·nI <= _DENSE_DK·k: the proxy's case)
    == the index_add_ route and the naive autograd, with -1 picks, odd sizes, > one 512-query chunk and S in
    sub-chunks; dq / dw are the same code in both routes (bit-equal). fp32: summation order only."""
    from dsv4.kernels.indexer import indexer_scores_listed
    from dsv4.kernels.indexer import op as iop
    g = torch.Generator().manual_seed(11)
    Tq, nI, cI, N, k = 1100, 3, 8, 37, 6
    q, kI, w = torch.randn(Tq, nI, cI, generator=g), torch.randn(N, cI, generator=g), torch.randn(Tq, nI, generator=g)
    idx = torch.rand(Tq, N, generator=g).topk(k, -1).indices
    idx = torch.where(torch.rand(Tq, k, generator=g) < 0.3, -1, idx)
    dI = torch.randn(Tq, k, generator=g)
    assert N * nI <= iop._DENSE_DK * k
    monkeypatch.setattr(iop, "_DENSE_DK_BYTES", sub_bytes)
    gemm = torch.ops.dsv4.indexer_scores_listed_bwd(dI, q, kI, w, idx)
    monkeypatch.setattr(iop, "_DENSE_DK", 0)
    scat = torch.ops.dsv4.indexer_scores_listed_bwd(dI, q, kI, w, idx)
    assert torch.equal(gemm[0], scat[0]) and torch.equal(gemm[2], scat[2])
    assert_close("dk gemm vs index_add_", gemm[1], scat[1], 1e-5, 1e-5)   # measured 5.7e-6 abs, 8 seeds, abs(dk) <= 11
    qq, kk, ww = (t.clone().requires_grad_() for t in (q, kI, w))
    fin = idx >= 0
    ref = indexer_scores_listed(qq, kk, ww, idx, backend="naive").masked_fill(~fin, 0)
    want = torch.autograd.grad(ref, (qq, kk, ww), dI * fin)
    assert_close("dk gemm vs naive", gemm[1], want[1], 1e-5, 1e-5)


def test_scatter_picks_places_each_valid_pick_once():
    """triton.scatter_picks (the Triton store kernel under the interpreter) == an explicit loop oracle."""
    g = torch.Generator().manual_seed(12)
    C, k, nI, N = 5, 19, 3, 23
    dd = torch.randn(C, k, nI, generator=g)
    idx = torch.stack([torch.randperm(N, generator=g)[:k] for _ in range(C)])
    idx = torch.where(torch.rand(C, k, generator=g) < 0.25, -1, idx)
    want = torch.zeros(C, nI, N)
    for c in range(C):
        for s in range(k):
            if idx[c, s] >= 0:
                want[c, :, idx[c, s]] = dd[c, s]
    assert torch.equal(tri.scatter_picks(dd, idx, N, torch.float32), want)
