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


@pytest.mark.parametrize("cI", [16, 32, 20])
def test_scores_fwd_tma_and_address_paths(monkeypatch, cI):
    """The forward's two qI loads -- the TMA descriptor (cI a power of two) and per-element addresses (forced, and
    cI = 20 where no descriptor is made) -- and both launch orders (JF, forced configs) each equal naive on a packed
    stream with padding, and each other."""
    q, k, w, meta = _inputs([9, 21, 3, 14], [1, 0, 2, 3], 3, cI, 4, torch.float32, seed=cI)
    ref = indexer_scores(q, k, w, 4, *meta, backend="naive").detach()
    fin = torch.isfinite(ref)
    assert (tri._q_desc(q) is None) == (cI == 20)
    args = (q.detach(), k.detach(), w.detach(), 4, tri._meta(*meta))
    got = {"desc": tri._launch_fwd(*args)}
    for jf in (False, True):
        got[f"desc, JF {jf}"] = tri._launch_fwd(*args, config=dict(BT=16, BJ=16, JF=jf, num_warps=4, num_stages=1))
    monkeypatch.setattr(tri, "_q_desc", lambda qI: None)
    got["addr"] = tri._launch_fwd(*args)
    for name, I in got.items():
        assert torch.equal(torch.isfinite(I), fin) and (I[~fin] == float("-inf")).all(), name
        assert_close(f"I ({name})", I[fin], ref[fin], 1e-5, 1e-5)
        assert torch.equal(I, got["desc"]), name


