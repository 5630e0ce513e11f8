"""Compressor softmax pooling (spec §6.2 HCA, §6.3 CSA) in Triton, forward and backward, on the packed stream.

Same contract as `naive.compress_pool` (kv, gate [T, coff*D], ape [m, coff*D], seg / pos [T]; N static slots).
Three kernels, no PyTorch gather of rows:
  `_slot_meta`  per slot s: the token that closes its entry (at most one in first + s m .. first + (s+1) m - 1),
                entry seg / j / end (the naive `entry_slots`), the first row r0 of its current window (-1: empty)
                and hp = "has a previous window" (CSA j > 0). Layer-independent: `compress_slots`, computed once
                per layout and key by the model (model/layout.Layout.compress_slots), passed in as `slots`.
  `_pool_fwd`   one program = NIT x BE consecutive slots x BD channels. Per slot the rows are read in place:
                HCA slots r = rows r0 .. r0+m-1; CSA slots r < m = rows r0-m+r, FIRST channel half (the previous
                window), r >= m = rows r0+r-m, SECOND half. Consecutive slots of a document cover consecutive
                rows, so a program streams one contiguous token block (both halves; the CSA first half shifted by
                one window) and every (token, channel) element is read by at most one entry: no element is read
                twice, none is gathered into a copy. Softmax over the slots in fp32 per channel. Two forms, timed
                against each other by the autotuner: the [BE, MP, BD] tile (softmax over its middle axis) and
                LOOP (`_pool_online`: a loop over the window's rows with [BE, BD] tiles, online softmax).
  `_pool_bwd`   the same tiles: recomputes α, writes d value = α dout and d logit = α dout (value - out) in
                place (each element belongs to at most one entry: plain stores, deterministic), and sums d logit
                over its slots into a per-program d ape partial [m, coff*D] (fp32; reduced by one PyTorch sum
                over cdiv(N, BE*NIT) partials). `_zero_free` stores zeros in the elements no slot owns (padding,
                trailing tokens, the last window's first half, halo rows no entry uses): it reads pos [T] and
                the slots' r0 / hp and stores only where the element is free, so no full zero-fill pass.
Bytes per call (bf16 kv / gate, T tokens, W = coff*D channels, N slots): forward reads 2·T·W·2 (each element once)
plus writes N·D·2; backward reads 2·T·W·2 + N·D·2, writes 2·T·W·2, plus the d ape partials
N/(BE·NIT)·m·W·4 (≤ 1/(2·BE·NIT) of the rest). ape [m, W] fp32 is re-read by every program (L2-resident).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.kernels._triton_util import configs, on_cpu, pow2, tuned

from . import naive


# ------------------------------------------------------------------------------------------------ configs
def _pool_cfgs(nits):
    """BE slots x BD channels per tile, NIT tiles per program; kept (`_fits`) where the [BE, MP, BD] tile is 32
    elements per thread (4 warps: 4096, 8 warps: 8192) -- two fp32 tiles (logit, value) stay in registers."""
    return [dict(BE=be, BD=bd, NIT=nit, num_warps=w, num_stages=1 if nit == 1 else 2)
            for be in (1, 2, 4, 8, 16, 32, 64) for bd in (32, 64, 128, 256) for w in (4, 8) for nit in nits]


def _loop_cfgs():
    """Forward configs of the slot-loop form (LOOP): [BE, BD] tiles of 8-32 fp32 elements per thread, one program
    per BE slots x BD channels, the loop over the window's rows software-pipelined (stages 2 / 3)."""
    return [dict(BE=be, BD=bd, NIT=1, LOOP=True, num_warps=w, num_stages=st)
            for be, bd, w in ((4, 256, 4), (8, 128, 4), (8, 256, 4), (4, 512, 4), (16, 128, 4), (16, 256, 8),
                              (8, 512, 8), (32, 128, 8), (32, 256, 8)) for st in (2, 3)]


