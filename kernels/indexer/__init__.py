"""Lightning-indexer ops (spec §7.2): `indexer_scores`, `indexer_topk` with `backend=` via `kernels.get_op`."""
from __future__ import annotations

from dsv4.kernels import get_op


def indexer_scores(qI, kI, w, ratio: int, seg_q, pos_q, entry_seg, entry_j, backend: str = "naive",
                   precision: str = "bf16"):
    """qI [Tq,nI,cI], kI [N,cI], w [Tq,nI] + document metadata -> I [Tq,N] fp32. See `naive.indexer_scores`.
    precision "fp8": qI / kI are the indexer's FP8 features (fp4.qk_fake_quant), which backend "triton+cudnn" scores
    in FP8 (kernels/indexer/cudnn_fwd.py); the other backends score them as given (the same values)."""
    fn = get_op("indexer_scores", backend, qI.device)
    if backend == "triton+cudnn":
        return fn(qI, kI, w, ratio, seg_q, pos_q, entry_seg, entry_j, precision)
    return fn(qI, kI, w, ratio, seg_q, pos_q, entry_seg, entry_j)


def indexer_topk(I, k: int, backend: str = "naive"):
    """I [Tq,N] -> idx [Tq,min(k,N)] long, -1 = not visible; ties -> lower index first."""
    return get_op("indexer_topk", backend, I.device)(I, k)


def indexer_scores_listed(qI, kI, w, idx, backend: str = "naive"):
    """The scores at the listed entries idx [Tq,k] -> [Tq,k] fp32 (-inf at -1). See `naive.indexer_scores_listed`."""
    return get_op("indexer_scores_listed", backend, qI.device)(qI, kI, w, idx)
