"""MoE combine op (spec §9): `moe_combine(y, w, tok, T, out_dtype, backend="naive"|"triton")` via `kernels.get_op`."""
from __future__ import annotations

from dsv4.kernels import get_op


def moe_combine(y, w, tok, T: int, out_dtype, backend: str = "naive"):
    return get_op("moe_combine", backend, y.device)(y, w, tok, T, out_dtype)