def _fits(cfgs, args):
    """The configs whose tile is 32 elements per thread (LOOP: any [BE, BD] tile), BD at most the channel count
    (>= 64 unless the slots or channels are few); only the first of them for a problem under 2^22 slot elements
    (not worth tuning)."""
    mp, dp = args["MP"], pow2(args["D"])
    kept = [c for c in cfgs if (c.kwargs.get("LOOP") or c.kwargs["BE"] * mp * c.kwargs["BD"] == 1024 * c.num_warps)
            and c.kwargs["BD"] <= max(64, dp) and (c.kwargs["BD"] >= 64 or mp >= 64 or dp < 64)]
    return kept if args["N"] * mp * args["D"] >= 1 << 22 else kept[:1]


_FWD = configs(gpu=[dict(c, LOOP=False) for c in _pool_cfgs((1, 4))] + _loop_cfgs(),
               cpu=dict(BE=2, BD=16, NIT=2, LOOP=True), prune=_fits)
_BWD = configs(gpu=_pool_cfgs((2, 8)), cpu=dict(BE=2, BD=16, NIT=2), prune=_fits)
_KEY = ["m", "D", "NK", "OVERLAP", "MP"]                  # NK: log2 bucket of the slot count (key only)


def _min_entries_per_program(MP, D):
    """Smallest BE*NIT over the backward configs a CUDA launch may pick (sizes the d ape partial buffer)."""
    return min(c.kwargs["BE"] * c.kwargs["NIT"] for c in _fits(_BWD["configs"][:-1], {"MP": MP, "D": D, "N": 1 << 22}))