def _holes(meta, every_q=61, every_e=37):
    """The metadata with padding tokens inside documents (every `every_q`-th token) and empty entry slots inside a
    document's entries (every `every_e`-th valid slot): still a stream-ordered layout, so that the unmasked core
    runs of the backward stop inside a document (the third tile loops of both kernels)."""
    seg, pos, eseg, ej = (x.clone() for x in meta)
    seg[every_q // 2::every_q] = -1
    pos[seg < 0] = 0
    valid = torch.nonzero(eseg >= 0).flatten()
    gone = valid[every_e // 2::every_e]
    eseg[gone], ej[gone] = -1, 0
    return seg, pos, eseg, ej


def _tile_kinds(lo, hi, core_hi, n_rows, BR, B):
    """{"pre", "core", "post"}: which of the backward's three tile loops run for some program (a Python copy of
    the kernels' bounds and triton._split over row blocks of BR rows, tiles of B columns; per row the visible
    columns lo..hi-1 (live: lo < hi) and the unbroken core lo..core_hi-1)."""
    kinds = set()
    for b in range(-(-n_rows // BR)):
        r = slice(b * BR, min(b * BR + BR, n_rows))
        live = lo[r] < hi[r]
        if not live.any():
            continue
        l, h = lo[r][live].min().item(), hi[r][live].max().item()
        cl, ch = lo[r][live].max().item(), core_hi[r][live].min().item()
        if b * BR + BR > n_rows:
            ch = cl
        c0 = l + -(-max(cl - l, 0) // B) * B
        c1 = c0 + max(ch - c0, 0) // B * B
        kinds |= {"pre"} if min(c0, h) > l else set()
        kinds |= {"core"} if c1 > c0 else set()
        kinds |= {"post"} if h > c1 else set()
    return kinds


def _dense_bwd_equals_naive(q, k, w, ratio, meta, label):
    """Dense scores of the Triton kernels == naive (same -inf pattern), and their gradients for a random dI (nonzero
    at the -inf scores too: the backward must drop those) == naive autograd, fp32 (summation order only: 1e-5)."""
    I = indexer_scores(q, k, w, ratio, *meta, backend="triton")
    ref = indexer_scores(q, k, w, ratio, *meta, backend="naive")
    assert torch.equal(torch.isfinite(ref), torch.isfinite(I))
    dI = torch.randn_like(I)
    got = torch.autograd.grad(I, (q, k, w), dI)
    want = torch.autograd.grad(ref, (q, k, w), dI)
    for n, a, b in zip(("dqI", "dkI", "dw"), got, want):
        assert_close(f"{label} {n}", a, b, 1e-5, 1e-5)


@pytest.mark.parametrize("case", ["one_doc", "packed", "holes"])
def test_dense_scores_bwd_core_and_boundary_tiles(case):
    """The dense scoring backward (the dense warm-up's KL path) == naive autograd, fp32, at sizes where the
    kernels' unmasked core tiles run next to masked boundary tiles before and after them (asserted from the
    _varlen ranges with the CPU config's tiles): one odd-length document, a packed batch with padding, and the
    same batch with padding tokens and empty slots inside documents. dI is random at every (t, n), the -inf
    ones included: the backward must drop those. fp32 only: Triton 3.9's interpreter computes bf16 tl.dot
    wrongly, so bf16 is judged on the GPU (test_dense_scores_bwd_every_config_bf16_on_gpu)."""
    from dsv4.kernels._varlen import entry_cores, entry_ranges, query_cores, query_ranges
    lens, pads, ratio = {"one_doc": ([150], None, 4), "packed": ([60, 5, 80, 23], [3, 0, 17, 2], 2),
                         "holes": ([60, 5, 80, 23], [3, 0, 17, 2], 2)}[case]
    q, k, w, meta = _inputs(lens, pads, 3, 20, ratio, torch.float32, seed=7)
    if case == "holes":
        meta = _holes(meta)
    S, T = q.shape[0], k.shape[0]
    if not CUDA:                                          # the CPU config's tiles reach every loop
        dq_cfg, dk_cfg = (kern.configs[-1].kwargs for kern in (tri._scores_bwd_dq, tri._scores_bwd_dk))
        elo, ehi = entry_ranges(*meta, ratio)
        qlo, qhi = query_ranges(*meta, ratio)
        ecore, qcore = entry_cores(meta[2], elo, ehi), query_cores(meta[0], meta[1], qlo, qhi)
        # a query block of one document sees entries from its start: no boundary tiles before its core
        assert _tile_kinds(elo, ehi, ecore, S, dq_cfg["BT"], dq_cfg["BJ"]) == \
            ({"core", "post"} if case == "one_doc" else {"pre", "core", "post"})
        assert _tile_kinds(qlo, qhi, qcore, T, dk_cfg["BJ"], dk_cfg["BT"]) == {"pre", "core", "post"}
        if case == "holes":                               # cores that a hole ends inside the visible range
            assert ((ecore < ehi) & (elo < ehi)).any() and ((qcore < qhi) & (qlo < qhi)).any()
    _dense_bwd_equals_naive(q, k, w, ratio, meta, case)


def test_dense_scores_bwd_positions_not_increasing():
    """The dense scoring backward == naive autograd (fp32, odd sizes) when the query positions inside a document
    do not increase along the stream: document 0's are permuted, document 2's restart (0..99 then 0..59). The
    entries stay those of the stream-ordered positions (the _varlen ranges' assumption: entry j increasing inside a
    document). A core run of the dk kernel (`query_cores`) must end where pos decreases: a later query of the same
    document with a smaller pos may not see the entry, and core tiles read dI unmasked (dI is random at the -inf
    scores). Asserted: every core query sees its entry, and core tiles still run next to boundary ones."""
    from dsv4.kernels._varlen import query_cores, query_ranges
    lens, pads, ratio = [37, 5, 160, 23], [3, 0, 17, 2], 2
    q, k, w, (seg, pos, eseg, ej) = _inputs(lens, pads, 3, 20, ratio, torch.float32, seed=11)
    pos = pos.clone()
    gen = torch.Generator(device=DEV).manual_seed(5)
    pos[:37] = torch.randperm(37, generator=gen, device=DEV)                   # document 0: permuted
    d2 = 37 + 3 + 5                                                            # document 2's first token
    pos[d2 + 100:d2 + 160] = torch.arange(60, device=DEV)                      # document 2: restarts at 100
    meta = (seg, pos, eseg, ej)
    qlo, qhi = query_ranges(*meta, ratio)
    qcore = query_cores(seg, pos, qlo, qhi)                                    # [N]
    vis = causal_entry_mask(*meta, ratio)                                      # [S, N]
    t = torch.arange(seg.numel(), device=DEV)[:, None]
    in_core = (t >= qlo[None, :].long()) & (t < qcore[None, :].long())          # [S, N]
    assert in_core.any() and not (in_core & ~vis).any()
    if not CUDA:
        dk_cfg = tri._scores_bwd_dk.configs[-1].kwargs
        assert _tile_kinds(qlo, qhi, qcore, k.shape[0], dk_cfg["BJ"], dk_cfg["BT"]) == {"pre", "core", "post"}
    _dense_bwd_equals_naive(q, k, w, ratio, meta, "pos not increasing")


@pytest.mark.skipif(not CUDA, reason="bf16 tensor-core products: GPU only (the interpreter's bf16 dot is wrong)")
def test_dense_scores_bwd_every_config_bf16_on_gpu():
    """The dense scoring backward at DSv4's indexer dims (nI = 64, cI = 128, ratio 4), bf16, ~8K packed tokens
    (three documents, padding), every dq and dk config of the tuners forced (dk at 4 heads a program, so that
    every HH / HM combination is legal), then the tuned path: dqI, dkI, dw vs naive autograd in fp32 of the same
    bf16 inputs; bounds as the bf16 cases above (2e-2 normwise: p and p·w rounded to bf16 for the second MMA)."""
    q, k, w, meta = _inputs([5000, 2900, 291], [0, 5, 0], 64, 128, 4, torch.bfloat16, seed=4)
    ins32 = [t.detach().float().requires_grad_() for t in (q, k, w)]
    ref = indexer_scores(*ins32, 4, *meta, backend="naive")
    dI = torch.randn_like(ref)                                  # nonzero at the -inf entries too: ignored
    want = torch.autograd.grad(ref, ins32, dI)
    del ref
    torch.cuda.empty_cache()
    each = lambda kern: [dict(**c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages) for c in kern.configs
                         if c.kwargs["BT"] > 16]                # the GPU list (the last one is the CPU config)
    dq_cfgs, dk_cfgs = each(tri._scores_bwd_dq), each(tri._scores_bwd_dk)
    assert all(c["HH"] <= 4 * c["HM"] and 4 * c["HM"] % c["HH"] == 0 for c in dk_cfgs)
    runs = [(dq_cfgs[i % len(dq_cfgs)], dk_cfgs[i]) for i in range(len(dk_cfgs))] + [(None, None)]
    for dq_cfg, dk_cfg in runs:
        got = tri.scores_bwd(dI, q.detach(), k.detach(), w.detach(), 4, meta, dq_config=dq_cfg, dk_config=dk_cfg,
                             dk_hpp=None if dk_cfg is None else 4)
        for n, a, b in zip(("dqI", "dkI", "dw"), got, want):
            assert_rel(f"{n} dq {dq_cfg} dk {dk_cfg}", a.float(), b, 2e-2)


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


def _listed_case(seed, Tq=67, nI=3, cI=24, N=37, k=6, drop=0.2, dev=DEV, dt=torch.float32):
    g = torch.Generator(device=dev).manual_seed(seed)
    q = torch.randn(Tq, nI, cI, generator=g, device=dev).to(dt)
    kI = torch.randn(N, cI, generator=g, device=dev).to(dt)
    w = torch.randn(Tq, nI, generator=g, device=dev).to(dt)
    idx = torch.rand(Tq, N, generator=g, device=dev).topk(k, -1).indices           # distinct picks per query
    idx = torch.where(torch.rand(Tq, k, generator=g, device=dev) < drop, -1, idx)
    return q, kI, w, idx, torch.randn(Tq, k, generator=g, device=dev)


def test_listed_scores_op_matches_naive_with_gradients():
    """The sparse-mode loss re-forms the scores at the listed entries: the Triton kernels (fp32; the interpreter
    on CPU) ==
    the reference einsum, values and gradients, with -1 picks, odd sizes (nI=3, cI=24, k=6: masked heads,
    channels and pick slots) and entries repeated across queries; both == the dense scores gathered at the picks.
    The -1 picks' dI is nonzero here: the backward must ignore it."""
    from dsv4.kernels.indexer import indexer_scores_listed
    from dsv4.kernels.indexer import op as iop
    q, kI, w, idx, dI = _listed_case(5)
    Tq, N = q.shape[0], kI.shape[0]
    ins = [t.clone().requires_grad_() for t in (q, kI, w)]
    ref = indexer_scores_listed(*ins, idx, backend="naive")
    got = iop.indexer_scores_listed(*ins, idx)
    seg = torch.zeros(Tq, dtype=torch.long, device=DEV)
    dense = indexer_scores(q, kI, w, 1, seg, torch.arange(Tq, device=DEV) + N,
                           torch.zeros(N, dtype=torch.long, device=DEV), torch.arange(N, device=DEV))
    fin = idx >= 0
    assert torch.isneginf(ref[~fin]).all() and torch.isneginf(got[~fin]).all()
    assert_close("listed vs dense gathered", ref[fin], dense.gather(-1, idx.clamp(min=0))[fin], 1e-5, 1e-6)
    assert_close("listed op", got[fin], ref[fin], 1e-5, 1e-6)            # fp32: summation order only
    want = torch.autograd.grad(ref.masked_fill(~fin, 0), ins, dI * fin)
    have = torch.autograd.grad(got, ins, dI)                                      # dI at -1 picks: ignored
    for n, a, b in zip(("dq", "dk", "dw"), have, want):
        assert_close(n, a, b, 1e-5, 1e-5)


@pytest.mark.parametrize("nI", [3, 16])     # the S store with its head mask (NP 16 > nI) and without (NP == nI)
@pytest.mark.parametrize("route", ["gemm", "gemm_sub", "atomic"])
def test_listed_scores_dk_routes_equal_naive(monkeypatch, route, nI):
    """dkI of the listed-scores backward by either route -- dd stored at its entries' rows of a dense S and
    one GEMM (N·nI <= DENSE_DK·k: the proxy's case; "gemm_sub": S of 7 queries at a time, several launches) or
    fp32 atomic adds (many entries per pick) -- == the naive autograd; dq / dw do not depend on the route
    (bit-equal). fp32: summation order only."""
    from dsv4.kernels.indexer import indexer_scores_listed
    q, kI, w, idx, dI = _listed_case(11, nI=nI, drop=0.3)
    N, k = kI.shape[0], idx.shape[1]
    assert N * nI <= tri.DENSE_DK * k
    base = tri.listed_scores_bwd(dI, q, kI, w, idx)
    if route == "gemm_sub":
        monkeypatch.setattr(tri, "DENSE_DK_BYTES", nI * N * 4 * 7)
    if route == "atomic":
        monkeypatch.setattr(tri, "DENSE_DK", 0)
    got = tri.listed_scores_bwd(dI, q, kI, w, idx)
    assert torch.equal(got[0], base[0]) and torch.equal(got[2], base[2])
    ins = [t.clone().requires_grad_() for t in (q, kI, w)]
    fin = idx >= 0
    ref = indexer_scores_listed(*ins, idx, backend="naive").masked_fill(~fin, 0)
    want = torch.autograd.grad(ref, ins, dI * fin)
    for n, a, b in zip(("dq", "dk", "dw"), got, want):
        assert_close(f"{route} {n}", a, b, 1e-5, 1e-5)


@pytest.mark.skipif(not CUDA, reason="CUDA graph capture: GPU only")
def test_listed_scores_bwd_captures_in_a_cuda_graph(monkeypatch):
    """The backward captured in a CUDA graph (as P11's packed step and `ours_cudagraph` capture it) and replayed ==
    eager, bit for bit, with S in several launches (the per-launch reset). At cde260c the reset's Python 0 was a CPU
    tensor copied over during capture: every captured training step failed."""
    q, kI, w, idx, dI = _listed_case(11, nI=16, drop=0.3, dev="cuda")
    N = kI.shape[0]
    monkeypatch.setattr(tri, "DENSE_DK_BYTES", 16 * N * 4 * 7)                  # 7 queries a launch
    ref = tri.listed_scores_bwd(dI, q, kI, w, idx)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        got = tri.listed_scores_bwd(dI, q, kI, w, idx)
    for _ in range(2):                                                           # the reset leaves S zero for the next
        g.replay()
        torch.cuda.synchronize()
        for n, a, b in zip(("dq", "dk", "dw"), got, ref):
            assert torch.equal(a, b), n


@pytest.mark.skipif(not CUDA, reason="bf16 tensor-core products: GPU only (the interpreter's bf16 dot is wrong)")
@pytest.mark.parametrize("N", [1024, 16384])                  # proxy 4K (S-GEMM dk) | 64K-token rows (still S-GEMM)
def test_listed_scores_bf16_matches_naive_on_gpu(N):
    """proxy shapes (nI=16, cI=128, k=512), bf16: the kernels vs the naive einsum in fp32 of the same bf16 inputs."""
    from dsv4.kernels.indexer import indexer_scores_listed
    from dsv4.kernels.indexer import op as iop
    q, kI, w, idx, dI = _listed_case(3, Tq=2048, nI=16, cI=128, N=N, k=512, dev="cuda", dt=torch.bfloat16)
    fin = idx >= 0
    ins = [t.clone().requires_grad_() for t in (q, kI, w)]
    got = iop.indexer_scores_listed(*ins, idx)
    have = torch.autograd.grad(got, ins, dI)
    ins32 = [t.float().requires_grad_() for t in (q, kI, w)]
    ref = indexer_scores_listed(*ins32, idx, backend="naive")
    want = torch.autograd.grad(ref.masked_fill(~fin, 0), ins32, dI * fin)
    # bf16 dd / S rounding: bounds as the sparse-attention bf16 cases (1e-2 values, 2e-2 gradients)
    assert_rel("listed bf16", got[fin], ref[fin], 1e-2)
    for n, a, b in zip(("dq", "dk", "dw"), have, want):
        assert_rel(n, a.float(), b, 2e-2)


