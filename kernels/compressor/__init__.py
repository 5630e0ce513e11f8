"""Compressor pooling op (spec §6): `compress_pool(..., backend="naive"|"triton")` via `kernels.get_op`."""
from __future__ import annotations

from dsv4.kernels import get_op


def compress_pool(kv, gate, ape, ratio: int, overlap: bool, seg, pos, first: int = 0, backend: str = "naive"):
    """kv, gate [T,coff*D]; ape [m, coff*D]; seg / pos [T] -> (pooled [N, D], entry_seg [N], entry_j [N], ends [N])
    in N = ceil((T - first) / m) static slots. See `naive.compress_pool`."""
    return get_op("compress_pool", backend, kv.device)(kv, gate, ape, ratio, overlap, seg, pos, first)