# ------------------------------------------------------------------------------------------------ kernels
@triton.jit
def _slot_meta(SEG, POS, ENDS, ESEG, EJ, R0, HP, T, N, m, first,
               OVERLAP: tl.constexpr, MQ: tl.constexpr, BS: tl.constexpr):
    """naive.entry_slots + the window start: ends [N] (T-1 when empty), eseg (-1), j (0), r0 (-1), hp (0/1)."""
    s = tl.program_id(0) * BS + tl.arange(0, BS)
    smask = s < N
    r = tl.arange(0, MQ)
    tok = first + s[:, None].to(tl.int64) * m + r[None, :]                    # [BS, MQ]
    inb = smask[:, None] & (r[None, :] < m) & (tok < T)
    sg = tl.load(SEG + tok, mask=inb, other=-1)
    ps = tl.load(POS + tok, mask=inb, other=0)
    closes = inb & (sg >= 0) & ((ps + 1) % m == 0)
    off = tl.max(tl.where(closes, r[None, :], -1), 1)                         # the one closing token, or -1
    valid = off >= 0
    end = tl.where(valid, first + s.to(tl.int64) * m + off, T - 1)
    pe = tl.load(POS + end, mask=smask, other=0)
    j = tl.where(valid, (pe + 1) // m - 1, 0)
    es = tl.where(valid, tl.load(SEG + end, mask=smask, other=-1), -1)
    tl.store(ENDS + s, end, mask=smask)
    tl.store(ESEG + s, es, mask=smask)
    tl.store(EJ + s, j, mask=smask)
    tl.store(R0 + s, tl.where(valid, end - m + 1, -1).to(tl.int32), mask=smask)
    if OVERLAP:
        tl.store(HP + s, (valid & (j > 0)).to(tl.int32), mask=smask)
    else:
        tl.store(HP + s, tl.zeros([BS], tl.int32), mask=smask)


@triton.jit
def _tile(R0, HP, e, N, m, D, W, OVERLAP: tl.constexpr, MP: tl.constexpr, d0, BD: tl.constexpr):
    """Addresses of the [BE, MP, BD] slot tile of slots e: element offset into kv / gate, ape offset [MP, BD],
    load mask (slot owns the element), slot validity [BE, MP, 1] (padded channels stay finite), entry validity."""
    emask = e < N
    r0 = tl.load(R0 + e, mask=emask, other=-1)
    ev = r0 >= 0                                                                # [BE] slot holds an entry
    r = tl.arange(0, MP)
    offs_d = d0 + tl.arange(0, BD)
    if OVERLAP:
        hp = tl.load(HP + e, mask=emask, other=0) != 0
        row = r0[:, None] - m + r[None, :]                                      # rows r0-m .. r0+m-1
        cur = r[None, :] >= m
        ok = ev[:, None] & (r[None, :] < 2 * m) & (cur | hp[:, None])           # [BE, MP]
        chan = offs_d[None, :] + (r[:, None] >= m).to(tl.int32) * D             # [MP, BD]
    else:
        row = r0[:, None] + r[None, :]
        ok = ev[:, None] & (r[None, :] < m)
        chan = offs_d[None, :] + r[:, None] * 0
    off = row[:, :, None].to(tl.int64) * W + chan[None, :, :]                   # [BE, MP, BD]
    dm = (offs_d < D)[None, None, :]
    ape_off = (r % m)[:, None] * W + chan
    return off, ape_off, ok[:, :, None] & dm, ok[:, :, None], ev, offs_d


@triton.jit
def _softmax(GATE, KV, APE, off, ape_off, mask, ok, dm):
    """α [BE, MP, BD] over the slots (axis 1) and the values c (fp32); empty entries get α = 0."""
    z = tl.load(GATE + off, mask=mask, other=0.0).to(tl.float32) + tl.load(APE + ape_off, mask=dm, other=0.0)[None]
    z = tl.where(ok, z, float("-inf"))
    c = tl.load(KV + off, mask=mask, other=0.0).to(tl.float32)
    zmax = tl.max(z, 1)
    zmax = tl.where(zmax == float("-inf"), 0.0, zmax)
    ez = tl.exp(z - zmax[:, None, :])
    den = tl.sum(ez, 1)
    a = ez / tl.where(den > 0, den, 1.0)[:, None, :]
    return a, c


@triton.jit
def _pool_online(KV, GATE, APE, R0, HP, e, N, m, D, W, d0, OVERLAP: tl.constexpr, BE: tl.constexpr,
                 BD: tl.constexpr):
    """The LOOP form: pooled [BE, BD] of slots e, a loop over the window's rows r (CSA: 2m, the first m from the
    previous window's first channel half; HCA: m) with [BE, BD] tiles and an online softmax per element (the
    reductions stay inside each thread; each row read is BD contiguous channels of BE slots)."""
    emask = e < N
    r0 = tl.load(R0 + e, mask=emask, other=-1)
    ev = r0 >= 0                                                                # [BE] slot holds an entry
    offs_d = d0 + tl.arange(0, BD)
    dmask = offs_d < D
    if OVERLAP:
        hp = tl.load(HP + e, mask=emask, other=0) != 0
        nr = 2 * m
    else:
        nr = m
    mx = tl.full([BE, BD], float("-inf"), tl.float32)
    den = tl.zeros([BE, BD], tl.float32)
    acc = tl.zeros([BE, BD], tl.float32)
    for r in range(0, nr):
        if OVERLAP:
            cur = (r >= m).to(tl.int32)                                         # 1: the entry's own window
            row = r0 - m + r                                                    # [BE] rows r0-m .. r0+m-1
            ok = ev & ((hp.to(tl.int32) + cur) > 0)
            chan = offs_d + cur * D                                             # [BD] first / second half
        else:
            row = r0 + r
            ok = ev
            chan = offs_d
        msk = ok[:, None] & dmask[None, :]
        off = row[:, None].to(tl.int64) * W + chan[None, :]                     # [BE, BD]
        z = tl.load(GATE + off, mask=msk, other=0.0).to(tl.float32) + \
            tl.load(APE + (r % m) * W + chan, mask=dmask, other=0.0)[None, :]
        z = tl.where(msk, z, float("-inf"))
        c = tl.load(KV + off, mask=msk, other=0.0).to(tl.float32)
        m_new = tl.maximum(mx, z)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)                    # no row yet: every exp is 0
        alpha = tl.exp(mx - m_ref)
        p = tl.exp(z - m_ref)
        den = den * alpha + p
        acc = acc * alpha + p * c
        mx = m_new
    return tl.where(ev[:, None] & (den > 0), acc / tl.where(den > 0, den, 1.0), 0.0)


