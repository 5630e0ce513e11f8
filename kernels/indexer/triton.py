"""Lightning-indexer scoring and top-k (spec §7.2) in Triton.

`indexer_scores` (same contract as `naive.indexer_scores`, packed stream with document metadata):
    I[t,n] = Σ_h (w[t,h]·nI^-1/2) · ReLU(qI[t,h] · kI[n]) · cI^-1/2,   -inf unless entry n is visible to query t
Forward: one program per (block of BT queries, block of BJ entries); the kI tile goes to shared memory once and
is the A operand of [BJ, cI]·[cI, BT] tensor-core products, one a head, the qI tiles streaming in by TMA (a host
descriptor; per-element addresses where cI is not a power of two), with the ReLU-weighted head sum as the
epilogue, so the [Tq, nI, N] per-head logits never exist; tiles outside every query's visible entry
range (kernels/_varlen.py: other documents, not yet complete entries) are written as -inf without any product.
Backward (`scores_bwd`): two deterministic kernels that recompute the per-head logits (dq, dw per (query block,
head group); partial dk per (entry block, head group), summed by PyTorch), no atomics; unmasked core tiles and
masked boundary tiles (the section's comment below).

Top-k is topk.py (radix select; same contract as `naive.indexer_topk`). NOT a streaming top-k: it reads the
dense score rows. `indexer_select` chains scores and top-k per chunk of query rows, so the full [S, B, T] score
matrix is never held: peak memory O(chunk · T) (at most 256 MiB of scores) instead of O(S · T).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from dsv4.kernels._triton_util import configs, on_cpu, pow2, tuned
from dsv4.kernels._varlen import entry_cores, entry_ranges, query_cores, query_ranges

from . import naive, topk

# Forward tiles. Every (query block, entry block) program re-reads its queries' nI·cI features (BT x 16 KB at
# nI 64, cI 128) for a [BT, BJ] score tile, so the L2 -> SM traffic of qI is Tq·nI·cI·2 · N/BJ bytes: at BJ 64 and
# 16K tokens ~8.6 GB a call (~1.2 ms at L2 rate) against 0.55 TFLOP (1.2 ms at 450 TFLOP/s); BJ 128 / 256 halve /
# quarter it. JF (entry blocks fastest in the launch order): the programs that run together share one query
# block (one BT x 16 KB block live in L2) instead of one entry block (a whole chunk of query features live, 64 MB
# for a 4096-row chunk at nI 64 -- more than the H200's L2). Both are tuner choices. Offline sm_90a compile
# (Triton 3.9, ptxas), registers a thread: (64, 64, 4 warps) 168, (64, 64, 8) 117, (64, 128, 8) 169, (32, 256, 8)
# 180, no spills; (64, 256, 8) and (128, 128, 8) reach 255 with spills outside the head loop (prologue / epilogue).
# Timed on the H200 at 16K tokens (nI 64, fc22c6d, CUDA-graph device time of one call; harness/device/
# indexer_fwd_ab.py, goldens/h200/D3/ab_indexer_fwd_82f9167.json):
# (64, 64, 4 warps) 1.50 ms with JF / 1.71 without; (64, 256, 8) 1.74 / 1.78; (64, 64, 8) 1.77 / 2.28; (128, 128,
# 8) 1.80 / 1.94; (64, 128, 8) 1.87 / 2.02; (32, 256, 8) 2.10 / 2.14 (the 3214bcf kernel: 1.95). The tuner keeps
# the first four with JF and (64, 64, 4) without.
def _q_block(nargs):
    """Autotune pre-hook (and forced configs): the qI descriptor's block is the config's [BT, BC] query tile."""
    if nargs.get("QD") is not None:
        nargs["QD"].block_shape = [nargs["BT"], nargs["BC"]]


_FWD_CONFIGS = configs(gpu=[dict(BT=bt, BJ=bj, JF=jf, num_warps=w, num_stages=3)
                            for bt, bj, w, jf in ((64, 64, 4, True), (64, 64, 4, False), (64, 256, 8, True),
                                                  (64, 64, 8, True), (128, 128, 8, True))],
                       cpu=dict(BT=16, BJ=16, JF=True), pre_hook=_q_block,
                       prune=lambda cfgs, a: cfgs if a["BIG"] else cfgs[:1])   # small problems: not worth tuning


@triton.jit
def _visible(SEGQ, POSQ, ESEG, EJ, offs_t, offs_j, tmask, jmask, ratio):
    """[BT, BJ] bool: entry j visible to query t (same document, complete)."""
    sq = tl.load(SEGQ + offs_t, mask=tmask, other=-1)
    pq = tl.load(POSQ + offs_t, mask=tmask, other=0)
    es = tl.load(ESEG + offs_j, mask=jmask, other=-2)
    ej = tl.load(EJ + offs_j, mask=jmask, other=0)
    return (es[None, :] == sq[:, None]) & (sq[:, None] >= 0) & (ej[None, :] < ((pq + 1) // ratio)[:, None])


@triton.autotune(**_FWD_CONFIGS, key=["NH", "BC", "BIG"])
@triton.jit
def _scores_fwd(Q, QD, K, Wt, I, SEGQ, POSQ, ESEG, EJ, ELO, EHI, S, T, NH, C, ratio, coef,
                sq_s, sq_h, sk_t, sw_s, si_s, BIG,                  # BIG: S·T·NH >= 2^27 (tuning key only)
                BC: tl.constexpr, PREC: tl.constexpr, BT: tl.constexpr, BJ: tl.constexpr, JF: tl.constexpr):
    if JF:                                                      # launch order: entry blocks fastest
        pt, pj = tl.program_id(1), tl.program_id(0)
    else:
        pt, pj = tl.program_id(0), tl.program_id(1)
    offs_t = pt * BT + tl.arange(0, BT)
    offs_j = pj * BJ + tl.arange(0, BJ)
    offs_c = tl.arange(0, BC)
    tmask, jmask, cmask = offs_t < S, offs_j < T, offs_c < C
    lo = tl.min(tl.load(ELO + offs_t, mask=tmask, other=2147483647), 0)
    hi = tl.max(tl.load(EHI + offs_t, mask=tmask, other=0), 0)
    j0 = pj * BJ
    if (j0 >= hi) | (j0 + BJ <= lo):                            # no query of the tile sees these entries
        tl.store(I + offs_t[:, None].to(tl.int64) * si_s + offs_j[None, :],
                 tl.full([BT, BJ], float("-inf"), tl.float32), mask=tmask[:, None] & jmask[None, :])
    else:
        k = tl.load(K + offs_j[:, None] * sk_t + offs_c[None, :], mask=jmask[:, None] & cmask[None, :], other=0.0)
        acc = tl.zeros([BJ, BT], tl.float32)
        w_ptr = Wt + offs_t.to(tl.int64) * sw_s
        if QD is None:                                          # per-element addresses (cI not a power of 2)
            q_blk = Q + (pt * BT).to(tl.int64) * sq_s
            q_off = tl.arange(0, BT)[:, None] * sq_s + offs_c[None, :]
        for h in range(0, NH):
            if QD is None:
                q = tl.load(q_blk + h * sq_h + q_off, mask=tmask[:, None] & cmask[None, :], other=0.0)
            else:   # TMA: head h's [BT, cI] tile of qI viewed as [Tq, nI·cI]; rows past Tq read as zeros. No
                    # [BT, BC] address / mask tensors live through the loop (with them the kernel spilled)
                q = QD.load([pt * BT, h * BC])
            wh = tl.load(w_ptr + h, mask=tmask, other=0.0).to(tl.float32)
            # kI tile as the A operand ([BJ, cI] · [cI, BT]): it goes to shared memory once, before the loop (as
            # the B operand of qI · kIᵀ, Triton re-stored it from registers every head: 64 registers a thread
            # held and a [BJ, cI] shared-memory store a head)
            s = tl.dot(k, tl.trans(q), input_precision=PREC)                          # [BJ, BT]
            acc += tl.maximum(s, 0.0) * wh[None, :]
        acc = tl.trans(acc)                                                           # [BT, BJ]
        vis = _visible(SEGQ, POSQ, ESEG, EJ, offs_t, offs_j, tmask, jmask, ratio)
        acc = tl.where(vis, acc * coef, float("-inf"))
        # the output offsets formed after the loop: [BT, BJ] int64 live through it cost BT·BJ·2/threads registers
        tl.store(I + offs_t[:, None].to(tl.int64) * si_s + offs_j[None, :], acc, mask=tmask[:, None] & jmask[None, :])


# ------------------------------------------------------------------ dense scores backward
#   p[t,n] = dI[t,n] 1[d > 0] (visible (t, n) only),  d = qI[t,h] . kI[n],  c = (nI cI)^-1/2
#   dqI[t,h] = c w[t,h] Σ_n p kI[n] = c w[t,h] u[t],  dw[t,h] = c Σ_n dI ReLU(d) = c qI[t,h] . u[t]
#   dkI[n] = c Σ_h Σ_t p w[t,h] qI[t,h]
# Two deterministic kernels (no atomics) that recompute d. Each program takes its visible range once (the
# _varlen ranges of its rows) and splits the loop over the other side's tiles into boundary tiles (masked with
# `_visible`, the forward's test) and CORE tiles, inside every row's unbroken visible run (_varlen.query_cores /
# entry_cores: no padding, no other document, no empty slot, no decrease of pos), which load dI with no mask and
# compute no visibility at all; rows that see nothing are zeroed at the store. Programs are numbered longest
# first (causal triangle: dq's last query blocks, dk's first entry blocks) so the long ones do not start in the
# last wave.
# dq: one program per (query block, head group), u [BT, cI] in registers per head (p·kI, no w in the loop; dw
# from u at the end). dk: one program per (entry block, head group), dkIᵀ [cI, BJ] += qIᵀ·(p w) (both MMA
# operands from shared memory, dI tiles in their stored orientation: 16-byte copies), HH heads a query tile
# sharing its dI tile; head-group partials summed by PyTorch. The 6c6e72a kernels had no per-tile metadata but
# masked every dI element with the causal test; the packed layout (29519d3) made that test `_visible` on every
# tile (4 metadata loads, int64 compares): the dq / dk inner loops went from ~660 / ~760 to ~1070 / ~1120
# instructions a warp and tile (offline compile, Triton 3.6) and dq's spilled in it: 2.5x slower on the H200
# (PERF_NOTES, issue 14).
_DQ_CONFIGS = configs(gpu=[dict(BT=64, BJ=64, num_warps=4, num_stages=3), dict(BT=64, BJ=64, num_warps=4, num_stages=2),
                           dict(BT=128, BJ=64, num_warps=8, num_stages=3), dict(BT=128, BJ=64, num_warps=8, num_stages=2)],
                      cpu=dict(BT=16, BJ=16))


def _dk_prune(cfgs, args):
    """HH heads a tile must divide the program's HPP·HM heads."""
    return [c for c in cfgs if args["HPP"] * c.kwargs["HM"] % c.kwargs["HH"] == 0]


