"""Lightning indexer of CSA layers (spec §7) and its auxiliary KL loss (spec §10.3).

Parameters (official names): `compressor` (its own overlapping compressor, D = c_I, ratio m), `wq_b`
[n_I*c_I, d_c] applied to the attention's q latent cQ (no separate q down-projection), `weights_proj` [n_I, d].

Scores (kernel op `indexer_scores`, fp32), on a packed token stream (model/layout.py):
    qI = RoPE_compress(cQ @ wq_b^T)  [Tq,n_I,c_I]    (last r dims, query position)
    KI = compressor(h)               [N,c_I]         (RoPE at each entry's first token; static entry slots)
    I[t,n] = sum_h (w[t,h] * n_I^-1/2) * ReLU(qI[t,h] . KI[n]) * c_I^-1/2,   w = h @ weights_proj^T;
    I[t,n] = -inf unless entry n is in t's document and complete (j < floor((pos_t+1)/m)).
Top-k (`indexer_topk`): the min(k, N) best entries, ties -> lower index first, -1 for not visible picks.
QK precision (`qk_precision`, set from outside by the precision recipe, model/lowp/recipe.py): "bf16" (the
scores above), "fp8" or "fp4" (Hadamard-rotated qI, KI fake-quantised, BF16 scores; kernels/indexer/fp4.py).
`qk_rerank` m > 0 (recipe `indexer_qk_rerank`) at fp8 / fp4: the low-precision scores pick k' = ceil(k (1 + m))
entries, their high-precision listed scores pick the k (fp4.py `rerank_topk`), and the sparse-mode loss re-forms
those high-precision scores; the dense [Tq, N] scores (and the dense-mode loss) stay low precision.
Scoring forward on the "triton" backend (`scores_fwd`, DSv4Model.set_indexer_fwd): "triton" (default) | "cudnn"
(NVIDIA cudnn-frontend's SM90 indexer forward, bf16 or at qk_precision "fp8" FP8 E4M3, + our Triton backward where
the call qualifies, the Triton forward elsewhere; kernels/indexer/cudnn_fwd.py). The top-k is ours either way.

The indexer is fed DETACHED inputs (h, cQ): top-k is a hard selection, so the LM loss never reaches the indexer,
and the indexer loss never reaches the main model -- the indexer is trained only by `indexer_kl_loss`.
"""
from __future__ import annotations

import torch
from torch import nn

from dsv4.kernels.indexer import indexer_scores, indexer_scores_listed, indexer_topk
from dsv4.kernels.indexer.fp4 import (qk_fake_quant, quantised_listed_scores, quantised_scores, rerank_topk,
                                      rerank_width)
from dsv4.kernels.sparse_attn import entry_probs
from dsv4.kernels.sparse_attn.naive import window_keys

from .compressor import Compressor
from .config import DSv4Config
from .rope import RotaryTable