@triton.autotune(**_FWD, key=_KEY)
@triton.jit
def _pool_fwd(KV, GATE, APE, R0, HP, OUT, N, m, D, W, NK,
              OVERLAP: tl.constexpr, MP: tl.constexpr, BE: tl.constexpr, BD: tl.constexpr, NIT: tl.constexpr,
              LOOP: tl.constexpr):
    d0 = tl.program_id(1) * BD
    for it in range(NIT):
        e = (tl.program_id(0) * NIT + it) * BE + tl.arange(0, BE)
        if LOOP:
            out = _pool_online(KV, GATE, APE, R0, HP, e, N, m, D, W, d0, OVERLAP, BE, BD)
            offs_d = d0 + tl.arange(0, BD)
        else:                                                                   # the [BE, MP, BD] tile form
            off, ape_off, mask, ok, ev, offs_d = _tile(R0, HP, e, N, m, D, W, OVERLAP, MP, d0, BD)
            dm = (offs_d[None, :] < D) & (tl.arange(0, MP)[:, None] >= 0)
            a, c = _softmax(GATE, KV, APE, off, ape_off, mask, ok, dm)
            out = tl.where(ev[:, None], tl.sum(a * c, 1), 0.0)                  # [BE, BD]
        tl.store(OUT + e[:, None].to(tl.int64) * D + offs_d[None, :], out.to(OUT.dtype.element_ty),
                 mask=(e < N)[:, None] & (offs_d < D)[None, :])


@triton.autotune(**_BWD, key=_KEY)
@triton.jit
def _pool_bwd(KV, GATE, APE, R0, HP, DOUT, DKV, DGATE, DAPE, N, m, D, W, NK,
              OVERLAP: tl.constexpr, MP: tl.constexpr, BE: tl.constexpr, BD: tl.constexpr, NIT: tl.constexpr):
    d0 = tl.program_id(1) * BD
    r = tl.arange(0, MP)
    dape = tl.zeros([MP, BD], tl.float32)
    for it in range(NIT):
        e = (tl.program_id(0) * NIT + it) * BE + tl.arange(0, BE)
        off, ape_off, mask, ok, ev, offs_d = _tile(R0, HP, e, N, m, D, W, OVERLAP, MP, d0, BD)
        dm = (offs_d[None, :] < D) & (r[:, None] >= 0)
        a, c = _softmax(GATE, KV, APE, off, ape_off, mask, ok, dm)
        out = tl.sum(a * c, 1)
        dout = tl.load(DOUT + e[:, None].to(tl.int64) * D + offs_d[None, :],
                       mask=(e < N)[:, None] & (offs_d < D)[None, :], other=0.0).to(tl.float32)
        dc = a * dout[:, None, :]
        dz = dc * (c - out[:, None, :])
        tl.store(DKV + off, dc.to(DKV.dtype.element_ty), mask=mask)
        tl.store(DGATE + off, dz.to(DGATE.dtype.element_ty), mask=mask)
        dape += tl.sum(dz, 0)
    offs_d = d0 + tl.arange(0, BD)
    if OVERLAP:
        chan = offs_d[None, :] + (r[:, None] >= m).to(tl.int32) * D
        rmask = r < 2 * m
    else:
        chan = offs_d[None, :] + r[:, None] * 0
        rmask = r < m
    tl.store(DAPE + tl.program_id(0).to(tl.int64) * (m * W) + (r % m)[:, None] * W + chan, dape,
             mask=rmask[:, None] & (offs_d < D)[None, :])