# dk: HM x the launcher's heads per program (HPP: the fewest that fill the GPU; more heads, fewer programs),
# HH of them per dI tile. Offline sm_90a compile (Triton 3.6, ptxas), warp instructions of the core loop per
# 64 x 64 tile and head: ~1050 at HH 4 (BT 64, 4 warps), ~1440 at HH 2 (BT 128, 8 warps), ~2310 at HH 1, no
# spills in it (6c6e72a: ~3030; dq's core loop ~960, 6c6e72a ~2650). At the SM's bf16 tensor rate the tile's
# two 64x64x128 MMAs take 512 cycles = 2048 issue slots of its 4 schedulers: above that a loop is issue-bound.
# Shared memory 104-192 KiB a program. Not yet timed on the GPU.
_DK_CONFIGS = configs(gpu=[dict(BT=64, BJ=64, HH=1, HM=1, num_warps=4, num_stages=3),
                           dict(BT=64, BJ=64, HH=2, HM=1, num_warps=4, num_stages=2),
                           dict(BT=64, BJ=64, HH=2, HM=2, num_warps=4, num_stages=2),
                           dict(BT=64, BJ=64, HH=4, HM=1, num_warps=4, num_stages=2),
                           dict(BT=64, BJ=64, HH=4, HM=4, num_warps=4, num_stages=2),
                           dict(BT=128, BJ=64, HH=2, HM=1, num_warps=8, num_stages=2),
                           dict(BT=128, BJ=64, HH=2, HM=2, num_warps=8, num_stages=2)],
                      cpu=dict(BT=16, BJ=16, HH=2, HM=1), prune=_dk_prune)


