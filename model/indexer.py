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
                    window: int, scale: float, teacher: str, chunk: int | None = None,
                    idx: torch.Tensor | None = None) -> torch.Tensor:
    """Target distribution P [S,B,T] fp32 (rows sum to 1 where the row has candidates, 0 elsewhere). Detached.

    q [S,B,H,c], kv [S,B,c] (window keys, = values), comp [T,B,c], cand [S,B,T] bool, sink [H].
    With ℓ[t,h,j] = (q[t,h] . comp[j]) * scale for candidate entries j of query t:
      "joint":        p[t,h,j] = exp(ℓ[t,h,j]) / Z[t,h],  Z[t,h] = sum over the keys the attention softmax saw
                      (window keys t-window < s <= t, the candidate entries, and exp(sink[h])) -- the main
                      attention's own probability of entry j in head h. Then P[t,j] = sum_h p[t,h,j], L1-normalised
                      over j in the candidate set (heads with more compressed mass weigh more).
      "renormalized": p[t,h,j] = softmax over the candidate entries only of ℓ[t,h,:] (each head has unit mass,
                      window and sink ignored); P[t,j] = sum_h p[t,h,j] / H.
    Computed over blocks of `chunk` queries (the window logits only over the keys a block can see), so the
    memory is O(chunk * (T + chunk + window)) per (b, h), never [S, S] or [S, H, T]. With `idx` [S,B,k] (-1 =
    none; then cand must be `candidates_from_idx(idx, T)`) the compressed logits are formed only at the k listed
    entries (O(chunk * k) per (b, h)) and scattered into P: the same values.
    """
    if teacher not in ("joint", "renormalized"):
        raise ValueError(f"indexer_teacher: teacher must be joint|renormalized, got {teacher!r}")
    S, B, H, c = q.shape
    T = comp.shape[0]
    dt = torch.promote_types(q.dtype, torch.float32)                                # fp32 (fp64 stays)
    compf = comp.detach().to(dt)
    if chunk is None:      # the largest power of two (256..S) whose fp32 logits block stays under 256 MiB
        n_c = T if idx is None else idx.shape[-1]
        chunk = 256
        while chunk < S and 2 * chunk * B * H * (n_c + 2 * chunk + window) * 4 <= 2 ** 28:
            chunk *= 2
    P = torch.zeros(S, B, T, dtype=dt, device=q.device)
    for a in range(0, S, chunk):
        e = min(S, a + chunk)
        qf = q[a:e].detach().to(dt)                                                  # [C, B, H, c]
        if idx is None:
            cc = cand[a:e]                                                           # [C, B, T]
            lc = torch.einsum("sbhc,tbc->sbht", qf, compf) * scale                   # [C, B, H, T]
        else:
            cc = idx[a:e] >= 0                                                       # [C, B, k]
            safe = idx[a:e].clamp_min(0)
            g = compf.transpose(0, 1)[torch.arange(B, device=q.device)[None, :, None], safe]   # [C, B, k, c]
            lc = torch.einsum("sbhc,sbkc->sbhk", qf, g) * scale                      # [C, B, H, k]
        lc = lc.masked_fill(~cc[:, :, None, :], float("-inf"))
        if teacher == "joint":
            k0 = max(0, a - window + 1)                                              # first key block a can see
            t = torch.arange(a, e, device=q.device)
            s = torch.arange(k0, e, device=q.device)
            band = (s[None, :] <= t[:, None]) & (s[None, :] > t[:, None] - window)   # [C(query), K(key)]
            lw = torch.einsum("sbhc,ubc->sbhu", qf, kv[k0:e].detach().to(dt)) * scale   # [C, B, H, K]
            lw = lw.masked_fill(~band[:, None, None, :], float("-inf"))
            ls = sink.detach().to(dt).view(1, 1, H, 1).expand(e - a, B, H, 1)
            lse = torch.logsumexp(torch.cat([lw, lc, ls], dim=-1), dim=-1, keepdim=True)   # [C, B, H, 1]
            p = torch.exp(lc - lse)                                                  # 0 outside cand
        else:
            lse = torch.logsumexp(lc, dim=-1, keepdim=True)
            p = torch.where(cc[:, :, None, :], torch.exp(lc - lse), torch.zeros_like(lc))
        if idx is None:
            P[a:e] = p.sum(dim=2)                                                    # [C, B, T]
        else:
            P[a:e].scatter_add_(-1, safe, p.sum(dim=2).masked_fill(~cc, 0.0))        # [C, B, k] -> [C, B, T]
    total = P.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, P / total.clamp_min(torch.finfo(P.dtype).tiny), torch.zeros_like(P))