@triton.jit
def _zero_free(POS, R0, HP, DKV, DGATE, T, N, m, D, W, first,
               OVERLAP: tl.constexpr, BT: tl.constexpr, BW: tl.constexpr):
    """Zeros where no slot owns the element. Token t's window closes at c = t + m-1 - pos%m (slot (c-first)//m):
    the element is owned iff that slot's current window covers t (HCA; CSA second half), or, CSA first half, iff
    the next window's slot (closing at c+m) has a previous window covering t -- the `_tile` rows, inverted."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    tmask = t < T
    p = tl.load(POS + t, mask=tmask, other=0)
    c = t + (m - 1) - p % m
    s = (c - first) // m
    okc = tmask & (c >= first) & (c < T)
    r0 = tl.load(R0 + s, mask=okc & (s < N), other=-1)
    own_cur = okc & (r0 >= 0) & (r0 <= t) & (t < r0 + m)
    ch = tl.program_id(1) * BW + tl.arange(0, BW)
    if OVERLAP:
        c2 = c + m
        s2 = (c2 - first) // m
        ok2 = tmask & (c2 >= first) & (c2 < T) & (s2 < N)
        r2 = tl.load(R0 + s2, mask=ok2, other=-1)
        h2 = tl.load(HP + s2, mask=ok2, other=0) != 0
        own_prev = ok2 & h2 & (r2 >= 0) & (r2 - m <= t) & (t < r2)
        own = tl.where(ch[None, :] < D, own_prev[:, None], own_cur[:, None])
    else:
        own = own_cur[:, None] & (ch[None, :] >= 0)
    free = tmask[:, None] & (ch[None, :] < W) & ~own
    off = t[:, None].to(tl.int64) * W + ch[None, :]
    zero = tl.zeros([BT, BW], tl.float32)
    tl.store(DKV + off, zero.to(DKV.dtype.element_ty), mask=free)
    tl.store(DGATE + off, zero.to(DGATE.dtype.element_ty), mask=free)


# ------------------------------------------------------------------------------------------- launch code
def _mp(m, overlap):
    return pow2(2 * m if overlap else m, lo=1)


def slot_meta(seg: torch.Tensor, pos: torch.Tensor, ratio: int, overlap: bool, first: int = 0):
    """(ends, entry_seg, j) [N] long as naive.entry_slots / compress_pool, and the kernels' r0, hp [N] int32."""
    T = seg.shape[0]
    N = naive.num_slots(T, ratio, first)
    dev = seg.device
    ends, eseg, ej = (torch.empty(N, dtype=torch.long, device=dev) for _ in range(3))
    r0, hp = torch.empty(N, dtype=torch.int32, device=dev), torch.empty(N, dtype=torch.int32, device=dev)
    if N > 0:
        BS = 8 if on_cpu(seg) else max(1, 4096 // pow2(ratio, lo=1))
        _slot_meta[(triton.cdiv(N, BS),)](seg.contiguous(), pos.contiguous(), ends, eseg, ej, r0, hp, T, N, ratio,
                                          first, OVERLAP=overlap, MQ=pow2(ratio, lo=1), BS=BS)
    return ends, eseg.to(seg.dtype), ej, r0, hp


def pool_forward(kv, gate, ape, r0, hp, ratio: int, overlap: bool):
    """kv, gate [T, W]; ape [m, W]; r0 / hp [N] int32 -> pooled [N, D] in kv's dtype (0 in empty slots)."""
    T, W = kv.shape
    D = W // 2 if overlap else W
    N = r0.shape[0]
    out = kv.new_empty(N, D)
    if N > 0:
        grid = lambda meta: (triton.cdiv(N, meta["BE"] * meta["NIT"]), triton.cdiv(D, meta["BD"]))
        _pool_fwd[grid](kv, gate, ape.float().contiguous(), r0, hp, out, N, ratio, D, W, N.bit_length(),
                        OVERLAP=overlap, MP=_mp(ratio, overlap))
    return out


def pool_backward(dout, kv, gate, ape, r0, hp, pos, ratio: int, overlap: bool, first: int):
    """-> (dkv, dgate [T, W] in their dtypes, dape [m, W] in ape's dtype); every element written once."""
    T, W = kv.shape
    D = W // 2 if overlap else W
    N = r0.shape[0]
    MP = _mp(ratio, overlap)
    dkv, dgate = torch.empty_like(kv), torch.empty_like(gate)
    cpu = on_cpu(kv)
    epp = 2 * 2 if cpu else _min_entries_per_program(MP, D)                 # cpu config: BE=2, NIT=2
    part = torch.empty(max(1, triton.cdiv(N, epp)), ratio, W, device=kv.device, dtype=torch.float32)
    used = 0
    if N > 0:
        grid = lambda meta: (triton.cdiv(N, meta["BE"] * meta["NIT"]), triton.cdiv(D, meta["BD"]))
        _pool_bwd[grid](kv, gate, ape.float().contiguous(), r0, hp, dout.contiguous(), dkv, dgate, part, N, ratio,
                        D, W, N.bit_length(), OVERLAP=overlap, MP=MP)
        used = triton.cdiv(N, tuned(_pool_bwd, "BE") * tuned(_pool_bwd, "NIT"))
    BT, BW = (8, 16) if cpu else (32, 128)
    _zero_free[(triton.cdiv(T, BT), triton.cdiv(W, BW))](pos.contiguous(), r0, hp, dkv, dgate, T, N, ratio, D, W,
                                                        first, OVERLAP=overlap, BT=BT, BW=BW)
    dape = part[:used].sum(0) if used else torch.zeros(ratio, W, device=kv.device, dtype=torch.float32)
    return dkv, dgate, dape.to(ape.dtype)


class _CompressPool(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kv, gate, ape, r0, hp, pos, ratio, overlap, first):
        kv, gate, ape = kv.contiguous(), gate.contiguous(), ape.contiguous()
        ctx.save_for_backward(kv, gate, ape, r0, hp, pos)
        ctx.cfg = (ratio, overlap, first)
        return pool_forward(kv, gate, ape, r0, hp, ratio, overlap)

    @staticmethod
    def backward(ctx, dout):
        kv, gate, ape, r0, hp, pos = ctx.saved_tensors
        ratio, overlap, first = ctx.cfg
        dkv, dgate, dape = pool_backward(dout, kv, gate, ape, r0, hp, pos, ratio, overlap, first)
        return dkv, dgate, dape, None, None, None, None, None, None


def compress_slots(seg: torch.Tensor, pos: torch.Tensor, ratio: int, overlap: bool, first: int = 0,
                   meta=None) -> naive.Slots:
    """`naive.Slots` from the `_slot_meta` kernel (op.py passes `meta`: dsv4::compress_slots_fwd)."""
    naive.check_ratio(ratio, "compress_slots")
    return naive.Slots(*(meta or slot_meta)(seg, pos, ratio, overlap, first), int(ratio), bool(overlap), int(first))


def compress_pool(kv: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, ratio: int, overlap: bool,
                  seg: torch.Tensor, pos: torch.Tensor, first: int = 0, meta=None, pool=None,
                  slots: naive.Slots | None = None):
    """Packed-stream pooling (same contract as `naive.compress_pool`): `_slot_meta` (unless `slots` are given,
    precomputed) then the in-place window kernel. op.py passes the custom ops (`meta`: dsv4::compress_slots_fwd,
    `pool`: dsv4::compress_pool_fwd)."""
    naive.check_args(kv, gate, ape, ratio, overlap, seg, pos)
    if slots is None:
        slots = compress_slots(seg, pos, ratio, overlap, first, meta)
    else:
        naive.check_slots(slots, kv.shape[0], ratio, overlap, first)
    ends, eseg, j, r0, hp = slots[:5]
    if seg.device.type == "cpu":                 # the halo check (a host sync: CPU tensors only, as in naive)
        naive.pool_rows(seg, pos, ends, eseg >= 0, j, ratio, overlap)
    out = (pool or _CompressPool.apply)(kv, gate, ape, r0, hp, pos, ratio, overlap, first)
    return out, eseg, j, ends
