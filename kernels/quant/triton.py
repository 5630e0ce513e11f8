"""Fused FP8 quantiser (slice X1): x [R, C] -> e4m3 / e5m2 values and fp32 scales in one pass over x.

The math of kernels/quant/naive.py `quantize` (its module doc), bit for bit, for the FP8 linear's operands:
    block (1, 128)    activation tiles: scale per row and 128 columns       S [R, ceil(C/128)]
    block (128, 128)  weight blocks                                         S [ceil(R/128), ceil(C/128)]
    block None        per tensor (a partial-amax pass first: one amax needs the whole tensor)  S 0-d
    transpose=True    also x^T quantised the same way, written by the same program from the same tile
                      (1x128: x's 128x1 tiles, the wgrad operand; 128x128 / per tensor: the values transposed)
One program loads one [BR, 128] tile (BR = 128 with blocks or transpose), takes the amax of its finite |x|
per row (and per column), forms the scale and writes the codes. Integer arithmetic only after one
correctly rounded scaling, so the result is the same on the GPU and on Triton's CPU interpreter:
    ue8m0  scale = 2^e, e = ceil(log2(amax / vmax)) from amax's exponent and mantissa bits (vmax = 1.75 2^ev:
           e = ea - ev + [mantissa(amax) > mantissa(1.75)]); v = x * 2^-e (exact: a power of two)
    fp32   scale = amax / vmax, v = x / scale, both `div_rn` (correctly rounded, as torch's tensor division)
    code   round-half-even of v to the format's grid on v's bits: quantum 2^(max(E, emin) - m), E = floor(log2|v|);
           code = ((max(E, emin) - emin) << m) + n (n = the rounded significand; a carry into the next binade
           and the subnormals come out right); saturated at vmax's code; NaN -> 0x7F with x's sign, ±Inf -> ±vmax.
The codes are stored as uint8 into the float8 tensor's bytes: no float -> fp8 conversion is involved (Triton's
interpreter converts fp32 -> fp8 by truncation and turns NaN into 384; seen with triton 3.9).
Inputs fp32 / bf16 / fp16, any strides (x.t() is read in place).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.kernels.quant.naive import TORCH_FP8, check_fp8_quantize_args

# fmt -> (mantissa bits m, smallest normal exponent emin, code of vmax, vmax, vmax's exponent ev, vmax's
# mantissa bits): e4m3 vmax 448 = 1.75 * 2^8 (code 0x7E), e5m2 57344 = 1.75 * 2^15 (code 0x7B)
_FMT = {"e4m3": (3, -6, 0x7E, 448.0, 8, 0x600000), "e5m2": (2, -14, 0x7B, 57344.0, 15, 0x600000)}
_MODE = {(1, 128): 0, (128, 128): 1, None: 2}
TILE = 128


@triton.jit
def _exp2i(k):
    """2^k in fp32 for int32 k in [-127, 127], exact (2^-127 is an fp32 subnormal: 2^-126 * 0.5)."""
    kk = tl.maximum(k, -126)
    p = ((kk + 127) << 23).to(tl.float32, bitcast=True)
    return tl.where(k < -126, p * 0.5, p)


@triton.jit
def _scale(amax, POW2: tl.constexpr, VMAX: tl.constexpr, EV: tl.constexpr, MV: tl.constexpr):
    """(scale, 1/scale) of block maxima amax (fp32, finite, >= 0); 1/scale is used only for POW2 scales."""
    if POW2:
        sub = amax < 1.1754943508222875e-38                          # fp32 subnormal amax: scale it up first
        a = amax * tl.where(sub, 18446744073709551616.0, 1.0)         # * 2^64, exact
        b = a.to(tl.int32, bitcast=True)
        ea = ((b >> 23) & 0xFF) - 127 - tl.where(sub, 64, 0)
        e = ea - EV + ((b & 0x7FFFFF) > MV).to(tl.int32)            # ceil(log2(amax / vmax)), exact
        e = tl.where(amax > 0, e, -127)
        e = tl.minimum(tl.maximum(e, -127), 127)
        return _exp2i(e), _exp2i(-e)
    else:
        s = tl.math.div_rn(amax, tl.zeros_like(amax) + VMAX)
        s = tl.where(s > 0, s, 1.0)                                  # amax = 0 or amax / vmax underflowing
        return s, s


@triton.jit
def _apply(x, s, r, POW2: tl.constexpr):
    if POW2:
        return x * r
    else:
        return tl.math.div_rn(x, s)


@triton.jit
def _code(v, xb, M: tl.constexpr, EMIN: tl.constexpr, VMAXC: tl.constexpr):
    """FP8 code (int32 in [0, 255]) of v = x / scale, RNE and saturating; NaN and the sign from x's bits xb."""
    a = v.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    ef = a >> 23
    e = ef - 127                                                     # floor(log2|v|) for normal v
    sig = (a & 0x7FFFFF) | 0x800000
    ec = tl.maximum(e, EMIN)
    shift = tl.minimum(23 - M + ec - e, 30)                         # bits of sig below the quantum
    n = sig >> shift
    rem = sig - (n << shift)
    half = (shift * 0 + 1) << (shift - 1)
    up = (rem > half) | ((rem == half) & ((n & 1) == 1))
    code = ((ec - EMIN) << M) + n + up.to(tl.int32)
    code = tl.minimum(code, VMAXC)
    code = tl.where(ef == 0, 0, code)                                # zero and fp32 subnormals -> 0
    code = tl.where(ef == 255, VMAXC, code)                          # ±Inf (saturating)
    xa = xb & 0x7FFFFFFF
    code = tl.where(xa > 0x7F800000, 0x7F, code)                     # NaN
    return tl.where(xb < 0, code | 0x80, code)


