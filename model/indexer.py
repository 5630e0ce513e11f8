"""Lightning indexer of CSA layers (spec §7) and its auxiliary KL loss (spec §10.3).

Parameters (official names): `compressor` (its own overlapping compressor, D = c_I, ratio m), `wq_b`
[n_I*c_I, d_c] applied to the attention's q latent cQ (no separate q down-projection), `weights_proj` [n_I, d].

Scores (kernel op `indexer_scores`, fp32):
    qI = RoPE_compress(cQ @ wq_b^T)  [S,B,n_I,c_I]   (last r dims, query position)
    KI = compressor(h)               [T,B,c_I]       (RoPE at each entry's first token)
    I[t,j] = sum_h (w[t,h] * n_I^-1/2) * ReLU(qI[t,h] . KI[j]) * c_I^-1/2,   w = h @ weights_proj^T;
    I[t,j] = -inf for j >= floor((t+1)/m).
Top-k (`indexer_topk`): the min(k, T) best entries, ties -> lower index first, -1 for non-causal picks.

The indexer is fed DETACHED inputs (h, cQ): top-k is a hard selection, so the LM loss never reaches the indexer,
and the indexer loss never reaches the main model -- the indexer is trained only by `indexer_kl_loss`.
"""
from __future__ import annotations

import torch
from torch import nn

from dsv4.kernels.indexer import indexer_scores, indexer_topk

from .compressor import Compressor
from .config import DSv4Config
from .rope import RotaryTable


class Indexer(nn.Module):
    def __init__(self, cfg: DSv4Config, rope: RotaryTable):
        super().__init__()
        self.n_heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        self.ratio, self.topk = cfg.csa_ratio, cfg.index_topk
        self.compressor = Compressor(cfg.hidden_size, cfg.index_head_dim, cfg.csa_ratio, overlap=True, rope=rope,
                                     eps=cfg.rms_norm_eps)
        self.wq_b = nn.Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, bias=False)
        self.weights_proj = nn.Linear(cfg.hidden_size, cfg.index_n_heads, bias=False)
        self.rope = rope

    def forward(self, x: torch.Tensor, cq: torch.Tensor, positions: torch.Tensor,
                backend: str = "naive") -> tuple[torch.Tensor, torch.Tensor]:
        """x [S,B,d], cq [S,B,d_c] (both already detached by the caller), positions [S]
        -> scores I [S,B,T] fp32, selected idx [S,B,min(k,T)] long (-1 = none)."""
        S, B, _ = x.shape
        k_idx = self.compressor(x, positions, backend=backend)                     # [T, B, c_I]
        q = self.wq_b(cq).view(S, B, self.n_heads, self.head_dim)                   # [S, B, n_I, c_I]
        q = self.rope(q, positions)
        w = self.weights_proj(x)                                                    # [S, B, n_I]
        scores = indexer_scores(q, k_idx, w, self.ratio, backend=backend)           # [S, B, T]
        idx = indexer_topk(scores, self.topk, backend=backend)                      # [S, B, k]
        return scores, idx


def candidates_from_idx(idx: torch.Tensor, T: int) -> torch.Tensor:
    """idx [S,B,k] (-1 = none) -> bool [S,B,T], True at the listed entries."""
    S, B, _ = idx.shape
    safe = torch.where(idx < 0, torch.full_like(idx, T), idx)
    cand = torch.zeros(S, B, T + 1, dtype=torch.bool, device=idx.device)
    cand.scatter_(-1, safe, True)
    return cand[..., :T]


@torch.no_grad()
def indexer_teacher(q: torch.Tensor, kv: torch.Tensor, comp: torch.Tensor, cand: torch.Tensor, sink: torch.Tensor,
                    window: int, scale: float, teacher: str) -> torch.Tensor:
    """Target distribution P [S,B,T] fp32 (rows sum to 1 where the row has candidates, 0 elsewhere). Detached.

    q [S,B,H,c], kv [S,B,c] (window keys, = values), comp [T,B,c], cand [S,B,T] bool, sink [H].
    With ℓ[t,h,j] = (q[t,h] . comp[j]) * scale for candidate entries j of query t:
      "joint":        p[t,h,j] = exp(ℓ[t,h,j]) / Z[t,h],  Z[t,h] = sum over the keys the attention softmax saw
                      (window keys t-window < s <= t, the candidate entries, and exp(sink[h])) -- the main
                      attention's own probability of entry j in head h. Then P[t,j] = sum_h p[t,h,j], L1-normalised
                      over j in the candidate set (heads with more compressed mass weigh more).
      "renormalized": p[t,h,j] = softmax over the candidate entries only of ℓ[t,h,:] (each head has unit mass,
                      window and sink ignored); P[t,j] = sum_h p[t,h,j] / H.
    """
    S, B, H, c = q.shape
    dt = torch.promote_types(q.dtype, torch.float32)                                # fp32 (fp64 stays)
    qf, compf = q.detach().to(dt), comp.detach().to(dt)
    lc = torch.einsum("sbhc,tbc->sbht", qf, compf) * scale                          # [S, B, H, T]
    lc = lc.masked_fill(~cand[:, :, None, :], float("-inf"))
    if teacher == "joint":
        t = torch.arange(S, device=q.device)
        band = (t[None, :] <= t[:, None]) & (t[None, :] > t[:, None] - window)      # [S(query), S(key)]
        lw = torch.einsum("sbhc,ubc->sbhu", qf, kv.detach().to(dt)) * scale        # [S, B, H, S]
        lw = lw.masked_fill(~band[:, None, None, :], float("-inf"))
        ls = sink.detach().to(dt).view(1, 1, H, 1).expand(S, B, H, 1)
        lse = torch.logsumexp(torch.cat([lw, lc, ls], dim=-1), dim=-1, keepdim=True)   # [S, B, H, 1]
        p = torch.exp(lc - lse)                                                      # 0 outside cand
    elif teacher == "renormalized":
        lse = torch.logsumexp(lc, dim=-1, keepdim=True)
        p = torch.where(cand[:, :, None, :], torch.exp(lc - lse), torch.zeros_like(lc))
    else:
        raise ValueError(f"indexer_teacher: teacher must be joint|renormalized, got {teacher!r}")
    P = p.sum(dim=2)                                                                 # [S, B, T]
    total = P.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, P / total.clamp_min(torch.finfo(P.dtype).tiny), torch.zeros_like(P))


def indexer_kl_loss(scores: torch.Tensor, target: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
    """Mean over queries with >= 1 candidate of KL(target[t] || softmax over the candidates of scores[t]).

    scores [S,B,T] (the indexer's I, differentiable), target [S,B,T] (detached, 0 outside cand), cand [S,B,T].
    Queries without any candidate (t < m-1) are left out of the mean; returns 0 (with a graph) if none has one.
    """
    valid = cand.any(dim=-1)                                                         # [S, B]
    if not bool(valid.any()):
        return scores.float().masked_fill(~cand, 0.0).sum() * 0.0
    dt = torch.promote_types(scores.dtype, torch.float32)
    c, tgt = cand[valid], target[valid].to(dt)                                       # [N, T]
    logq = torch.log_softmax(scores.to(dt)[valid].masked_fill(~c, float("-inf")), dim=-1)
    logq = logq.masked_fill(~c, 0.0)
    kl = torch.where(c, torch.xlogy(tgt, tgt) - tgt * logq, torch.zeros_like(logq)).sum(-1)   # [N]
    return kl.mean()
