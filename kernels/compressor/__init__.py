"""Compressor pooling op (spec §6): `compress_pool(..., backend="naive"|"triton")` via `kernels.get_op`, and its
slot metadata `compress_slots` (layer-independent: computed once per layout and key, model/layout.py)."""
from __future__ import annotations

from dsv4.kernels import get_op


def compress_slots(seg, pos, ratio: int, overlap: bool, first: int = 0, backend: str = "naive"):
    """seg / pos [T] -> `naive.Slots` (ends, entry_seg, j [N] long-like; r0, hp [N] int32; ratio, overlap, first)
    of the N = ceil((T - first) / m) static slots: what `compress_pool(..., slots=)` takes precomputed."""
    return get_op("compress_slots", backend, seg.device)(seg, pos, ratio, overlap, first)


def compress_pool(kv, gate, ape, ratio: int, overlap: bool, seg, pos, first: int = 0, backend: str = "naive",
                  slots=None):
    """kv, gate [T,coff*D]; ape [m, coff*D]; seg / pos [T] -> (pooled [N, D], entry_seg [N], entry_j [N], ends [N])
    in N = ceil((T - first) / m) static slots. See `naive.compress_pool`. `slots`: the stream's
    `compress_slots(seg, pos, ratio, overlap, first)` computed beforehand (any backend: the same values), else
    computed here."""
    return get_op("compress_pool", backend, kv.device)(kv, gate, ape, ratio, overlap, seg, pos, first, slots=slots)
