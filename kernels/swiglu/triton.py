"""Clamped SwiGLU (spec §9.2) as one fused Triton elementwise kernel, forward and backward.

    y = silu(min(gate, L)) * clamp(up, -L, L)           (limit None: plain SwiGLU)

Math in fp32 (fp64 for fp64 inputs), outputs in the input dtype. Gradients follow `naive.clamped_swiglu` (torch.clamp semantics):
zero for gate where gate > L, zero for up where |up| > L, passed through at the boundary itself.
Memory-bound: fwd reads gate+up and writes y; bwd reads gate, up, dy and writes dgate, dup (no saved y).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.kernels._triton_util import on_cpu


def _block(x) -> int:
    """Elements per program: 256 for CPU tensors (Triton's interpreter), 2048 on the GPU."""
    return 256 if on_cpu(x) else 2048


@triton.jit
def _swiglu_fwd(G, U, Y, N, limit, CLAMP: tl.constexpr, CT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    g = tl.load(G + offs, mask=m, other=0.0).to(CT)
    u = tl.load(U + offs, mask=m, other=0.0).to(CT)
    if CLAMP:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    y = g * tl.sigmoid(g) * u
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=m)


@triton.jit
def _swiglu_bwd(G, U, DY, DG, DU, N, limit, CLAMP: tl.constexpr, CT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    g = tl.load(G + offs, mask=m, other=0.0).to(CT)
    u = tl.load(U + offs, mask=m, other=0.0).to(CT)
    dy = tl.load(DY + offs, mask=m, other=0.0).to(CT)
    if CLAMP:
        g_pass = g <= limit
        u_pass = (u >= -limit) & (u <= limit)
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    sg = tl.sigmoid(g)
    silu = g * sg
    dg = dy * u * sg * (1.0 + g * (1.0 - sg))                   # d silu(g) = σ(g)(1 + g(1 - σ(g)))
    du = dy * silu
    if CLAMP:
        dg = tl.where(g_pass, dg, 0.0)
        du = tl.where(u_pass, du, 0.0)
    tl.store(DG + offs, dg.to(DG.dtype.element_ty), mask=m)
    tl.store(DU + offs, du.to(DU.dtype.element_ty), mask=m)


def _ct(x):
    """Compute dtype: fp32, or fp64 for fp64 inputs (gradcheck)."""
    return tl.float64 if x.dtype == torch.float64 else tl.float32


class _ClampedSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, limit):
        gate, up = gate.contiguous(), up.contiguous()
        y = torch.empty_like(gate)
        n, BLOCK = gate.numel(), _block(gate)
        clamp = limit is not None
        lim = float(limit) if clamp else 0.0
        _swiglu_fwd[(triton.cdiv(n, BLOCK),)](gate, up, y, n, lim, CLAMP=clamp, CT=_ct(gate), BLOCK=BLOCK, num_warps=8)
        ctx.save_for_backward(gate, up)
        ctx.cfg = (clamp, lim)
        return y

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        clamp, lim = ctx.cfg
        dy = dy.contiguous()
        dg, du = torch.empty_like(gate), torch.empty_like(up)
        n, BLOCK = gate.numel(), _block(gate)
        _swiglu_bwd[(triton.cdiv(n, BLOCK),)](gate, up, dy, dg, du, n, lim, CLAMP=clamp, CT=_ct(gate), BLOCK=BLOCK,
                                              num_warps=8)
        return dg, du, None


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit); any shape (gate and up alike), Triton fused."""
    if gate.shape != up.shape:
        raise ValueError(f"clamped_swiglu: gate shape {tuple(gate.shape)} != up shape {tuple(up.shape)}")
    return _ClampedSwiGLU.apply(gate, up, limit)