class _CandidateKL(torch.autograd.Function):
    """Mean over rows with >= 1 candidate of KL(target || softmax over the candidates of scores), computed over
    row blocks; saves only the inputs and the per-row log-sum-exp (no [rows, T] temporaries kept)."""

    @staticmethod
    def forward(ctx, scores, target, cand, chunk):
        T = scores.shape[-1]
        dt = torch.promote_types(scores.dtype, torch.float32)
        s2, t2, c2 = scores.flatten(0, -2), target.flatten(0, -2), cand.flatten(0, -2)
        R = s2.shape[0]
        n = c2.any(dim=-1).sum().to(dt)                                              # rows with a candidate
        lse = torch.empty(R, dtype=dt, device=scores.device)
        total = torch.zeros((), dtype=dt, device=scores.device)
        for a in range(0, R, chunk):
            c = c2[a:a + chunk]
            s = s2[a:a + chunk].to(dt).masked_fill(~c, float("-inf"))
            tg = t2[a:a + chunk].to(dt)
            l = torch.logsumexp(s, dim=-1)                                           # -inf on rows without any
            logq = (s - l[:, None]).masked_fill(~c, 0.0)
            total += torch.where(c, torch.xlogy(tg, tg) - tg * logq, torch.zeros_like(logq)).sum()
            lse[a:a + chunk] = l
        ctx.save_for_backward(scores, target, cand, lse, n)
        ctx.chunk = chunk
        return total / n.clamp_min(1)

    @staticmethod
    def backward(ctx, g):
        scores, target, cand, lse, n = ctx.saved_tensors
        T = scores.shape[-1]
        dt = lse.dtype
        s2, t2, c2 = scores.flatten(0, -2), target.flatten(0, -2), cand.flatten(0, -2)
        grad = torch.empty_like(s2)
        coef = g.to(dt) / n.clamp_min(1)
        for a in range(0, s2.shape[0], ctx.chunk):
            c = c2[a:a + ctx.chunk]
            tg = t2[a:a + ctx.chunk].to(dt).masked_fill(~c, 0.0)
            qv = torch.exp(s2[a:a + ctx.chunk].to(dt) - lse[a:a + ctx.chunk, None])
            d = torch.where(c, qv * tg.sum(-1, keepdim=True) - tg, torch.zeros_like(qv)) * coef
            grad[a:a + ctx.chunk] = d.to(grad.dtype)
        return grad.view_as(scores), None, None, None


def indexer_kl_loss(scores: torch.Tensor, target: torch.Tensor, cand: torch.Tensor,
                    chunk: int = 4096) -> torch.Tensor:
    """Mean over queries with >= 1 candidate of KL(target[t] || softmax over the candidates of scores[t]).

    scores [S,B,T] (the indexer's I, differentiable), target [S,B,T] (detached, 0 outside cand), cand [S,B,T].
    Queries without any candidate (t < m-1) are left out of the mean; returns 0 (with a graph) if none has one.
    Gradient (per row with candidates, N of them): (softmax_cand(scores) * sum(target) - target) / N on the
    candidates, 0 elsewhere. No host synchronisation.
    """
    return _CandidateKL.apply(scores, target.detach(), cand, chunk)