@triton.jit
def _fp8_quant(X, Q, S, QT, ST, AMAX, R, C, sxr, sxc, n_cb, n_rb,
               MODE: tl.constexpr, TRANS: tl.constexpr, POW2: tl.constexpr, M: tl.constexpr, EMIN: tl.constexpr,
               VMAXC: tl.constexpr, VMAX: tl.constexpr, EV: tl.constexpr, MV: tl.constexpr,
               BR: tl.constexpr, BC: tl.constexpr):
    pr = tl.program_id(0)
    pc = tl.program_id(1)
    rows = pr * BR + tl.arange(0, BR)                                # [BR]
    cols = pc * BC + tl.arange(0, BC)                                # [BC]
    rm, cm = rows < R, cols < C
    m = rm[:, None] & cm[None, :]
    x = tl.load(X + rows[:, None].to(tl.int64) * sxr + cols[None, :].to(tl.int64) * sxc, mask=m,
                other=0.0).to(tl.float32)                             # [BR, BC]
    xb = x.to(tl.int32, bitcast=True)
    a = tl.where((xb & 0x7F800000) != 0x7F800000, tl.abs(x), 0.0)   # |x| of the finite values
    if MODE == 0:                                                    # 1x128: a scale per row of the tile
        s, r = _scale(tl.max(a, axis=1), POW2, VMAX, EV, MV)         # [BR]
        code = _code(_apply(x, s[:, None], r[:, None], POW2), xb, M, EMIN, VMAXC)
        tl.store(S + rows.to(tl.int64) * n_cb + pc, s, mask=rm)
    elif MODE == 1:                                                  # 128x128: one scale
        s, r = _scale(tl.max(tl.max(a, axis=1), axis=0), POW2, VMAX, EV, MV)
        code = _code(_apply(x, s, r, POW2), xb, M, EMIN, VMAXC)
        tl.store(S + pr * n_cb + pc, s)
    else:                                                            # per tensor: amax from the first pass
        s, r = _scale(tl.load(AMAX), POW2, VMAX, EV, MV)
        code = _code(_apply(x, s, r, POW2), xb, M, EMIN, VMAXC)
        if (pr == 0) & (pc == 0):
            tl.store(S, s)
    tl.store(Q + rows[:, None].to(tl.int64) * C + cols[None, :], code.to(tl.uint8), mask=m)
    if TRANS:
        qt = QT + cols[None, :].to(tl.int64) * R + rows[:, None]     # x^T [C, R]
        if MODE == 0:                                                # x's 128x1 tiles (BR = 128)
            st, rt = _scale(tl.max(a, axis=0), POW2, VMAX, EV, MV)   # [BC]
            code_t = _code(_apply(x, st[None, :], rt[None, :], POW2), xb, M, EMIN, VMAXC)
            tl.store(qt, code_t.to(tl.uint8), mask=m)
            tl.store(ST + cols.to(tl.int64) * n_rb + pr, st, mask=cm)
        else:
            tl.store(qt, code.to(tl.uint8), mask=m)
            if MODE == 1:
                tl.store(ST + pc * n_rb + pr, s)


