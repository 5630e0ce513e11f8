"""Compressor pooling op (spec §6). `compress_pool(..., backend="naive")`; other backends register in _IMPLS."""
from __future__ import annotations

from . import naive

_IMPLS = {"naive": naive.compress_pool}


def compress_pool(kv, gate, ape, ratio: int, overlap: bool, seg, pos, first: int = 0, backend: str = "naive"):
    """kv, gate [T,coff*D]; ape [m, coff*D]; seg / pos [T] -> (pooled [N, D], entry_seg [N], entry_j [N], ends [N])
    in N = ceil((T - first) / m) static slots. See `naive.compress_pool`."""
    if backend == "triton" and "triton" not in _IMPLS:             # lazy: triton is imported only when asked for
        from . import triton as _triton
        _IMPLS["triton"] = _triton.compress_pool
    if backend not in _IMPLS:
        raise ValueError(f"compress_pool: unknown backend {backend!r}; known: {', '.join(_IMPLS)}")
    return _IMPLS[backend](kv, gate, ape, ratio, overlap, seg, pos, first)
