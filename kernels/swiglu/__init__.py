"""Clamped SwiGLU op (spec §9.2): `clamped_swiglu(gate, up, limit, backend="naive"|"triton")` via `kernels.get_op`,
and `clamped_swiglu_packed(gu, limit, backend)` for gate | up as the halves of one [..., 2f] tensor."""
from __future__ import annotations

from dsv4.kernels import get_op


def clamped_swiglu(gate, up, limit, backend: str = "naive"):
    return get_op("clamped_swiglu", backend, gate.device)(gate, up, limit)


def clamped_swiglu_packed(gu, limit, backend: str = "naive"):
    return get_op("clamped_swiglu_packed", backend, gu.device)(gu, limit)
