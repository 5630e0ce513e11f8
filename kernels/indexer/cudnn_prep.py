"""The argument preparation and output mask of backend "triton+cudnn" (kernels/indexer/cudnn_fwd.py `forward`),
on CUDA tensors without the [Tq, N] visibility mask and without the generic quantiser's chain of PyTorch ops:

  causal_offset_meta  q_causal_offsets [1] int32 = max(0, max_t(ratio * hi[t] - t - 1)), hi[t] = 1 + the last
                      entry visible to query t (0: none), from the per-query / per-entry metadata: one Triton
                      program per BT queries scans all N entries' (seg, j) and keeps the largest visible index
                      (O(Tq N) integer compares on registers, O(N Tq / BT + Tq) bytes read, no [Tq, N] tensor), then
                      one atomic max per program into the zero-initialised offset (on the device, no host sync).
                      Exact for ANY entry order: the kernels of kernels/_varlen.py assume stream order (documents in
                      increasing id, j increasing inside one), test_cudnn_fwd.py also scores permuted entries.
  mask_scores_        I[t, n] = -inf IN PLACE wherever naive.causal_entry_mask says not visible: one pass of
                      [BT, BN] tiles that only writes (I is never read, so visible scores -- NaN, -inf included --
                      are untouched).
  fp8_split           (e4m3, fp32 descale per row) of x [..., 128] = quantize(x, "e4m3", (1, 128), "ue8m0") by the
                      fused Triton FP8 quantiser (kernels/quant/triton.py fp8_quantize, 1x128 tiles: one tile is
                      one row at cI = 128), bit-identical to the exact quantiser (kernels/quant/test_quant.py).
Visibility (naive.causal_entry_mask): entry_seg[n] == seg_q[t] >= 0 and entry_j[n] < floor((pos_q[t] + 1) / ratio).
CPU tensors (and use_triton=False) take the plain PyTorch path, the mask-based code these replace (the reference).
Triton is imported with the module, as by kernels/indexer/topk.py: backend "triton+cudnn" (its only user, through
cudnn_fwd.py) resolves only where Triton is installed (kernels/__init__.py `_resolve`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.kernels.quant import triton as QT
from dsv4.kernels.quant.naive import quantize

from . import naive

BT, BN = 64, 128                  # queries x entries a tile (both kernels)
FP8_DTYPES = (torch.float32, torch.bfloat16, torch.float16)     # what the Triton quantiser reads


# ------------------------------------------------------------------------------------------- PyTorch (reference)
def causal_offset(mask: torch.Tensor, ratio: int) -> torch.Tensor:
    """mask [Tq, N] bool (visible) -> q_causal_offsets [1] int32: the least off >= 0 whose cuDNN window
    (off + t + 1) // ratio covers every visible entry of every query t (cudnn_fwd.py's module docstring)."""
    Tq, N = mask.shape
    last = N - 1 - mask.flip(1).to(torch.uint8).argmax(1)                          # the last visible entry
    hi = torch.where(mask.any(1), last + 1, 0)                                     # [Tq]
    need = ratio * hi - torch.arange(1, Tq + 1, device=mask.device)
    return need.amax().clamp_min(0).to(torch.int32).reshape(1)


