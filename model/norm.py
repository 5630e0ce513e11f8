"""RMSNorm (spec §5.1): weighted (a learnable fp32 weight, kept in FP32 under bf16 -- P1) or unweighted.

Computed in fp32 and cast back once, as Hugging Face and DeepSeek's code do.
"""
from __future__ import annotations

import torch
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) [* weight], over the last dim, in fp32 (fp64 stays fp64, for gradchecks);
    returns x's dtype."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(xf.dtype)
    return y.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))   # FP32-kept (P1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
