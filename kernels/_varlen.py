"""Visibility ranges of a packed stream for the Triton kernels (tile skipping), computed with static shapes.

Queries carry (seg_q, pos_q) and compressed entries (entry_seg, entry_j) (model/layout.py,
kernels/compressor): entry n is visible to query t iff entry_seg[n] == seg_q[t] >= 0 and
entry_j[n] < (pos_q[t] + 1) // ratio. Both sequences are in stream order (documents in increasing id, positions
and j increasing inside a document; empty entry slots / padding tokens interleaved), so the entries visible to
a query form one index range of the entry slots, and the queries that see an entry one range of the queries;
empty slots / padding inside a range are masked by the kernels. Query positions that do not increase inside a
document still leave every query that sees an entry inside its query range (the ranges need the document order
and, on the entry side, j increasing); `query_cores` then ends its unmasked runs where pos decreases.
"""
from __future__ import annotations

import torch

_BIG = 1 << 32


def clamp_rows(rows: torch.Tensor, lo: int = 0) -> torch.Tensor:
    """max(rows, lo) for key / token rows derived from an arange, written as a `where`: Inductor's index
    propagation turns a clamp of such rows into a sympy Max inside the load index, which torch 2.11's Triton
    tiling cannot compare ("The argument '-127 + ((0))' is not comparable", goldens/h200/D9/compile_gpu_failure.log);
    a `where` stays a value, loaded through an indirect index. Same values as rows.clamp(min=lo)."""
    return torch.where(rows >= lo, rows, lo)


def _sorted_key(key: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """key where valid, else the last valid key before it (-1 before any): non-decreasing, searchable."""
    return torch.cummax(torch.where(valid, key, torch.full_like(key, -1)), 0).values.contiguous()


def entry_ranges(seg_q, pos_q, entry_seg, entry_j, ratio: int):
    """(lo, hi) [Tq] int32: the entry slots lo..hi-1 contain every entry visible to query t (hi = lo: none)."""
    ekey = _sorted_key(entry_seg * _BIG + entry_j, entry_seg >= 0)
    base = seg_q.clamp(min=0) * _BIG
    lo = torch.searchsorted(ekey, base)
    hi = torch.searchsorted(ekey, base + torch.div(pos_q + 1, ratio, rounding_mode="floor"))
    hi = torch.where(seg_q >= 0, hi, lo)
    return lo.to(torch.int32).contiguous(), hi.to(torch.int32).contiguous()


def query_ranges(seg_q, pos_q, entry_seg, entry_j, ratio: int):
    """(lo, hi) [N] int32: the queries lo..hi-1 contain every query that sees entry n (hi = lo: none)."""
    qkey = _sorted_key(seg_q * _BIG + pos_q, seg_q >= 0)
    es = entry_seg.clamp(min=0)
    lo = torch.searchsorted(qkey, es * _BIG + (entry_j + 1) * ratio - 1)
    hi = torch.searchsorted(qkey, (es + 1) * _BIG)
    hi = torch.where(entry_seg >= 0, hi, lo)
    return lo.to(torch.int32).contiguous(), hi.to(torch.int32).contiguous()


def _next_break(brk: torch.Tensor, end: int) -> torch.Tensor:
    """[n] int64: for each i, the smallest index u >= i with brk[u] (end if none)."""
    n = brk.shape[0]
    idx = torch.where(brk, torch.arange(n, device=brk.device), torch.full_like(brk, end, dtype=torch.long))
    return torch.flip(torch.cummin(torch.flip(idx, [0]), 0).values, [0])


def _run_end(lo: torch.Tensor, hi: torch.Tensor, nxt: torch.Tensor) -> torch.Tensor:
    """min(hi, nxt[lo]) where lo < hi, else lo (int32): the end of the unbroken part of lo..hi-1."""
    if nxt.numel() == 0:
        return lo
    at = nxt[lo.long().clamp(max=nxt.shape[0] - 1)]
    return torch.where(lo < hi, torch.minimum(at, hi.long()), lo.long()).to(torch.int32).contiguous()


def query_cores(seg_q, pos_q, qlo, qhi):
    """[N] int32 qrun: the queries qlo[n]..qrun[n]-1 ALL see entry n (`query_ranges`' qlo[n] is the first query that
    sees it; the following ones do too up to the first padding token, other document or decrease of pos, and
    qhi[n] bounds them; a later query of the document with a smaller pos may not see it, so a decrease ends the
    run and its queries fall to the masked boundary tiles). The backward's dk kernel runs query tiles inside every
    entry's core without any visibility mask."""
    S = seg_q.shape[0]
    brk = torch.ones_like(seg_q, dtype=torch.bool)
    if S > 1:
        brk[1:] = (seg_q[1:] != seg_q[:-1]) | (pos_q[1:] < pos_q[:-1])
    brk = brk | (seg_q < 0)
    # nxt[t] = the first u > t that breaks t's run (a document change, padding, pos decreasing): shift by one
    nxt = torch.cat([_next_break(brk, S)[1:], brk.new_full((1,), S, dtype=torch.long)]) if S else brk.long()
    return _run_end(qlo, qhi, nxt)


def entry_cores(entry_seg, elo, ehi):
    """[Tq] int32 erun: the entries elo[t]..erun[t]-1 are ALL visible to query t (`entry_ranges`' elo..ehi-1 holds
    every visible entry and empty slots only; erun stops at the first empty slot). The dq kernel's unmasked tiles."""
    N = entry_seg.shape[0]
    return _run_end(elo, ehi, _next_break(entry_seg < 0, N))
