"""RMSNorm (spec §5.1): weighted (a learnable fp32 weight, kept in FP32 under bf16 -- P1) or unweighted.

Computed in fp32 and cast back once, as Hugging Face and DeepSeek's code do: kernels/rmsnorm (`naive.py` the
reference, `triton.py` one fused kernel each way), chosen by `backend` like every kernel op.
"""
from __future__ import annotations

import torch
from torch import nn

from dsv4.kernels.rmsnorm import rms_norm as _rms_norm


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, backend: str = "naive") -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) [* weight], over the last dim, in fp32 (fp64 stays fp64, for gradchecks);
    returns x's dtype."""
    return _rms_norm(x, weight, eps, backend=backend)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))   # FP32-kept (P1)
        self.backend = "naive"                                             # set by DSv4Model.set_kernel_backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.backend)
