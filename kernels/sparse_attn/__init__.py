"""Hybrid sparse attention op (spec §5.2-5.3): `sparse_attn(..., backend="naive")`; backends register in _IMPLS."""
from __future__ import annotations

from . import naive

_IMPLS = {"naive": naive.sparse_attn}


def sparse_attn(q, kv, comp, comp_idx, sink, window: int, ratio: int, scale: float, seg, pos, entry_seg=None,
                entry_j=None, q_offset: int = 0, backend: str = "naive"):
    """q [Tq,H,c], kv [Tk,c], comp [N,c] | None, comp_idx [Tq,k] | None, sink [H], seg/pos [Tk], entry_seg /
    entry_j [N] -> o [Tq,H,c]. See `naive.sparse_attn`."""
    if backend == "triton" and "triton" not in _IMPLS:             # lazy: triton is imported only when asked for
        from . import triton as _triton
        _IMPLS["triton"] = _triton.sparse_attn
    if backend not in _IMPLS:
        raise ValueError(f"sparse_attn: unknown backend {backend!r}; known: {', '.join(_IMPLS)}")
    return _IMPLS[backend](q, kv, comp, comp_idx, sink, window, ratio, scale, seg, pos, entry_seg, entry_j,
                           q_offset)
