"""The reference of the fused query norm + rotation: the two reference ops in sequence, nothing new.

    y = rope_rows(rms_norm(x, None, eps), cos, sin)       x [P, G, C], cos / sin [P, h]  (kernels/rmsnorm, kernels/rope)

Each op rounds to x's dtype once, as the model did before the fusion (model/attention.py), so the naive backend's
values are the unfused ones bit for bit.
"""
from __future__ import annotations

import torch

from dsv4.kernels.rmsnorm.naive import rms_norm
from dsv4.kernels.rope.naive import rope_rows


def norm_rope_rows(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float) -> torch.Tensor:
    """x [P, G, C], cos / sin [P, h] (2h <= C) -> [P, G, C] in x's dtype."""
    return rope_rows(rms_norm(x, None, eps), cos, sin)
