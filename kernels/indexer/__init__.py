"""Lightning-indexer ops (spec §7.2): `indexer_scores`, `indexer_topk` with `backend="naive"` dispatch."""
from __future__ import annotations

from . import naive

_SCORES = {"naive": naive.indexer_scores}
_TOPK = {"naive": naive.indexer_topk}


def _register_triton():
    """Lazy: the Triton backend (and triton itself) is imported only when asked for."""
    if "triton" not in _SCORES:
        from . import triton as _triton
        _SCORES["triton"], _TOPK["triton"] = _triton.indexer_scores, _triton.indexer_topk


def indexer_scores(qI, kI, w, ratio: int, seg_q, pos_q, entry_seg, entry_j, backend: str = "naive"):
    """qI [Tq,nI,cI], kI [N,cI], w [Tq,nI] + document metadata -> I [Tq,N] fp32. See `naive.indexer_scores`."""
    if backend == "triton":
        _register_triton()
    if backend not in _SCORES:
        raise ValueError(f"indexer_scores: unknown backend {backend!r}; known: {', '.join(_SCORES)}")
    return _SCORES[backend](qI, kI, w, ratio, seg_q, pos_q, entry_seg, entry_j)


def indexer_topk(I, k: int, backend: str = "naive"):
    """I [Tq,N] -> idx [Tq,min(k,N)] long, -1 = not visible; ties -> lower index first."""
    if backend == "triton":
        _register_triton()
    if backend not in _TOPK:
        raise ValueError(f"indexer_topk: unknown backend {backend!r}; known: {', '.join(_TOPK)}")
    return _TOPK[backend](I, k)
