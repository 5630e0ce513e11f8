"""Hybrid sparse attention with a sink on a packed token stream, plain PyTorch reference (spec §5.2, §5.3).

Layout THD: queries q [Tq, H, c] are the key-stream rows q_offset .. q_offset + Tq - 1 of kv [Tk, c] (K = V,
one shared head); the first q_offset rows are left context only (a context-parallel halo). Document metadata
(model/layout.py): seg / pos [Tk] of the key stream (seg -1 = padding), entry_seg / entry_j [N] of the
compressed entries (kernels/compressor; empty slots have seg -1). For query t (key row u = q_offset + t) and
head h, ONE softmax over
    window keys      rows s in u - window < s <= u with seg[s] == seg[u] >= 0 and pos[u] - window < pos[s] <= pos[u]
    compressed keys  comp_idx given (CSA): the entries listed in comp_idx[t] (-1 = none) that are visible;
                     comp_idx None, comp given (HCA): every visible entry;
                     visible = same document and complete: entry_j < floor((pos[u]+1)/ratio)
    the sink logit   sink[h] (no value)
with logits (q . k) * scale; o[t,h] = sum_s p_s * V_s. A plain sequence is one document (seg 0, pos 0..S-1).
A padding query sees only the sink: its output is 0. Logits / softmax in fp32 (fp64 for fp64 q); output in
q's dtype. Memory O(Tq * (window + k)) for CSA, O(Tq * (window + N)) for HCA; no [Tq, Tk] matrix.
"""
from __future__ import annotations

import torch

from dsv4.kernels.indexer.naive import causal_entry_mask
from dsv4.kernels._varlen import clamp_rows


def check_args(q, kv, comp, comp_idx, sink, window, ratio, seg, pos, entry_seg, entry_j, q_offset) -> None:
    """The argument contract of sparse_attn, shared by every backend (one-line errors)."""
    if q.dim() != 3:
        raise ValueError(f"sparse_attn: q must be [Tq, H, c], got {tuple(q.shape)}")
    Tq, H, c = q.shape
    if kv.dim() != 2 or kv.shape[1] != c or kv.shape[0] < q_offset + Tq:
        raise ValueError(f"sparse_attn: kv shape {tuple(kv.shape)} != (Tk >= q_offset + Tq, c) "
                         f"with q_offset={q_offset}, Tq={Tq}, c={c}")
    if tuple(sink.shape) != (H,):
        raise ValueError(f"sparse_attn: sink shape {tuple(sink.shape)} != (H,) = {(H,)}")
    if window < 1:
        raise ValueError(f"sparse_attn: window must be >= 1, got {window}")
    if tuple(seg.shape) != (kv.shape[0],) or tuple(pos.shape) != (kv.shape[0],):
        raise ValueError(f"sparse_attn: seg / pos must be [Tk] = [{kv.shape[0]}]")
    if comp is not None and comp.shape[0] > 0:
        N = comp.shape[0]
        if tuple(comp.shape) != (N, c):
            raise ValueError(f"sparse_attn: comp shape {tuple(comp.shape)} != (N, c) = {(N, c)}")
        if entry_seg is None or entry_j is None or tuple(entry_seg.shape) != (N,) or tuple(entry_j.shape) != (N,):
            raise ValueError(f"sparse_attn: entry_seg / entry_j must be [N] = [{N}] with comp")
        if ratio <= 0:
            raise ValueError(f"sparse_attn: ratio must be positive, got {ratio}")
        if comp_idx is not None and comp_idx.shape[0] != Tq:
            raise ValueError(f"sparse_attn: comp_idx shape {tuple(comp_idx.shape)} != (Tq, k)")


def window_keys(seg, pos, Tq: int, window: int, q_offset: int):
    """(rows [Tq, W] clamped key rows, valid [Tq, W]) of the window keys of each query (W = window)."""
    u = torch.arange(Tq, device=seg.device) + q_offset                           # key row of each query
    rows = u[:, None] + torch.arange(-(window - 1), 1, device=seg.device)
    inb = rows >= 0
    rc = clamp_rows(rows)
    sq, pq = seg[u][:, None], pos[u][:, None]
    valid = inb & (seg[rc] == sq) & (sq >= 0) & (pos[rc] <= pq) & (pos[rc] > pq - window)
    return rc, valid


def listed_entries(comp_idx, seg_q, pos_q, entry_seg, entry_j, ratio: int):
    """(clamped idx [Tq,k], visible [Tq,k]) of the listed entries: listed (>= 0), same document as the query,
    complete before it (j < (pos + 1) // ratio)."""
    cidx = clamp_rows(comp_idx)
    valid = (comp_idx >= 0) & (entry_seg[cidx] == seg_q[:, None]) & (seg_q[:, None] >= 0) \
        & (entry_j[cidx] < torch.div(pos_q + 1, ratio, rounding_mode="floor")[:, None])
    return cidx, valid


