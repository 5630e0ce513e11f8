"""RMSNorm op (spec §5.1): `rms_norm(x, weight, eps, backend="naive"|"triton")` via `kernels.get_op`."""
from __future__ import annotations

from dsv4.kernels import get_op


def rms_norm(x, weight, eps: float, backend: str = "naive"):
    return get_op("rms_norm", backend, x.device)(x, weight, eps)