@triton.jit
def _split(lo, hi, core_lo, core_hi, B: tl.constexpr):
    """Tiles of B rows from lo to hi: (end of the boundary tiles before the core, core start, core end); the core
    tiles lie inside core_lo..core_hi-1 (the rest: boundary tiles, core_end..hi)."""
    c0 = lo + tl.cdiv(tl.maximum(core_lo - lo, 0), B) * B
    c1 = c0 + tl.maximum(core_hi - c0, 0) // B * B
    return tl.minimum(c0, hi), c0, c1


@triton.jit
def _dq_tile(u, q, K, DI_row, SEGQ, POSQ, ESEG, EJ, offs_t, tmask, offs_c, cmask, j0, T, ratio, sk_t,
             PREC: tl.constexpr, BJ: tl.constexpr, CORE: tl.constexpr):
    offs_j = j0 + tl.arange(0, BJ)
    if CORE:                                    # every (t, j) of the tile visible or a row zeroed at the store
        k = tl.load(K + offs_j[:, None] * sk_t + offs_c[None, :], mask=cmask[None, :], other=0.0)
        g = tl.load(DI_row + offs_j[None, :])
    else:
        jmask = offs_j < T
        k = tl.load(K + offs_j[:, None] * sk_t + offs_c[None, :], mask=jmask[:, None] & cmask[None, :], other=0.0)
        g = tl.load(DI_row + offs_j[None, :], mask=_visible(SEGQ, POSQ, ESEG, EJ, offs_t, offs_j, tmask, jmask, ratio),
                    other=0.0)
    d = tl.dot(q, tl.trans(k), input_precision=PREC)                                   # [BT, BJ]
    p = tl.where(d > 0, g, 0.0)
    return u + tl.dot(p.to(k.dtype), k, input_precision=PREC)


@triton.autotune(**_DQ_CONFIGS, key=["NH", "BC", "HPP"])
@triton.jit
def _scores_bwd_dq(Q, K, Wt, DI, DQ, DW, SEGQ, POSQ, ESEG, EJ, ELO, EHI, ERUN, S, T, NH, C, ratio, coef, HPP, NG,
                   sq_s, sq_h, sk_t, sw_s, si_s,
                   BC: tl.constexpr, PREC: tl.constexpr, BT: tl.constexpr, BJ: tl.constexpr):
    # 1-D grid, head groups fastest: the last query block (the most entries) first
    pid = tl.program_id(0)
    qb = tl.cdiv(S, BT) - 1 - pid // NG
    offs_t = qb * BT + tl.arange(0, BT)
    offs_c = tl.arange(0, BC)
    tmask, cmask = offs_t < S, offs_c < C
    elo = tl.load(ELO + offs_t, mask=tmask, other=0)
    ehi = tl.load(EHI + offs_t, mask=tmask, other=0)
    live = elo < ehi                                          # the query sees some entry
    lo = tl.min(tl.where(live, elo, T), 0) // BJ * BJ       # tiles on the BJ grid: aligned (vector) dI loads
    hi = tl.max(tl.where(live, ehi, 0), 0)
    core_lo = tl.max(tl.where(live, elo, 0), 0)
    core_hi = tl.min(tl.where(live, tl.load(ERUN + offs_t, mask=tmask, other=0), T), 0)
    # core tiles load whole dI rows: a full block only (and one with a live row)
    core_hi = tl.where((qb * BT + BT <= S) & (hi > 0), core_hi, core_lo)
    pre_end, c0, c1 = _split(lo, hi, core_lo, core_hi, BJ)
    DI_row = DI + offs_t[:, None].to(tl.int64) * si_s
    for h in range(pid % NG * HPP, tl.minimum(pid % NG * HPP + HPP, NH)):
        q_off = offs_t[:, None].to(tl.int64) * sq_s + h * sq_h + offs_c[None, :]
        q = tl.load(Q + q_off, mask=tmask[:, None] & cmask[None, :], other=0.0)
        u = tl.zeros([BT, BC], tl.float32)
        for j0 in range(lo, pre_end, BJ):
            u = _dq_tile(u, q, K, DI_row, SEGQ, POSQ, ESEG, EJ, offs_t, tmask, offs_c, cmask, j0, T, ratio, sk_t,
                         PREC, BJ, False)
        for j0 in range(c0, c1, BJ):
            u = _dq_tile(u, q, K, DI_row, SEGQ, POSQ, ESEG, EJ, offs_t, tmask, offs_c, cmask, j0, T, ratio, sk_t,
                         PREC, BJ, True)
        for j0 in range(c1, hi, BJ):
            u = _dq_tile(u, q, K, DI_row, SEGQ, POSQ, ESEG, EJ, offs_t, tmask, offs_c, cmask, j0, T, ratio, sk_t,
                         PREC, BJ, False)
        u = tl.where(live[:, None], u * coef, 0.0)
        w_off = offs_t.to(tl.int64) * sw_s + h
        wh = tl.load(Wt + w_off, mask=tmask, other=0.0).to(tl.float32)
        tl.store(DQ + q_off, (u * wh[:, None]).to(DQ.dtype.element_ty), mask=tmask[:, None] & cmask[None, :])
        tl.store(DW + w_off, tl.sum(u * q.to(tl.float32), 1).to(DW.dtype.element_ty), mask=tmask)


