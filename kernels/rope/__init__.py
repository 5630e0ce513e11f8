"""Rotary embedding op (spec §3): `rope_rows(x, cos, sin, inverse, backend="naive"|"triton")` via
`kernels.get_op`; model/rope.py builds the angles and the [P, G, C] view."""
from __future__ import annotations

from dsv4.kernels import get_op


def rope_rows(x, cos, sin, inverse: bool = False, backend: str = "naive"):
    return get_op("rope_rows", backend, x.device)(x, cos, sin, inverse)
