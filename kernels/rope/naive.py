"""Rotary embedding (spec §3), the reference rotation: the last 2 h dims of x in pairs (2i, 2i+1) rotated by the
angles whose cos / sin are given (h = r/2), the leading dims untouched:

    (x_2i, x_2i+1) -> (x_2i cos_i - x_2i+1 sin_i,  x_2i sin_i + x_2i+1 cos_i)          (inverse: sin -> -sin)

Math in fp32 (fp64 for fp64 inputs), result in x's dtype.
"""
from __future__ import annotations

import torch


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """x [..., C], cos / sin broadcastable to x[..., :h] with h = cos.shape[-1] -> x's dtype and shape."""
    h = cos.shape[-1]
    nope, rope = x[..., : x.shape[-1] - 2 * h], x[..., x.shape[-1] - 2 * h:]
    dt = torch.promote_types(torch.promote_types(x.dtype, torch.float32), cos.dtype)   # fp32 (fp64 stays)
    pairs = rope.to(dt).unflatten(-1, (h, 2))                               # [..., h, 2]
    x0, x1 = pairs[..., 0], pairs[..., 1]
    if inverse:
        sin = -sin
    cos, sin = cos.to(dt), sin.to(dt)
    rot = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)   # [..., 2h] fp32
    return torch.cat([nope, rot.to(x.dtype)], dim=-1)


def rope_rows(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """The op's layout: x [P, G, C] (P positions, G rows sharing each: heads), cos / sin [P, h] -> [P, G, C]."""
    return rotate_pairs(x, cos[:, None], sin[:, None], inverse)
