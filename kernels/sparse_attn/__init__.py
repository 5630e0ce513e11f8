"""Hybrid sparse attention op (spec §5.2-5.3): `sparse_attn(..., backend="naive")`; backends register in _IMPLS."""
from __future__ import annotations

from . import naive

_IMPLS = {"naive": naive.sparse_attn}


def sparse_attn(q, kv, comp, comp_idx, sink, window: int, ratio: int, scale: float, backend: str = "naive"):
    """q [S,B,H,c], kv [S,B,c], comp [T,B,c] | None, comp_idx [S,B,k] | None, sink [H] -> o [S,B,H,c]."""
    if backend == "triton" and "triton" not in _IMPLS:             # lazy: triton is imported only when asked for
        from . import triton as _triton
        _IMPLS["triton"] = _triton.sparse_attn
    if backend not in _IMPLS:
        raise ValueError(f"sparse_attn: unknown backend {backend!r}; known: {', '.join(_IMPLS)}")
    return _IMPLS[backend](q, kv, comp, comp_idx, sink, window, ratio, scale)
