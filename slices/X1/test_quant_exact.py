"""X1: the quantisers are exact against an independent oracle written here.

The oracle decodes every code of e2m1 / e4m3 (fn) / e5m2 from its bits (sign, exponent, mantissa, bias),
quantises by brute force (the nearest finite value, ties to the code with an even mantissa, saturation to the
largest finite value, NaN kept) and selects scales in Python floats (math.frexp) block by block. Equality is
exact (torch.equal on fp32, NaN positions compared separately).
"""
from __future__ import annotations

import math

import pytest
import torch

from dsv4.kernels.quant import naive as Q

# format -> (exponent bits, mantissa bits, bias, special rule)
SPECS = {"e2m1": (2, 1, 1, "none"), "e4m3": (4, 3, 7, "fn"), "e5m2": (5, 2, 15, "ieee")}


def decode(code: int, fmt: str) -> float:
    E, M, bias, special = SPECS[fmt]
    s = (code >> (E + M)) & 1
    e = (code >> M) & ((1 << E) - 1)
    m = code & ((1 << M) - 1)
    sign = -1.0 if s else 1.0
    if special == "fn" and e == (1 << E) - 1 and m == (1 << M) - 1:
        return float("nan")
    if special == "ieee" and e == (1 << E) - 1:
        return sign * math.inf if m == 0 else float("nan")
    if e == 0:
        return sign * 2.0 ** (1 - bias) * (m / 2 ** M)
    return sign * 2.0 ** (e - bias) * (1 + m / 2 ** M)


def table(fmt: str):
    """All codes -> values; the finite non-negative ones as (value, code) sorted by value."""
    E, M, _, _ = SPECS[fmt]
    n = 1 << (1 + E + M)
    vals = [decode(c, fmt) for c in range(n)]
    pos = sorted({(v, c) for c, v in enumerate(vals) if math.isfinite(v) and v >= 0 and not (v == 0 and c)})
    return vals, pos


def oracle_round(x: float, fmt: str) -> float:
    """Nearest finite value of fmt, ties -> even mantissa (code LSB 0), saturating; NaN -> NaN."""
    if math.isnan(x):
        return x
    _, pos = table(fmt)
    vmax = pos[-1][0]
    a = abs(x)
    if a >= vmax:
        return math.copysign(vmax, x)
    best = None
    for v, c in pos:
        d = abs(a - v)
        if best is None or d < best[0] or (d == best[0] and c % 2 == 0):
            best = (d, v, c)
    return math.copysign(best[1], x)


_TABLES = {}


