"""Rotary embedding as one Triton kernel (the eager composite is about 30 launches a call, forward + backward).

x [P, G, C] (P positions, G rows per position, e.g. heads), cos / sin [P, h] fp32: each row copies its C - 2h
leading dims and rotates its last 2h in pairs (naive.py), in fp32, stored in x's dtype. The backward is the
same kernel rotating dy by the opposite angles (the rotation's transpose). Memory-bound: reads and writes x once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.kernels._triton_util import on_cpu


@triton.jit
def _rope(X, COS, SIN, Y, R, G, C, NOPE, H, INVERSE: tl.constexpr, CT: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_H: tl.constexpr, ROWS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)                      # [ROWS] of the R = P G rows
    rm = rows < R
    base = rows.to(tl.int64)[:, None] * C                                    # [ROWS, 1]
    if BLOCK_N > 0:                                                          # the unrotated dims: a copy
        cn = tl.arange(0, BLOCK_N)
        mn = rm[:, None] & (cn[None, :] < NOPE)
        tl.store(Y + base + cn[None, :], tl.load(X + base + cn[None, :], mask=mn), mask=mn)
    hi = tl.arange(0, BLOCK_H)
    mh = rm[:, None] & (hi[None, :] < H)
    p = (rows // G).to(tl.int64)[:, None] * H + hi[None, :]                  # [ROWS, BLOCK_H] into cos / sin
    c = tl.load(COS + p, mask=mh, other=0.0).to(CT)
    s = tl.load(SIN + p, mask=mh, other=0.0).to(CT)
    if INVERSE:
        s = -s
    e = base + NOPE + 2 * hi[None, :]                                        # even element of each pair
    x0 = tl.load(X + e, mask=mh, other=0.0).to(CT)
    x1 = tl.load(X + e + 1, mask=mh, other=0.0).to(CT)
    tl.store(Y + e, (x0 * c - x1 * s).to(Y.dtype.element_ty), mask=mh)
    tl.store(Y + e + 1, (x0 * s + x1 * c).to(Y.dtype.element_ty), mask=mh)


def rope_rows(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """x [P, G, C], cos / sin [P, h] -> [P, G, C] in x's dtype."""
    P, G, C = x.shape
    H = cos.shape[-1]
    x = x.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    y = torch.empty_like(x)
    R = P * G
    if R == 0:
        return y
    nope = C - 2 * H
    BLOCK_N = triton.next_power_of_2(nope) if nope > 0 else 0
    BLOCK_H = triton.next_power_of_2(H)
    rows = 1 << max(0, min(6, ((2048 if on_cpu(x) else 8192) // (BLOCK_N + 2 * BLOCK_H)).bit_length() - 1))   # pow2
    ct = tl.float64 if torch.float64 in (x.dtype, cos.dtype) else tl.float32
    _rope[(triton.cdiv(R, rows),)](x, cos, sin, y, R, G, C, nope, H, INVERSE=bool(inverse), CT=ct,
                                   BLOCK_N=BLOCK_N, BLOCK_H=BLOCK_H, ROWS=rows, num_warps=4)
    return y
