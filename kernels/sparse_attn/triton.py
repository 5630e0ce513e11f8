"""Sparse attention (window + CSA-selected / HCA-causal compressed entries + sink) in Triton, fwd and bwd.

Same contract as `naive.sparse_attn` (spec §5.2, §5.3), packed stream with document metadata: query t is key
row u = q_offset + t; for query t and head h, ONE softmax over
  * the window keys  {s : u - window < s <= u, same document as u}        (rows of `kv`),
  * the compressed entries: comp_idx given -> those listed (-1 = none; listed but not visible entries --
                            other document, not yet complete -- ignored; entries must be listed at most once),
                            comp_idx None and comp given -> every visible entry (one index range of the
                            entry slots per query, kernels/_varlen.py),
  * the sink logit sink[h] (no value).
K = V (MQA: all H heads share one kv head of width c).

Schedule (flash-attention style, MQA): one program per (QB consecutive queries, block of HB heads); its BH =
QB * HB rows (query-major: row r = query t0 + r // HB, head r % HB) are the M dimension of the tensor-core tiles.
HB = min(next_pow2(H), largest BH): with H >= BH (DSv4, H = 64) a program is one query, as in FlashMLA; with
fewer heads (`proxy`, H = 16) QB = BH / HB queries can share the window and HCA key tiles instead of leaving rows
of the tile empty (4x fewer window / HCA key loads in the forward, and 2x fewer dKV atomics in the backward, at
H = 16). Each query's CSA picks are its own: they stream one query at a time with the other rows masked, so a
several-query program spends QB x the MMA work on them; the tuner also times BH = HB (one query a program, M = 16
tiles at H = 16) and keeps, per mode, whichever is faster. A key tile's
load is masked by its address range only (rows <= u, listed idx >= 0, the slot range); visibility (document,
window, entry completeness, from seg / pos / entry_seg / entry_j) masks the logits, so the tile load never waits
on the metadata gathers (two levels of indirection stall the software pipeline). Keys stream in tiles of BN rows
(window rows are contiguous, CSA rows are gathered by index, HCA rows are contiguous), online softmax in the exp2 domain,
seeded with the sink (running max = sink, running sum = 1), so a query with no key is well defined.
A query's listing is read up to its last entry (`listed_width`, host side): a top-k lists a query's visible
picks first, so the -1 tail of a query that sees fewer than k entries (the first m * k tokens of a document)
costs no tile: 1/8 of the slots of an 8K-token document at m 4, k 512, more in packed rows of short documents.

The indexer's joint teacher (`return_probs`, op.py): with listed entries the forward also stores each pick's logits
[Tq, k, H] fp32 (STORE_S; -inf where not visible) and `_picks_probs` sums 2^(s - lse) over the heads once the
final lse is known: `entry_probs` without a second gather of the picks (up to _STORE_S_BYTES of logits). With every
visible entry read (MODE_ALL) and a listing of them (`probs_idx`), the logits are stored by the entry's index in its
document (entry_j), which the listing's entries are read back by.

Backward (one fused kernel, FA2 style with the stored log-sum-exp): per key tile recompute P, dP = dO Vᵀ,
dS = P (dP - delta) * scale; dQ += dS K stays in registers; dKV_tile = dSᵀ Q + Pᵀ dO (K = V, the heads of the
block reduced inside the tile) goes to fp32 buffers through atomic adds (non-deterministic summation order).
The sink gradient is -Σ p_sink · delta, reduced in PyTorch from the per-(t, b, h) delta the kernel stores.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from dsv4.kernels._triton_util import configs, on_cpu, pow2
from dsv4.kernels._varlen import entry_ranges

from . import naive

LOG2E = 1.4426950408889634
MODE_NONE, MODE_IDX, MODE_ALL = 0, 1, 2

# (64, 64|32, 8 warps) compile to wgmma with small register spills (ptxas, sm_90, triton 3.9). Backward: the
# plain [BN, BD] dKV form needs q and dO twice in shared memory at BH=64 (> 228 KB): BH=32 (mma.sync). The
# transposed form (DKT: q / dO reused as transposed A operands) fits BH=64 with wgmma but faulted on the device.
# The launcher fixes HB (heads a program) before tuning; the configs' BH (rows a program) then sets QB = BH / HB
# queries a program, and the prune keeps the configs with BH >= HB. With H <= 16 (`proxy`) the tuner so also times
# BH = 16 = one query a program (M = 16 mma.sync tiles): the CSA picks are per query, and in a several-query
# program each query's pick tiles run the whole BH-row dot with the other rows masked (4x the MMA work at QB = 4).
_FWD_BH, _BWD_BH, _CPU_BH = 64, 32, 16
# The largest transient [Tq, k, H] fp32 logits buffer the forward stores for `return_probs` (4 GiB: `proxy` up to 128K
# tokens; DSv4-Flash's H 64 up to 32K a call); a larger call leaves the probabilities to `entry_probs`' second pass
_STORE_S_BYTES = 1 << 32


def stores_logits(want_probs: bool, listed: bool, Tq: int, nsel: int, H: int) -> bool:
    """Whether the forward stores the picks' logits for `return_probs` (listed entries, within _STORE_S_BYTES):
    the one rule of the forward and of its custom op's fake (op.py), so compiled shapes match the kernel's."""
    return bool(want_probs) and listed and Tq * nsel * H * 4 <= _STORE_S_BYTES


def _bh_at_least_hb(cfgs, args):
    return [c for c in cfgs if c.kwargs["BH"] >= args["HB"]]


_FWD_CONFIGS = configs(
    gpu=[dict(BH=_FWD_BH, BN=64, num_warps=8, num_stages=2), dict(BH=_FWD_BH, BN=32, num_warps=8, num_stages=2),
         dict(BH=_FWD_BH, BN=32, num_warps=8, num_stages=3),
         dict(BH=16, BN=64, num_warps=8, num_stages=2), dict(BH=16, BN=32, num_warps=4, num_stages=3)],
    cpu=dict(BH=_CPU_BH, BN=16, num_warps=4, num_stages=1), prune=_bh_at_least_hb)
_BWD_CONFIGS = configs(   # DKT=True (BH=64, wgmma) hit an illegal address on the H200 (triton 3.6, c=512): off
    gpu=[dict(BH=_BWD_BH, BN=32, DKT=False, num_warps=8, num_stages=1),
         dict(BH=_BWD_BH, BN=16, DKT=False, num_warps=8, num_stages=2),
         dict(BH=16, BN=32, DKT=False, num_warps=8, num_stages=1),
         dict(BH=16, BN=16, DKT=False, num_warps=4, num_stages=2),
         dict(BH=16, BN=32, DKT=False, num_warps=4, num_stages=2)],   # H 16 at 16K: CSA -5%, window -4% (e6d359e A/B)
    cpu=dict(BH=_CPU_BH, BN=16, DKT=False, num_warps=4, num_stages=1), prune=_bh_at_least_hb)


def _heads(x, H: int, bh_max: int) -> int:
    """HB heads a program for H heads: min(next_pow2(H), the largest BH of the device's configs)."""
    return min(triton.next_power_of_2(int(H)), _CPU_BH if on_cpu(x) else bh_max)


def _grid(Tq: int, H: int, hb: int):
    """Programs (query blocks of QB = BH / HB queries, head blocks) for the config the tuner tries."""
    return lambda meta: (triton.cdiv(Tq, meta["BH"] // hb), triton.cdiv(H, hb))


# ----------------------------------------------------------------------------------------------- forward
@triton.jit
def _fwd_tile(q, k, valid, m_i, l_i, acc, qk_scale, PREC: tl.constexpr):
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale                       # [BH, BN] logits, log2 domain
    s = tl.where(valid, s, float("-inf"))                                              # valid [BH, BN]
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(k.dtype), k, input_precision=PREC)   # V = K
    return m_new, l_i, acc, s


@triton.jit
def _window_valid(SEG, POS, offs_n, u, seg_u, pos_u, window):
    """Window keys of key row u (scalars): rows <= u of u's document within `window` positions."""
    inb = (offs_n <= u) & (offs_n >= 0)
    sk = tl.load(SEG + offs_n, mask=inb, other=-2)
    pk = tl.load(POS + offs_n, mask=inb, other=0)
    return inb & (sk == seg_u) & (sk >= 0) & (pk <= pos_u) & (pk > pos_u - window)


@triton.jit
def _window_valid_rows(SEG, POS, offs_n, hi, u, seg_u, pos_u, window):
    """[rows, keys]: the window keys of each row's key row u [BH] (keys offs_n [BN] <= hi, the tile's range)."""
    inb = (offs_n <= hi) & (offs_n >= 0)
    sk = tl.load(SEG + offs_n, mask=inb, other=-2)
    pk = tl.load(POS + offs_n, mask=inb, other=0)
    return (inb & (sk >= 0))[None, :] & (offs_n[None, :] <= u[:, None]) & (sk[None, :] == seg_u[:, None]) & \
        (pk[None, :] <= pos_u[:, None]) & (pk[None, :] > pos_u[:, None] - window)


@triton.jit
def _window_mask(SEG, POS, offs_n, hi, u, seg_u, pos_u, u0, seg0, pos0, window, ONE: tl.constexpr):
    """The logits mask of a window tile: [1, BN] from the one query's scalars (u0 / seg0 / pos0) when the program
    is one query (ONE), else [BH, BN] per row. The per-key form keeps the H >= BH (DSv4) kernel's code as it was
    (same ptxas spills, sm_90a) and its 2-D integer compares out of the loop."""
    if ONE:
        valid = _window_valid(SEG, POS, offs_n, u0, seg0, pos0, window)[None, :]
    else:
        valid = _window_valid_rows(SEG, POS, offs_n, hi, u, seg_u, pos_u, window)
    return valid


@triton.jit
def _entry_mask(ESEG, EJ, idx, live, seg_u, pos_u, seg0, pos0, ratio, ONE: tl.constexpr):
    """The logits mask of an entry tile, as `_window_mask`."""
    if ONE:
        valid = _entry_valid(ESEG, EJ, idx, live, seg0, pos0, ratio)[None, :]
    else:
        valid = _entry_valid_rows(ESEG, EJ, idx, live, seg_u, pos_u, ratio)
    return valid


@triton.jit
def _entry_valid(ESEG, EJ, idx, live, seg_u, pos_u, ratio):
    """Entries `idx` [BN] (where `live`) visible to a query of document seg_u at position pos_u (scalars)."""
    es = tl.load(ESEG + idx, mask=live, other=-2)
    ej = tl.load(EJ + idx, mask=live, other=0)
    return live & (es == seg_u) & (es >= 0) & (ej < (pos_u + 1) // ratio)


@triton.jit
def _entry_valid_rows(ESEG, EJ, idx, live, seg_u, pos_u, ratio):
    """[rows, entries]: entries `idx` [BN] (where `live`) visible to each row's query (seg_u / pos_u [BH])."""
    es = tl.load(ESEG + idx, mask=live, other=-2)
    ej = tl.load(EJ + idx, mask=live, other=0)
    return (live & (es >= 0))[None, :] & (es[None, :] == seg_u[:, None]) & \
        (ej[None, :] < ((pos_u + 1) // ratio)[:, None])


@triton.jit
def _rotate_rows(x, COS, SIN, tq, t0, rmask, s_cs, sign, C: tl.constexpr, RD: tl.constexpr, BH: tl.constexpr,
                 BD: tl.constexpr, ONE: tl.constexpr):
    """x [BH, BD] fp32 with each row's query tq [BH]: its last RD channels (of C) rotated in pairs (2i, 2i+1) by
    the query's table row, (a, b) -> (a cos - sign b sin, sign a sin + b cos) (sign -1: the inverse rotation);
    cos / sin [TQ, RD/2] fp32 (row stride s_cs). kernels/rope/naive.py's rotation, on registers. ONE (the program
    is one query, t0): the table row is loaded once and broadcast ([1, BD/2], not [BH, BD/2] registers)."""
    a, b = tl.split(tl.reshape(x, [BH, BD // 2, 2]))                          # [BH, BD/2] even / odd channels
    i = tl.arange(0, BD // 2) - (C - RD) // 2                                 # pair index in the rope part
    live = (i >= 0) & (i < RD // 2)
    if ONE:
        cs = tl.load(COS + t0 * s_cs + i, mask=live, other=1.0)[None, :]
        sn = tl.load(SIN + t0 * s_cs + i, mask=live, other=0.0)[None, :] * sign
    else:
        m = rmask[:, None] & live[None, :]
        cs = tl.load(COS + tq[:, None] * s_cs + i[None, :], mask=m, other=1.0)
        sn = tl.load(SIN + tq[:, None] * s_cs + i[None, :], mask=m, other=0.0) * sign
    return tl.reshape(tl.join(a * cs - b * sn, a * sn + b * cs), [BH, BD])


_PREP_ROWS = 16      # (query, head) rows a program of `_out_rope_bwd_prep`


@triton.jit
def _out_rope_bwd_prep(O, DO, DOU, DELTA, COS, SIN, so_s, so_h, sl_s, s_cs, TQ, H,
                       C: tl.constexpr, RD: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr):
    """The backward's first pass when the output was rotated in the forward (`out_rope`): for BR (query, head)
    rows of the rotated O and dO, delta = rowsum(O ∘ dO) (what the un-rotated pair gives: the rotation's adjoint)
    and dO with its last RD channels rotated forward again (the gradient of the un-rotated output) into DOU."""
    r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    rm = r < TQ * H
    t = r // H
    offs_d = tl.arange(0, BD)
    m = rm[:, None] & (offs_d < C)[None, :]
    off = t[:, None] * so_s + (r % H)[:, None] * so_h + offs_d[None, :]
    o = tl.load(O + off, mask=m, other=0.0).to(tl.float32)
    do = tl.load(DO + off, mask=m, other=0.0).to(tl.float32)
    tl.store(DELTA + t * sl_s + r % H, tl.sum(o * do, 1), mask=rm)
    do = _rotate_rows(do, COS, SIN, t, 0, rm, s_cs, 1.0, C, RD, BR, BD, False)
    tl.store(DOU + off, do.to(DOU.dtype.element_ty), mask=m)


@triton.autotune(**_FWD_CONFIGS, key=["H", "BD", "MODE", "HB", "ROT"])
@triton.jit
def _sparse_attn_fwd(Q, KV, COMP, IDX, SINK, O, LSE, SEG, POS, ESEG, EJ, ELO, EHI, COS, SIN, S_OUT,
                     sq_s, sq_h, skv_s, sc_s, si_s, so_s, so_h, sl_s, s_cs, ss_t,
                     TQ, H, NSEL, window, ratio, qk_scale, q_off,
                     C: tl.constexpr, MODE: tl.constexpr, PREC: tl.constexpr, BD: tl.constexpr, HB: tl.constexpr,
                     ROT: tl.constexpr, RD: tl.constexpr, STORE_S: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr):
    t0 = tl.program_id(0).to(tl.int64) * (BH // HB)            # BH // HB = QB queries per program (constexpr)
    rows = tl.arange(0, BH)
    qi = rows // HB                                             # [BH] each row's query (t0 + qi) and head
    tq = t0 + qi
    offs_h = tl.program_id(1) * HB + rows % HB
    rmask = (offs_h < H) & (tq < TQ)
    offs_d = tl.arange(0, BD)
    dmask = offs_d < C
    u = tq + q_off                                              # [BH] key row of each row's query
    seg_u = tl.load(SEG + u, mask=rmask, other=-3)              # -3: no key or entry matches an empty row
    pos_u = tl.load(POS + u, mask=rmask, other=0)
    u0 = t0 + q_off                                             # the first query's (the only one when BH == HB)
    seg0 = tl.load(SEG + u0)
    pos0 = tl.load(POS + u0)
    q = tl.load(Q + tq[:, None] * sq_s + offs_h[:, None] * sq_h + offs_d[None, :],
                mask=rmask[:, None] & dmask[None, :], other=0.0)
    m_i = tl.load(SINK + offs_h, mask=rmask, other=0.0).to(tl.float32) * 1.4426950408889634
    l_i = tl.full([BH], 1.0, tl.float32)                        # the sink's exp(z - m) = 1
    acc = tl.zeros([BH, BD], tl.float32)
    u_hi = tl.minimum(t0 + BH // HB, TQ) - 1 + q_off                  # the last query's key row
    lo = tl.maximum(t0 + q_off - window + 1, 0)
    for start in range(lo, u_hi + 1, BN):                       # window keys u-window < s <= u of every query
        offs_n = start + tl.arange(0, BN)
        valid = _window_mask(SEG, POS, offs_n, u_hi, u, seg_u, pos_u, u0, seg0, pos0, window, BH == HB)
        k = tl.load(KV + offs_n[:, None] * skv_s + offs_d[None, :], mask=(offs_n <= u_hi)[:, None] & dmask[None, :],
                    other=0.0)
        m_i, l_i, acc, _s = _fwd_tile(q, k, valid, m_i, l_i, acc, qk_scale, PREC)
    if MODE == 1:                                               # CSA: gathered top-k entries, one query at a time
        for j in range(0, BH // HB):                    # a loop: unrolled, it spilled 3x more
            tj = t0 + j
            uj = tl.minimum(tj, TQ - 1) + q_off
            n_j = tl.load(EHI + tl.minimum(tj, TQ - 1)) * (tj < TQ).to(tl.int32)  # `listed_width`
            seg_j = tl.load(SEG + uj)
            pos_j = tl.load(POS + uj)
            for s0 in range(0, n_j, BN):
                offs_n = s0 + tl.arange(0, BN)
                idx = tl.load(IDX + tj * si_s + offs_n, mask=offs_n < n_j, other=-1)
                valid = _entry_valid(ESEG, EJ, idx, idx >= 0, seg_j, pos_j, ratio)[None, :]   # query j's picks
                if BH != HB:                                    # several queries: query j's rows only
                    valid = valid & (qi == j)[:, None]
                k = tl.load(COMP + idx[:, None] * sc_s + offs_d[None, :], mask=(idx >= 0)[:, None] & dmask[None, :],
                            other=0.0)
                m_i, l_i, acc, s = _fwd_tile(q, k, valid, m_i, l_i, acc, qk_scale, PREC)
                if STORE_S:                                     # the picks' logits (log2 units, -inf: not visible)
                    tl.store(S_OUT + tj * ss_t + offs_n[None, :] * H + offs_h[:, None], s,
                             mask=rmask[:, None] & (qi == j)[:, None] & (offs_n < n_j)[None, :])
            if STORE_S:                                         # the unread tail of the listing (all -1): -inf
                for s0 in range((n_j // BN) * BN, NSEL * (tj < TQ).to(tl.int32), BN):
                    offs_n = s0 + tl.arange(0, BN)
                    tl.store(S_OUT + tj * ss_t + offs_n[None, :] * H + offs_h[:, None],
                             tl.full([BH, BN], float("-inf"), tl.float32),
                             mask=rmask[:, None] & (qi == j)[:, None] & ((offs_n >= n_j) & (offs_n < NSEL))[None, :])
    if MODE == 2:                                               # HCA: every visible entry, the union of the ranges
        if BH == HB:
            e_lo = tl.load(ELO + t0)
            e_hi = tl.load(EHI + t0)
        else:
            e_lo = tl.min(tl.load(ELO + tq, mask=rmask, other=2147483647), 0)
            e_hi = tl.max(tl.load(EHI + tq, mask=rmask, other=0), 0)
        for start in range(e_lo, e_hi, BN):
            offs_n = start + tl.arange(0, BN)
            valid = _entry_mask(ESEG, EJ, offs_n, offs_n < e_hi, seg_u, pos_u, seg0, pos0, ratio, BH == HB)
            k = tl.load(COMP + offs_n[:, None] * sc_s + offs_d[None, :], mask=(offs_n < e_hi)[:, None] & dmask[None, :],
                        other=0.0)
            m_i, l_i, acc, s = _fwd_tile(q, k, valid, m_i, l_i, acc, qk_scale, PREC)
            if STORE_S:         # a visible entry's logits at slot j = its index in the row's document (< NSEL)
                slot = tl.load(EJ + offs_n, mask=offs_n < e_hi, other=0)[None, :]
                tl.store(S_OUT + tq[:, None] * ss_t + slot * H + offs_h[:, None], s,
                         mask=rmask[:, None] & valid & (slot < NSEL))
    o = acc / l_i[:, None]
    if ROT:                                                     # the output rotated back by the query position
        o = _rotate_rows(o, COS, SIN, tq, t0, rmask, s_cs, -1.0, C, RD, BH, BD, BH == HB)
    tl.store(O + tq[:, None] * so_s + offs_h[:, None] * so_h + offs_d[None, :], o.to(O.dtype.element_ty),
             mask=rmask[:, None] & dmask[None, :])
    tl.store(LSE + tq * sl_s + offs_h, m_i + tl.log2(l_i), mask=rmask)


# ---------------------------------------------------------------------------------------------- backward
@triton.jit
def _bwd_tile(q, do, k, valid, lse, delta, dq, qk_scale, scale, PREC: tl.constexpr, DKT: tl.constexpr):
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale              # [BH, BN]
    p = tl.where(valid, tl.exp2(s - lse[:, None]), 0.0)                      # valid [BH, BN]
    dp = tl.dot(do, tl.trans(k), input_precision=PREC)                       # dO Vᵀ, V = K
    ds = p * (dp - delta[:, None]) * scale
    dq = dq + tl.dot(ds.to(k.dtype), k, input_precision=PREC)
    if DKT:   # dKVᵀ [BD, BN] = Qᵀ dS + dOᵀ P: q / dO serve as (transposed) A operands, no second smem copy
        dk = tl.dot(tl.trans(q), ds.to(q.dtype), input_precision=PREC) + \
            tl.dot(tl.trans(do), p.to(do.dtype), input_precision=PREC)
    else:     # dKV [BN, BD] = dSᵀ Q + Pᵀ dO
        dk = tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PREC) + \
            tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PREC)
    return dq, dk


@triton.jit
def _dk_add(DK, rows, s_row, offs_d, valid, dmask, dk, DKT: tl.constexpr):
    """Atomic fp32 add of a key tile's dKV (rows = key indices) in either orientation, for the keys that some row
    of the program sees (valid [BH, BN] or [1, BN])."""
    valid = tl.max(valid.to(tl.int32), 0) > 0                                 # [BN]
    if DKT:
        tl.atomic_add(DK + rows[None, :] * s_row + offs_d[:, None], dk,
                      mask=valid[None, :] & dmask[:, None], sem="relaxed")
    else:
        tl.atomic_add(DK + rows[:, None] * s_row + offs_d[None, :], dk,
                      mask=valid[:, None] & dmask[None, :], sem="relaxed")


@triton.autotune(**_BWD_CONFIGS, key=["H", "BD", "MODE", "HB", "DELTA_IN"], reset_to_zero=["DKV", "DCOMP"])
@triton.jit
def _sparse_attn_bwd(Q, KV, COMP, IDX, O, DO, LSE, DQ, DKV, DCOMP, DELTA, SEG, POS, ESEG, EJ, ELO, EHI,
                     sq_s, sq_h, skv_s, sc_s, si_s, so_s, so_h, sl_s,
                     TQ, H, NSEL, window, ratio, qk_scale, scale, q_off,
                     C: tl.constexpr, MODE: tl.constexpr, PREC: tl.constexpr, BD: tl.constexpr, HB: tl.constexpr,
                     DELTA_IN: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr, DKT: tl.constexpr):
    # Q/DQ/O/DO share strides (sq_*, so_*: q and dq; o and do), KV/DKV share skv_*, COMP/DCOMP share sc_*.
    # Rows as in the forward: row r = query t0 + r // HB, head r % HB of the program's head block.
    t0 = tl.program_id(0).to(tl.int64) * (BH // HB)
    rows = tl.arange(0, BH)
    qi = rows // HB
    tq = t0 + qi
    offs_h = tl.program_id(1) * HB + rows % HB
    rmask = (offs_h < H) & (tq < TQ)
    offs_d = tl.arange(0, BD)
    dmask = offs_d < C
    hd = rmask[:, None] & dmask[None, :]
    u = tq + q_off
    seg_u = tl.load(SEG + u, mask=rmask, other=-3)
    pos_u = tl.load(POS + u, mask=rmask, other=0)
    u0 = t0 + q_off
    seg0 = tl.load(SEG + u0)
    pos0 = tl.load(POS + u0)
    q_off2 = tq[:, None] * sq_s + offs_h[:, None] * sq_h + offs_d[None, :]
    q = tl.load(Q + q_off2, mask=hd, other=0.0)
    o_off = tq[:, None] * so_s + offs_h[:, None] * so_h + offs_d[None, :]
    do = tl.load(DO + o_off, mask=hd, other=0.0)
    if DELTA_IN:                                                # given (`_out_rope_bwd_prep`): O is not read
        delta = tl.load(DELTA + tq * sl_s + offs_h, mask=rmask, other=0.0)
    else:
        o = tl.load(O + o_off, mask=hd, other=0.0)
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)  # [BH] rowsum(dO ∘ O)
        tl.store(DELTA + tq * sl_s + offs_h, delta, mask=rmask)
    lse = tl.load(LSE + tq * sl_s + offs_h, mask=rmask, other=0.0)
    dq = tl.zeros([BH, BD], tl.float32)
    u_hi = tl.minimum(t0 + BH // HB, TQ) - 1 + q_off
    lo = tl.maximum(t0 + q_off - window + 1, 0)
    for start in range(lo, u_hi + 1, BN):
        offs_n = start + tl.arange(0, BN)
        valid = _window_mask(SEG, POS, offs_n, u_hi, u, seg_u, pos_u, u0, seg0, pos0, window, BH == HB)
        k = tl.load(KV + offs_n[:, None] * skv_s + offs_d[None, :], mask=(offs_n <= u_hi)[:, None] & dmask[None, :],
                    other=0.0)
        dq, dk = _bwd_tile(q, do, k, valid, lse, delta, dq, qk_scale, scale, PREC, DKT)
        _dk_add(DKV, offs_n, skv_s, offs_d, valid, dmask, dk, DKT)
    if MODE == 1:
        for j in tl.static_range(BH // HB):             # unrolled: as a loop it spilled 3x more
            tj = t0 + j
            uj = tl.minimum(tj, TQ - 1) + q_off
            n_j = tl.load(EHI + tl.minimum(tj, TQ - 1)) * (tj < TQ).to(tl.int32)  # `listed_width`
            seg_j = tl.load(SEG + uj)
            pos_j = tl.load(POS + uj)
            for s0 in range(0, n_j, BN):
                offs_n = s0 + tl.arange(0, BN)
                idx = tl.load(IDX + tj * si_s + offs_n, mask=offs_n < n_j, other=-1)
                valid = _entry_valid(ESEG, EJ, idx, idx >= 0, seg_j, pos_j, ratio)[None, :]   # query j's picks
                if BH != HB:                                    # several queries: query j's rows only
                    valid = valid & (qi == j)[:, None]
                k = tl.load(COMP + idx[:, None] * sc_s + offs_d[None, :], mask=(idx >= 0)[:, None] & dmask[None, :],
                            other=0.0)
                dq, dk = _bwd_tile(q, do, k, valid, lse, delta, dq, qk_scale, scale, PREC, DKT)
                _dk_add(DCOMP, idx, sc_s, offs_d, valid, dmask, dk, DKT)
    if MODE == 2:
        if BH == HB:
            e_lo = tl.load(ELO + t0)
            e_hi = tl.load(EHI + t0)
        else:
            e_lo = tl.min(tl.load(ELO + tq, mask=rmask, other=2147483647), 0)
            e_hi = tl.max(tl.load(EHI + tq, mask=rmask, other=0), 0)
        for start in range(e_lo, e_hi, BN):
            offs_n = start + tl.arange(0, BN)
            valid = _entry_mask(ESEG, EJ, offs_n, offs_n < e_hi, seg_u, pos_u, seg0, pos0, ratio, BH == HB)
            k = tl.load(COMP + offs_n[:, None] * sc_s + offs_d[None, :], mask=(offs_n < e_hi)[:, None] & dmask[None, :],
                        other=0.0)
            dq, dk = _bwd_tile(q, do, k, valid, lse, delta, dq, qk_scale, scale, PREC, DKT)
            _dk_add(DCOMP, offs_n, sc_s, offs_d, valid, dmask, dk, DKT)
    tl.store(DQ + q_off2, dq.to(DQ.dtype.element_ty), mask=hd)


# -------------------------------------------------------------------------------- listed-entry probabilities
_PROB_CONFIGS = configs(   # BH=16: H = 16 (`proxy`) without empty rows
    gpu=[dict(BH=64, BN=64, num_warps=8, num_stages=2), dict(BH=64, BN=32, num_warps=4, num_stages=2),
         dict(BH=32, BN=64, num_warps=4, num_stages=2), dict(BH=16, BN=64, num_warps=4, num_stages=2),
         dict(BH=16, BN=128, num_warps=4, num_stages=2)],
    cpu=dict(BH=16, BN=16, num_warps=4, num_stages=1))


@triton.autotune(**_PROB_CONFIGS, key=["H", "BD"])
@triton.jit
def _entry_probs(Q, COMP, IDX, LSE, P, SEG, POS, ESEG, EJ, sq_s, sq_h, sc_s, si_s, sl_s, sp_s,
                 H, NSEL, ratio, qk_scale, q_off,
                 C: tl.constexpr, PREC: tl.constexpr, BD: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr):
    """One program per query t: P[t, j] = sum_h exp2(q[t,h] . comp[idx[t,j]] * qk_scale - lse2[t,h]) over the
    listed visible entries (the forward's QK products again, no PV), 0 elsewhere."""
    t = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, BD)
    dmask = offs_d < C
    u = t + q_off
    seg_u = tl.load(SEG + u)
    pos_u = tl.load(POS + u)
    for start in range(0, NSEL, BN):
        offs_n = start + tl.arange(0, BN)
        idx = tl.load(IDX + t * si_s + offs_n, mask=offs_n < NSEL, other=-1)
        valid = _entry_valid(ESEG, EJ, idx, idx >= 0, seg_u, pos_u, ratio)
        k = tl.load(COMP + idx[:, None] * sc_s + offs_d[None, :], mask=(idx >= 0)[:, None] & dmask[None, :], other=0.0)
        psum = tl.zeros([BN], tl.float32)
        for h0 in range(0, H, BH):
            offs_h = h0 + tl.arange(0, BH)
            hmask = offs_h < H
            q = tl.load(Q + t * sq_s + offs_h[:, None] * sq_h + offs_d[None, :],
                        mask=hmask[:, None] & dmask[None, :], other=0.0)
            lse = tl.load(LSE + t * sl_s + offs_h, mask=hmask, other=float("inf"))
            s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale                 # [BH, BN], log2 units
            psum += tl.sum(tl.exp2(s - lse[:, None]), 0)
        tl.store(P + t * sp_s + offs_n, tl.where(valid, psum, 0.0), mask=offs_n < NSEL)


def entry_probs(q, comp, comp_idx, lse, ratio, scale, seg, pos, entry_seg, entry_j, q_offset=0):
    """Triton `naive.entry_probs`: q [Tq,H,c], comp [N,c], comp_idx [Tq,k], lse [Tq,H] (natural log) -> [Tq,k]
    fp32."""
    q, comp, idx = q.contiguous(), comp.contiguous(), comp_idx.contiguous()
    Tq, H, C = q.shape
    lse2 = (lse.float() * LOG2E).contiguous()                                        # log2 units
    p = torch.empty(idx.shape, device=q.device, dtype=torch.float32)
    if Tq == 0 or idx.shape[-1] == 0:
        return p.zero_()
    _entry_probs[(Tq,)](q, comp, idx, lse2, p, seg.contiguous(), pos.contiguous(), entry_seg.contiguous(),
                        entry_j.contiguous(), q.stride(0), q.stride(1), comp.stride(0), idx.stride(0),
                        lse2.stride(0), p.stride(0), H, idx.shape[-1], max(int(ratio), 1), float(scale) * LOG2E,
                        int(q_offset), C=C, PREC=_prec(q), BD=pow2(C))
    return p


_PROB_ROWS = 64      # (query, pick) rows a program of `_picks_probs`


@triton.jit
def _picks_probs(S, LSE, P, NSEL, R, H, sl_s, BR: tl.constexpr, BHP: tl.constexpr):
    """P[r] = sum_h 2^(S[r, h] - lse[r // NSEL, h]) for BR rows r = (query, pick) of the forward's stored logits
    S [Tq * NSEL, H] (log2 units, -inf where not visible): one read of S."""
    r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    rm = r < R
    h = tl.arange(0, BHP)
    m = rm[:, None] & (h < H)[None, :]
    s = tl.load(S + r[:, None] * H + h[None, :], mask=m, other=float("-inf"))
    lse = tl.load(LSE + (r // NSEL)[:, None] * sl_s + h[None, :], mask=m, other=0.0)
    tl.store(P + r, tl.sum(tl.exp2(s - lse), 1), mask=rm)


# ------------------------------------------------------------------------------------------------ driver
def _prec(x):
    """fp32 inputs: exact fp32 products ("ieee", tests); bf16/fp16: tensor cores (the flag is ignored)."""
    return "ieee" if x.dtype in (torch.float32, torch.float64) else "tf32"


def listed_width(idx: torch.Tensor) -> torch.Tensor:
    """idx [Tq, k] (-1 = none) -> [Tq] int32: 1 + the last slot holding an entry (0 for a row of -1 only). The
    MODE_IDX kernels stop there: slots past it hold no entry, so skipping them changes no sum."""
    if idx.shape[-1] == 0:
        return torch.zeros(idx.shape[0], dtype=torch.int32, device=idx.device)
    slot = torch.arange(1, idx.shape[-1] + 1, dtype=torch.int32, device=idx.device)
    return torch.where(idx >= 0, slot, 0).amax(-1).to(torch.int32)


def prepare(q, kv, comp, comp_idx, ratio, seg, pos, entry_seg, entry_j, q_off):
    """The launch metadata of one call: (mode, nsel, ratio, comp_t, idx_t, seg, pos, eseg, ej, elo, ehi), with
    dummy pointers for what the mode does not read. Shared by `_SparseAttn.forward` and the backward custom op
    (kernels/sparse_attn/op.py), which rebuilds the saved state from the inputs."""
    Tq = q.shape[0]
    ratio = max(int(ratio or 1), 1)
    if comp is None or comp.shape[0] == 0:
        mode, nsel = MODE_NONE, 0
    elif comp_idx is not None:
        mode, nsel = MODE_IDX, comp_idx.shape[-1]
    else:
        mode, nsel = MODE_ALL, 0
    dummy = torch.zeros(1, dtype=torch.long, device=q.device)
    comp_t = comp.contiguous() if mode != MODE_NONE else kv.contiguous()  # dummy pointer when unused
    idx_t = comp_idx.contiguous() if mode == MODE_IDX else dummy.view(1, 1)
    seg, pos = seg.contiguous(), pos.contiguous()
    eseg = entry_seg.contiguous() if mode != MODE_NONE else dummy
    ej = entry_j.contiguous() if mode != MODE_NONE else dummy
    if mode == MODE_ALL:
        elo, ehi = entry_ranges(seg[q_off:q_off + Tq], pos[q_off:q_off + Tq], eseg, ej, ratio)
    elif mode == MODE_IDX:      # ehi: each query's listing width used (its last slot >= 0, plus 1): a top-k lists
        elo = dummy.to(torch.int32)     # the visible picks first, so a query seeing < k entries skips its -1 tail
        ehi = listed_width(idx_t)
    else:
        elo = ehi = dummy.to(torch.int32)
    return mode, nsel, ratio, comp_t, idx_t, seg, pos, eseg, ej, elo, ehi


def _out_rope(q, rope_cos, rope_sin):
    """(cos, sin, r) of the output's fused inverse rotation: the tables [Tq, r/2] fp32 (contiguous) and the rotated
    width r = 2 h; without tables (None) 1-element dummies and r = 0 (the kernels' ROT off)."""
    if rope_cos is None:
        dummy = torch.empty(1, 1, device=q.device, dtype=torch.float32)      # never read (ROT off): no fill
        return dummy, dummy, 0
    Tq, _, C = q.shape
    h = rope_cos.shape[-1]
    if tuple(rope_cos.shape) != (Tq, h) or tuple(rope_sin.shape) != (Tq, h) or 2 * h > C or (C - 2 * h) % 2:
        raise ValueError(f"sparse_attn: out_rope tables must be [Tq, r/2] = [{Tq}, <= {C // 2}] with c - r even "
                         f"(the kernels' channel pairs), got {tuple(rope_cos.shape)} / {tuple(rope_sin.shape)}, c {C}")
    return rope_cos.float().contiguous(), rope_sin.float().contiguous(), 2 * h


class _SparseAttn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, comp, comp_idx, sink, window, ratio, scale, seg, pos, entry_seg, entry_j, q_off,
                rope_cos=None, rope_sin=None, want_probs=False, probs_idx=None):
        """want_probs: with listed entries (comp_idx), also `ctx.probs` = `entry_probs` of this call [Tq, k] fp32
        from the logits the forward formed anyway (stored [Tq, k, H] fp32, then summed over heads against the
        final lse): the indexer's joint teacher without a second pass over the picks. Without comp_idx (every
        visible entry read, MODE_ALL), probs_idx [Tq, k] names the entries of those probabilities: the forward
        stores each visible entry's logits at slot j = its index in the query's document (entry_j; a query at
        position p sees j < (p + 1) // ratio, at most k when no document is longer than ratio (k + 1) - 1 tokens:
        DSv4Attention._lists_every_visible) and reads each listed visible entry's slot (0 for the others).
        Otherwise, or when the stored logits would pass _STORE_S_BYTES, ctx.probs None (the caller runs
        `entry_probs`)."""
        q, kv = q.contiguous(), kv.contiguous()
        Tq, H, C = q.shape
        mode, nsel, ratio, comp_t, idx_t, seg, pos, eseg, ej, elo, ehi = prepare(
            q, kv, comp, comp_idx, ratio, seg, pos, entry_seg, entry_j, q_off)
        cs, sn, rd = _out_rope(q, rope_cos, rope_sin)
        o = torch.empty_like(q)
        lse = torch.empty(Tq, H, device=q.device, dtype=torch.float32)
        ranged = mode == MODE_ALL and probs_idx is not None     # every visible entry read, probs in probs_idx's order
        ns = probs_idx.shape[-1] if ranged else nsel            # stored slots a query
        store = stores_logits(want_probs, mode == MODE_IDX or ranged, Tq, ns, H)
        s_out = lse                                             # dummy pointer without the store
        if store:           # [Tq, ns, H]; ranged: a slot no visible entry has is never written, so -inf first
            f32 = dict(device=q.device, dtype=torch.float32)
            s_out = torch.full((Tq, ns, H), float("-inf"), **f32) if ranged else torch.empty(Tq, ns, H, **f32)
        hb = _heads(q, H, _FWD_BH)
        _sparse_attn_fwd[_grid(Tq, H, hb)](
            q, kv, comp_t, idx_t, sink.contiguous(), o, lse, seg, pos, eseg, ej, elo, ehi, cs, sn, s_out,
            q.stride(0), q.stride(1), kv.stride(0), comp_t.stride(0), idx_t.stride(0), o.stride(0), o.stride(1),
            lse.stride(0), cs.stride(0), ns * H, Tq, H, ns, int(window), ratio, float(scale) * LOG2E, int(q_off),
            C=C, MODE=mode, PREC=_prec(q), BD=pow2(C), HB=hb, ROT=rd > 0, RD=max(rd, 2), STORE_S=store)
        ctx.probs = None
        if store:           # P[t, j] = sum_h 2^(s[t, j, h] - lse[t, h])   (log2 units; -inf logits give 0)
            ctx.probs = torch.empty(Tq, ns, device=q.device, dtype=torch.float32)
            R = Tq * ns
            if R:
                _picks_probs[(triton.cdiv(R, _PROB_ROWS),)](s_out, lse, ctx.probs, ns, R, H, lse.stride(0),
                                                          BR=_PROB_ROWS, BHP=pow2(H, 2), num_warps=4)
            if ranged:      # slot j of query t holds its document's entry j: read each listed visible entry's
                e, ok = naive.listed_entries(probs_idx, seg[q_off:q_off + Tq], pos[q_off:q_off + Tq], eseg, ej, ratio)
                j = ej[e]                                                              # [Tq, ns]
                ctx.probs = torch.where(ok & (j < ns), ctx.probs.gather(1, j.clamp(0, max(ns - 1, 0))), 0.0)
        ctx.save_for_backward(q, kv, comp_t, idx_t, sink, o, lse, seg, pos, eseg, ej, elo, ehi, cs, sn)
        ctx.cfg = (mode, nsel, int(window), ratio, float(scale), int(q_off), rd)
        ctx.comp_none = comp is None
        return o

    @staticmethod
    def backward(ctx, do):
        q, kv, comp_t, idx_t, sink, o, lse, seg, pos, eseg, ej, elo, ehi, cs, sn = ctx.saved_tensors
        mode, nsel, window, ratio, scale, q_off, rd = ctx.cfg
        do = do.contiguous()
        Tq, H, C = q.shape
        dq = torch.empty_like(q)
        dkv = torch.zeros(kv.shape, device=q.device, dtype=torch.float32)
        has_comp = mode != MODE_NONE
        dcomp = torch.zeros(comp_t.shape, device=q.device, dtype=torch.float32) if has_comp else dkv
        delta = torch.empty_like(lse)
        if rd:       # o / do are the rotated output's: delta from them (the adjoint), dO un-rotated for the products
            do_u = torch.empty_like(do)
            _out_rope_bwd_prep[(triton.cdiv(Tq * H, _PREP_ROWS),)](
                o, do, do_u, delta, cs, sn, o.stride(0), o.stride(1), delta.stride(0), cs.stride(0), Tq, H,
                C=C, RD=rd, BD=pow2(C), BR=_PREP_ROWS, num_warps=4)
            do = do_u
        hb = _heads(q, H, _BWD_BH)
        _sparse_attn_bwd[_grid(Tq, H, hb)](
            q, kv, comp_t, idx_t, o, do, lse, dq, dkv, dcomp, delta, seg, pos, eseg, ej, elo, ehi,
            q.stride(0), q.stride(1), kv.stride(0), comp_t.stride(0), idx_t.stride(0), o.stride(0), o.stride(1),
            lse.stride(0), Tq, H, nsel, window, ratio, scale * LOG2E, scale, q_off,
            C=C, MODE=mode, PREC=_prec(q), BD=pow2(C), HB=hb, DELTA_IN=rd > 0)
        # d sink_h = -Σ_t p_sink(t,h) · delta(t,h),  p_sink = exp(z_h - lse)   (lse in log2 units)
        p_sink = torch.exp2(sink.float() * LOG2E - lse)
        dsink = -(p_sink * delta).sum(0).to(sink.dtype)
        dcomp_out = None if ctx.comp_none else (dcomp.to(comp_t.dtype) if has_comp else None)
        return (dq, dkv.to(kv.dtype), dcomp_out, None, dsink) + (None,) * 12


def sparse_attn(q: torch.Tensor, kv: torch.Tensor, comp: torch.Tensor | None, comp_idx: torch.Tensor | None,
                sink: torch.Tensor, window: int, ratio: int, scale: float, seg: torch.Tensor, pos: torch.Tensor,
                entry_seg: torch.Tensor | None = None, entry_j: torch.Tensor | None = None,
                q_offset: int = 0) -> torch.Tensor:
    """Triton sparse attention; same contract as `naive.sparse_attn`: q [Tq,H,c], kv [Tk,c], comp [N,c] | None,
    comp_idx [Tq,k] | None, sink [H], seg/pos [Tk], entry_seg/entry_j [N] -> o [Tq,H,c]."""
    naive.check_args(q, kv, comp, comp_idx, sink, window, ratio, seg, pos, entry_seg, entry_j, q_offset)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return _SparseAttn.apply(q, kv, comp, comp_idx, sink, window, ratio, scale, seg, pos, entry_seg, entry_j,
                             int(q_offset))
