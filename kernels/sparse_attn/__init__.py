"""Hybrid sparse attention op (spec §5.2-5.3): `sparse_attn(..., backend="naive"|"triton")` via `kernels.get_op`."""
from __future__ import annotations

from dsv4.kernels import get_op


def sparse_attn(q, kv, comp, comp_idx, sink, window: int, ratio: int, scale: float, seg, pos, entry_seg=None,
                entry_j=None, q_offset: int = 0, return_lse: bool = False, backend: str = "naive"):
    """q [Tq,H,c], kv [Tk,c], comp [N,c] | None, comp_idx [Tq,k] | None, sink [H], seg/pos [Tk], entry_seg /
    entry_j [N] -> o [Tq,H,c] (with return_lse: (o, lse [Tq,H])). See `naive.sparse_attn`."""
    return get_op("sparse_attn", backend, q.device)(q, kv, comp, comp_idx, sink, window, ratio, scale, seg, pos,
                                                     entry_seg, entry_j, q_offset, return_lse)


def entry_probs(q, comp, comp_idx, lse, ratio: int, scale: float, seg, pos, entry_seg, entry_j, q_offset: int = 0,
                backend: str = "naive"):
    """The attention's mass on each listed entry, summed over heads: [Tq,k]. See `naive.entry_probs`."""
    return get_op("sparse_attn_entry_probs", backend, q.device)(q, comp, comp_idx, lse, ratio, scale, seg, pos,
                                                                 entry_seg, entry_j, q_offset)
