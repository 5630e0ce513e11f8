"""FP8 quantiser op (slice X1): `fp8_quantize(x, fmt, block, scale_format, transpose, backend="naive"|"triton")`
via `kernels.get_op`: x [R, C] -> (fp8 values, fp32 scales[, the same for x^T]); naive = the exact quantiser
(naive.py, `quantize`), triton = one fused pass (triton.py), bit-identical."""
from __future__ import annotations

from dsv4.kernels import get_op


def fp8_quantize(x, fmt: str = "e4m3", block=(1, 128), scale_format: str = "ue8m0", transpose: bool = False,
                 backend: str = "naive"):
    return get_op("fp8_quantize", backend, x.device)(x, fmt, block, scale_format, transpose)
