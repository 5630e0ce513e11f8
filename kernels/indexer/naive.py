"""Lightning-indexer scores and top-k, plain PyTorch reference (spec §7.2).

    I[t, b, j] = sum_h (w[t,b,h] * nI^-1/2) * ReLU(qI[t,b,h] . kI[j,b]) * cI^-1/2     (fp32)
    I[t, b, j] = -inf  where  j >= floor((t+1)/ratio)        (entry j ends at token (j+1)*ratio - 1 > t)

t is the index in the sequence (0..S-1). Top-k: the min(k, T) largest scores per (t, b); ties are ordered by
the LOWER entry index first (a stable descending sort), so the selection does not depend on T or on the
backend; picked entries that are not causal (score -inf) are returned as -1.
"""
from __future__ import annotations

import torch


def causal_entry_mask(S: int, T: int, ratio: int, device=None) -> torch.Tensor:
    """[S, T] bool, True where entry j is complete for query t: j < floor((t+1)/ratio)."""
    t = torch.arange(S, device=device)
    j = torch.arange(T, device=device)
    return j[None, :] < torch.div(t + 1, ratio, rounding_mode="floor")[:, None]


def check_scores_args(qI: torch.Tensor, kI: torch.Tensor, w: torch.Tensor, ratio: int) -> None:
    """The argument contract of indexer_scores, shared by every backend (one-line errors)."""
    if ratio <= 0:
        raise ValueError(f"indexer_scores: ratio must be positive, got {ratio}")
    S, B, nI, cI = qI.shape
    T = kI.shape[0]
    if tuple(kI.shape) != (T, B, cI):
        raise ValueError(f"indexer_scores: kI shape {tuple(kI.shape)} != (T, B, cI) = {(T, B, cI)}")
    if tuple(w.shape) != (S, B, nI):
        raise ValueError(f"indexer_scores: w shape {tuple(w.shape)} != (S, B, nI) = {(S, B, nI)}")


def indexer_scores(qI: torch.Tensor, kI: torch.Tensor, w: torch.Tensor, ratio: int) -> torch.Tensor:
    """qI [S,B,nI,cI], kI [T,B,cI], w [S,B,nI] -> I [S,B,T] fp32 (fp64 for fp64 qI; -inf on non-causal entries)."""
    check_scores_args(qI, kI, w, ratio)
    S, B, nI, cI = qI.shape
    T = kI.shape[0]
    dt = torch.promote_types(qI.dtype, torch.float32)                          # fp32 (fp64 stays fp64)
    logits = torch.einsum("sbhc,tbc->sbht", qI.to(dt), kI.to(dt))           # [S, B, nI, T]
    scores = torch.relu(logits) * cI ** -0.5
    weights = w.to(dt) * nI ** -0.5                                            # [S, B, nI]
    I = (scores * weights[..., None]).sum(dim=2)                                # [S, B, T]
    causal = causal_entry_mask(S, T, ratio, device=qI.device)                   # [S, T]
    return I.masked_fill(~causal[:, None, :], float("-inf"))


def indexer_topk(I: torch.Tensor, k: int) -> torch.Tensor:
    """I [S,B,T] -> idx [S,B,min(k,T)] long; -1 where the picked entry is not causal (score -inf)."""
    if k < 1:
        raise ValueError(f"indexer_topk: k must be >= 1, got {k}")
    kk = min(k, I.shape[-1])
    vals, idx = torch.sort(I.detach(), dim=-1, descending=True, stable=True)   # ties: lower index first
    vals, idx = vals[..., :kk], idx[..., :kk]
    return torch.where(torch.isneginf(vals), torch.full_like(idx, -1), idx)
