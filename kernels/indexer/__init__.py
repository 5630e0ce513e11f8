"""Lightning-indexer ops (spec §7.2): `indexer_scores`, `indexer_topk` with `backend=` via `kernels.get_op`."""
from __future__ import annotations

from dsv4.kernels import get_op


def indexer_scores(qI, kI, w, ratio: int, backend: str = "naive"):
    """qI [S,B,nI,cI], kI [T,B,cI], w [S,B,nI] -> I [S,B,T] fp32. See `naive.indexer_scores`."""
    return get_op("indexer_scores", backend, qI.device)(qI, kI, w, ratio)


def indexer_topk(I, k: int, backend: str = "naive"):
    """I [S,B,T] -> idx [S,B,min(k,T)] long, -1 = not causal; ties -> lower index first."""
    return get_op("indexer_topk", backend, I.device)(I, k)
