"""mHC (spec §4.2) in Triton: fused `hc_pre` and `hc_post`, forward and backward; fp32 math.

Same contract as `naive` (N tokens, n streams, d hidden; fn [(2+n)n, n*d] rows pre | post | comb):

Byte counts below: X = N·n·d·2 (x in bf16), U = N·d·2, for n = 4, d = 4096 at 16K tokens X = 512 MiB.

Products (`_proj`, `_pre_bwd_dx`): bf16 tensor-core dots of exact bf16 pieces, fp32 accumulation. An fp32 operand v
is split v = v1 + v2 + v3 exactly (`_split3`: 8 significant bits each, round to nearest even on the bits), bf16 x
is its own single piece; each bf16 x bf16 product is exact in fp32, so Σ_i x·f_i is ~fp32 accurate (`_mm3` picks
the piece products by significance). fn's pieces are made once per call ([3, R, K] bf16, `_split_bf16`), dh's
by `_pre_bwd_map`. On CPU tensors (the interpreter, whose bf16 tl.dot is wrong) the same pieces are upcast and
dotted in exact fp32 ("ieee"): the same products, so the CPU tests exercise the decomposition.

hc_pre forward, three kernels, 2X + U of HBM traffic:
  1. `_proj` (split-K): grid (token blocks of BM, SPLIT contiguous ranges of K = n·d); each program streams its
     [BM, K/SPLIT] slice of x once and writes partial x·fnᵀ [BM, RP] and Σx² [BM] (SPLIT·N·(RP+1)·4 bytes in
     all, < 2% of X). x stays bf16 (a dot operand as loaded, upcast only for Σx²); x·fnᵀ = Σ_i x·f_iᵀ, three
     bf16 dots (was: x upcast to fp32, two TF32 passes at half the bf16 rate). fn's pieces [R, BK] come from L2
     (2.25 MiB in all; 72/BM of the x bytes per program, hence BM up to 256). fp32 x is split in registers (six
     dots).
  2. `_pre_map`: per block of tokens the fixed-order split-K reduction, r = rsqrt(mean(x²)+eps), mix, the
     pre / post sigmoids and the Sinkhorn iterations on [BM, n, n] in registers (reads SPLIT partials).
  3. `_pre_agg`: grid (token blocks, channel blocks): u = Σ_j pre_j X_j (the second read of x, the write of u).
     Pure streaming (no products); 0.16 ms = 4.2 TB/s at 16K already.
hc_pre backward, three kernels, 3X + 2U:
  1. `_pre_bwd_dpre`: dpre = Σ_d du·X_j streamed over d (X + U). It cannot join `_pre_bwd_dx`: dh needs the whole
     d-sum of dpre (through the sigmoid / Sinkhorn backward) before any dx column.
  2. `_pre_bwd_map`: the backward of the small map (sigmoids; the Sinkhorn steps from their inputs, replayed
     once and kept in a [2·iters-1, N, n, n] fp32 scratch), dh = dmix·r as three bf16 pieces [3, N, RP],
     cx = -r²/(nd)·Σ dmix·mix.
  3. `_pre_bwd_dx`: grid (n·d/BD, NSPLIT token ranges), stream fastest; a program owns one stream's channel block
     (BD·2-byte row segments of x, du, dx), keeps fn's pieces for it [RP, BD] in shared memory and walks its
     tokens: dx = dh·fn + cx·x + pre_j·du (reads x and du, writes dx: 2X + U; the n programs of a channel block run
     side by side, so n-1 of them read du from L2), and dfnᵀ += xᵀ·dh into a per-split partial [K, RP]
     (NSPLIT·K·RP·4 bytes: ≤ 32 MiB, summed by PyTorch) -- no second pass over x. Products: bf16 dx takes
     dh1·f1 + dh1·f2 + dh2·f1 (3 bf16 dots; the dropped terms are ~2^-16 relative, the bf16 store rounds at 2^-9),
     dfnᵀ = Σ_i xᵀ·dh_i (3 dots, ~fp32); was 3xTF32 + 2 TF32 passes (5 TF32 = 10 bf16-dot equivalents, now 6).
     dbase / dscale: `_pre_bwd_map` writes per-program sums, reduced by two PyTorch sums (were six launches).
hc_post: one kernel each way, per (block of tokens, block of channels), 2X + U forward, 3X + 2U backward; the
  backward writes dpost / dcomb partial sums per channel block (summed by PyTorch; deterministic, no atomics).
Every streaming kernel is autotuned over block sizes / warps / stages (and SPLIT / NSPLIT); the launch code
reads the split the tuner picked (`tuned`) to reduce exactly the partials that launch wrote.
`sinkhorn` is the naive PyTorch version (not fused here); `hc_head` runs on hc_pre (kernels/mhc/op.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.kernels._triton_util import configs, on_cpu, pow2, tuned
from dsv4.kernels.mhc import naive

sinkhorn = naive.sinkhorn


def _ieee(x) -> bool:
    """Dot arithmetic: exact fp32 dots of the (upcast) bf16 pieces for CPU tensors -- Triton 3.9's interpreter
    computes bf16 tl.dot wrongly -- and bf16 tensor-core dots on the GPU; the same products either way."""
    return on_cpu(x)


def _bf16x(x) -> bool:
    """x is bf16: it is its own single bf16 piece (no split), and dx is stored in bf16."""
    return x.dtype == torch.bfloat16


def _small(n_elems):
    """Prune for problems too small to tune (tests): the first config only."""
    return lambda cfgs, args: cfgs if args["N"] * n_elems(args) >= 1 << 24 else cfgs[:1]


@triton.jit
def _bf16_hi(v):
    """fp32 v rounded to the nearest bf16 (ties to even) by its bits, kept in fp32. Done on the bits so every
    backend rounds alike (the interpreter truncates in fp32 -> bf16 casts); v - hi is then exact in fp32."""
    b = v.to(tl.int32, bitcast=True)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _split3(v):
    """fp32 v = p1 + p2 + p3 exactly in three bf16 pieces (8 significant bits each; |p2| <= 2^-9 |v|,
    |p3| <= 2^-17 |v|). The casts to bf16 are exact (each piece is already a bf16 value)."""
    h1 = _bf16_hi(v)
    r = v - h1
    h2 = _bf16_hi(r)
    return h1.to(tl.bfloat16), h2.to(tl.bfloat16), (r - h2).to(tl.bfloat16)


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    """acc + a·b for bf16 a, b: every product is exact in fp32, the sums are fp32 (tensor cores). IEEE
    (interpreter): the same exact products as an fp32 dot of the upcast pieces."""
    if IEEE:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _mm3(a1, a2, a3, b1, b2, b3, acc, NA: tl.constexpr, NB: tl.constexpr, LVL: tl.constexpr,
         IEEE: tl.constexpr):
    """acc + a·b with a = a1 + a2 + a3 (its first NA pieces), b = b1 + b2 + b3 (first NB): the bf16 dots
    a_i·b_j with i + j <= LVL (0-based). Piece i carries ~2^-8i of its operand, so LVL 2 drops terms of
    <= ~2^-24 relative (~fp32 accuracy: 3 dots for one piece of a, 6 for three), LVL 1 drops ~2^-16 (3 dots; for
    outputs stored in bf16, whose rounding is 2^-9). Unused pieces may be any tensor (never read)."""
    acc = _dot(a1, b1, acc, IEEE)
    if LVL >= 1:
        if NB >= 2:
            acc = _dot(a1, b2, acc, IEEE)
        if NA >= 2:
            acc = _dot(a2, b1, acc, IEEE)
    if LVL >= 2:
        if NB >= 3:
            acc = _dot(a1, b3, acc, IEEE)
        if NA >= 2 and NB >= 2:
            acc = _dot(a2, b2, acc, IEEE)
        if NA >= 3:
            acc = _dot(a3, b1, acc, IEEE)
    return acc


@triton.jit
def _pieces(P, off, mask, STRIDE, NPC: tl.constexpr):
    """The first NPC of the three bf16 pieces P[i] = P + i·STRIDE at `off` (the rest: the first, unused)."""
    p1 = tl.load(P + off, mask=mask, other=0.0)
    p2 = p1
    p3 = p1
    if NPC >= 2:
        p2 = tl.load(P + STRIDE + off, mask=mask, other=0.0)
    if NPC >= 3:
        p3 = tl.load(P + 2 * STRIDE + off, mask=mask, other=0.0)
    return p1, p2, p3


@triton.jit
def _split_kernel(SRC, DST, numel, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < numel
    p1, p2, p3 = _split3(tl.load(SRC + offs, mask=m, other=0.0))
    tl.store(DST + offs, p1, mask=m)
    tl.store(DST + numel + offs, p2, mask=m)
    tl.store(DST + 2 * numel + offs, p3, mask=m)


def _split_bf16(t):
    """[3, *t.shape] bf16 pieces of fp32 t, t = Σ pieces exactly (`_split3`); fn [R, K]: 6·R·K bytes, one launch."""
    t = t.contiguous()
    out = torch.empty(3, *t.shape, device=t.device, dtype=torch.bfloat16)
    BLOCK = 4096
    _split_kernel[(triton.cdiv(t.numel(), BLOCK),)](t, out, t.numel(), BLOCK=BLOCK)
    return out


# ------------------------------------------------------------------------------------------ hc_pre fwd
_SPLIT_MAX = 8
# x [BM, BK] stays bf16 (a dot operand as loaded; upcast only for Σx²); the first 8 were the TF32 kernel's set
# (32 fp32 elements per thread), the last 4 use the room it frees: BM 128-256 cuts the fn pieces' L2 reads
# (3 pieces x R rows x 2 B per k: 72/BM of the x bytes). Offline Triton 3.6 sm_90 compile: 64-138 registers, no
# spills, wgmma, loads pipelined (the TF32 kernel: 114-188)
_PROJ = configs(gpu=[dict(BM=64, BK=64, SPLIT=4, num_warps=4, num_stages=3),
                     dict(BM=64, BK=64, SPLIT=8, num_warps=4, num_stages=4),
                     dict(BM=128, BK=32, SPLIT=4, num_warps=4, num_stages=4),
                     dict(BM=64, BK=128, SPLIT=4, num_warps=8, num_stages=3),
                     dict(BM=128, BK=64, SPLIT=4, num_warps=8, num_stages=3),
                     dict(BM=128, BK=64, SPLIT=8, num_warps=8, num_stages=4),
                     dict(BM=256, BK=32, SPLIT=2, num_warps=8, num_stages=4),
                     dict(BM=256, BK=32, SPLIT=4, num_warps=8, num_stages=4),
                     dict(BM=128, BK=64, SPLIT=8, num_warps=4, num_stages=4),
                     dict(BM=128, BK=128, SPLIT=4, num_warps=8, num_stages=3),
                     dict(BM=256, BK=64, SPLIT=4, num_warps=8, num_stages=3),
                     dict(BM=256, BK=64, SPLIT=8, num_warps=8, num_stages=3)],
                cpu=dict(BM=16, BK=32, SPLIT=2), prune=_small(lambda a: a["K"]))


@triton.autotune(**_PROJ, key=["K", "R", "NK", "XB16"])
@triton.jit
def _proj(X, FN3, PART, SQ, N, K, R, NK, RP: tl.constexpr, XB16: tl.constexpr, IEEE: tl.constexpr,
          BM: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr):
    """Split-K partials of the projection: PART[s] [N, RP] = x[:, Ks]·fn[:, Ks]ᵀ and SQ[s] [N] = Σ_Ks x², over
    the s-th of SPLIT contiguous K ranges (K = n·d). Reduced in fixed order by `_pre_map`: no atomics.
    FN3 [3, R, K]: fn's bf16 pieces (`_split_bf16`). bf16 x (XB16): x·fnᵀ = Σ_i x·f_iᵀ, three bf16 dots with
    exact products (~fp32 accuracy); other x dtypes are split in registers too (six dots, `_mm3`)."""
    offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
    s = tl.program_id(1)
    offs_r = tl.arange(0, RP)
    mmask, rmask = offs_m < N, offs_r < R
    ks = tl.cdiv(tl.cdiv(K, SPLIT), BK) * BK
    lo = s * ks
    hi = tl.minimum(lo + ks, K)
    acc = tl.zeros([BM, RP], tl.float32)
    sq = tl.zeros([BM], tl.float32)
    for k0 in range(lo, hi, BK):
        offs_k = k0 + tl.arange(0, BK)
        kmask = offs_k < hi
        x = tl.load(X + offs_m[:, None].to(tl.int64) * K + offs_k[None, :], mask=mmask[:, None] & kmask[None, :],
                    other=0.0)
        f1, f2, f3 = _pieces(FN3, offs_r[None, :] * K + offs_k[:, None], rmask[None, :] & kmask[:, None], R * K, 3)
        xf = x.to(tl.float32)
        if XB16:
            acc = _mm3(x, x, x, f1, f2, f3, acc, 1, 3, 2, IEEE)          # [BM, RP]
        else:
            x1, x2, x3 = _split3(xf)
            acc = _mm3(x1, x2, x3, f1, f2, f3, acc, 3, 3, 2, IEEE)
        sq += tl.sum(xf * xf, 1)
    tl.store(PART + (s * N + offs_m[:, None].to(tl.int64)) * RP + offs_r[None, :], acc, mask=mmask[:, None])
    tl.store(SQ + s * N + offs_m, sq, mask=mmask)


# The two small-map kernels (sigmoids, Sinkhorn and its backward on [BM, n, n]) are latency-bound chains of ~40
# dependent normalisations per token with 4 elements per thread at BM 32 x 4 warps (~16 warps per SM at 16K
# tokens); more warps per token block spread the same tiles thinner (more warps in flight). `_pre_bwd_map` took
# 0.09 ms at 16K with the first config (its bytes: ~90 MiB, mostly the Sinkhorn scratch, ~0.02 ms).
_MAP = configs(gpu=[dict(BM=32, num_warps=4), dict(BM=32, num_warps=8), dict(BM=32, num_warps=16),
                    dict(BM=16, num_warps=4), dict(BM=16, num_warps=8), dict(BM=64, num_warps=16)],
               cpu=dict(BM=16), prune=_small(lambda a: 1 << 13))
_MAP_BM_MIN = min(c.kwargs["BM"] for c in _MAP["configs"])    # sizes `_pre_bwd_map`'s per-program sums


@triton.autotune(**_MAP, key=["NK", "NS"])
@triton.jit
def _pre_map(PART, SQ, BASE, SCALE, MIX, RINV, POST, COMB, PRE, N, K, SPLIT, iters, eps, norm_eps, NK,
             NS: tl.constexpr, NP: tl.constexpr, RP: tl.constexpr, BM: tl.constexpr):
    """Per block of tokens: the split-K reduction (fixed order), r = rsqrt(mean(x²)+eps), mix = r·(x·fnᵀ), then
    pre / post sigmoids and the Sinkhorn iterations on [BM, n, n] in registers."""
    offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
    mmask = offs_m < N
    offs_r = tl.arange(0, RP)
    acc = tl.zeros([BM, RP], tl.float32)
    sqs = tl.zeros([BM], tl.float32)
    for s in range(SPLIT):
        acc += tl.load(PART + (s * N + offs_m[:, None].to(tl.int64)) * RP + offs_r[None, :], mask=mmask[:, None],
                       other=0.0)
        sqs += tl.load(SQ + s * N + offs_m, mask=mmask, other=0.0)
    r = 1.0 / tl.sqrt(sqs / K + norm_eps)
    tl.store(MIX + offs_m[:, None] * RP + offs_r[None, :], acc * r[:, None], mask=mmask[:, None])
    tl.store(RINV + offs_m, r, mask=mmask)
    tl.debug_barrier()                                          # MIX is re-read below by other threads
    j = tl.arange(0, NP)
    jm = j < NS
    s0 = tl.load(SCALE)
    s1 = tl.load(SCALE + 1)
    s2 = tl.load(SCALE + 2)
    m2 = mmask[:, None] & jm[None, :]
    mix_row = MIX + offs_m[:, None] * RP
    pre = tl.sigmoid(tl.load(mix_row + j[None, :], mask=m2, other=0.0) * s0 + tl.load(BASE + j, mask=jm)[None, :]) + eps
    post = 2.0 * tl.sigmoid(tl.load(mix_row + NS + j[None, :], mask=m2, other=0.0) * s1
                            + tl.load(BASE + NS + j, mask=jm)[None, :])
    pre = tl.where(m2, pre, 0.0)
    tl.store(POST + offs_m[:, None] * NS + j[None, :], post, mask=m2)
    tl.store(PRE + offs_m[:, None] * NS + j[None, :], pre, mask=m2)
    # Sinkhorn on comb logits [BM, j, k]: softmax over k, +eps, column norm, then (iters-1) x (row, column)
    jk = 2 * NS + j[:, None] * NS + j[None, :]                  # flat mix column of comb[j, k]
    valid = jm[:, None] & jm[None, :]
    m3 = mmask[:, None, None] & valid[None, :, :]
    lg = tl.load(MIX + offs_m[:, None, None] * RP + jk[None, :, :], mask=m3, other=0.0) * s2 \
        + tl.load(BASE + jk, mask=valid, other=0.0)[None, :, :]
    lg = tl.where(valid[None, :, :], lg, float("-inf"))
    lg = tl.where(jm[None, :, None], lg, 0.0)                   # padded rows: finite, zeroed below
    e = tl.exp(lg - tl.max(lg, 2)[:, :, None])
    c = e / tl.sum(e, 2)[:, :, None] + eps
    c = tl.where(valid[None, :, :], c, 0.0)
    c = c / (tl.sum(c, 1)[:, None, :] + eps)
    for _ in range(iters - 1):
        c = c / (tl.sum(c, 2)[:, :, None] + eps)
        c = c / (tl.sum(c, 1)[:, None, :] + eps)
    tl.store(COMB + offs_m[:, None, None] * (NS * NS) + j[None, :, None] * NS + j[None, None, :], c, mask=m3)


_AGG = configs(gpu=[dict(BM=4, BD=256, num_warps=4), dict(BM=8, BD=256, num_warps=4),
                    dict(BM=4, BD=512, num_warps=4), dict(BM=8, BD=512, num_warps=8),
                    dict(BM=16, BD=256, num_warps=8), dict(BM=16, BD=128, num_warps=4)],
               # CPU (interpreter): each element is one sum over the n streams, so the tile changes no value; 16 x 32
               # (was 4 x 16) runs 8x fewer interpreted programs (it was 40% of a debug forward under the interpreter)
               cpu=dict(BM=16, BD=32), prune=_small(lambda a: a["D"] * a["NS"]))


@triton.autotune(**_AGG, key=["D", "NK", "NS"])
@triton.jit
def _pre_agg(X, PRE, U, N, D, NK, NS: tl.constexpr, NP: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr):
    """u [BM, BD] = Σ_j pre_j X_j: one read of x, one write of u."""
    offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
    offs_d = tl.program_id(1) * BD + tl.arange(0, BD)
    j = tl.arange(0, NP)
    mmask = offs_m < N
    md = mmask[:, None] & (offs_d[None, :] < D)
    pre = tl.load(PRE + offs_m[:, None] * NS + j[None, :], mask=mmask[:, None] & (j < NS)[None, :], other=0.0)
    u = tl.zeros([BM, BD], tl.float32)
    for jj in tl.static_range(NS):
        pj = tl.sum(tl.where(j[None, :] == jj, pre, 0.0), 1)
        xj = tl.load(X + offs_m[:, None].to(tl.int64) * (NS * D) + jj * D + offs_d[None, :], mask=md, other=0.0)
        u += pj[:, None] * xj.to(tl.float32)
    tl.store(U + offs_m[:, None].to(tl.int64) * D + offs_d[None, :], u.to(U.dtype.element_ty), mask=md)


# ------------------------------------------------------------------------------------------ hc_pre bwd
_DPRE = configs(gpu=[dict(BM=4, BD=256, num_warps=4, num_stages=2), dict(BM=8, BD=256, num_warps=8, num_stages=3),
                     dict(BM=8, BD=128, num_warps=4, num_stages=3), dict(BM=16, BD=128, num_warps=8, num_stages=2),
                     dict(BM=4, BD=512, num_warps=8, num_stages=2), dict(BM=8, BD=256, num_warps=8, num_stages=2)],
                cpu=dict(BM=4, BD=16), prune=_small(lambda a: a["D"] * a["NS"]))


@triton.autotune(**_DPRE, key=["D", "NK", "NS"])
@triton.jit
def _pre_bwd_dpre(X, DU, DPRE, N, D, NK, NS: tl.constexpr, NP: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr):
    """dpre [N, NP] = Σ_d du·X_j, streamed over d: one read of x and of du."""
    offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
    mmask = offs_m < N
    j = tl.arange(0, NP)
    m2 = mmask[:, None] & (j < NS)[None, :]
    dpre = tl.zeros([BM, NP], tl.float32)
    for d0 in range(0, D, BD):
        offs_d = d0 + tl.arange(0, BD)
        dmask = offs_d < D
        du = tl.load(DU + offs_m[:, None].to(tl.int64) * D + offs_d[None, :], mask=mmask[:, None] & dmask[None, :],
                     other=0.0).to(tl.float32)
        x = tl.load(X + offs_m[:, None, None].to(tl.int64) * (NS * D) + j[None, :, None] * D + offs_d[None, None, :],
                    mask=m2[:, :, None] & dmask[None, None, :], other=0.0)
        dpre += tl.sum(x.to(tl.float32) * du[:, None, :], 2)
    tl.store(DPRE + offs_m[:, None] * NP + j[None, :], dpre, mask=mmask[:, None])


@triton.autotune(**_MAP, key=["NK", "NS"])
@triton.jit
def _pre_bwd_map(MIX, RINV, BASE, SCALE, DPRE, DPOST, DCOMB, DZ, DH3, CX, ST, SB, SS, N, K, R, iters, eps, NK,
                 NS: tl.constexpr, NP: tl.constexpr, RP: tl.constexpr, BM: tl.constexpr):
    """Backward of the small map z = mix·scale + base -> (pre, post, comb) into DZ = dL/dz [N, RP], then
    DH3 [3, N, RP] = the bf16 pieces (`_split3`) of dh = d(x·fnᵀ) = dz·scale·r, and CX = -r²/K·Σ dmix·mix (the
    rsqrt's term of dx). The Sinkhorn steps: the forward is replayed once from the softmax (the same operations in
    the same order as `_pre_map`), the input of every step stored in ST [2·iters-1, N, NP, NP] fp32 (scratch), then
    the steps are differentiated last to first from those inputs: O(iters) work per token (was an O(iters²)
    replay: 741 normalisations at 20 iters). This program's token sums: SB [programs, RP] of dz (-> dbase), SS
    [programs, 3] of dz·mix over the pre / post / comb columns (-> dscale)."""
    offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
    mmask = offs_m < N
    j = tl.arange(0, NP)
    jm = j < NS
    m2 = mmask[:, None] & jm[None, :]
    dpre = tl.load(DPRE + offs_m[:, None] * NP + j[None, :], mask=m2, other=0.0)
    s0 = tl.load(SCALE)
    s1 = tl.load(SCALE + 1)
    s2 = tl.load(SCALE + 2)
    mix_row = MIX + offs_m[:, None] * RP
    # pre = σ(z) + eps, post = 2σ(z): dz = g · σ(1-σ) (· 2)
    sp = tl.sigmoid(tl.load(mix_row + j[None, :], mask=m2, other=0.0) * s0 + tl.load(BASE + j, mask=jm)[None, :])
    tl.store(DZ + offs_m[:, None] * RP + j[None, :], dpre * sp * (1.0 - sp), mask=m2)
    sq = tl.sigmoid(tl.load(mix_row + NS + j[None, :], mask=m2, other=0.0) * s1 + tl.load(BASE + NS + j, mask=jm)[None, :])
    dpost = tl.load(DPOST + offs_m[:, None] * NS + j[None, :], mask=m2, other=0.0)
    tl.store(DZ + offs_m[:, None] * RP + NS + j[None, :], 2.0 * dpost * sq * (1.0 - sq), mask=m2)
    # comb: replay softmax + eps, then the 2·iters-1 normalisations (even step: column, odd step: row)
    jk = 2 * NS + j[:, None] * NS + j[None, :]
    valid = jm[:, None] & jm[None, :]
    m3 = mmask[:, None, None] & valid[None, :, :]
    lg = tl.load(MIX + offs_m[:, None, None] * RP + jk[None, :, :], mask=m3, other=0.0) * s2 \
        + tl.load(BASE + jk, mask=valid, other=0.0)[None, :, :]
    lg = tl.where(valid[None, :, :], lg, float("-inf"))
    lg = tl.where(jm[None, :, None], lg, 0.0)
    e = tl.exp(lg - tl.max(lg, 2)[:, :, None])
    p = tl.where(valid[None, :, :], e / tl.sum(e, 2)[:, :, None], 0.0)       # softmax over k
    c0 = tl.where(valid[None, :, :], p + eps, 0.0)
    g = tl.load(DCOMB + offs_m[:, None, None] * (NS * NS) + j[None, :, None] * NS + j[None, None, :], mask=m3, other=0.0)
    nsteps = 2 * iters - 1
    st_off = (offs_m[:, None, None].to(tl.int64) * NP + j[None, :, None]) * NP + j[None, None, :]   # [BM, NP, NP]
    st_mask = mmask[:, None, None] & (j[None, :, None] >= 0) & (j[None, None, :] >= 0)
    x = c0
    for st in range(0, nsteps):                                 # replay the forward once, keep each step's input
        tl.store(ST + st * N * NP * NP + st_off, x, mask=st_mask)
        if st % 2 == 0:
            x = x / (tl.sum(x, 1)[:, None, :] + eps)
        else:
            x = x / (tl.sum(x, 2)[:, :, None] + eps)
    tl.debug_barrier()                                          # ST is read back below
    for i in range(nsteps - 1, -1, -1):
        x = tl.load(ST + i * N * NP * NP + st_off, mask=st_mask, other=0.0)
        if i % 2 == 0:                                          # y = x / (colsum + eps)
            sc_col = tl.sum(x, 1)[:, None, :] + eps
            g = g / sc_col - tl.sum(g * x, 1)[:, None, :] / (sc_col * sc_col)
        else:                                                   # y = x / (rowsum + eps)
            sc_row = tl.sum(x, 2)[:, :, None] + eps
            g = g / sc_row - tl.sum(g * x, 2)[:, :, None] / (sc_row * sc_row)
        g = tl.where(valid[None, :, :], g, 0.0)                 # padded streams (n not a power of 2)
    dl = p * (g - tl.sum(p * g, 2)[:, :, None])                 # softmax backward (the +eps passes g)
    tl.store(DZ + offs_m[:, None, None] * RP + jk[None, :, :], dl, mask=m3)
    # dh = dz·scale_group·r, cx = -r²/K Σ_cols dz·scale·mix (padded columns written 0)
    tl.debug_barrier()                                          # DZ is re-read below by other threads
    offs_r = tl.arange(0, RP)
    rm = mmask[:, None] & (offs_r < R)[None, :]
    dzr = tl.load(DZ + offs_m[:, None] * RP + offs_r[None, :], mask=rm, other=0.0)
    mixr = tl.load(MIX + offs_m[:, None] * RP + offs_r[None, :], mask=rm, other=0.0)
    sc = tl.where(offs_r < NS, s0, tl.where(offs_r < 2 * NS, s1, s2))
    dmix = dzr * sc[None, :]
    rinv = tl.load(RINV + offs_m, mask=mmask, other=0.0)
    dh1, dh2, dh3 = _split3(dmix * rinv[:, None])
    dh_off = offs_m[:, None] * RP + offs_r[None, :]
    tl.store(DH3 + dh_off, dh1, mask=mmask[:, None])
    tl.store(DH3 + N * RP + dh_off, dh2, mask=mmask[:, None])
    tl.store(DH3 + 2 * N * RP + dh_off, dh3, mask=mmask[:, None])
    tl.store(DZ + offs_m[:, None] * RP + offs_r[None, :], dzr, mask=mmask[:, None])
    tl.store(CX + offs_m, -tl.sum(dmix * mixr, 1) * rinv * rinv / K, mask=mmask)
    ds = tl.sum(dzr * mixr, 0)                                  # [RP] this block's Σ_t dz·mix (rows past N: 0)
    tl.store(SB + tl.program_id(0) * RP + offs_r, tl.sum(dzr, 0))            # -> dbase
    ss = SS + tl.program_id(0) * 3                                           # -> dscale (columns past R: 0)
    tl.store(ss, tl.sum(tl.where(offs_r < NS, ds, 0.0), 0))
    tl.store(ss + 1, tl.sum(tl.where((offs_r >= NS) & (offs_r < 2 * NS), ds, 0.0), 0))
    tl.store(ss + 2, tl.sum(tl.where(offs_r >= 2 * NS, ds, 0.0), 0))


_DX_SPLIT_MAX = 16
# One stream's [BM, BD] tiles per program (x, du, dx: BD·2-byte row segments) and its fn pieces [RP, BD] (in shared
# memory). The first is the small-problem config (no tuning). Offline Triton 3.6 sm_90 compile (ptxas -v): 98-231
# registers per thread, no spills, all wgmma (BD 128 x BM 64 at 4 warps and BD 128 x BM 128 spilled 44 bytes and
# BD 256 x BM 32 at 4 warps 204: left out); the small tiles (BM 16-32 x 4 warps, 98-130 registers) fit 4-5
# programs per SM, the wide ones (BD 128-256) give 256-512-byte row segments. The old all-streams kernel: 238-250.
_DX = configs(gpu=[dict(BD=64, BM=64, NSPLIT=8, num_warps=4, num_stages=3),
                   dict(BD=64, BM=64, NSPLIT=16, num_warps=4, num_stages=3),
                   dict(BD=64, BM=32, NSPLIT=16, num_warps=4, num_stages=4),
                   dict(BD=64, BM=32, NSPLIT=8, num_warps=4, num_stages=3),
                   dict(BD=64, BM=16, NSPLIT=8, num_warps=4, num_stages=3),
                   dict(BD=64, BM=64, NSPLIT=8, num_warps=8, num_stages=4),
                   dict(BD=64, BM=128, NSPLIT=8, num_warps=8, num_stages=3),
                   dict(BD=32, BM=64, NSPLIT=8, num_warps=4, num_stages=3),
                   dict(BD=128, BM=16, NSPLIT=8, num_warps=4, num_stages=3),
                   dict(BD=128, BM=32, NSPLIT=8, num_warps=4, num_stages=3),
                   dict(BD=128, BM=32, NSPLIT=8, num_warps=8, num_stages=3),
                   dict(BD=128, BM=32, NSPLIT=16, num_warps=8, num_stages=3),
                   dict(BD=128, BM=32, NSPLIT=16, num_warps=4, num_stages=3),   # a807594's pick at twice the split
                   dict(BD=128, BM=32, NSPLIT=8, num_warps=4, num_stages=4),
                   dict(BD=128, BM=64, NSPLIT=8, num_warps=8, num_stages=4),
                   dict(BD=256, BM=32, NSPLIT=8, num_warps=8, num_stages=3)],
              cpu=dict(BD=16, BM=16, NSPLIT=2), prune=_small(lambda a: a["K"]))


@triton.autotune(**_DX, key=["K", "NK", "NS", "XB16"])
@triton.jit
def _pre_bwd_dx(X, FN3, DH3, CX, PRE, DU, DRES, DX, DFN, N, K, D, R, NK, NS: tl.constexpr, RP: tl.constexpr,
                XB16: tl.constexpr, IEEE: tl.constexpr, HAS_RES: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr,
                NSPLIT: tl.constexpr):
    """Program (stream j, channel block d0, token split s) -- j varies fastest, so the n programs that share a du
    block run side by side and n-1 of them read it from L2 -- owns the columns k = j·d + d0 + [0, BD): it keeps
    fn's pieces for them ([RP, BD]) and walks its token range in BM blocks:
    dx = dh·fn + cx·x + pre_j·du and dfnᵀ[BD, RP] += xᵀ·dh, all products bf16 dots of pieces (`_mm3`): dh and fn
    in three pieces (DH3 [3, N, RP] from `_pre_bwd_map`, FN3 [3, R, K]), bf16 x as it is. dx in bf16 takes
    dh1·f1 + dh1·f2 + dh2·f1 (dropped terms ~2^-16 relative, under its 2^-9 rounding), in fp32 six dots;
    dfnᵀ = Σ_i xᵀ·dh_i (exact products: ~fp32). DFN[s] [K, RP] partial, summed over s by PyTorch. HAS_RES: dx also
    takes DRES [N, K], x's other gradient (hc_post's residual input, `hc_pre_residual`), in fp32 before the store. (A
    [RP, K] partial -- fn's layout, no transposed copy after the sum -- made this kernel 0.507 -> 0.566-0.572 ms at
    16K on the H200, stored from the [BD, RP] tile or its tl.trans alike: kept [K, RP].)"""
    LDX: tl.constexpr = 1 if XB16 else 2                        # _mm3 level of dx (bf16 dx: 3 dots)
    j = tl.program_id(0) % NS
    offs_d = (tl.program_id(0) // NS) * BD + tl.arange(0, BD)
    s = tl.program_id(1)
    dmask = offs_d < D
    kk = j * D + offs_d                                         # column -> K index
    offs_r = tl.arange(0, RP)
    f1, f2, f3 = _pieces(FN3, offs_r[:, None] * K + kk[None, :], (offs_r < R)[:, None] & dmask[None, :], R * K,
                         LDX + 1)
    dfnT = tl.zeros([BD, RP], tl.float32)
    tps = tl.cdiv(tl.cdiv(N, NSPLIT), BM) * BM
    lo = s * tps
    hi = tl.minimum(lo + tps, N)
    ii = tl.arange(0, BM)
    x_tile = ii[:, None] * K + kk[None, :]                      # int32 offsets from the block's first token (the
    du_tile = ii[:, None] * D + offs_d[None, :]                 # loop-invariant part of the addresses is 32-bit)
    dh_tile = ii[:, None] * RP + offs_r[None, :]
    for t0 in range(lo, hi, BM):
        offs_m = t0 + ii
        mmask = offs_m < hi
        md = mmask[:, None] & dmask[None, :]
        t64 = tl.cast(t0, tl.int64)
        dh1, dh2, dh3 = _pieces(DH3 + t0 * RP, dh_tile, mmask[:, None], N * RP, 3)
        x = tl.load(X + t64 * K + x_tile, mask=md, other=0.0)
        cx = tl.load(CX + offs_m, mask=mmask, other=0.0)
        pre = tl.load(PRE + offs_m * NS + j, mask=mmask, other=0.0)
        du = tl.load(DU + t64 * D + du_tile, mask=md, other=0.0).to(tl.float32)
        dx = _mm3(dh1, dh2, dh3, f1, f2, f3, tl.zeros([BM, BD], tl.float32), 3, LDX + 1, LDX, IEEE)
        dx += cx[:, None] * x.to(tl.float32) + pre[:, None] * du
        if HAS_RES:
            dx += tl.load(DRES + t64 * K + x_tile, mask=md, other=0.0).to(tl.float32)
        tl.store(DX + t64 * K + x_tile, dx.to(DX.dtype.element_ty), mask=md)
        if XB16:
            xt = tl.trans(x)
            dfnT = _mm3(xt, xt, xt, dh1, dh2, dh3, dfnT, 1, 3, 2, IEEE)
        else:
            x1, x2, x3 = _split3(tl.trans(x.to(tl.float32)))
            dfnT = _mm3(x1, x2, x3, dh1, dh2, dh3, dfnT, 3, 3, 2, IEEE)
    tl.store(DFN + (s * K + kk[:, None].to(tl.int64)) * RP + offs_r[None, :], dfnT,
             mask=dmask[:, None] & (offs_r < R)[None, :])


def _project(x, fn32, norm_eps, base32=None, scale32=None, iters=1, eps=0.0):
    """mix [N, RP] (normalised x·fnᵀ, zero-padded columns), rinv = rsqrt(mean(x²)+eps) [N], the small map
    (post [N, n], comb [N, n, n], pre [N, n]; zero base / unit scale when not given) and fn's bf16 pieces fn3
    [3, R, K] (kept for the backward's `_pre_bwd_dx`): `_split_bf16` + `_proj` + `_pre_map`."""
    N, n, d = x.shape
    R, K = fn32.shape
    RP = pow2(R)
    dev = x.device
    f32 = dict(device=dev, dtype=torch.float32)
    base32 = torch.zeros(R, **f32) if base32 is None else base32
    scale32 = torch.ones(3, **f32) if scale32 is None else scale32
    part = torch.empty(_SPLIT_MAX, N, RP, **f32)
    sq = torch.empty(_SPLIT_MAX, N, **f32)
    fn3 = _split_bf16(fn32)
    _proj[lambda meta: (triton.cdiv(N, meta["BM"]), meta["SPLIT"])](x, fn3, part, sq, N, K, R,
                                                                     N.bit_length(), RP=RP, XB16=_bf16x(x),
                                                                     IEEE=_ieee(x))
    mix, rinv = torch.empty(N, RP, **f32), torch.empty(N, **f32)
    post, comb, pre = torch.empty(N, n, **f32), torch.empty(N, n, n, **f32), torch.empty(N, n, **f32)
    _pre_map[lambda meta: (triton.cdiv(N, meta["BM"]),)](part, sq, base32, scale32, mix, rinv, post, comb, pre, N, K,
                                                         tuned(_proj, "SPLIT"), int(iters), float(eps),
                                                         float(norm_eps), N.bit_length(), NS=n, NP=pow2(n, lo=1),
                                                         RP=RP)
    return mix, rinv, post, comb, pre, fn3


class _HcPre(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fn, base, scale, iters, eps, norm_eps):
        x = x.contiguous()
        N, n, d = x.shape
        fn32, base32, scale32 = fn.float().contiguous(), base.float().contiguous(), scale.float().contiguous()
        mix, rinv, post, comb, pre, fn3 = _project(x, fn32, norm_eps, base32, scale32, iters, eps)
        u = torch.empty(N, d, device=x.device, dtype=x.dtype)
        _pre_agg[lambda meta: (triton.cdiv(N, meta["BM"]), triton.cdiv(d, meta["BD"]))](
            x, pre, u, N, d, N.bit_length(), NS=n, NP=pow2(n, lo=1))
        ctx.save_for_backward(x, fn32, base32, scale32, mix, rinv, pre, fn3)
        ctx.cfg = (int(iters), float(eps), fn.dtype, base.dtype, scale.dtype)
        return u, post, comb

    @staticmethod
    def backward(ctx, du, dpost, dcomb, dres=None):
        """dres: x's other gradient (None: none), added into dx by `_pre_bwd_dx`."""
        x, fn32, base32, scale32, mix, rinv, pre, fn3 = ctx.saved_tensors
        iters, eps, fdt, bdt, sdt = ctx.cfg
        N, n, d = x.shape
        R, K = fn32.shape
        RP, NP = mix.shape[1], pow2(n, lo=1)
        f32 = dict(device=x.device, dtype=torch.float32)
        du = torch.zeros(N, d, device=x.device, dtype=x.dtype) if du is None else du.contiguous()
        dpost = torch.zeros(N, n, **f32) if dpost is None else dpost.float().contiguous()
        dcomb = torch.zeros(N, n, n, **f32) if dcomb is None else dcomb.float().contiguous()
        dpre = torch.empty(N, NP, **f32)
        _pre_bwd_dpre[lambda meta: (triton.cdiv(N, meta["BM"]),)](x, du, dpre, N, d, N.bit_length(), NS=n, NP=NP)
        dz, cx = torch.empty(N, RP, **f32), torch.empty(N, **f32)
        dh3 = torch.empty(3, N, RP, device=x.device, dtype=torch.bfloat16)     # dh's bf16 pieces
        steps = torch.empty(max(2 * iters - 1, 1), N, NP, NP, **f32)         # Sinkhorn step inputs (scratch)
        P = triton.cdiv(N, _MAP_BM_MIN)                                        # per-program dbase / dscale sums
        sb, ss = torch.empty(P, RP, **f32), torch.empty(P, 3, **f32)
        _pre_bwd_map[lambda meta: (triton.cdiv(N, meta["BM"]),)](mix, rinv, base32, scale32, dpre, dpost, dcomb, dz,
                                                                 dh3, cx, steps, sb, ss, N, K, R, iters, eps,
                                                                 N.bit_length(), NS=n, NP=NP, RP=RP)
        del steps
        P = triton.cdiv(N, tuned(_pre_bwd_map, "BM"))
        dbase, dscale = sb[:P, :R].sum(0), ss[:P].sum(0)                        # dscale: pre, post, comb
        dx = torch.empty_like(x)
        part = torch.empty(_DX_SPLIT_MAX, K, RP, **f32)
        _pre_bwd_dx[lambda meta: (n * triton.cdiv(d, meta["BD"]), meta["NSPLIT"])](
            x, fn3, dh3, cx, pre, du, dx if dres is None else dres.contiguous(), dx, part, N, K, d, R, N.bit_length(),
            NS=n, RP=RP, XB16=_bf16x(x), IEEE=_ieee(x), HAS_RES=dres is not None)
        dfn = part[:tuned(_pre_bwd_dx, "NSPLIT"), :, :R].sum(0).t().contiguous()  # [R, n*d]
        return dx, dfn.to(fdt), dbase.to(bdt), dscale.to(sdt), None, None, None


# ------------------------------------------------------------------------------------------ hc_post
_POST_FWD = configs(gpu=[dict(BM=4, BD=256, num_warps=4), dict(BM=8, BD=256, num_warps=4),
                         dict(BM=4, BD=512, num_warps=4), dict(BM=8, BD=512, num_warps=8),
                         dict(BM=16, BD=256, num_warps=8), dict(BM=2, BD=512, num_warps=4)],
                    cpu=dict(BM=16, BD=32), prune=_small(lambda a: a["D"] * a["NS"]))
_POST_BWD = configs(gpu=[dict(BM=2, num_warps=4), dict(BM=4, num_warps=4), dict(BM=8, num_warps=4),
                         dict(BM=8, num_warps=8), dict(BM=16, num_warps=8)],
                    cpu=dict(BM=16), prune=_small(lambda a: a["D"] * a["NS"]))
_POST_BD = 256                                  # hc_post bwd channel block on the GPU (fixes the partial count)


@triton.autotune(**_POST_FWD, key=["D", "NK", "NS"])
@triton.jit
def _post_fwd(X, OUT, POST, COMB, Y, N, D, NK, NS: tl.constexpr, NP: tl.constexpr, BM: tl.constexpr,
              BD: tl.constexpr):
    offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
    offs_d = tl.program_id(1) * BD + tl.arange(0, BD)
    k = tl.arange(0, NP)
    mmask, dmask, kmask = offs_m < N, offs_d < D, k < NS
    md = mmask[:, None] & dmask[None, :]
    mk = mmask[:, None] & kmask[None, :]
    out = tl.load(OUT + offs_m[:, None].to(tl.int64) * D + offs_d[None, :], mask=md, other=0.0).to(tl.float32)
    post = tl.load(POST + offs_m[:, None] * NS + k[None, :], mask=mk, other=0.0)       # [BM, k]
    y = post[:, :, None] * out[:, None, :]                                               # [BM, k, BD]
    x_row = X + offs_m[:, None].to(tl.int64) * (NS * D) + offs_d[None, :]
    for jj in tl.static_range(NS):
        cj = tl.load(COMB + offs_m[:, None] * (NS * NS) + jj * NS + k[None, :], mask=mk, other=0.0)  # comb[j, :]
        xj = tl.load(x_row + jj * D, mask=md, other=0.0).to(tl.float32)
        y += cj[:, :, None] * xj[:, None, :]
    y_off = offs_m[:, None, None].to(tl.int64) * (NS * D) + k[None, :, None] * D + offs_d[None, None, :]
    tl.store(Y + y_off, y.to(Y.dtype.element_ty), mask=mk[:, :, None] & dmask[None, None, :])


@triton.autotune(**_POST_BWD, key=["D", "NK", "NS", "BD"])
@triton.jit
def _post_bwd(X, OUT, POST, COMB, DY, DX, DOUT, DPOST, DCOMB, N, D, NK,
              NS: tl.constexpr, NP: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr):
    """Grid (token blocks, channel blocks): dx, dout of the block's channels; dpost / dcomb partial sums over
    the block's channels go to DPOST[dblock] / DCOMB[dblock] (summed by PyTorch; no atomics)."""
    offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
    offs_d = tl.program_id(1) * BD + tl.arange(0, BD)
    k = tl.arange(0, NP)
    mmask, kmask, dmask = offs_m < N, k < NS, offs_d < D
    mk = mmask[:, None] & kmask[None, :]
    md = mmask[:, None] & dmask[None, :]
    post = tl.load(POST + offs_m[:, None] * NS + k[None, :], mask=mk, other=0.0)
    row3 = offs_m[:, None, None].to(tl.int64) * (NS * D) + k[None, :, None] * D + offs_d[None, None, :]
    dy = tl.load(DY + row3, mask=mk[:, :, None] & dmask[None, None, :], other=0.0).to(tl.float32)   # [BM, k, BD]
    out = tl.load(OUT + offs_m[:, None].to(tl.int64) * D + offs_d[None, :], mask=md, other=0.0).to(tl.float32)
    tl.store(DOUT + offs_m[:, None].to(tl.int64) * D + offs_d[None, :],
             tl.sum(post[:, :, None] * dy, 1).to(DOUT.dtype.element_ty), mask=md)
    part = tl.program_id(1).to(tl.int64) * N
    tl.store(DPOST + (part + offs_m[:, None]) * NS + k[None, :], tl.sum(dy * out[:, None, :], 2), mask=mk)
    x_row = offs_m[:, None].to(tl.int64) * (NS * D) + offs_d[None, :]
    for jj in tl.static_range(NS):
        cj = tl.load(COMB + offs_m[:, None] * (NS * NS) + jj * NS + k[None, :], mask=mk, other=0.0)   # comb[j, :]
        tl.store(DX + x_row + jj * D, tl.sum(cj[:, :, None] * dy, 1).to(DX.dtype.element_ty), mask=md)
        xj = tl.load(X + x_row + jj * D, mask=md, other=0.0).to(tl.float32)
        tl.store(DCOMB + (part + offs_m[:, None]) * (NS * NS) + jj * NS + k[None, :], tl.sum(xj[:, None, :] * dy, 2),
                 mask=mk)


class _HcPost(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out, post, comb):
        x, out = x.contiguous(), out.contiguous()
        post32, comb32 = post.float().contiguous(), comb.float().contiguous()
        N, n, d = x.shape
        y = torch.empty_like(x)
        _post_fwd[lambda meta: (triton.cdiv(N, meta["BM"]), triton.cdiv(d, meta["BD"]))](
            x, out, post32, comb32, y, N, d, N.bit_length(), NS=n, NP=pow2(n, lo=1))
        ctx.save_for_backward(x, out, post32, comb32)
        ctx.dts = (out.dtype, post.dtype, comb.dtype)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, out, post32, comb32 = ctx.saved_tensors
        N, n, d = x.shape
        dx, dout = torch.empty_like(x), torch.empty_like(out)
        BD = min(pow2(d), 8 if on_cpu(x) else _POST_BD)
        nd = triton.cdiv(d, BD)
        dpost = torch.empty(nd, N, n, device=x.device, dtype=torch.float32)
        dcomb = torch.empty(nd, N, n, n, device=x.device, dtype=torch.float32)
        _post_bwd[lambda meta: (triton.cdiv(N, meta["BM"]), nd)](x, out, post32, comb32, dy.contiguous(), dx, dout,
                                                                 dpost, dcomb, N, d, N.bit_length(), NS=n,
                                                                 NP=pow2(n, lo=1), BD=BD)
        return dx, dout, dpost.sum(0).to(ctx.dts[1]), dcomb.sum(0).to(ctx.dts[2])


def hc_pre(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int, eps: float,
           norm_eps: float):
    """x [N,n,d] -> (u [N,d] x.dtype, post [N,n] fp32, comb [N,n,n] fp32); Triton-fused RMS+projection,
    sigmoid/Sinkhorn and aggregate (same contract as `naive.hc_pre`)."""
    N, n, d = x.shape
    if tuple(fn.shape) != ((2 + n) * n, n * d):
        raise ValueError(f"hc_pre: fn shape {tuple(fn.shape)} != ((2+n)n, n*d) = {((2 + n) * n, n * d)}")
    return _HcPre.apply(x, fn, base, scale, iters, eps, norm_eps)


def hc_post(x: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """X'[k] = post[k]·out + Σ_j comb[j,k] X[j]; [N,n,d] in x's dtype (Triton, fp32 math)."""
    N, n, d = x.shape
    if tuple(out.shape) != (N, d) or tuple(post.shape) != (N, n) or tuple(comb.shape) != (N, n, n):
        raise ValueError(f"hc_post: shapes x {tuple(x.shape)}, out {tuple(out.shape)}, post {tuple(post.shape)}, "
                         f"comb {tuple(comb.shape)} do not match [N,n,d], [N,d], [N,n], [N,n,n]")
    return _HcPost.apply(x, out, post, comb)