# Indexer.scores_fwd (DSv4Model.set_indexer_fwd) -> the scoring's kernel backend on the "triton" backend
INDEXER_FWDS = {"triton": "triton", "cudnn": "triton+cudnn"}


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
        self.qk_precision = "bf16"            # "bf16" | "fp8" | "fp4" (kernels/indexer/fp4.py QK_PRECISIONS)
        self.qk_rerank = 0.0                  # > 0 at fp8 / fp4: pick ceil(k (1 + it)), re-rank them in bf16
        self.scores_fwd = "triton"            # "triton" | "cudnn" (INDEXER_FWDS; no effect on the "naive" backend)

    def forward(self, x: torch.Tensor, cq: torch.Tensor, ctx, layout, backend: str = "naive",
                dense_grad: bool = True, return_feats: bool = False, slots=None):
        """x [T',d] the rows the layer sees (halo + local), cq [Tq,d_c] of the local queries (both already
        detached by the caller), ctx = (seg, pos, rope_pos, q_offset) of x's rows, layout (gathers the other
        ranks' entries) -> (scores I [Tq,N] fp32 (bf16 at qk_precision fp8 / fp4), selected idx [Tq,min(k,N)]
        long (-1 = none), entry_seg [N], entry_j [N]; with return_feats also the features of `listed_scores`).
        dense_grad=False: the [Tq,N] scores only pick the top-k (no graph through them); the sparse-mode loss
        re-forms the k listed scores from the features (at fp8 / fp4 the rotated, fake-quantised ones).
        slots: the compressor's precomputed slot metadata of x's rows (`Layout.compress_slots`), or None."""
        seg, pos, rope_pos, q0 = ctx
        Tq = cq.shape[0]
        kI, eseg, ej = layout.gather_entries(*self.compressor(x, seg, pos, rope_pos, q0, backend=backend,
                                                              slots=slots))
        q = self.wq_b(cq).view(Tq, self.n_heads, self.head_dim)                      # [Tq, n_I, c_I]
        q = self.rope(q, rope_pos[q0:])
        w = self.weights_proj(x[q0:])                                               # [Tq, n_I]
        quant = self.qk_precision != "bf16"
        qs, ks = q, kI
        if quant:                                   # rotated + fake-quantised features (straight through)
            qs, ks = qk_fake_quant(q, self.qk_precision), qk_fake_quant(kI, self.qk_precision)
        sb = INDEXER_FWDS[self.scores_fwd] if backend == "triton" else backend      # the scoring's backend
        with torch.set_grad_enabled(dense_grad and torch.is_grad_enabled()):
            scores = (quantised_scores(qs, ks, w, self.ratio, seg[q0:], pos[q0:], eseg, ej, sb, self.qk_precision)
                      if quant else indexer_scores(q, kI, w, self.ratio, seg[q0:], pos[q0:], eseg, ej, backend=sb))
        if quant and self.qk_rerank > 0:            # low precision pre-filters k', high precision picks the k
            wide = indexer_topk(scores, rerank_width(self.topk, scores.shape[-1], self.qk_rerank), backend=backend)
            idx = rerank_topk(wide, q, kI, w, self.topk, backend=backend)           # [Tq, k]
            feats = (q, kI, w, False)               # the loss re-forms the scores that picked: high precision
        else:
            idx = indexer_topk(scores, self.topk, backend=backend)                  # [Tq, N] fp32 | bf16 -> [Tq, k]
            feats = (qs, ks, w, quant)
        return (scores, idx, eseg, ej, feats) if return_feats else (scores, idx, eseg, ej)

    def extra_repr(self) -> str:
        return f"scores_fwd={self.scores_fwd}" if self.scores_fwd != "triton" else ""

    @staticmethod
    def listed_scores(feats, idx: torch.Tensor, backend: str = "naive") -> torch.Tensor:
        """The scores I at the listed entries idx [Tq,k] -> [Tq,k] fp32 (-inf at -1), differentiable: re-formed
        from (qI, kI, w) (kernel op `indexer_scores_listed`); at qk_precision fp8 / fp4 from the quantised
        features, rounded to BF16 like the dense scores."""
        q, kI, w, quant = feats
        if quant:
            return quantised_listed_scores(q, kI, w, idx, backend=backend)
        return indexer_scores_listed(q, kI, w, idx, backend=backend)


def candidates_from_idx(idx: torch.Tensor, N: int) -> torch.Tensor:
    """idx [..., k] (-1 = none) -> bool [..., N], True at the listed entries."""
    safe = torch.where(idx < 0, torch.full_like(idx, N), idx)
    cand = torch.zeros(*idx.shape[:-1], N + 1, dtype=torch.bool, device=idx.device)
    cand.scatter_(-1, safe, True)
    return cand[..., :N]