def sparse_attn(q: torch.Tensor, kv: torch.Tensor, comp: torch.Tensor | None, comp_idx: torch.Tensor | None,
                sink: torch.Tensor, window: int, ratio: int, scale: float, seg: torch.Tensor, pos: torch.Tensor,
                entry_seg: torch.Tensor | None = None, entry_j: torch.Tensor | None = None,
                q_offset: int = 0, return_lse: bool = False):
    """q [Tq,H,c], kv [Tk,c], comp [N,c] | None, comp_idx [Tq,k] long | None, sink [H], seg/pos [Tk],
    entry_seg/entry_j [N] -> o [Tq,H,c] (and, with return_lse, the softmax's log-sum-exp [Tq,H], natural log,
    fp32 / fp64, no gradient)."""
    check_args(q, kv, comp, comp_idx, sink, window, ratio, seg, pos, entry_seg, entry_j, q_offset)
    Tq, H, c = q.shape
    dt = torch.promote_types(q.dtype, torch.float32)                            # fp32 (fp64 stays)
    qf = q.to(dt)
    wrows, wvalid = window_keys(seg, pos, Tq, window, q_offset)
    wkeys = kv[wrows].to(dt)                                                    # [Tq, W, c]
    lw = torch.einsum("thc,twc->thw", qf, wkeys) * scale                        # [Tq, H, W]
    lw = lw.masked_fill(~wvalid[:, None, :], float("-inf"))
    lc, cvals = None, None
    if comp is not None and comp.shape[0] > 0:
        sq = seg[q_offset:q_offset + Tq]
        pq = pos[q_offset:q_offset + Tq]
        if comp_idx is not None:                                                # CSA: listed entries
            cidx, cvalid = listed_entries(comp_idx, sq, pq, entry_seg, entry_j, ratio)
            cvals = comp[cidx].to(dt)                                           # [Tq, k, c]
            lc = torch.einsum("thc,tkc->thk", qf, cvals) * scale                # [Tq, H, k]
        else:                                                                   # HCA: all visible entries
            cvalid = causal_entry_mask(sq, pq, entry_seg, entry_j, ratio)       # [Tq, N]
            lc = torch.einsum("thc,nc->thn", qf, comp.to(dt)) * scale           # [Tq, H, N]
        lc = lc.masked_fill(~cvalid[:, None, :], float("-inf"))
    # one softmax over window + compressed + sink (spec §5.3); the values are applied per branch, so the
    # [Tq, W + K, c] key/value concatenation is never built
    ls = sink.to(dt).view(1, H, 1).expand(Tq, H, 1)
    lse = torch.logsumexp(torch.cat([lw, ls] if lc is None else [lw, lc, ls], dim=2), dim=2, keepdim=True)
    o = torch.einsum("thw,twc->thc", torch.exp(lw - lse), wkeys)
    if lc is not None:
        pc = torch.exp(lc - lse)
        o = o + (torch.einsum("thk,tkc->thc", pc, cvals) if cvals is not None
                 else torch.einsum("thn,nc->thc", pc, comp.to(dt)))
    if return_lse:
        return o.to(q.dtype), lse.squeeze(-1).detach()
    return o.to(q.dtype)


@torch.no_grad()
def entry_probs(q: torch.Tensor, comp: torch.Tensor, comp_idx: torch.Tensor, lse: torch.Tensor, ratio: int,
                scale: float, seg: torch.Tensor, pos: torch.Tensor, entry_seg: torch.Tensor, entry_j: torch.Tensor,
                q_offset: int = 0) -> torch.Tensor:
    """The attention's probability mass on each listed entry, summed over heads (the "joint" indexer teacher's
    numerator, spec §10.3): P[t,j] = sum_h exp(q[t,h] . comp[idx[t,j]] * scale - lse[t,h]) for visible listed
    entries, 0 elsewhere. q [Tq,H,c], comp [N,c], comp_idx [Tq,k], lse [Tq,H] (natural log, the sparse
    attention's own, `return_lse=True`) -> [Tq,k] fp32 (fp64 stays). No gradient."""
    Tq = q.shape[0]
    dt = torch.promote_types(q.dtype, torch.float32)
    sq, pq = seg[q_offset:q_offset + Tq], pos[q_offset:q_offset + Tq]
    cidx, cvalid = listed_entries(comp_idx, sq, pq, entry_seg, entry_j, ratio)
    lc = torch.einsum("thc,tkc->thk", q.to(dt), comp[cidx].to(dt)) * scale       # [Tq, H, k]
    p = torch.exp(lc - lse.to(dt)[:, :, None]).sum(1)                            # [Tq, k]
    return torch.where(cvalid, p, torch.zeros_like(p))
