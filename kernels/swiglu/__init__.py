"""Clamped SwiGLU op (spec §9.2): `clamped_swiglu(gate, up, limit, backend="naive"|"triton")` via `kernels.get_op`."""
from __future__ import annotations

from dsv4.kernels import get_op


def clamped_swiglu(gate, up, limit, backend: str = "naive"):
    return get_op("clamped_swiglu", backend, gate.device)(gate, up, limit)