@torch.no_grad()
def indexer_teacher(q: torch.Tensor, kv: torch.Tensor, comp: torch.Tensor, cand: torch.Tensor, sink: torch.Tensor,
                    window: int, scale: float, teacher: str, seg: torch.Tensor, pos: torch.Tensor,
                    q_offset: int = 0, chunk: int | None = None, idx: torch.Tensor | None = None) -> torch.Tensor:
    """Target distribution P [Tq,N] fp32 (rows sum to 1 where the row has candidates, 0 elsewhere). Detached.

    q [Tq,H,c] (query t = key row q_offset + t), kv [Tk,c] (window keys, = values) with seg / pos [Tk],
    comp [N,c], cand [Tq,N] bool, sink [H]. With l[t,h,n] = (q[t,h] . comp[n]) * scale for candidates n of t:
      "joint":        p[t,h,n] = exp(l[t,h,n]) / Z[t,h],  Z[t,h] = sum over the keys the attention softmax saw
                      (the window keys of t's document, kernels/sparse_attn, the candidate entries, and
                      exp(sink[h])) -- the main attention's own probability of entry n in head h. Then
                      P[t,n] = sum_h p[t,h,n], L1-normalised over the candidates (heads with more compressed
                      mass weigh more).
      "renormalized": p[t,h,n] = softmax over the candidate entries only of l[t,h,:] (each head has unit mass,
                      window and sink ignored); P[t,n] = sum_h p[t,h,n] / H.
    Computed over blocks of `chunk` queries, so the memory is O(chunk * (N + window)) per head, never
    [Tq, H, N] at once. With `idx` [Tq,k] (-1 = none; then cand must be `candidates_from_idx(idx, N)`) the
    compressed logits are formed only at the k listed entries (O(chunk * k) per head) and scattered into P.
    """
    if teacher not in ("joint", "renormalized"):
        raise ValueError(f"indexer_teacher: teacher must be joint|renormalized, got {teacher!r}")
    Tq, H, c = q.shape
    N = comp.shape[0]
    dt = torch.promote_types(q.dtype, torch.float32)                                # fp32 (fp64 stays)
    compf = comp.detach().to(dt)
    kvf = kv.detach().to(dt)
    if chunk is None:      # the largest power of two (256..Tq) whose fp32 logits block stays under 256 MiB
        n_c = N if idx is None else idx.shape[-1]
        chunk = 256
        while chunk < Tq and 2 * chunk * H * (n_c + window) * 4 <= 2 ** 28:
            chunk *= 2
    wrows, wvalid = window_keys(seg, pos, Tq, window, q_offset)                      # [Tq, W]
    P = torch.zeros(Tq, N, dtype=dt, device=q.device)
    for a in range(0, Tq, chunk):
        e = min(Tq, a + chunk)
        qf = q[a:e].detach().to(dt)                                                  # [C, H, c]
        if idx is None:
            cc = cand[a:e]                                                           # [C, N]
            lc = torch.einsum("thc,nc->thn", qf, compf) * scale                      # [C, H, N]
        else:
            cc = idx[a:e] >= 0                                                       # [C, k]
            safe = idx[a:e].clamp_min(0)
            lc = torch.einsum("thc,tkc->thk", qf, compf[safe]) * scale               # [C, H, k]
        lc = lc.masked_fill(~cc[:, None, :], float("-inf"))
        if teacher == "joint":
            lw = torch.einsum("thc,twc->thw", qf, kvf[wrows[a:e]]) * scale           # [C, H, W]
            lw = lw.masked_fill(~wvalid[a:e, None, :], float("-inf"))
            ls = sink.detach().to(dt).view(1, H, 1).expand(e - a, H, 1)
            lse = torch.logsumexp(torch.cat([lw, lc, ls], dim=-1), dim=-1, keepdim=True)   # [C, H, 1]
            p = torch.exp(lc - lse)                                                  # 0 outside cand
        else:
            lse = torch.logsumexp(lc, dim=-1, keepdim=True)
            p = torch.where(cc[:, None, :], torch.exp(lc - lse), torch.zeros_like(lc))
        if idx is None:
            P[a:e] = p.sum(dim=1)                                                    # [C, N]
        else:
            P[a:e].scatter_add_(-1, safe, p.sum(dim=1).masked_fill(~cc, 0.0))        # [C, k] -> [C, N]
    total = P.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, P / total.clamp_min(torch.finfo(P.dtype).tiny), torch.zeros_like(P))


@torch.no_grad()
def indexer_teacher_listed(q: torch.Tensor, comp: torch.Tensor, idx: torch.Tensor, lse: torch.Tensor, ratio: int,
                           scale: float, seg: torch.Tensor, pos: torch.Tensor, entry_seg: torch.Tensor,
                           entry_j: torch.Tensor, q_offset: int = 0, backend: str = "naive",
                           probs: torch.Tensor | None = None) -> torch.Tensor:
    """The "joint" teacher over the listed entries (sparse mode) from the attention's own log-sum-exp:
    P[t,j] = sum_h exp(l[t,h,idx[t,j]] - lse[t,h]), L1-normalised over j (== `indexer_teacher` with teacher="joint"
    and idx, whose Z[t,h] is this lse, gathered at idx). lse [Tq,H] from `sparse_attn(..., return_lse=True)`, so
    window keys and sink are not scored again; kernel op `entry_probs` -> P [Tq,k] fp32 (0 at -1), unless the
    attention already returned this P (`probs`, `sparse_attn(..., return_probs=True)` on backend "triton")."""
    P = probs if probs is not None else entry_probs(q, comp, idx, lse, ratio, scale, seg, pos, entry_seg, entry_j,
                                                    q_offset, backend=backend)
    total = P.sum(dim=-1, keepdim=True)                                             # [Tq, k], 0 at -1
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

    scores [..., N] (the indexer's I, [Tq, N] in the model; differentiable), target [..., N] (detached, 0 outside
    cand), cand [..., N] bool: every leading index is one query.
    Queries without any candidate (t < m-1) are left out of the mean; returns 0 (with a graph) if none has one.
    Gradient (per row with candidates, N of them): (softmax_cand(scores) * sum(target) - target) / N on the
    candidates, 0 elsewhere. No host synchronisation.
    """
    return _CandidateKL.apply(scores, target.detach(), cand, chunk)
