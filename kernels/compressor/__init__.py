"""Compressor pooling op (spec §6): `compress_pool(..., backend="naive"|"triton")` via `kernels.get_op`."""
from __future__ import annotations

from dsv4.kernels import get_op


def compress_pool(kv, gate, ape, ratio: int, overlap: bool, backend: str = "naive"):
    """kv, gate [S,B,coff*D]; ape [m, coff*D] -> [S//m, B, D]. See `naive.compress_pool`."""
    return get_op("compress_pool", backend, kv.device)(kv, gate, ape, ratio, overlap)
