"""Hybrid sparse attention op (spec §5.2-5.3): `sparse_attn(..., backend="naive"|"triton")` via `kernels.get_op`."""
from __future__ import annotations

from dsv4.kernels import get_op


def sparse_attn(q, kv, comp, comp_idx, sink, window: int, ratio: int, scale: float, backend: str = "naive"):
    """q [S,B,H,c], kv [S,B,c], comp [T,B,c] | None, comp_idx [S,B,k] | None, sink [H] -> o [S,B,H,c]."""
    return get_op("sparse_attn", backend, q.device)(q, kv, comp, comp_idx, sink, window, ratio, scale)