@triton.jit
def _dk_tile(acc, k, Q, Wt, DI, SEGQ, POSQ, ESEG, EJ, offs_j, jmask, offs_c, cmask, t0, h0, h_end, S, ratio,
             sq_s, sq_h, sw_s, si_s, PREC: tl.constexpr, BT: tl.constexpr, HH: tl.constexpr, CORE: tl.constexpr):
    offs_t = t0 + tl.arange(0, BT)
    tmask = offs_t < S                          # (all true in a core tile)
    g_ptr = DI + offs_t[:, None].to(tl.int64) * si_s + offs_j[None, :]
    if CORE:
        g = tl.load(g_ptr)
    else:
        g = tl.load(g_ptr, mask=_visible(SEGQ, POSQ, ESEG, EJ, offs_t, offs_j, tmask, jmask, ratio), other=0.0)
    for i in tl.static_range(HH):               # HH heads share the dI tile
        h = h0 + i
        # a head past the group's last adds nothing (masks as tensors: the interpreter rejects a scalar & tensor)
        hc = cmask & (offs_c * 0 + h < h_end)
        q_ptr = Q + offs_t[:, None].to(tl.int64) * sq_s + h * sq_h + offs_c[None, :]
        if CORE:
            q = tl.load(q_ptr, mask=hc[None, :], other=0.0)
        else:
            q = tl.load(q_ptr, mask=tmask[:, None] & hc[None, :], other=0.0)
        wh = tl.load(Wt + offs_t.to(tl.int64) * sw_s + h, mask=tmask & (offs_t * 0 + h < h_end), other=0.0)
        d = tl.dot(q, tl.trans(k), input_precision=PREC)                                # [BT, BJ]
        p = tl.where(d > 0, g * wh.to(tl.float32)[:, None], 0.0)
        acc += tl.dot(tl.trans(q), p.to(q.dtype), input_precision=PREC)                 # dkᵀ [BC, BJ]
    return acc


