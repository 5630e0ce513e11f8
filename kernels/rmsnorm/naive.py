"""RMSNorm (spec §5.1), the reference: y = x / sqrt(mean(x^2) + eps) [* w] over the last dim.

Computed in fp32 (fp64 stays fp64, for gradchecks) and cast back once, as Hugging Face and DeepSeek's code do;
the weight is read in that dtype (it is FP32-kept, P1).
"""
from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x [..., D], weight [D] | None -> x's dtype and shape."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(xf.dtype)
    return y.to(x.dtype)
