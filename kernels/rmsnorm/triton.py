"""RMSNorm as one Triton kernel forward and one backward (the eager composite is about 24 launches a call).

    r = 1 / sqrt(mean_j x_j^2 + eps),   n = x r,   y = n w                    (fp32 math, y in x's dtype)
    backward: dn = dy w,   dx = r (dn - n mean_j(dn_j n_j)),   dw = sum_rows dy n

Rows of D elements, ROWS rows a program. The backward recomputes r from x (no saved statistics: the op stays
stateless for torch.compile) and writes per-program partial dw rows [programs, D] in fp32, summed by one
`torch.sum` (deterministic: no atomics). Memory-bound: fwd reads x, writes y; bwd reads x and dy, writes dx.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.kernels._triton_util import on_cpu


@triton.jit
def _rms_fwd(X, W, Y, M, D, eps, HAS_W: tl.constexpr, CT: tl.constexpr, BLOCK_D: tl.constexpr,
             ROWS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)                       # [ROWS]
    cols = tl.arange(0, BLOCK_D)                                              # [BLOCK_D]
    cm = cols < D
    m = (rows < M)[:, None] & cm[None, :]
    offs = rows.to(tl.int64)[:, None] * D + cols[None, :]                     # [ROWS, BLOCK_D]
    x = tl.load(X + offs, mask=m, other=0.0).to(CT)
    r = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)                        # [ROWS]
    y = x * r[:, None]
    if HAS_W:
        w = tl.load(W + cols, mask=cm, other=0.0).to(CT)
        y = y * w[None, :]
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=m)


@triton.jit
def _rms_bwd(X, W, DY, DX, DWP, M, D, eps, ITERS, HAS_W: tl.constexpr, CT: tl.constexpr, BLOCK_D: tl.constexpr,
             ROWS: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    cm = cols < D
    if HAS_W:
        w = tl.load(W + cols, mask=cm, other=0.0).to(CT)
    dw = tl.zeros([BLOCK_D], dtype=CT)
    for it in range(0, ITERS):                                                # ITERS row blocks a program
        rows = (pid * ITERS + it) * ROWS + tl.arange(0, ROWS)
        m = (rows < M)[:, None] & cm[None, :]
        offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
        x = tl.load(X + offs, mask=m, other=0.0).to(CT)
        dy = tl.load(DY + offs, mask=m, other=0.0).to(CT)
        r = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)                    # [ROWS]
        n = x * r[:, None]
        if HAS_W:
            dw += tl.sum(dy * n, axis=0)
            dn = dy * w[None, :]
        else:
            dn = dy
        dx = r[:, None] * (dn - n * (tl.sum(dn * n, axis=1) / D)[:, None])
        tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=m)
    if HAS_W:
        tl.store(DWP + pid.to(tl.int64) * D + cols, dw, mask=cm)


def _ct(x: torch.Tensor):
    """Compute dtype: fp32, or fp64 for fp64 inputs (gradcheck)."""
    return tl.float64 if x.dtype == torch.float64 else tl.float32


def _tiles(D: int, x: torch.Tensor) -> tuple[int, int, int]:
    """(BLOCK_D, ROWS, num_warps): whole rows, about 4096 elements a program on the GPU (2048 on CPU)."""
    BLOCK_D = triton.next_power_of_2(D)
    rows = max(1, min(64, (2048 if on_cpu(x) else 4096) // BLOCK_D))
    return BLOCK_D, rows, (4 if BLOCK_D * rows <= 2048 else 8)


def rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x [..., D] (contiguous rows), weight [D] | None -> y, x's dtype."""
    D = x.shape[-1]
    x2 = x.contiguous().view(-1, D)
    y = torch.empty_like(x2)
    M = x2.shape[0]
    BLOCK_D, ROWS, nw = _tiles(D, x2)
    _rms_fwd[(triton.cdiv(M, ROWS),)](x2, weight if weight is not None else x2, y, M, D, float(eps),
                                      HAS_W=weight is not None, CT=_ct(x2), BLOCK_D=BLOCK_D, ROWS=ROWS, num_warps=nw)
    return y.view(x.shape)


def rms_norm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """-> (dx in x's dtype, dw in weight's dtype | None)."""
    D = x.shape[-1]
    x2, dy2 = x.contiguous().view(-1, D), dy.contiguous().view(-1, D)
    M = x2.shape[0]
    dx = torch.empty_like(x2)
    BLOCK_D, ROWS, nw = _tiles(D, x2)
    blocks = triton.cdiv(M, ROWS)
    progs = blocks if on_cpu(x2) else min(blocks, 4 * torch.cuda.get_device_properties(x2.device).multi_processor_count)
    iters = triton.cdiv(blocks, max(progs, 1))
    progs = triton.cdiv(blocks, iters) if blocks else 0
    ct = torch.float64 if x2.dtype == torch.float64 else torch.float32
    dwp = torch.empty((progs, D), device=x2.device, dtype=ct) if weight is not None else dx
    if progs:
        _rms_bwd[(progs,)](x2, weight if weight is not None else x2, dy2, dx, dwp, M, D, float(eps), iters,
                           HAS_W=weight is not None, CT=_ct(x2), BLOCK_D=BLOCK_D, ROWS=ROWS, num_warps=nw)
    dw = None
    if weight is not None:
        dw = (dwp.sum(0) if progs else torch.zeros(D, device=x2.device, dtype=ct)).to(weight.dtype)
    return dx.view(x.shape), dw
