"""Lightning-indexer scores and top-k on a packed token stream, plain PyTorch reference (spec §7.2).

    I[t, n] = sum_h (w[t,h] * nI^-1/2) * ReLU(qI[t,h] . kI[n]) * cI^-1/2     (fp32)
    I[t, n] = -inf  unless entry n is visible to query t (`causal_entry_mask`): same document
              (entry_seg[n] == seg_q[t] >= 0) and complete (entry_j[n] < floor((pos_q[t]+1)/ratio))

Queries carry their document metadata (seg_q, pos_q [Tq]; model/layout.py), entries theirs (entry_seg,
entry_j [N]; kernels/compressor: empty slots have seg -1). A plain sequence is one document: the mask is then
j < floor((t+1)/ratio). Top-k: the min(k, N) largest scores per query; ties are ordered by the LOWER entry index
first (a stable descending sort), so the selection does not depend on N or on the backend; picked entries that
are not visible (score -inf) are returned as -1.
"""
from __future__ import annotations

import torch

from dsv4.kernels._varlen import clamp_rows


def causal_entry_mask(seg_q: torch.Tensor, pos_q: torch.Tensor, entry_seg: torch.Tensor, entry_j: torch.Tensor,
                      ratio: int) -> torch.Tensor:
    """[Tq, N] bool: entry (seg, j) is visible to query (seg_q, pos_q) iff same document and j < (pos_q+1)//m."""
    same = (entry_seg[None, :] == seg_q[:, None]) & (seg_q[:, None] >= 0)
    return same & (entry_j[None, :] < torch.div(pos_q + 1, ratio, rounding_mode="floor")[:, None])


def check_scores_args(qI, kI, w, ratio, seg_q, pos_q, entry_seg, entry_j) -> None:
    """The argument contract of indexer_scores, shared by every backend (one-line errors)."""
    if ratio <= 0:
        raise ValueError(f"indexer_scores: ratio must be positive, got {ratio}")
    if qI.dim() != 3:
        raise ValueError(f"indexer_scores: qI must be [Tq, nI, cI], got {tuple(qI.shape)}")
    Tq, nI, cI = qI.shape
    N = kI.shape[0]
    if tuple(kI.shape) != (N, cI):
        raise ValueError(f"indexer_scores: kI shape {tuple(kI.shape)} != (N, cI) = {(N, cI)}")
    if tuple(w.shape) != (Tq, nI):
        raise ValueError(f"indexer_scores: w shape {tuple(w.shape)} != (Tq, nI) = {(Tq, nI)}")
    if tuple(seg_q.shape) != (Tq,) or tuple(pos_q.shape) != (Tq,):
        raise ValueError(f"indexer_scores: seg_q / pos_q must be [Tq] = [{Tq}]")
    if tuple(entry_seg.shape) != (N,) or tuple(entry_j.shape) != (N,):
        raise ValueError(f"indexer_scores: entry_seg / entry_j must be [N] = [{N}]")


def indexer_scores(qI: torch.Tensor, kI: torch.Tensor, w: torch.Tensor, ratio: int, seg_q: torch.Tensor,
                   pos_q: torch.Tensor, entry_seg: torch.Tensor, entry_j: torch.Tensor) -> torch.Tensor:
    """qI [Tq,nI,cI], kI [N,cI], w [Tq,nI], metadata -> I [Tq,N] fp32 (fp64 for fp64 qI; -inf where not visible)."""
    check_scores_args(qI, kI, w, ratio, seg_q, pos_q, entry_seg, entry_j)
    nI, cI = qI.shape[-2:]
    dt = torch.promote_types(qI.dtype, torch.float32)                          # fp32 (fp64 stays fp64)
    dots = torch.einsum("thc,nc->thn", qI.to(dt), kI.to(dt))                   # [Tq, nI, N]
    I = torch.einsum("thn,th->tn", torch.relu(dots), w.to(dt) * nI ** -0.5) * cI ** -0.5
    return I.masked_fill(~causal_entry_mask(seg_q, pos_q, entry_seg, entry_j, ratio), float("-inf"))


def indexer_scores_listed(qI: torch.Tensor, kI: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The scores of `indexer_scores` at the listed entries only (the sparse-mode indexer loss needs no others):
    qI [Tq,nI,cI], kI [N,cI], w [Tq,nI], idx [Tq,k] (visible picks, -1 = none) -> I [Tq,k] fp32 (fp64 stays;
    -inf at -1). Differentiable; memory [Tq,k,cI] (the reference; the "triton" backend gathers the picked rows
    inside its kernels and recomputes the scores in backward)."""
    nI, cI = qI.shape[-2:]
    dt = torch.promote_types(qI.dtype, torch.float32)
    dots = torch.einsum("thc,tkc->thk", qI.to(dt), kI[clamp_rows(idx)].to(dt))      # [Tq, nI, k]
    I = torch.einsum("thk,th->tk", torch.relu(dots), w.to(dt) * nI ** -0.5) * cI ** -0.5
    return I.masked_fill(idx < 0, float("-inf"))


def indexer_topk(I: torch.Tensor, k: int) -> torch.Tensor:
    """I [..., N] -> idx [..., min(k, N)] long; -1 where the picked entry is not visible (score -inf)."""
    if k < 1:
        raise ValueError(f"indexer_topk: k must be >= 1, got {k}")
    kk = min(k, I.shape[-1])
    vals, idx = torch.sort(I.detach(), dim=-1, descending=True, stable=True)   # ties: lower index first
    vals, idx = vals[..., :kk], idx[..., :kk]
    return torch.where(torch.isneginf(vals), torch.full_like(idx, -1), idx)
