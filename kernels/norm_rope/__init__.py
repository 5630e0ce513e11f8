"""Unweighted RMSNorm then RoPE of each row (spec §5.1, §3; the attention's per-head query norm and its rotation):
`norm_rope_rows(x, cos, sin, eps, backend="naive"|"triton")` via `kernels.get_op`; model/rope.py builds the angles
and the [P, G, C] view."""
from __future__ import annotations

from dsv4.kernels import get_op


def norm_rope_rows(x, cos, sin, eps: float, backend: str = "naive"):
    return get_op("norm_rope_rows", backend, x.device)(x, cos, sin, eps)
