"""Unweighted RMSNorm then RoPE of each row as one Triton kernel forward and one backward (kernels/rmsnorm and
kernels/rope are two kernels each way, with an x-sized tensor written and read again between them).

Rows x [R, C] (R = P G; row i at position i // G), cos / sin [P, h] (they may carry a scale s, cos² + sin² = s²):

    r = 1 / sqrt(mean_j x_j² + eps),  n = x r,  y = A n          A: the last 2h channels' pairs times [[c, -s], [s, c]]
    backward, from the output:  m = mean_j(dy_j y_j)  (= mean(dn n): dn = Aᵀ dy, n = A⁻¹ y, and dy·A n = Aᵀdy·n)
                                dx = r Aᵀ (dy - y m / k)       k = c² + s² on a rotated pair, 1 elsewhere

so the backward needs y (the attention saves it anyway: it is its q) and r [R] fp32, not x: the op keeps one
x-sized tensor where norm + rope kept two. fp32 math (fp64 for fp64 inputs). Memory-bound: fwd reads x, writes y;
bwd reads dy and y, writes dx (one read of the rotated channels again from cache, each way).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.kernels._triton_util import on_cpu


@triton.jit
def _norm_rope_fwd(X, COS, SIN, Y, RSTD, R, G, C, NOPE, H, eps, CT: tl.constexpr, BLOCK_C: tl.constexpr,
                   BLOCK_H: tl.constexpr, ROWS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)                      # [ROWS] of the R = P G rows
    rm = rows < R
    base = rows.to(tl.int64)[:, None] * C                                    # [ROWS, 1]
    cols = tl.arange(0, BLOCK_C)
    m = rm[:, None] & (cols[None, :] < C)
    x = tl.load(X + base + cols[None, :], mask=m, other=0.0).to(CT)          # [ROWS, BLOCK_C]
    r = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / C + eps)                       # [ROWS]
    tl.store(RSTD + rows, r, mask=rm)
    mn = rm[:, None] & (cols[None, :] < NOPE)
    tl.store(Y + base + cols[None, :], (x * r[:, None]).to(Y.dtype.element_ty), mask=mn)   # unrotated: n
    hi = tl.arange(0, BLOCK_H)
    mh = rm[:, None] & (hi[None, :] < H)
    p = (rows // G).to(tl.int64)[:, None] * H + hi[None, :]                  # [ROWS, BLOCK_H] into cos / sin
    c = tl.load(COS + p, mask=mh, other=0.0).to(CT)
    s = tl.load(SIN + p, mask=mh, other=0.0).to(CT)
    e = base + NOPE + 2 * hi[None, :]                                        # even channel of each pair
    n0 = tl.load(X + e, mask=mh, other=0.0).to(CT) * r[:, None]              # (again, from cache)
    n1 = tl.load(X + e + 1, mask=mh, other=0.0).to(CT) * r[:, None]
    tl.store(Y + e, (n0 * c - n1 * s).to(Y.dtype.element_ty), mask=mh)
    tl.store(Y + e + 1, (n0 * s + n1 * c).to(Y.dtype.element_ty), mask=mh)


@triton.jit
def _norm_rope_bwd(DY, Y, RSTD, COS, SIN, DX, R, G, C, NOPE, H, CT: tl.constexpr, BLOCK_C: tl.constexpr,
                   BLOCK_H: tl.constexpr, ROWS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rm = rows < R
    base = rows.to(tl.int64)[:, None] * C
    cols = tl.arange(0, BLOCK_C)
    m = rm[:, None] & (cols[None, :] < C)
    dy = tl.load(DY + base + cols[None, :], mask=m, other=0.0).to(CT)
    y = tl.load(Y + base + cols[None, :], mask=m, other=0.0).to(CT)
    mean = tl.sum(dy * y, axis=1) / C                                        # [ROWS] = mean(dn n)
    r = tl.load(RSTD + rows, mask=rm, other=0.0).to(CT)
    mn = rm[:, None] & (cols[None, :] < NOPE)
    tl.store(DX + base + cols[None, :], (r[:, None] * (dy - y * mean[:, None])).to(DX.dtype.element_ty), mask=mn)
    hi = tl.arange(0, BLOCK_H)
    mh = rm[:, None] & (hi[None, :] < H)
    p = (rows // G).to(tl.int64)[:, None] * H + hi[None, :]
    c = tl.load(COS + p, mask=mh, other=0.0).to(CT)
    s = tl.load(SIN + p, mask=mh, other=0.0).to(CT)
    k = c * c + s * s                                                        # the pair's scale², 1 for a rotation
    k = tl.where(k > 0, k, 1.0)
    e = base + NOPE + 2 * hi[None, :]
    t0 = tl.load(DY + e, mask=mh, other=0.0).to(CT) - tl.load(Y + e, mask=mh, other=0.0).to(CT) * mean[:, None] / k
    t1 = tl.load(DY + e + 1, mask=mh, other=0.0).to(CT) - tl.load(Y + e + 1, mask=mh, other=0.0).to(CT) * mean[:, None] / k
    tl.store(DX + e, (r[:, None] * (t0 * c + t1 * s)).to(DX.dtype.element_ty), mask=mh)     # Aᵀ: the transpose
    tl.store(DX + e + 1, (r[:, None] * (t1 * c - t0 * s)).to(DX.dtype.element_ty), mask=mh)


def _launch(x: torch.Tensor, cos: torch.Tensor):
    P, G, C = x.shape
    H = cos.shape[-1]
    BLOCK_C, BLOCK_H = triton.next_power_of_2(C), triton.next_power_of_2(H)
    rows = max(1, min(64, (2048 if on_cpu(x) else 4096) // BLOCK_C))         # about 4096 elements a program
    ct = tl.float64 if torch.float64 in (x.dtype, cos.dtype) else tl.float32
    return P * G, G, C, C - 2 * H, H, ct, BLOCK_C, BLOCK_H, rows, (4 if BLOCK_C * rows <= 2048 else 8)


def norm_rope_fwd(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float):
    """x [P, G, C], cos / sin [P, h] -> (y [P, G, C] in x's dtype, rstd [P G] fp32 / fp64)."""
    x, cos, sin = x.contiguous(), cos.contiguous(), sin.contiguous()
    R, G, C, nope, H, ct, BC, BH, rows, nw = _launch(x, cos)
    y = torch.empty_like(x)
    rstd = torch.empty(R, device=x.device, dtype=torch.float64 if ct == tl.float64 else torch.float32)
    if R:
        _norm_rope_fwd[(triton.cdiv(R, rows),)](x, cos, sin, y, rstd, R, G, C, nope, H, float(eps), CT=ct,
                                                BLOCK_C=BC, BLOCK_H=BH, ROWS=rows, num_warps=nw)
    return y, rstd


def norm_rope_bwd(dy: torch.Tensor, y: torch.Tensor, rstd: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> torch.Tensor:
    """dy, y [P, G, C], rstd [P G], cos / sin [P, h] -> dx [P, G, C] in y's dtype."""
    dy, y, cos, sin = dy.contiguous(), y.contiguous(), cos.contiguous(), sin.contiguous()
    R, G, C, nope, H, ct, BC, BH, rows, nw = _launch(y, cos)
    dx = torch.empty_like(y)
    if R:
        _norm_rope_bwd[(triton.cdiv(R, rows),)](dy, y, rstd, cos, sin, dx, R, G, C, nope, H, CT=ct, BLOCK_C=BC,
                                                BLOCK_H=BH, ROWS=rows, num_warps=nw)
    return dx
