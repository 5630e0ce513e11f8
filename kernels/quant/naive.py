"""Exact quantisers (slice X1): OCP FP8 (e4m3 "fn" and e5m2), MXFP4 elements (e2m1), e8m0 / ue8m0 scales; the
reference of the fused Triton FP8 quantiser (kernels/quant/triton.py, op `fp8_quantize` at the end of this file).

Element rounding, one formula for every format with `m` mantissa bits, smallest normal exponent `emin` and
largest finite value `vmax`:
    e       = max(floor(log2|x|), emin)            (exponent of x; subnormals share emin)
    quantum = 2^(e - m)                            (spacing of the format's grid around x)
    y       = round_half_even(x / quantum) * quantum
Every step is exact in fp32 (division / multiplication by powers of two, `torch.round` is half-to-even), so
the result is the nearest representable value with ties to the even mantissa (IEEE / OCP rounding).
Saturating cast (the only mode): |y| > vmax -> ±vmax, ±Inf -> ±vmax; NaN -> NaN (e2m1 has no NaN: an MX block
holding a non-finite value gets the NaN scale, code 255, and dequantises to NaN entirely).

Scales (always applied as  x ≈ q * scale):
    "fp32"   scale = amax / vmax                   (per-tensor, Transformer Engine style; amax of the finite values)
    "ue8m0"  scale = 2^ceil(log2(amax / vmax))     (DeepSeek's power-of-two scale: nothing saturates)
    "ocp"    scale = 2^(floor(log2 amax) - emax)   (OCP MX v1.0 shared exponent, emax = 2 for e2m1, 8 for e4m3;
                                                    the block maximum may saturate to ±vmax)
amax = 0 (or an all-padding block; "fp32": or amax / vmax underflowing to 0) gives scale 1 ("fp32") / 2^-127
(power-of-two rules, smallest e8m0).
Power-of-two exponents are clamped to e8m0's range [-127, 127] (code = exponent + 127; 255 = NaN).

Divisions are tensor / tensor on purpose: CUDA turns a division by a Python scalar into a multiplication by
its reciprocal, which is not correctly rounded (seen on the H200: per-tensor fp32 scales differed from the CPU's).
e4m3 / e5m2 elements are rounded by torch's float8 cast after the saturating clamp (RNE; equal to the formula,
which `round_to_format(..., method="formula")` keeps and the tests compare against the oracle); e2m1 by the formula.

Block layouts (`block`): None = one scale for the tensor; (1, 128) = activation tiles along the last dim
(DeepSeek-V3's 1x128); (128, 128) = weight blocks over the last two dims; (1, 32) = MX blocks. Sizes that are
not multiples of the block are padded with zeros for the scale computation only.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# name -> (mantissa bits, smallest normal exponent, largest finite value, largest exponent)
FORMATS = {
    "e4m3": (3, -6, 448.0, 8),
    "e5m2": (2, -14, 57344.0, 15),
    "e2m1": (1, 0, 6.0, 2),
}
TORCH_FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
E8M0_MIN, E8M0_MAX = -127, 127


def round_to_format(x: torch.Tensor, fmt: str, method: str = "auto") -> torch.Tensor:
    """x (any float dtype) -> fp32 tensor of values of `fmt`'s grid: RNE, saturating, NaN kept.
    method "formula" (any format), "cast" (e4m3 / e5m2: clamp then torch's float8 cast), "auto" (cast if
    possible)."""
    m, emin, vmax, _ = FORMATS[fmt]
    x = x.float()
    if method == "auto":
        method = "cast" if fmt in TORCH_FP8 else "formula"
    if method == "cast":
        return torch.clamp(x, -vmax, vmax).to(TORCH_FP8[fmt]).float()       # clamp: ±Inf -> ±vmax, NaN kept
    if method != "formula":
        raise ValueError(f"round_to_format: unknown method {method!r} (auto|cast|formula)")
    _, ex = torch.frexp(x)                                   # x = mant * 2^ex, mant in [0.5, 1)
    e = torch.clamp(ex - 1, min=emin)                        # floor(log2|x|), at least emin
    quantum = torch.ldexp(torch.ones_like(x), (e - m).to(torch.int32))
    y = torch.round(x / quantum) * quantum
    y = torch.where(torch.isinf(x), torch.sign(x) * vmax, y)
    y = torch.clamp(y, -vmax, vmax)                          # saturation (clamp keeps NaN)
    return torch.where(torch.isnan(x), x, y)


def to_torch_fp8(values: torch.Tensor, fmt: str) -> torch.Tensor:
    """Grid values (output of round_to_format) -> torch float8 tensor (a lossless cast)."""
    return values.to(TORCH_FP8[fmt])


def pow2_exponent(amax: torch.Tensor, fmt: str, rule: str) -> torch.Tensor:
    """Power-of-two scale exponent (int32) for the block maxima `amax` (finite, >= 0)."""
    _, _, vmax, emax = FORMATS[fmt]
    a = amax.double()                                        # fp64: amax / vmax must not underflow
    if rule == "ue8m0":                                      # 2^ceil(log2(amax / vmax)): no saturation
        r = a / torch.full_like(a, vmax)                     # tensor / tensor: correctly rounded on CUDA too
        mant, ex = torch.frexp(r)                            # r = mant * 2^ex, mant in [0.5, 1)
        e = torch.where(mant == 0.5, ex - 1, ex)             # exact ceil(log2 r)
    elif rule == "ocp":                                      # floor(log2 amax) - emax
        _, ex = torch.frexp(a)
        e = ex - 1 - emax
    else:
        raise ValueError(f"pow2_exponent: unknown rule {rule!r} (ue8m0|ocp)")
    e = torch.where(a > 0, e, torch.full_like(e, E8M0_MIN))
    return torch.clamp(e, E8M0_MIN, E8M0_MAX).to(torch.int32)


def e8m0_encode(exponent: torch.Tensor, nan: torch.Tensor | None = None) -> torch.Tensor:
    """Exponents in [-127, 127] -> uint8 e8m0 codes (bias 127); code 255 where `nan`."""
    code = (exponent.to(torch.int32) + 127).to(torch.uint8)
    if nan is not None:
        code = torch.where(nan, torch.full_like(code, 255), code)
    return code


def e8m0_decode(code: torch.Tensor) -> torch.Tensor:
    """uint8 e8m0 codes -> fp32 scales 2^(code-127); 255 -> NaN."""
    c = code.to(torch.int32)
    v = torch.ldexp(torch.ones(c.shape, dtype=torch.float32, device=c.device), c - 127)
    return torch.where(c == 255, torch.full_like(v, float("nan")), v)


@dataclass
class QTensor:
    """A quantised tensor: `values` [*shape] the grid values of `fmt` (exact), as fp32 or as the torch float8 tensor
    (`fp8_quantize`'s output; the same numbers), `scale` fp32 per block
    ([*lead, ceil(R/br), ceil(C/bc)] for a 2-D block, a 0-d tensor per-tensor), x ≈ values * scale."""
    values: torch.Tensor
    scale: torch.Tensor
    fmt: str
    block: tuple[int, int] | None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return apply_scale(self.values.float(), self.scale, self.block, "mul").to(dtype)

    def fp8(self) -> torch.Tensor:
        return to_torch_fp8(self.values, self.fmt)


def _blocks(x: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, tuple[int, int]]:
    """x [..., R, C] (a 1-D x is one row) -> zero-padded view [..., nR, br, nC, bc] and (R, C)."""
    if x.dim() == 1:
        x = x[None]
    br, bc = block
    R, C = x.shape[-2:]
    pr, pc = (-R) % br, (-C) % bc
    xp = torch.nn.functional.pad(x, (0, pc, 0, pr)) if (pr or pc) else x
    lead = xp.shape[:-2]
    return xp.reshape(*lead, (R + pr) // br, br, (C + pc) // bc, bc), (R, C)


def expand_scale(scale: torch.Tensor, block: tuple[int, int] | None, shape) -> torch.Tensor:
    """Per-block scale -> a tensor broadcastable to `shape` (each block's scale on its elements)."""
    if block is None:
        return scale
    br, bc = block
    one_d = len(shape) == 1
    R, C = (1, shape[0]) if one_d else tuple(shape[-2:])
    s = scale.repeat_interleave(br, dim=-2)[..., :R, :].repeat_interleave(bc, dim=-1)[..., :C]
    return s[0] if one_d else s


def apply_scale(x: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None, op: str) -> torch.Tensor:
    """x * scale or x / scale, each block by its scale, broadcasting over a block view (no expanded copy
    of the scales; a padded copy of x only when its shape is not a multiple of the block)."""
    if block is None:
        return x * scale if op == "mul" else x / scale
    xb, (R, C) = _blocks(x, block)
    sb = scale[..., :, None, :, None]
    yb = xb * sb if op == "mul" else xb / sb
    y = yb.reshape(*yb.shape[:-4], yb.shape[-4] * yb.shape[-3], yb.shape[-2] * yb.shape[-1])[..., :R, :C]
    return y.reshape(x.shape)


def block_amax(x: torch.Tensor, block: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(amax of the finite values, any-non-finite flag) per block; x fp32."""
    fin = torch.isfinite(x)
    a = torch.where(fin, x.abs(), torch.zeros_like(x))
    if block is None:
        return a.amax(), ~fin.all()
    ab, _ = _blocks(a, block)
    fb, _ = _blocks(~fin, block)
    return ab.amax(dim=(-3, -1)), fb.any(dim=(-3, -1))


def quantize(x: torch.Tensor, fmt: str = "e4m3", block: tuple[int, int] | None = (1, 128),
             scale_format: str = "ue8m0", method: str = "auto") -> QTensor:
    """Scaled quantisation of x to `fmt` (see the module doc): scale per block, values = round(x / scale)."""
    if fmt not in FORMATS:
        raise ValueError(f"quantize: unknown format {fmt!r}; known: {', '.join(FORMATS)}")
    x = x.float()
    amax, nonfinite = block_amax(x, block)
    vmax = FORMATS[fmt][2]
    if scale_format == "fp32":
        scale = amax / torch.full_like(amax, vmax)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))    # amax = 0, or amax / vmax underflowing
    elif scale_format in ("ue8m0", "ocp"):
        scale = torch.ldexp(torch.ones_like(amax), pow2_exponent(amax, fmt, scale_format))
    else:
        raise ValueError(f"quantize: unknown scale_format {scale_format!r} (fp32|ue8m0|ocp)")
    if fmt == "e2m1":                          # no NaN / Inf code: the block's scale becomes NaN (OCP MX)
        scale = torch.where(nonfinite, torch.full_like(scale, float("nan")), scale)
    values = round_to_format(apply_scale(x, scale, block, "div"), fmt, method)
    if fmt == "e2m1":
        values = torch.nan_to_num(values, nan=0.0)           # the NaN lives in the scale
    return QTensor(values, scale, fmt, block)


def fake_quantize(x: torch.Tensor, fmt: str = "e4m3", block: tuple[int, int] | None = (1, 128),
                  scale_format: str = "ue8m0") -> torch.Tensor:
    """quantize then dequantize, in x's dtype (no gradient rule: see `ste_fake_quantize`)."""
    return quantize(x, fmt, block, scale_format).dequantize(x.dtype)


def mx_quantize(x: torch.Tensor, fmt: str = "e2m1", block_size: int = 32, rule: str = "ocp") -> QTensor:
    """OCP MX quantisation along the last dim: blocks of `block_size` elements, one e8m0 scale each.
    rule "ocp" (MX v1.0 shared exponent) or "ue8m0" (DeepSeek: 2^ceil(log2(amax/vmax)))."""
    return quantize(x, fmt, (1, block_size), rule)


def mx_scale_codes(q: QTensor) -> torch.Tensor:
    """The e8m0 codes (uint8) of a power-of-two-scaled QTensor's scales."""
    nan = torch.isnan(q.scale)
    _, ex = torch.frexp(torch.where(nan, torch.ones_like(q.scale), q.scale))
    return e8m0_encode(ex - 1, nan)


class _STE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fmt, block, scale_format, out_dtype):
        return quantize(x, fmt, block, scale_format).dequantize(out_dtype or x.dtype)

    @staticmethod
    def backward(ctx, g):
        return g, None, None, None, None


def ste_fake_quantize(x: torch.Tensor, fmt: str, block, scale_format: str,
                      out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Fake quantisation with a straight-through estimator: forward = dequant(quant(x)), backward = identity."""
    return _STE.apply(x, fmt, block, scale_format, out_dtype)


# ------------------------------------------------------------------ the op of kernels/quant (reference)

FP8_BLOCKS = ((1, 128), (128, 128), None)


def check_fp8_quantize_args(x: torch.Tensor, fmt: str, block, scale_format: str) -> None:
    """One-line errors for what `fp8_quantize` (both backends) does not take."""
    if x.dim() != 2:
        raise ValueError(f"fp8_quantize: x must be 2-D [R, C], got shape {tuple(x.shape)}")
    if fmt not in TORCH_FP8:
        raise ValueError(f"fp8_quantize: fmt must be e4m3|e5m2, got {fmt!r}")
    if block not in FP8_BLOCKS:
        raise ValueError(f"fp8_quantize: block must be (1, 128), (128, 128) or None, got {block!r}")
    if scale_format not in ("ue8m0", "fp32"):
        raise ValueError(f"fp8_quantize: scale_format must be ue8m0|fp32, got {scale_format!r}")


def fp8_quantize(x: torch.Tensor, fmt: str = "e4m3", block: tuple[int, int] | None = (1, 128),
                 scale_format: str = "ue8m0", transpose: bool = False):
    """x [R, C] -> (q [R, C] torch float8, scale): `quantize(x, fmt, block, scale_format)` with the values as
    float8; scale fp32 [R, ceil(C/128)] (1x128), [ceil(R/128), ceil(C/128)] (128x128) or 0-d (per tensor).
    transpose=True also returns (q_t [C, R], scale_t) = the same for x^T (the backward GEMM's operand: for 1x128
    these are x's 128x1 tiles, along R; for 128x128 / per tensor the transposed values and scale grid)."""
    check_fp8_quantize_args(x, fmt, block, scale_format)
    q = quantize(x, fmt, block, scale_format)
    if not transpose:
        return q.fp8(), q.scale
    qt = quantize(x.t(), fmt, block, scale_format)
    return q.fp8(), q.scale, qt.fp8(), qt.scale


# ---------------------------------------------------------------------------------------------------------
# Packed storage: two e2m1 codes per byte (DeepSeek-V4's released FP4 experts, OCP MX), e8m0 scale bytes.
# Code = sign << 3 | exponent << 1 | mantissa (bias 1; exponent 0 = subnormal 0 / 0.5). The element of even
# index along the last dim is the low nibble, the odd one the high nibble (transformers 5.23 `_unpack_fp4`).
# ---------------------------------------------------------------------------------------------------------

def e2m1_decode(code: torch.Tensor) -> torch.Tensor:
    """4-bit e2m1 codes (any int dtype, values 0..15) -> fp32 values."""
    c = code.to(torch.int32)
    s, e, m = (c >> 3) & 1, (c >> 1) & 3, c & 1
    mag = torch.where(e == 0, m.float() * 0.5, torch.ldexp(1.0 + 0.5 * m.float(), e - 1))
    return torch.where(s == 1, -mag, mag)


def e2m1_encode(values: torch.Tensor) -> torch.Tensor:
    """e2m1 grid values (output of round_to_format(., "e2m1")) -> uint8 codes 0..15 (-0 -> code 8)."""
    v = values.float()
    mag = v.abs()
    e = torch.where(mag < 1, torch.zeros_like(mag), torch.floor(torch.log2(mag.clamp_min(1))) + 1)
    m = torch.where(e == 0, mag * 2, mag / torch.ldexp(torch.ones_like(mag), (e - 1).to(torch.int32)) * 2 - 2)
    sign = torch.signbit(v).to(torch.int32)
    return ((sign << 3) | (e.to(torch.int32) << 1) | m.round().to(torch.int32)).to(torch.uint8)


def fp4_unpack(packed: torch.Tensor) -> torch.Tensor:
    """[..., C/2] bytes (uint8 / int8 / float4_e2m1fn_x2) -> [..., C] fp32 e2m1 values."""
    u = packed.contiguous().view(torch.uint8)
    lo, hi = e2m1_decode(u & 0xF), e2m1_decode(u >> 4)
    return torch.stack([lo, hi], -1).reshape(*u.shape[:-1], 2 * u.shape[-1])


def fp4_pack(values: torch.Tensor) -> torch.Tensor:
    """[..., C] e2m1 grid values (C even) -> [..., C/2] uint8, element 2j in the low nibble."""
    c = e2m1_encode(values)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).contiguous()