# ------------------------------------------------------------------------------------------------------ Triton
@triton.jit
def _floor_div(a, r):
    """floor(a / r) for r > 0 (integer `//` is not floor division for negative a in Triton)."""
    return tl.where(a >= 0, a // r, -((r - 1 - a) // r))


@triton.jit
def _queries(SQ, PQ, t, tm, ratio):
    """(seg_q, floor((pos_q + 1) / ratio)) [BT] of queries t; out of range: seg -1 (sees nothing)."""
    sq = tl.load(SQ + t, mask=tm, other=-1)
    return sq, _floor_div(tl.load(PQ + t, mask=tm, other=0) + 1, ratio)


@triton.jit
def _visible(sq, jq, ES, EJ, n, nm):
    """[BT, BN] bool: naive.causal_entry_mask of queries (sq, jq) [BT] and entries n [BN]."""
    es = tl.load(ES + n, mask=nm, other=-1)
    ej = tl.load(EJ + n, mask=nm, other=0)
    return (es[None, :] == sq[:, None]) & (sq[:, None] >= 0) & (ej[None, :] < jq[:, None]) & nm[None, :]


@triton.jit
def _offset_kernel(OFF, SQ, PQ, ES, EJ, Tq, N, ratio, BT: tl.constexpr, BN: tl.constexpr):
    t = tl.program_id(0) * BT + tl.arange(0, BT)                                  # [BT] queries
    tm = t < Tq
    sq, jq = _queries(SQ, PQ, t, tm, ratio)
    hi = tl.zeros([BT], dtype=tl.int32)                                           # 1 + last visible entry (0: none)
    for n0 in range(0, N, BN):
        n = n0 + tl.arange(0, BN)                                                 # [BN] entries
        vis = _visible(sq, jq, ES, EJ, n, n < N)                                  # [BT, BN]
        hi = tl.maximum(hi, tl.max(tl.where(vis, n[None, :] + 1, 0), axis=1))
    need = tl.where(tm, ratio * hi - t - 1, 0)                                    # [BT]
    tl.atomic_max(OFF, tl.max(need, axis=0))                                      # OFF starts at 0: the clamp


@triton.jit
def _mask_kernel(I, SQ, PQ, ES, EJ, Tq, N, s_t, s_n, ratio, BT: tl.constexpr, BN: tl.constexpr):
    t = tl.program_id(0) * BT + tl.arange(0, BT)                                  # [BT] queries
    n = tl.program_id(1) * BN + tl.arange(0, BN)                                  # [BN] entries
    tm, nm = t < Tq, n < N
    sq, jq = _queries(SQ, PQ, t, tm, ratio)
    hide = tm[:, None] & nm[None, :] & ~_visible(sq, jq, ES, EJ, n, nm)           # [BT, BN]
    ptr = I + t[:, None].to(tl.int64) * s_t + n[None, :].to(tl.int64) * s_n
    tl.store(ptr, tl.full([BT, BN], float("-inf"), tl.float32), mask=hide)


# ------------------------------------------------------------------------------------------------- the calls
def _triton(x: torch.Tensor, use_triton: bool | None) -> bool:
    return x.is_cuda if use_triton is None else use_triton


def causal_offset_meta(seg_q, pos_q, entry_seg, entry_j, ratio: int, use_triton: bool | None = None) -> torch.Tensor:
    """seg_q, pos_q [Tq], entry_seg, entry_j [N] -> q_causal_offsets [1] int32 == causal_offset(causal_entry_mask)
    (module docstring). use_triton None: Triton on CUDA tensors, PyTorch (the mask) otherwise."""
    if not _triton(seg_q, use_triton):
        return causal_offset(naive.causal_entry_mask(seg_q, pos_q, entry_seg, entry_j, ratio), ratio)
    Tq, N = seg_q.shape[0], entry_seg.shape[0]
    off = torch.zeros(1, dtype=torch.int32, device=seg_q.device)
    _offset_kernel[(triton.cdiv(Tq, BT),)](off, seg_q, pos_q, entry_seg, entry_j, Tq, N, int(ratio), BT=BT, BN=BN)
    return off


def mask_scores_(I: torch.Tensor, seg_q, pos_q, entry_seg, entry_j, ratio: int,
                 use_triton: bool | None = None) -> torch.Tensor:
    """I [Tq, N] -> I with -inf wherever naive.causal_entry_mask is False, in place (visible scores untouched)."""
    if not _triton(I, use_triton):
        return I.masked_fill_(~naive.causal_entry_mask(seg_q, pos_q, entry_seg, entry_j, ratio), float("-inf"))
    Tq, N = I.shape
    if Tq * N == 0:
        return I
    grid = (triton.cdiv(Tq, BT), triton.cdiv(N, BN))
    _mask_kernel[grid](I, seg_q, pos_q, entry_seg, entry_j, Tq, N, I.stride(0), I.stride(1), int(ratio),
                       BT=BT, BN=BN)
    return I


def fp8_split(x: torch.Tensor, use_triton: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., c] (qk_fake_quant's "fp8" features: e4m3 values times one power-of-two scale per row) -> (e4m3
    [..., c] torch.float8_e4m3fn, descale [...] fp32) with e4m3 * descale == x exactly for such x (a general x is
    quantised: e4m3, ue8m0 scale per row, DeepSeek's rule). The Triton quantiser at c = 128 (its tile) and fp32 /
    bf16 / fp16 x; `quantize` (the same bits) otherwise."""
    c = x.shape[-1]
    if _triton(x, use_triton) and c == QT.TILE and x.dtype in FP8_DTYPES:
        q, s = QT.fp8_quantize(x.detach().reshape(-1, c), "e4m3", (1, c), "ue8m0")   # [R, c] e4m3, [R, 1]
        return q.view(x.shape), s.view(x.shape[:-1])
    qt = quantize(x.detach(), "e4m3", (1, c), "ue8m0")
    return qt.fp8(), qt.scale[..., 0].float()
