"""Visibility ranges of a packed stream for the Triton kernels (tile skipping), computed with static shapes.

Queries carry (seg_q, pos_q) and compressed entries (entry_seg, entry_j) (model/layout.py,
kernels/compressor): entry n is visible to query t iff entry_seg[n] == seg_q[t] >= 0 and
entry_j[n] < (pos_q[t] + 1) // ratio. Both sequences are in stream order (documents in increasing id, positions
and j increasing inside a document; empty entry slots / padding tokens interleaved), so the entries visible to
a query form one index range of the entry slots, and the queries that see an entry one range of the queries;
empty slots / padding inside a range are masked by the kernels.
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
