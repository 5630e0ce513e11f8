"""Clamped SwiGLU (spec §9.2) as one fused Triton elementwise kernel, forward and backward.

    y = silu(min(gate, L)) * clamp(up, -L, L)           (limit None: plain SwiGLU)

Math in fp32 (fp64 for fp64 inputs), outputs in the input dtype. Gradients follow `naive.clamped_swiglu` (torch.clamp semantics):
zero for gate where gate > L, zero for up where |up| > L, passed through at the boundary itself.
Memory-bound: fwd reads gate+up and writes y; bwd reads gate, up, dy and writes dgate, dup (no saved y).
`clamped_swiglu_packed(gu)`: gate and up are the halves of one [..., 2f] tensor (the grouped expert GEMM's output,
Megatron's bias_swiglu layout); the kernels read them in place at row stride 2f and write d(gu) as one tensor.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.kernels._triton_util import on_cpu


def _tile(x, f: int) -> tuple[int, int]:
    """(rows, columns) of a program's tile: 256 elements for CPU tensors (Triton's interpreter), 2048 on the GPU;
    columns up to 1024 (one row's run of a program), the rest rows."""
    n = 256 if on_cpu(x) else 2048
    bc = min(triton.next_power_of_2(f), 1024, n)
    return n // bc, bc


@triton.jit
def _tile_gu(G, U, R, F, s_in, CT: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    """The program's [BR, BC] tile: rows r, columns c, mask m, and gate / up there in CT; gate / up rows at stride
    s_in (f for separate tensors, 2f for the halves of one [R, 2f])."""
    r = (tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR))[:, None]
    c = (tl.program_id(1) * BC + tl.arange(0, BC))[None, :]
    m = (r < R) & (c < F)
    g = tl.load(G + r * s_in + c, mask=m, other=0.0).to(CT)
    u = tl.load(U + r * s_in + c, mask=m, other=0.0).to(CT)
    return r, c, m, g, u


@triton.jit
def _swiglu_fwd(G, U, Y, R, F, s_in, limit, CLAMP: tl.constexpr, CT: tl.constexpr, BR: tl.constexpr,
                BC: tl.constexpr):
    # y [R, f] dense
    r, c, m, g, u = _tile_gu(G, U, R, F, s_in, CT, BR, BC)
    if CLAMP:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    y = g * tl.sigmoid(g) * u
    tl.store(Y + r * F + c, y.to(Y.dtype.element_ty), mask=m)


@triton.jit
def _swiglu_bwd(G, U, DY, DG, DU, R, F, s_in, limit, CLAMP: tl.constexpr, CT: tl.constexpr, BR: tl.constexpr,
                BC: tl.constexpr):
    # gate / up and their gradients at row stride s_in, dy [R, f] dense
    r, c, m, g, u = _tile_gu(G, U, R, F, s_in, CT, BR, BC)
    dy = tl.load(DY + r * F + c, mask=m, other=0.0).to(CT)
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
    tl.store(DG + r * s_in + c, dg.to(DG.dtype.element_ty), mask=m)
    tl.store(DU + r * s_in + c, du.to(DU.dtype.element_ty), mask=m)


def _ct(x):
    """Compute dtype: fp32, or fp64 for fp64 inputs (gradcheck)."""
    return tl.float64 if x.dtype == torch.float64 else tl.float32


def _halves(gu):
    """gate, up: the two halves of gu [..., 2f] as [R, f] views at row stride 2f (gu made contiguous first)."""
    gu = gu.contiguous()
    f = gu.shape[-1] // 2
    rows = gu.view(-1, 2 * f)
    return gu, rows[:, :f], rows[:, f:]


def swiglu_fwd(gate, up, limit) -> torch.Tensor:
    """y [R, f] of gate / up [R, f] views sharing one row stride (dense, or the halves of one [R, 2f])."""
    R, f = gate.shape
    y = torch.empty((R, f), dtype=gate.dtype, device=gate.device)
    if R * f == 0:
        return y
    BR, BC = _tile(gate, f)
    clamp = limit is not None
    _swiglu_fwd[(triton.cdiv(R, BR), triton.cdiv(f, BC))](gate, up, y, R, f, gate.stride(0),
                                                          float(limit) if clamp else 0.0, CLAMP=clamp, CT=_ct(gate),
                                                          BR=BR, BC=BC, num_warps=8)
    return y


def swiglu_bwd(dy, gate, up, dg, du, limit) -> None:
    """dg, du (views at gate's row stride) from dy [R, f] and gate / up as in swiglu_fwd."""
    R, f = gate.shape
    if R * f == 0:
        return
    BR, BC = _tile(gate, f)
    clamp = limit is not None
    _swiglu_bwd[(triton.cdiv(R, BR), triton.cdiv(f, BC))](gate, up, dy.contiguous(), dg, du, R, f, gate.stride(0),
                                                          float(limit) if clamp else 0.0, CLAMP=clamp, CT=_ct(gate),
                                                          BR=BR, BC=BC, num_warps=8)


class _ClampedSwiGLU(torch.autograd.Function):
    """gate, up (any shape, alike) -> y of their shape."""

    @staticmethod
    def forward(ctx, gate, up, limit):
        gate, up = gate.contiguous(), up.contiguous()
        f = gate.shape[-1] if gate.dim() else 1
        y = swiglu_fwd(gate.view(-1, f), up.view(-1, f), limit)
        ctx.save_for_backward(gate, up)
        ctx.limit = limit
        return y.view(gate.shape)

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        f = gate.shape[-1] if gate.dim() else 1
        dg, du = torch.empty_like(gate), torch.empty_like(up)
        swiglu_bwd(dy.reshape(-1, f), gate.view(-1, f), up.view(-1, f), dg.view(-1, f), du.view(-1, f), ctx.limit)
        return dg, du, None


class _ClampedSwiGLUPacked(torch.autograd.Function):
    """gu [..., 2f] = gate | up (the expert GEMM's output) -> y [..., f]. The kernels read the halves in place and
    write the gradient as one [..., 2f] tensor: no copy of the halves, no concatenation of their gradients."""

    @staticmethod
    def forward(ctx, gu, limit):
        gu, gate, up = _halves(gu)
        y = swiglu_fwd(gate, up, limit)
        ctx.save_for_backward(gu)
        ctx.limit = limit
        return y.view(*gu.shape[:-1], gu.shape[-1] // 2)

    @staticmethod
    def backward(ctx, dy):
        gu, gate, up = _halves(ctx.saved_tensors[0])
        dgu = torch.empty_like(gu)
        _, dg, du = _halves(dgu)
        swiglu_bwd(dy.reshape(gate.shape), gate, up, dg, du, ctx.limit)
        return dgu, None


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit); any shape (gate and up alike), Triton fused."""
    if gate.shape != up.shape:
        raise ValueError(f"clamped_swiglu: gate shape {tuple(gate.shape)} != up shape {tuple(up.shape)}")
    return _ClampedSwiGLU.apply(gate, up, limit)


def clamped_swiglu_packed(gu: torch.Tensor, limit: float | None) -> torch.Tensor:
    """clamped_swiglu of the halves of gu [..., 2f] (gate first), Triton fused, read in place."""
    if gu.dim() == 0 or gu.shape[-1] % 2:
        raise ValueError(f"clamped_swiglu_packed: last dim must be even (gate | up), got {tuple(gu.shape)}")
    return _ClampedSwiGLUPacked.apply(gu, limit)