def oracle_round_tensor(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Vectorised version of oracle_round (same rule), for many values."""
    if fmt not in _TABLES:
        _, pos = table(fmt)
        _TABLES[fmt] = (torch.tensor([v for v, _ in pos], dtype=torch.float64),
                        torch.tensor([c for _, c in pos]))
    v, c = _TABLES[fmt]
    a = x.double().abs()
    d = (a[:, None] - v[None, :]).abs()
    dmin = d.min(dim=1, keepdim=True).values
    cand = d == dmin
    odd = (c % 2 == 1)[None, :]
    pick = torch.where(cand & ~odd, 1, 0) * 2 + torch.where(cand, 1, 0)       # prefer even among the nearest
    y = v[pick.argmax(dim=1)]
    y = torch.where(a >= v[-1], v[-1], y)
    y = torch.copysign(y, x.double())
    return torch.where(torch.isnan(x.double()), x.double(), y).float()


# both implementations of the element rounding: the formula (every format) and torch's float8 cast after the
# saturating clamp (the default for e4m3 / e5m2)
METHODS = [("e2m1", "formula"), ("e4m3", "formula"), ("e5m2", "formula"), ("e4m3", "cast"), ("e5m2", "cast")]


@pytest.mark.parametrize("fmt", ["e2m1", "e4m3", "e5m2"])
def test_table_matches_the_module_constants(fmt):
    vals, pos = table(fmt)
    m, emin, vmax, emax = Q.FORMATS[fmt]
    assert pos[-1][0] == vmax
    assert min(v for v, _ in pos if v > 0) == 2.0 ** (emin - m)                # smallest subnormal
    assert math.floor(math.log2(vmax)) == emax
    if fmt == "e2m1":
        assert sorted(v for v, _ in pos) == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    if fmt == "e4m3":
        assert sum(math.isnan(v) for v in vals) == 2 and not any(math.isinf(v) for v in vals)
        assert len(pos) == 127                                                 # 0 + 126 positive finite
    if fmt in Q.TORCH_FP8:   # the bit formula agrees with torch's float8 decoding of every byte
        bits = torch.arange(256, dtype=torch.uint8).view(Q.TORCH_FP8[fmt]).float()
        want = torch.tensor(vals, dtype=torch.float32)
        nan = torch.isnan(want)
        assert torch.equal(torch.isnan(bits), nan) and torch.equal(bits[~nan], want[~nan])


@pytest.mark.parametrize("fmt,method", METHODS)
def test_every_code_is_a_fixed_point(fmt, method):
    vals, _ = table(fmt)
    fin = torch.tensor([v for v in vals if math.isfinite(v)], dtype=torch.float32)
    assert torch.equal(Q.round_to_format(fin, fmt, method), fin)
    # signed zero kept
    z = Q.round_to_format(torch.tensor([-0.0]), fmt, method)
    assert z.item() == 0 and math.copysign(1, z.item()) == -1


@pytest.mark.parametrize("fmt,method", METHODS)
def test_midpoints_round_to_even(fmt, method):
    _, pos = table(fmt)
    xs, want = [], []
    for (v0, c0), (v1, c1) in zip(pos, pos[1:]):
        mid = (v0 + v1) / 2
        even = v0 if c0 % 2 == 0 else v1
        assert (c0 % 2) != (c1 % 2)                                 # neighbours always differ in parity
        for s in (1.0, -1.0):
            xs.append(s * mid)
            want.append(s * even)
            xs += [s * math.nextafter(mid, 0), s * math.nextafter(mid, math.inf)]   # just below / above
            want += [s * v0, s * v1]
    x = torch.tensor(xs, dtype=torch.float64).float()
    ok = torch.tensor(xs, dtype=torch.float64) == x.double()                  # keep only fp32-exact probes
    got = Q.round_to_format(x[ok], fmt, method)
    exp = torch.tensor(want, dtype=torch.float32)[ok]
    assert torch.equal(got, exp)
    assert torch.equal(got, oracle_round_tensor(x[ok], fmt))


@pytest.mark.parametrize("fmt,method", METHODS)
def test_random_values_equal_brute_force(fmt, method):
    g = torch.Generator().manual_seed(0)
    _, _, vmax, _ = Q.FORMATS[fmt]
    _, emin, _, _ = Q.FORMATS[fmt][0], Q.FORMATS[fmt][1], 0, 0
    lo, hi = math.log2(2.0 ** (emin - 6)), math.log2(vmax * 4)                # deep subnormals .. beyond max
    mag = torch.exp2(lo + (hi - lo) * torch.rand(20000, generator=g))
    x = torch.where(torch.rand(20000, generator=g) < 0.5, -mag, mag)
    assert torch.equal(Q.round_to_format(x, fmt, method), oracle_round_tensor(x, fmt))
    for xi in x[:50].tolist():                                                # the scalar oracle agrees too
        assert Q.round_to_format(torch.tensor([xi]), fmt, method).item() == oracle_round(xi, fmt)


@pytest.mark.parametrize("fmt,method", METHODS)
def test_saturation_nan_inf(fmt, method):
    vmax = Q.FORMATS[fmt][2]
    x = torch.tensor([vmax, vmax * 1.01, vmax * 1.5, 1e30, math.inf, -vmax * 3, -math.inf, math.nan])
    y = Q.round_to_format(x, fmt, method)
    assert y[:7].tolist() == [vmax, vmax, vmax, vmax, vmax, -vmax, -vmax]
    assert math.isnan(y[7].item())
    if fmt in Q.TORCH_FP8:                                   # grid values cast losslessly to torch float8
        f = Q.to_torch_fp8(y, fmt).float()
        assert torch.equal(f[:7], y[:7]) and math.isnan(f[7].item())


def test_e8m0_codes():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    v = Q.e8m0_decode(codes)
    for c in range(255):
        assert v[c].item() == 2.0 ** (c - 127)
    assert math.isnan(v[255].item())
    ex = torch.arange(-127, 128, dtype=torch.int32)
    assert torch.equal(Q.e8m0_encode(ex), codes[:255])
    assert Q.e8m0_encode(torch.tensor([0]), torch.tensor([True])).item() == 255


# ------------------------------------------------------------------ scale selection (oracle in Python floats)

def oracle_scale(amax: float, fmt: str, rule: str) -> float:
    vmax = Q.FORMATS[fmt][2]
    emax = Q.FORMATS[fmt][3]
    if rule == "fp32":
        return amax / vmax if amax > 0 else 1.0       # (fp32 division: recomputed in fp32 below)
    if amax == 0:
        return 2.0 ** -127
    if rule == "ue8m0":
        r = amax / vmax                                 # exact in double for fp32 amax
        m, e = math.frexp(r)                            # r = m 2^e, m in [0.5, 1)
        k = e - 1 if m == 0.5 else e                    # ceil(log2 r)
    else:                                               # ocp: floor(log2 amax) - emax
        m, e = math.frexp(amax)
        k = e - 1 - emax
    return 2.0 ** max(-127, min(127, k))


def oracle_quantize(x: torch.Tensor, fmt: str, block, rule: str):
    """Loops over blocks in Python; returns (values, scale per block)."""
    x2 = x if x.dim() == 2 else x[None]
    R, C = x2.shape
    br, bc = block if block is not None else (R, C)
    nR, nC = -(-R // br), -(-C // bc)
    scale = torch.empty(nR, nC)
    vals = torch.empty(R, C)
    for i in range(nR):
        for j in range(nC):
            blk = x2[i * br:(i + 1) * br, j * bc:(j + 1) * bc]
            fin = blk[torch.isfinite(blk)]
            amax = float(fin.abs().max()) if fin.numel() else 0.0
            s = oracle_scale(amax, fmt, rule)
            if rule == "fp32":
                s = float(torch.tensor(amax, dtype=torch.float32) / Q.FORMATS[fmt][2]) if amax > 0 else 1.0
            if fmt == "e2m1" and not torch.isfinite(blk).all():
                s = math.nan
            scale[i, j] = s
            q = oracle_round_tensor((blk.float() / torch.tensor(s, dtype=torch.float32)).flatten(), fmt)
            if fmt == "e2m1":
                q = torch.nan_to_num(q, nan=0.0)
            vals[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = q.view_as(blk)
    if block is None:
        scale = scale[0, 0]
    return (vals if x.dim() == 2 else vals[0]), scale


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    na, nb = torch.isnan(a), torch.isnan(b)
    return torch.equal(na, nb) and torch.equal(a[~na], b[~nb])


CASES = [("e4m3", (1, 128), "ue8m0", (5, 300)), ("e4m3", (128, 128), "ue8m0", (200, 260)),
         ("e4m3", None, "fp32", (33, 70)), ("e4m3", (1, 128), "fp32", (4, 256)), ("e5m2", (1, 128), "ue8m0", (3, 200)),
         ("e2m1", (1, 32), "ocp", (6, 96)), ("e2m1", (1, 32), "ue8m0", (6, 100)), ("e4m3", (1, 32), "ocp", (3, 64))]


@pytest.mark.parametrize("fmt,block,rule,shape", CASES)
def test_scaled_quantize_equals_oracle(fmt, block, rule, shape):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-20, 20, (shape[0], 1), generator=g).float())
    x[0, :3] = torch.tensor([0.0, -0.0, 1e-30])
    if shape[0] > 2:
        x[2] = 0.0                                                            # an all-zero row: amax 0
    q = Q.quantize(x, fmt, block, rule)
    vals, scale = oracle_quantize(x, fmt, block, rule)
    qf = Q.quantize(x, fmt, block, rule, method="formula")
    assert torch.equal(qf.values, q.values) and _same(qf.scale, q.scale)
    assert _same(q.scale, scale), (q.scale, scale)
    assert torch.equal(q.values, vals)
    if rule != "fp32":   # dequantisation by a power of two is exact
        assert torch.equal(q.dequantize(), vals * Q.expand_scale(scale, block, x.shape))
    if rule == "ue8m0":  # the DeepSeek rule never saturates: every |value| <= vmax and the max block reaches > vmax/2
        assert q.values.abs().max() <= Q.FORMATS[fmt][2]


def test_scale_exponent_edges():
    # exact powers of two: ue8m0 = ceil, so amax = vmax * 2^k gives exactly 2^k (no rounding up)
    a = torch.tensor([448.0, 448.0 * 2 ** -10, 449.0, 447.0, 0.0, 3e38, 1e-45])
    e = Q.pow2_exponent(a, "e4m3", "ue8m0")
    assert e.tolist() == [0, -10, 1, 0, -127, 120, -127]
    o = Q.pow2_exponent(torch.tensor([6.0, 7.99, 8.0, 1.0, 0.0]), "e2m1", "ocp")
    assert o.tolist() == [0, 0, 1, -2, -127]
    for amax in a.tolist():
        assert 2.0 ** e[a.tolist().index(amax)].item() == oracle_scale(amax, "e4m3", "ue8m0")


def test_mx_nonfinite_block_gets_nan_scale():
    x = torch.ones(2, 64)
    x[0, 5] = math.nan
    x[1, 40] = math.inf
    q = Q.mx_quantize(x)
    codes = Q.mx_scale_codes(q)
    assert codes.tolist() == [[255, 125], [125, 255]]       # amax 1 -> floor(log2 1) - 2 = -2 -> code 125
    d = q.dequantize()
    assert torch.isnan(d[0, :32]).all() and torch.isnan(d[1, 32:]).all()
    assert torch.equal(d[0, 32:], torch.ones(32)) and torch.equal(d[1, :32], torch.ones(32))
    # FP8 tiles keep a per-element NaN and saturate Inf to the tile's max code
    y = torch.ones(1, 128)
    y[0, 0], y[0, 1] = math.nan, math.inf
    q8 = Q.quantize(y, "e4m3", (1, 128), "ue8m0")
    assert math.isnan(q8.values[0, 0].item()) and q8.values[0, 1].item() == 448.0


def test_ste_passes_gradients_unchanged():
    x = torch.randn(4, 64, requires_grad=True)
    g = torch.randn(4, 64)
    y = Q.ste_fake_quantize(x, "e2m1", (1, 32), "ocp")
    y.backward(g)
    assert torch.equal(x.grad, g)
    assert torch.equal(y.detach(), Q.fake_quantize(x.detach(), "e2m1", (1, 32), "ocp"))
