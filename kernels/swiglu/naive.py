"""Clamped SwiGLU (spec §9.2, slice P5): the reference implementation (plain PyTorch, autograd).

    y = silu(min(gate, L)) * clamp(up, -L, L)          limit L = None -> plain SwiGLU silu(gate) * up

The gate is clamped from ABOVE only, the linear ("up") branch on both sides. Gradients follow torch.clamp:
zero where the value was clamped (strictly outside the limit), passed through at the boundary itself
(torch.clamp passes the gradient when x == limit).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit); any shape (gate and up alike)."""
    if gate.shape != up.shape:
        raise ValueError(f"clamped_swiglu: gate shape {tuple(gate.shape)} != up shape {tuple(up.shape)}")
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


def clamped_swiglu_packed(gu: torch.Tensor, limit: float | None) -> torch.Tensor:
    """clamped_swiglu of the halves of gu [..., 2f]: gate = gu[..., :f], up = gu[..., f:] (the expert GEMM's
    output; Megatron's bias_swiglu layout)."""
    if gu.dim() == 0 or gu.shape[-1] % 2:
        raise ValueError(f"clamped_swiglu_packed: last dim must be even (gate | up), got {tuple(gu.shape)}")
    gate, up = gu.chunk(2, dim=-1)
    return clamped_swiglu(gate, up, limit)
