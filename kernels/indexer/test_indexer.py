"""Triton indexer scoring / top-k vs the naive reference (spec §7.2): scores (incl. the -inf causal mask),
gradients of qI, kI, w; top-k indices EXACTLY equal (ties -> lower index first, -1 for non-causal picks);
the chunked `indexer_select` equals top-k of the full scores."""
from dsv4.kernels._testing import CUDA, assert_close, assert_rel, use_interpreter

use_interpreter()

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
from dsv4.kernels.indexer import indexer_scores, indexer_topk  # noqa: E402
from dsv4.kernels.indexer import triton as tri  # noqa: E402

DEV = "cuda" if CUDA else "cpu"
CASES = [(13, 2, 3, 20, 4), (37, 1, 2, 16, 3)]
REAL = [(2048, 1, 64, 128, 4)]


def _inputs(S, B, nI, cI, ratio, dt, seed=0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(S, B, nI, cI, generator=gen, device=DEV).to(dt).requires_grad_()
    k = torch.randn(S // ratio, B, cI, generator=gen, device=DEV).to(dt).requires_grad_()
    w = torch.randn(S, B, nI, generator=gen, device=DEV).to(dt).requires_grad_()
    return q, k, w


@pytest.mark.parametrize("S,B,nI,cI,ratio", CASES + (REAL if CUDA else []))
def test_scores_match_naive(S, B, nI, cI, ratio):
    dt = torch.bfloat16 if S > 1000 else torch.float32
    q, k, w = _inputs(S, B, nI, cI, ratio, dt)
    I = indexer_scores(q, k, w, ratio, backend="triton")
    ref = indexer_scores(q, k, w, ratio, backend="naive")
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
    index first); a pick whose score is -inf (not causal) is -1."""
    S, B, T = I.shape
    kk = min(k, T)
    out = torch.empty(S, B, kk, dtype=torch.long)
    rows = I.detach().cpu().tolist()
    for s in range(S):
        for b in range(B):
            row, left = rows[s][b], list(range(T))
            for j in range(kk):
                best = left[0]
                for t in left[1:]:
                    if row[t] > row[best]:
                        best = t
                left.remove(best)
                out[s, b, j] = -1 if row[best] == float("-inf") else best
    return out


def _tied_scores(S, B, T, ratio, seed=2):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    I = torch.randint(-3, 3, (S, B, T), generator=gen, device=DEV).float()      # many exact ties
    I[0, 0, :4] = -0.0                                                         # -0.0 ties with +0.0
    I[5, 1, 1:] = 0.0                                                          # a row of equal causal scores
    t = torch.arange(S, device=DEV)
    return I.masked_fill(~(torch.arange(T, device=DEV)[None, :] < ((t + 1) // ratio)[:, None])[:, None], float("-inf"))


def test_topk_oracle_is_sharp():
    """The oracle itself: a hand-made row, and it disagrees with an unstable (higher-index-first) tie order."""
    I = torch.tensor([[[1.0, 3.0, 3.0, -0.0, 0.0, float("-inf")]]])
    assert _topk_oracle(I, 6).tolist() == [[[1, 2, 0, 3, 4, -1]]]
    T = I.shape[-1]
    flipped = T - 1 - torch.sort(I.flip(-1), dim=-1, descending=True, stable=True).indices   # ties: higher first
    assert not torch.equal(torch.where(torch.isneginf(I.sort(-1, descending=True).values), -1, flipped),
                           _topk_oracle(I, 6))


@pytest.mark.parametrize("backend", ["naive", "triton"])
@pytest.mark.parametrize("k", [1, 3, 6, 50])
def test_topk_exact_with_ties(k, backend):
    I = _tied_scores(37, 2, 9, 4)
    assert torch.equal(indexer_topk(I, k, backend=backend).cpu(), _topk_oracle(I, k))


def test_select_equals_topk_of_scores():
    q, k, w = _inputs(37, 2, 2, 16, 3, torch.float32, seed=3)
    with torch.no_grad():
        want = _topk_oracle(indexer_scores(q, k, w, 3, backend="naive"), 5)
        got = tri.indexer_select(q, k, w, 3, 5, chunk=16)
    assert torch.equal(got.cpu(), want)