@triton.autotune(**_DK_CONFIGS, key=["NH", "BC", "HPP"])
@triton.jit
def _scores_bwd_dk(Q, K, Wt, DI, DK, SEGQ, POSQ, ESEG, EJ, QLO, QHI, QRUN, S, T, NH, C, ratio, coef, HPP,
                   sq_s, sq_h, sk_t, sw_s, si_s, BC: tl.constexpr, PREC: tl.constexpr, BT: tl.constexpr,
                   BJ: tl.constexpr, HH: tl.constexpr, HM: tl.constexpr):
    # 1-D grid, head groups (of HPP·HM heads) fastest: the first entry block (the most queries) first; each head
    # group writes its partial dk to DK[group] (summed after)
    NG = tl.cdiv(NH, HPP * HM)
    pid = tl.program_id(0)
    grp = pid % NG
    offs_j = pid // NG * BJ + tl.arange(0, BJ)
    offs_c = tl.arange(0, BC)
    jmask, cmask = offs_j < T, offs_c < C
    k = tl.load(K + offs_j[:, None] * sk_t + offs_c[None, :], mask=jmask[:, None] & cmask[None, :], other=0.0)
    qlo = tl.load(QLO + offs_j, mask=jmask, other=0)
    qhi = tl.load(QHI + offs_j, mask=jmask, other=0)
    live = qlo < qhi                                          # some query sees the entry
    lo = tl.min(tl.where(live, qlo, S), 0)
    hi = tl.max(tl.where(live, qhi, 0), 0)
    core_lo = tl.max(tl.where(live, qlo, 0), 0)
    core_hi = tl.min(tl.where(live, tl.load(QRUN + offs_j, mask=jmask, other=0), S), 0)
    core_hi = tl.where(pid // NG * BJ + BJ <= T, core_hi, core_lo)   # core tiles load whole dI rows: a full block
    pre_end, c0, c1 = _split(lo, hi, core_lo, core_hi, BT)
    h_end = tl.minimum(grp * HPP * HM + HPP * HM, NH)
    acc = tl.zeros([BC, BJ], tl.float32)
    for h0 in range(grp * HPP * HM, h_end, HH):
        for t0 in range(lo, pre_end, BT):
            acc = _dk_tile(acc, k, Q, Wt, DI, SEGQ, POSQ, ESEG, EJ, offs_j, jmask, offs_c, cmask, t0, h0, h_end, S,
                           ratio, sq_s, sq_h, sw_s, si_s, PREC, BT, HH, False)
        for t0 in range(c0, c1, BT):
            acc = _dk_tile(acc, k, Q, Wt, DI, SEGQ, POSQ, ESEG, EJ, offs_j, jmask, offs_c, cmask, t0, h0, h_end, S,
                           ratio, sq_s, sq_h, sw_s, si_s, PREC, BT, HH, True)
        for t0 in range(c1, hi, BT):
            acc = _dk_tile(acc, k, Q, Wt, DI, SEGQ, POSQ, ESEG, EJ, offs_j, jmask, offs_c, cmask, t0, h0, h_end, S,
                           ratio, sq_s, sq_h, sw_s, si_s, PREC, BT, HH, False)
    acc = tl.where(live[None, :], acc * coef, 0.0)
    tl.store(DK + grp.to(tl.int64) * (T * sk_t) + offs_j[None, :] * sk_t + offs_c[:, None], acc,
             mask=jmask[None, :] & cmask[:, None])


def _prec(x):
    """fp32 inputs: exact fp32 products ("ieee"); bf16: tensor cores (flag ignored)."""
    return "ieee" if x.dtype in (torch.float32, torch.float64) else "tf32"


def _strides(q, k, w, i):
    return (q.stride(0), q.stride(1), k.stride(0), w.stride(0), i.stride(0))


def _meta(seg_q, pos_q, entry_seg, entry_j):
    return [x.contiguous() for x in (seg_q, pos_q, entry_seg, entry_j)]


def _q_desc(qI):
    """A host TMA descriptor of contiguous qI [Tq, nI, cI] viewed as [Tq, nI·cI] (block shape set per config by
    `_q_block`), or None where TMA cannot take it: cI not a power of two >= 16 (a tile would reach into the next
    head), a row stride or base not 16-byte aligned."""
    S, nI, cI = qI.shape
    if cI != pow2(cI) or (nI * cI * qI.element_size()) % 16 or qI.data_ptr() % 16:
        return None
    return TensorDescriptor(qI, [S, nI * cI], [nI * cI, 1], [16, cI])


def _launch_fwd(qI, kI, w, ratio, meta, config=None):
    """Scores [Tq, N] fp32 of query rows with metadata `meta` = (seg_q, pos_q, entry_seg, entry_j). config (launch
    kwargs incl. num_warps / num_stages) forces one config instead of the tuner's choice, as in `scores_bwd`
    (the A/B harness/device/indexer_fwd_ab.py, the tests' launch orders)."""
    qI, kI, w = qI.contiguous(), kI.contiguous(), w.contiguous()
    S, nI, cI = qI.shape
    T = kI.shape[0]
    I = torch.empty(S, T, device=qI.device, dtype=torch.float32)
    if S and T:
        lo, hi = entry_ranges(*meta, ratio)
        grid = lambda m: ((triton.cdiv(T, m["BJ"]), triton.cdiv(S, m["BT"])) if m["JF"] else
                          (triton.cdiv(S, m["BT"]), triton.cdiv(T, m["BJ"])))
        qd, BC = _q_desc(qI), pow2(cI)
        kern, kw = (_scores_fwd, {}) if config is None else (_scores_fwd.fn, config)
        if kw:
            _q_block({"QD": qd, "BC": BC, **kw})                # the tuner's pre-hook does not run here
        kern[grid](qI, qd, kI, w, I, *meta, lo, hi, S, T, nI, cI, ratio, nI ** -0.5 * cI ** -0.5,
                   *_strides(qI, kI, w, I), int(S * T * nI >= 1 << 27), BC=BC, PREC=_prec(qI), **kw)
    return I


class _IndexerScores(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qI, kI, w, ratio, seg_q, pos_q, entry_seg, entry_j):
        qI, kI, w = qI.contiguous(), kI.contiguous(), w.contiguous()
        meta = _meta(seg_q, pos_q, entry_seg, entry_j)
        I = _launch_fwd(qI, kI, w, ratio, meta)
        ctx.save_for_backward(qI, kI, w, *meta)
        ctx.cfg = (ratio, qI.shape[1] ** -0.5 * qI.shape[2] ** -0.5)
        return I

    @staticmethod
    def backward(ctx, dI):
        qI, kI, w, *meta = ctx.saved_tensors
        return (*scores_bwd(dI, qI, kI, w, ctx.cfg[0], meta), None, None, None, None, None)


def scores_bwd(dI, qI, kI, w, ratio, meta, dq_config=None, dk_config=None, dk_hpp=None):
    """(dqI, dkI, dw) of `indexer_scores` for the upstream gradient dI [Tq, N]; meta = (seg_q, pos_q, entry_seg,
    entry_j). dq_config / dk_config (launch kwargs incl. num_warps / num_stages) and dk_hpp force one config and
    dk's heads per program instead of the tuner's choice (the GPU tests run every config)."""
    qI, kI, w, dI = qI.contiguous(), kI.contiguous(), w.contiguous(), dI.contiguous()
    meta = _meta(*meta)
    S, nI, cI = qI.shape
    T = kI.shape[0]
    coef = nI ** -0.5 * cI ** -0.5
    dq, dw = torch.zeros_like(qI), torch.zeros_like(w)
    if not (S and T):
        return dq, torch.zeros_like(kI), dw
    BC, PREC = pow2(cI), _prec(qI)
    elo, ehi = entry_ranges(*meta, ratio)
    hq = _heads_per_program(qI, nI, triton.cdiv(S, 64), 8)
    gq = triton.cdiv(nI, hq)
    kern, kw = (_scores_bwd_dq, {}) if dq_config is None else (_scores_bwd_dq.fn, dq_config)
    kern[lambda m: (triton.cdiv(S, m["BT"]) * gq,)](
        qI, kI, w, dI, dq, dw, *meta, elo, ehi, entry_cores(meta[2], elo, ehi), S, T, nI, cI, ratio, coef, hq, gq,
        *_strides(qI, kI, w, dI), BC=BC, PREC=PREC, **kw)
    qlo, qhi = query_ranges(*meta, ratio)
    hk = _heads_per_program(qI, nI, triton.cdiv(T, 64), 4) if dk_hpp is None else dk_hpp
    gk = triton.cdiv(nI, hk)                                     # head groups at HM = 1 (the most)
    dk_part = torch.empty(gk, T, cI, device=kI.device, dtype=torch.float32)        # kI is contiguous
    kern, kw = (_scores_bwd_dk, {}) if dk_config is None else (_scores_bwd_dk.fn, dk_config)
    kern[lambda m: (triton.cdiv(T, m["BJ"]) * triton.cdiv(nI, hk * m["HM"]),)](
        qI, kI, w, dI, dk_part, *meta, qlo, qhi, query_cores(meta[0], meta[1], qlo, qhi), S, T, nI, cI, ratio,
        coef, hk, *_strides(qI, kI, w, dI), BC=BC, PREC=PREC, **kw)
    dk_part = dk_part[:triton.cdiv(nI, hk * (kw["HM"] if kw else tuned(_scores_bwd_dk, "HM")))]
    return dq, dk_part.sum(0).to(kI.dtype), dw


def _heads_per_program(x, nI, blocks, per_sm):
    """Heads a program of a backward grid of `blocks` row blocks x head groups: on the GPU the most (a power of
    two) that still give >= per_sm programs per SM, so that the causal triangle's long programs (numbered first)
    share the machine with many short ones (dk: a partial sum per group, ~T·cI·4 bytes each: ~1K programs' worth,
    ~32 MiB at 64-entry blocks); on the CPU 2 (the tests exercise the split and a partial last group)."""
    if on_cpu(x):
        return 2
    want = per_sm * _sm_count(x.device)
    hpp = triton.next_power_of_2(nI)
    while hpp > 1 and blocks * triton.cdiv(nI, hpp) < want:
        hpp //= 2
    return hpp


_SMS: dict = {}


def _sm_count(dev) -> int:
    if dev not in _SMS:
        _SMS[dev] = torch.cuda.get_device_properties(dev).multi_processor_count
    return _SMS[dev]


def indexer_scores(qI: torch.Tensor, kI: torch.Tensor, w: torch.Tensor, ratio: int, seg_q: torch.Tensor,
                   pos_q: torch.Tensor, entry_seg: torch.Tensor, entry_j: torch.Tensor) -> torch.Tensor:
    """qI [Tq,nI,cI], kI [N,cI], w [Tq,nI], metadata -> I [Tq,N] fp32 (-inf where not visible), Triton."""
    naive.check_scores_args(qI, kI, w, ratio, seg_q, pos_q, entry_seg, entry_j)
    return _IndexerScores.apply(qI, kI, w, int(ratio), seg_q, pos_q, entry_seg, entry_j)


SELECT_BLOCK_BYTES = 1 << 28      # the [chunk, N] fp32 score block of `indexer_select`: at most 256 MiB


def indexer_select(qI: torch.Tensor, kI: torch.Tensor, w: torch.Tensor, ratio: int, k: int, seg_q: torch.Tensor,
                   pos_q: torch.Tensor, entry_seg: torch.Tensor, entry_j: torch.Tensor,
                   chunk: int | None = None) -> torch.Tensor:
    """== indexer_topk(indexer_scores(qI, kI, w, ratio, ...), k), computed per chunk of query rows so that only
    a [chunk, N] block of scores exists at a time (no autograd). chunk None: the most rows (a multiple of 4096, at
    least 4096) whose fp32 block fits SELECT_BLOCK_BYTES -- few launches: each scoring launch ends in a tail of
    part-empty waves (on the H200 at 16K tokens, 4 chunks of 4096 rows took 1.80 ms of scoring against 1.50 for
    one launch of all 16384, fc22c6d)."""
    S = qI.shape[0]
    if chunk is None:
        chunk = max(1, SELECT_BLOCK_BYTES // (4 * max(kI.shape[0], 1) * 4096)) * 4096
    outs = []
    with torch.no_grad():
        for s0 in range(0, S, chunk):
            meta = _meta(seg_q[s0:s0 + chunk], pos_q[s0:s0 + chunk], entry_seg, entry_j)
            outs.append(topk.indexer_topk(_launch_fwd(qI[s0:s0 + chunk], kI, w[s0:s0 + chunk], ratio, meta), k,
                                          chunk, sort_max_n=topk.SORT_MAX_N,
                                          row_max_n=topk.ROW_MAX_N))
    return torch.cat(outs, 0)


# ------------------------------------------------------------------ scores at the listed entries (sparse mode)
# The sparse-mode indexer loss re-forms the scores at each query's k listed entries with gradients:
#   d[h, s] = qI[t,h] . kI[idx[t,s]];  I[t,s] = Σ_h w[t,h] c ReLU(d[h,s]),  c = (nI cI)^-1/2,  -inf where idx = -1
#   dw[t,h] = c Σ_s dI[t,s] ReLU(d);  dd[h,s] = dI[t,s] w[t,h] c 1[d > 0]
#   dqI[t,h] = Σ_s dd[h,s] kI[idx[t,s]];  dkI[idx[t,s]] += Σ_h dd[h,s] qI[t,h]
# One program per query (backward) or per (query, block of picks) (forward); the picked kI rows are gathered
# into the tile and never exist as a [Tq, k, cI] tensor. dkI: while N·nI <= DENSE_DK·k (proxy; DSv4 up to 128K
# tokens at nI = 64 / k = 1024 ... see op.py) the backward stores dd at its entries' rows of a dense
# S [N, queries, nI] (plain stores: a query's picks are distinct) and dkI = S qI is one GEMM per sub-chunk of
# queries. A pick's nI heads are one contiguous run of S (a whole 32-byte sector at nI 16, stored 4 heads = 8 bytes
# a thread when nI is a power of two); the [queries, nI, N] layout before 2026-12-04 put them nI rows N apart, one
# 2-byte store and one partial sector each (not yet timed against each other on the H200). fp32 atomics (the other
# route, many entries per pick) cost ~5 ns an add here (the sparse-attention backward's dKV adds: >= 200 G adds/s
# measured on the H200), 1.1 G adds per 16K-token call.
_LIST_FWD_CONFIGS = configs(gpu=[dict(BK=64, num_warps=4, num_stages=2), dict(BK=128, num_warps=4, num_stages=2)],
                            cpu=dict(BK=16, num_warps=4, num_stages=1))
_LIST_BWD_CONFIGS = configs(gpu=[dict(BK=32, num_warps=4, num_stages=2), dict(BK=64, num_warps=4, num_stages=2)],
                            cpu=dict(BK=16, num_warps=4, num_stages=1))


@triton.autotune(**_LIST_FWD_CONFIGS, key=["NP", "CP"])
@triton.jit
def _listed_fwd(Q, K, W, IDX, OUT, sq_t, sq_h, sk, sw, si, NI, CI, k, coef,
                NP: tl.constexpr, CP: tl.constexpr, PREC: tl.constexpr, BK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slots = tl.program_id(1) * BK + tl.arange(0, BK)
    h = tl.arange(0, NP)
    c = tl.arange(0, CP)
    hm, cm, sm = h < NI, c < CI, slots < k
    col = tl.load(IDX + t * si + slots, mask=sm, other=-1)                         # [BK] picked entries
    live = col >= 0
    kt = tl.load(K + col[:, None] * sk + c[None, :], mask=live[:, None] & cm[None, :], other=0.0)   # [BK, CP]
    q = tl.load(Q + t * sq_t + h[:, None] * sq_h + c[None, :], mask=hm[:, None] & cm[None, :], other=0.0)
    w = tl.load(W + t * sw + h, mask=hm, other=0.0).to(tl.float32) * coef          # [NP]  w c
    d = tl.dot(q.to(kt.dtype), tl.trans(kt), input_precision=PREC)                 # [NP, BK] fp32
    score = tl.sum(tl.maximum(d, 0.0) * w[:, None], 0)                             # [BK]
    tl.store(OUT + t * si + slots, tl.where(live, score, float("-inf")), mask=sm)


# reset_to_zero: the atomic route adds into DK, and every timed launch of the autotuner would add again (the GPU
# test of that route saw dkI ~2900x too large, 2026-12-03; the S-GEMM route, the proxy's, only stores)
@triton.autotune(**_LIST_BWD_CONFIGS, key=["NP", "CP", "DENSE"], reset_to_zero=["DK"])
@triton.jit
def _listed_bwd(Q, K, W, IDX, DI, DQ, DW, S, DK, t0, R, sq_t, sq_h, sk, sw, si, NI: tl.constexpr, CI, k, N, coef,
                NP: tl.constexpr, CP: tl.constexpr, PREC: tl.constexpr, DENSE: tl.constexpr, BK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)                                              # query t0 + r of the R in S
    t = t0 + r
    h = tl.arange(0, NP)
    c = tl.arange(0, CP)
    hm, cm = h < NI, c < CI
    q = tl.load(Q + t * sq_t + h[:, None] * sq_h + c[None, :], mask=hm[:, None] & cm[None, :], other=0.0)
    w = tl.load(W + t * sw + h, mask=hm, other=0.0).to(tl.float32) * coef          # [NP]  w c
    dq = tl.zeros([NP, CP], tl.float32)
    dw = tl.zeros([NP], tl.float32)
    for s0 in range(0, k, BK):
        slots = s0 + tl.arange(0, BK)
        sm = slots < k
        col = tl.load(IDX + t * si + slots, mask=sm, other=-1)
        live = col >= 0
        kt = tl.load(K + col[:, None] * sk + c[None, :], mask=live[:, None] & cm[None, :], other=0.0)
        qk = q.to(kt.dtype)
        d = tl.dot(qk, tl.trans(kt), input_precision=PREC)                          # [NP, BK] recomputed
        g = tl.load(DI + t * si + slots, mask=live, other=0.0).to(tl.float32)      # [BK], 0 at -1 picks
        dw += tl.sum(tl.maximum(d, 0.0) * g[None, :], 1)
        dd = tl.where(d > 0, g[None, :] * w[:, None], 0.0)                          # [NP, BK] fp32
        dq += tl.dot(dd.to(kt.dtype), kt, input_precision=PREC)
        if DENSE:   # S[col, r, h] = dd (bf16 in training: what the GEMM reads); a pick's nI heads are adjacent
            if NP == NI:    # no head mask: vector stores (a mask on h splits them into 2-byte ones; sm_90 PTX)
                smask = live[None, :]
            else:
                smask = hm[:, None] & live[None, :]
            tl.store(S + (col[None, :] * R + r) * NI + h[:, None], dd.to(S.dtype.element_ty), mask=smask)
        else:
            dkt = tl.dot(tl.trans(dd.to(kt.dtype)), qk, input_precision=PREC)      # [BK, CP]
            tl.atomic_add(DK + col[:, None] * CI + c[None, :], dkt, mask=live[:, None] & cm[None, :], sem="relaxed")
    tl.store(DQ + t * sq_t + h[:, None] * sq_h + c[None, :], dq.to(DQ.dtype.element_ty), mask=hm[:, None] & cm[None, :])
    tl.store(DW + t * sw + h, (dw * coef).to(DW.dtype.element_ty), mask=hm)


@triton.jit
def _zero_picks(IDX, S, t0, R, si, k, NI: tl.constexpr, NP: tl.constexpr, BK: tl.constexpr):
    """S[col, r, :] = 0 at the picks of query t0 + r: what `_listed_bwd` stored there, so S is all zero again."""
    r = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, NP)
    for s0 in range(0, k, BK):
        slots = s0 + tl.arange(0, BK)
        col = tl.load(IDX + (t0 + r) * si + slots, mask=slots < k, other=-1)      # [BK]
        live = col >= 0
        smask = live[None, :] if NP == NI else (h < NI)[:, None] & live[None, :]  # as `_listed_bwd`'s store
        tl.store(S + (col[None, :] * R + r) * NI + h[:, None], tl.zeros([NP, BK], S.dtype.element_ty), mask=smask)


def listed_scores(qI: torch.Tensor, kI: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """`naive.indexer_scores_listed` (forward only): qI [Tq,nI,cI], kI [N,cI], w [Tq,nI], idx [Tq,k] -> [Tq,k]
    fp32, -inf at -1."""
    qI, kI, w, idx = qI.contiguous(), kI.contiguous(), w.contiguous(), idx.contiguous()
    Tq, nI, cI = qI.shape
    k = idx.shape[1]
    out = torch.full(idx.shape, float("-inf"), device=qI.device, dtype=torch.float32)
    if Tq == 0 or k == 0 or kI.shape[0] == 0:
        return out
    _listed_fwd[lambda m: (Tq, triton.cdiv(k, m["BK"]))](
        qI, kI, w, idx, out, qI.stride(0), qI.stride(1), kI.stride(0), w.stride(0), idx.stride(0), nI, cI, k,
        (nI * cI) ** -0.5, NP=pow2(nI), CP=pow2(cI), PREC=_prec(qI))
    return out


DENSE_DK = 1024                 # dkI by S-GEMM while N·nI <= DENSE_DK·k (its extra FLOPs beat the atomics)
DENSE_DK_BYTES = 1 << 29        # at most 512 MiB of S at a time (sub-chunks of queries). Was 64 MiB: at 64K tokens
# (proxy: nI 16, N 16K entries, 512 KiB of S a query) that is 128 queries a launch, a grid of 128 programs on 132
# SMs, 512 launches a layer: `_listed_bwd` 42 ms in 1,024 launches + 25 ms of dkI GEMMs in 1,024 (H200, 717ce5a)


def listed_scores_bwd(dI: torch.Tensor, qI: torch.Tensor, kI: torch.Tensor, w: torch.Tensor,
                      idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward of `listed_scores`: dI [Tq,k] (entries at -1 picks are ignored) -> (dqI, dkI, dw) in the
    inputs' dtypes; fp32 accumulation, products in kI's dtype (the forward's)."""
    qI, kI, w, idx = qI.contiguous(), kI.contiguous(), w.contiguous(), idx.contiguous()
    dI = dI.contiguous()
    Tq, nI, cI = qI.shape
    N, k = kI.shape[0], idx.shape[1]
    dq = torch.zeros(qI.shape, device=qI.device, dtype=qI.dtype)
    dw = torch.zeros(w.shape, device=qI.device, dtype=w.dtype)
    dk = torch.zeros(kI.shape, device=qI.device, dtype=torch.float32)
    if Tq == 0 or k == 0 or N == 0:
        return dq, dk.to(kI.dtype), dw
    dense = N * nI <= DENSE_DK * k
    sub = max(1, DENSE_DK_BYTES // max(1, nI * N * kI.element_size())) if dense else Tq   # queries per launch
    coef = (nI * cI) ** -0.5
    # S [N, R, nI] of each launch: one zeroed buffer for the whole call. A launch writes only its queries' picks
    # (k of the N rows), so after its GEMM those picks are set back to 0, and the next launch finds S all zero.
    # (A fresh zeroed S per launch was 64 fills of 512 MiB a CSA layer at 64K tokens: 19 ms of a 662 ms step.)
    buf = torch.zeros(N * min(sub, Tq) * nI, device=qI.device, dtype=kI.dtype) if dense else dk   # dummy if not
    for b in range(0, Tq, sub):
        e = min(b + sub, Tq)
        S = buf[:N * (e - b) * nI].view(N, e - b, nI) if dense else dk
        _listed_bwd[(e - b,)](qI, kI, w, idx, dI, dq, dw, S, dk, b, e - b, qI.stride(0), qI.stride(1),
                              kI.stride(0), w.stride(0), idx.stride(0), nI, cI, k, N, coef, NP=pow2(nI), CP=pow2(cI),
                              PREC=_prec(qI), DENSE=dense)
        if dense:                                                                   # dkI += S qI  [N, cI]
            dk += (S.view(N, -1) @ qI[b:e].flatten(0, 1).to(kI.dtype)).float()
            # back to 0 by a store at the picks: ATen's index_put_ of a [R, k] index took 55 us a launch at 64K
            # and 0.45 ms at 16K (H100, cde260c), more than the fill it replaced; a Python 0 there was also a CPU
            # tensor copied over, which CUDA graph capture refuses (fixed at 76ffe84)
            _zero_picks[(e - b,)](idx, S, b, e - b, idx.stride(0), k, NI=nI, NP=pow2(nI), BK=64)
    return dq, dk.to(kI.dtype), dw