@triton.jit
def _amax_partial(X, P, R, C, sxr, sxc, BR: tl.constexpr, BC: tl.constexpr):
    pr = tl.program_id(0)
    pc = tl.program_id(1)
    rows = pr * BR + tl.arange(0, BR)
    cols = pc * BC + tl.arange(0, BC)
    m = (rows[:, None] < R) & (cols[None, :] < C)
    x = tl.load(X + rows[:, None].to(tl.int64) * sxr + cols[None, :].to(tl.int64) * sxc, mask=m,
                other=0.0).to(tl.float32)
    xb = x.to(tl.int32, bitcast=True)
    a = tl.where((xb & 0x7F800000) != 0x7F800000, tl.abs(x), 0.0)
    tl.store(P + pr * tl.num_programs(1) + pc, tl.max(tl.max(a, axis=1), axis=0))


def fp8_quantize(x: torch.Tensor, fmt: str = "e4m3", block: tuple[int, int] | None = (1, 128),
                 scale_format: str = "ue8m0", transpose: bool = False):
    """As kernels/quant/naive.py `fp8_quantize` (same outputs, bit for bit), in one fused pass."""
    check_fp8_quantize_args(x, fmt, block, scale_format)
    block = None if block is None else tuple(block)
    R, C = x.shape
    dev = x.device
    mode = _MODE[block]
    n_rb, n_cb = triton.cdiv(R, TILE), triton.cdiv(C, TILE)
    q = torch.empty(R, C, dtype=TORCH_FP8[fmt], device=dev)
    qt = torch.empty(C, R, dtype=q.dtype, device=dev) if transpose else q
    if mode == 0:
        s = torch.empty(R, n_cb, dtype=torch.float32, device=dev)
        st = torch.empty(C, n_rb, dtype=torch.float32, device=dev) if transpose else s
    elif mode == 1:
        s = torch.empty(n_rb, n_cb, dtype=torch.float32, device=dev)
        st = torch.empty(n_cb, n_rb, dtype=torch.float32, device=dev) if transpose else s
    else:
        s = torch.empty((), dtype=torch.float32, device=dev)
        st = s
    BR = TILE if (mode == 1 or transpose) else 32
    warps = 8 if BR == TILE else 4
    grid = (triton.cdiv(R, BR), n_cb)
    amax = s
    if mode == 2:
        part = torch.empty(grid[0] * grid[1], dtype=torch.float32, device=dev)
        _amax_partial[grid](x, part, R, C, x.stride(0), x.stride(1), BR=BR, BC=TILE, num_warps=warps)
        amax = part.amax().reshape(())
    m, emin, vmaxc, vmax, ev, mv = _FMT[fmt]
    _fp8_quant[grid](x, q.view(torch.uint8), s, qt.view(torch.uint8), st, amax, R, C, x.stride(0), x.stride(1),
                     n_cb, n_rb, MODE=mode, TRANS=transpose, POW2=scale_format == "ue8m0", M=m, EMIN=emin,
                     VMAXC=vmaxc, VMAX=vmax, EV=ev, MV=mv, BR=BR, BC=TILE, num_warps=warps)
    if not transpose:
        return q, s
    return q, s, qt, (st.clone() if mode == 2 else st)

