"""Exact top-k of score rows by radix select (Triton): the result of `naive.indexer_topk` (a stable descending
sort, first k kept), without sorting the N entries of a row.

The Triton backend's top-k (kernels/__init__.py OPS -> `op.indexer_topk`, a custom op under torch.compile). It
replaced a chunked stable sort (naive's algorithm), whose CUB segmented radix sorts were 15% / 32% of a proxy
step's kernels at 64K / 128K tokens on the H200 (harness/perf_notes.md); `dsv4 bench kernels --only indexer` times
both (`topk_rows`: radix vs the sort, same process).

Order key: fp32 score -> uint32 key with the same order (sign bit flipped for >= 0, all bits flipped for < 0);
-0.0 is first made +0.0 (torch.sort compares them equal, so they tie and keep index order) and every NaN gets
key 0xFFFFFFFF (above +inf, all NaNs equal: torch.sort's descending order puts NaNs first, in index order; the
tests check it), -inf is the smallest key of a real score (0x007FFFFF).

One program per row, the row read tile by tile (BLOCK entries) in every pass:
  1. select (ceil(32 / BITS) passes, BITS = 8: 4): a histogram (`tl.histogram`, 2^BITS bins, masked to the
     entries whose higher key bits equal the prefix found so far) of the next BITS key bits; the chosen bin is
     the highest one with >= `need` live entries at or above it, and `need` drops by the entries above it. After
     the last pass the prefix is the k-th largest key t exactly, and `need` is how many of the entries with
     key == t belong to the top k (all entries with key > t do). -inf entries stay out of the histograms (a
     causal row's -inf tail would hammer one bin): the first pass counts them, and when fewer than k entries are
     finite, t = -inf and the other select passes are skipped.
  2. collect (1 pass, stops once the row's k picks are found): entries with key > t, then the first `need`
     entries with key == t in index order (running offsets from `tl.cumsum` per tile), written with their
     order keys (int64) to [rows, k] buffers: index order within each group, the key == t group last.
  3. order (PyTorch, [rows, k] only): a stable descending sort of the k picked KEYS. Equal keys are in index
     order in the buffer, so this is the stable sort's order of the full row; -inf picks -> -1. Not a sort of
     the scores: CUDA's float sort does not keep NaNs of either sign equal (H200, torch 2.11: -nan ranked below
     +nan, which broke the index order of NaN picks), the integer keys hold the order the selection used.
Bytes: (ceil(32 / BITS) + 1) reads of the row = 5 x 4N B at BITS = 8 (the collect pass stops once its k picks
are found: a causal row's -inf tail is not read), plus 16k B of picks written (int64 index and key): <= 2.7 GB
of reads at [4096, 32768] fp32, from L2 in part (a program re-reads its 128 KB row pass after pass). The sort it replaces
(naive, a segmented radix sort of the full rows) reads and writes the fp32 keys and int64 indices in each of its
4 passes, roughly 24N B a pass: ~13 GB at that shape. GPU speed is unmeasured here: `dsv4 bench kernels --only
indexer` times both (`topk_rows`); the GPU configs (BLOCK, BITS, num_warps) are autotuned per N.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.kernels._triton_util import configs

NINF_KEY = tl.constexpr(0x007FFFFF)                     # the order key of -inf
SNINF_KEY = tl.constexpr(0x007FFFFF - 0x80000000)       # the same, sign bit flipped, as a signed int32

# H200 at a4eb668 (4 configs, the first 4 below): BLOCK 2048 / BITS 8 / 8 warps won at N = 4K, 16K and 32K
_CONFIGS = configs(gpu=[dict(BLOCK=2048, BITS=8, num_warps=8), dict(BLOCK=4096, BITS=8, num_warps=8),
                        dict(BLOCK=4096, BITS=8, num_warps=16), dict(BLOCK=4096, BITS=5, num_warps=8),
                        dict(BLOCK=1024, BITS=8, num_warps=4), dict(BLOCK=2048, BITS=11, num_warps=8),
                        dict(BLOCK=4096, BITS=11, num_warps=16)],
                   cpu=dict(BLOCK=32, BITS=8, num_warps=1))


@triton.jit
def _keys(X, offs, N):
    """[BLOCK] scores at offs (fp32 / bf16 / fp16, widened to fp32) -> (uint32 order keys, fp32 scores); entries
    past N get key 0 (below any score)."""
    x = tl.load(X + offs, mask=offs < N, other=0.0).to(tl.float32)               # bf16 / fp16: exact widening
    bits = tl.where(x == 0.0, 0.0, x).to(tl.uint32, bitcast=True)               # -0.0 -> +0.0
    key = tl.where((bits & 0x80000000) != 0, bits ^ 0xFFFFFFFF, bits | 0x80000000)
    key = tl.where(x != x, 0xFFFFFFFF, key)                                        # NaN: above +inf
    return tl.where(offs < N, key, 0), x


@triton.jit
def _select_pass(X, N, prefix, need, HI: tl.constexpr, LO: tl.constexpr, BLOCK: tl.constexpr, BINS: tl.constexpr):
    """One select pass over key bits [LO, HI) of the entries other than -inf -> (prefix with those bits
    appended, need, the row's count of -inf entries (first pass only, else 0))."""
    lane = tl.arange(0, BLOCK)
    hist = tl.zeros([BINS], tl.int32)
    n_ninf = tl.zeros([BLOCK], tl.int32)
    for s in range(0, N, BLOCK):
        key, _ = _keys(X, s + lane, N)
        digit = ((key >> LO) & ((1 << (HI - LO)) - 1)).to(tl.int32)
        live = ((s + lane) < N) & (key != NINF_KEY)
        if HI < 32:
            live &= (key >> HI) == prefix                                 # entries still in the running
        else:
            n_ninf += (((s + lane) < N) & (key == NINF_KEY)).to(tl.int32)
        hist += tl.histogram(digit, BINS, mask=live)
    ge = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist                     # [BINS] live entries in bins >= b
    b = tl.sum((ge >= need).to(tl.int32), 0) - 1                         # ge is non-increasing
    need -= tl.sum(tl.where(tl.arange(0, BINS) == b, ge - hist, 0), 0)
    return (prefix << (HI - LO)) | b.to(tl.uint32), need, tl.sum(n_ninf, 0)


@triton.jit
def _radix_topk(I, OUT_IDX, OUT_KEY, N, kk, si, so, BLOCK: tl.constexpr, BITS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    X = I + row * si
    lane = tl.arange(0, BLOCK)
    # 1. select. prefix: the high key bits of the k-th largest found so far; need: how many entries matching it
    # are picked. -inf entries never enter a histogram (a row's -inf tail would be one hot bin): counted in the
    # first pass, they are the threshold when fewer than k entries are finite, else below it.
    prefix, need, n_ninf = _select_pass(X, N, tl.zeros([], tl.uint32), kk, 32, 32 - BITS, BLOCK, 1 << BITS)
    if N - n_ninf < kk:
        prefix = tl.full([], NINF_KEY, tl.uint32)
        need = kk - (N - n_ninf)
    else:
        for p in tl.static_range(1, (32 + BITS - 1) // BITS):
            prefix, need, _ = _select_pass(X, N, prefix, need, 32 - p * BITS,
                                           (32 - (p + 1) * BITS) * (32 > (p + 1) * BITS), BLOCK, 1 << BITS)
    n_gt = kk - need                                    # entries with key > t (all picked)
    got_gt, got_eq = 0, 0
    s = 0
    while (s < N) & ((got_gt < n_gt) | (got_eq < need)):                             # 2. collect
        offs = s + lane
        key, x = _keys(X, offs, N)
        gt = key > prefix
        eq = (key == prefix) & (offs < N)
        c_gt = tl.cumsum(gt.to(tl.int32), 0)
        c_eq = tl.cumsum(eq.to(tl.int32), 0)
        pos = tl.where(gt, got_gt + c_gt - 1, n_gt + got_eq + c_eq - 1)
        keep = gt | (eq & (got_eq + c_eq <= need))
        tl.store(OUT_IDX + row * so + pos, offs.to(tl.int64), mask=keep)
        tl.store(OUT_KEY + row * so + pos, key.to(tl.int64), mask=keep)
        got_gt += tl.sum(gt.to(tl.int32), 0)
        got_eq += tl.sum(eq.to(tl.int32), 0)
        s += BLOCK


_radix_topk_tuned = triton.autotune(**_CONFIGS, key=["N"])(_radix_topk)


def radix_topk(I: torch.Tensor, k: int, cfg: dict | None = None) -> torch.Tensor:
    """I [R, N] fp32 / bf16 / fp16 (CUDA, or CPU under TRITON_INTERPRET=1) -> idx [R, min(k, N)] long ==
    `naive.indexer_topk`. `cfg` = dict(BLOCK=, BITS=, num_warps=) bypasses the autotuner (tests)."""
    if I.dtype not in (torch.float32, torch.bfloat16, torch.float16) or I.dim() != 2:
        raise ValueError(f"radix_topk: I must be a 2-D fp32 / bf16 / fp16 tensor, got {I.dtype} {tuple(I.shape)}")
    I = I.detach()
    if I.stride(-1) != 1:
        I = I.contiguous()
    R, N = I.shape
    kk = min(k, N)
    idx = torch.empty(R, kk, dtype=torch.long, device=I.device)
    if R == 0 or kk == 0:
        return idx
    key = torch.empty(R, kk, dtype=torch.int64, device=I.device)
    if cfg is None:
        _radix_topk_tuned[(R,)](I, idx, key, N, kk, I.stride(0), kk)
    else:
        _radix_topk[(R,)](I, idx, key, N, kk, I.stride(0), kk, **cfg)
    key, order = torch.sort(key, dim=-1, descending=True, stable=True)        # 3. [R, k]: the picks in order
    idx = idx.gather(-1, order)
    return idx.masked_fill_(key == NINF_KEY.value, -1)


# ------------------------------------------------------------------ one row in registers (rows of <= ROW_MAX_N)
# For rows that fit one tile (the indexer's rows up to 64K tokens: N = S / 4 <= 16384), the row is read once and
# everything happens on registers: no select passes over memory, no [R, k] key buffer, no PyTorch sort after.
#   1. t = the kk-th largest order key, bit by bit from the top: the largest t with #(key >= t) >= kk
#      (32 compare-and-count reductions over the row in registers). Entries past N have key 0, below every score.
#   2. picks: keys > t, then the first `need` keys == t in index order, as before; with fewer than kk finite
#      entries t is the -inf key and the first -inf entries fill the row, as in the stable sort. One `tl.cumsum`
#      of (gt << 16) | eq counts both (each count <= N <= 16384 < 2^16); a pick's slot = the > t entries up to it
#      + min(the == t entries up to it, need) - 1.
#   3. order: each pick as one int64 c = (signed key << 32) | (2^31 - 1 - index) -- unique, and c's descending
#      order is the stable sort's (higher key first, then lower index); the kk picks are stored compacted to the
#      output row, read back as one [KP] vector (after a CTA barrier), sorted on registers (`tl.sort`, bitonic),
#      decoded (index, -1 for -inf picks) and stored over the same row.
_ROW_CONFIGS = configs(gpu=[dict(num_warps=4), dict(num_warps=8), dict(num_warps=16)], cpu=dict(num_warps=1))
ROW_MAX_N = 16384                                     # 16K fp32 keys a program: 32 a thread at 16 warps


@triton.jit
def _row_topk(I, OUT, N, kk, si, so, BLOCK: tl.constexpr, KP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    key, _ = _keys(I + row * si, offs, N)                                      # [BLOCK] uint32, 0 past N
    t = tl.zeros([], tl.uint32)                                                 # 1. the kk-th largest key
    for b in tl.static_range(31, -1, -1):
        cand = t | tl.full([], 1 << b, tl.uint32)
        t = tl.where(tl.sum((key >= cand).to(tl.int32), 0) >= kk, cand, t)
    gt = key > t                                                                # 2. the picks
    eq = key == t
    cnt = tl.cumsum((gt.to(tl.int32) << 16) | eq.to(tl.int32), 0)              # [BLOCK] (#gt << 16) | #eq so far
    need = kk - (tl.max(cnt, 0) >> 16)                                          # the == t picks (cnt's last)
    n_eq = cnt & 0xFFFF
    keep = gt | (eq & (n_eq <= need))
    pos = (cnt >> 16) + tl.minimum(n_eq, need) - 1                              # picks before + this one - 1
    skey = (key ^ 0x80000000).to(tl.int32, bitcast=True).to(tl.int64)          # 3. order: c, unique
    c = (skey << 32) | (0x7FFFFFFF - offs).to(tl.int64)
    dst = OUT + row * so
    tl.store(dst + pos, c, mask=keep)
    tl.debug_barrier()                                                          # the row's stores -> its loads
    ks = tl.arange(0, KP)
    c = tl.load(dst + ks, mask=ks < kk, other=-9223372036854775807 - 1, cache_modifier=".cg")
    c = tl.sort(c, descending=True)                                             # [KP] the picks in order
    tl.debug_barrier()                                                          # every load before the stores
    idx = 0x7FFFFFFF - (c & 0xFFFFFFFF)
    ninf = (c >> 32) == SNINF_KEY                                              # (arithmetic shift)
    tl.store(dst + ks, tl.where(ninf, -1, idx), mask=ks < kk)


_row_topk_tuned = triton.autotune(**_ROW_CONFIGS, key=["BLOCK", "KP"])(_row_topk)


def row_topk(I: torch.Tensor, k: int, cfg: dict | None = None) -> torch.Tensor:
    """I [R, N] fp32 / bf16 / fp16, N <= ROW_MAX_N (CUDA, or CPU under TRITON_INTERPRET=1) -> idx [R, min(k, N)]
    long == `naive.indexer_topk`, one program a row with the row on registers. `cfg` = dict(num_warps=) bypasses
    the autotuner (tests)."""
    if I.dtype not in (torch.float32, torch.bfloat16, torch.float16) or I.dim() != 2:
        raise ValueError(f"row_topk: I must be a 2-D fp32 / bf16 / fp16 tensor, got {I.dtype} {tuple(I.shape)}")
    R, N = I.shape
    if N > ROW_MAX_N:
        raise ValueError(f"row_topk: rows of at most {ROW_MAX_N} entries, got {N}")
    I = I.detach()
    if I.stride(-1) != 1:
        I = I.contiguous()
    kk = min(k, N)
    idx = torch.empty(R, kk, dtype=torch.long, device=I.device)
    if R == 0 or kk == 0:
        return idx
    BLOCK, KP = triton.next_power_of_2(N), triton.next_power_of_2(kk)
    kern = _row_topk_tuned if cfg is None else _row_topk
    kern[(R,)](I, idx, N, kk, I.stride(0), kk, BLOCK=BLOCK, KP=KP, **(cfg or {}))
    return idx


# The Triton backend's choice (kernels/indexer/op.py, triton.indexer_select): rows of <= ROW_MAX_N entries take
# `row_topk`, longer rows the radix select. Until 2026-12-04 rows of <= 4096 entries took naive's stable sort (H200
# at a4eb668, [4096, N] fp32, k = 512: N = 4K sort 0.57 ms vs radix 0.61; N = 16K 4.9 vs 1.9; 32K 9.7 vs 3.6;
# `dsv4 bench kernels --only indexer`, topk_rows, which times all three). Same result every way (test_topk.py).
SORT_MAX_N = 0


def indexer_topk(I: torch.Tensor, k: int, chunk: int = 4096, sort_max_n: int = 0, row_max_n: int = 0) -> torch.Tensor:
    """I [..., N] -> idx [..., min(k, N)] long == `naive.indexer_topk` (ties lower index first, -1 = -inf pick,
    NaN above +inf): rows of N <= `row_max_n` entries by `row_topk` (all rows in one launch, the row on registers),
    else per chunk of rows (bounding the [chunk, k] buffers, or the sort's workspace) by naive's sort when
    N <= `sort_max_n`, else by `radix_topk`. The backend passes ROW_MAX_N / SORT_MAX_N. fp32 / bf16 / fp16 scores
    (the last two widened exactly in the kernel, no fp32 copy); fp64 rows take naive's sort (a cast to fp32 could
    merge distinct scores)."""
    from dsv4.kernels.indexer import naive
    if k < 1:
        raise ValueError(f"indexer_topk: k must be >= 1, got {k}")
    if I.dtype == torch.float64:
        return naive.indexer_topk(I, k)
    lead, N = I.shape[:-1], I.shape[-1]
    kk = min(k, N)
    I = I.detach().reshape(-1, N)                                              # [rows, N]
    if kk == 0 or I.shape[0] == 0:
        return torch.empty(*lead, kk, dtype=torch.long, device=I.device)
    if N <= min(row_max_n, ROW_MAX_N):
        return row_topk(I, kk).view(*lead, kk)
    top = naive.indexer_topk if N <= sort_max_n else radix_topk
    return torch.cat([top(I[s:s + chunk], kk) for s in range(0, I.shape[0], chunk)], 0).view(*lead, kk)
