"""Lightning-indexer scoring and top-k (spec §7.2) in Triton.

`indexer_scores` (same contract as `naive.indexer_scores`):
    I[t,b,j] = Σ_h (w[t,b,h]·nI^-1/2) · ReLU(qI[t,b,h] · kI[j,b]) · cI^-1/2,   -inf where j >= floor((t+1)/ratio)
Forward: one program per (block of BT queries, block of BJ entries, batch); the kI tile stays in registers
while the loop over the nI heads does [BT, cI]·[cI, BJ] tensor-core products with the ReLU-weighted head sum
as the epilogue, so the [S, nI, T] per-head logits never exist; tiles entirely above the causal limit are
written as -inf without any product. Backward: two deterministic kernels that recompute the per-head logits
(dq, dw per (query block, head group); partial dk per (entry block, head group), summed by PyTorch), no atomics.

`indexer_topk` (same contract as `naive.indexer_topk`): a stable descending sort per row (= naive's algorithm,
ties lower index first), in chunks of rows to bound the sort's workspace. NOT a streaming top-k: it needs the
dense score rows (an int64 (score, -index) key + torch.topk was tried: 2.4x slower on the H200).
`indexer_select` chains the two per chunk of query rows, so the full [S, B, T] score matrix is never held:
peak memory O(chunk · T) instead of O(S · T).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.kernels._triton_util import configs, on_cpu, pow2

from . import naive

_FWD_CONFIGS = configs(gpu=[dict(BT=64, BJ=64, num_warps=4, num_stages=3), dict(BT=128, BJ=64, num_warps=8, num_stages=3)],
                       cpu=dict(BT=16, BJ=16))
_BWD_CONFIGS = configs(gpu=[dict(BT=64, BJ=64, num_warps=4, num_stages=2)], cpu=dict(BT=16, BJ=16))


@triton.autotune(**_FWD_CONFIGS, key=["NH", "BC"])
@triton.jit
def _scores_fwd(Q, K, Wt, I, S, T, NH, C, ratio, coef, t_off,
                sq_s, sq_b, sq_h, sk_t, sk_b, sw_s, sw_b, si_s, si_b,
                BC: tl.constexpr, PREC: tl.constexpr, BT: tl.constexpr, BJ: tl.constexpr):
    offs_t = tl.program_id(0) * BT + tl.arange(0, BT)
    offs_j = tl.program_id(1) * BJ + tl.arange(0, BJ)
    b = tl.program_id(2).to(tl.int64)
    offs_c = tl.arange(0, BC)
    tmask, jmask, cmask = offs_t < S, offs_j < T, offs_c < C
    limit = (offs_t + t_off + 1) // ratio                       # entries j < limit are complete
    out_off = offs_t[:, None].to(tl.int64) * si_s + b * si_b + offs_j[None, :]
    omask = tmask[:, None] & jmask[None, :]
    last_t = tl.minimum(tl.program_id(0) * BT + BT, S) - 1
    if tl.program_id(1) * BJ >= (last_t + t_off + 1) // ratio:         # whole tile above the causal limit
        tl.store(I + out_off, tl.full([BT, BJ], float("-inf"), tl.float32), mask=omask)
    else:
        k = tl.load(K + offs_j[:, None] * sk_t + b * sk_b + offs_c[None, :], mask=jmask[:, None] & cmask[None, :],
                    other=0.0)
        acc = tl.zeros([BT, BJ], tl.float32)
        q_ptr = Q + offs_t[:, None].to(tl.int64) * sq_s + b * sq_b + offs_c[None, :]
        w_ptr = Wt + offs_t.to(tl.int64) * sw_s + b * sw_b
        for h in range(0, NH):
            q = tl.load(q_ptr + h * sq_h, mask=tmask[:, None] & cmask[None, :], other=0.0)
            wh = tl.load(w_ptr + h, mask=tmask, other=0.0).to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=PREC)                          # [BT, BJ]
            acc += tl.maximum(s, 0.0) * wh[:, None]
        acc = tl.where(offs_j[None, :] < limit[:, None], acc * coef, float("-inf"))
        tl.store(I + out_off, acc, mask=omask)


@triton.autotune(**_BWD_CONFIGS, key=["NH", "BC"])
@triton.jit
def _scores_bwd_dq(Q, K, Wt, DI, DQ, DW, S, T, NH, C, ratio, coef, HPP,
                   sq_s, sq_b, sq_h, sk_t, sk_b, sw_s, sw_b, si_s, si_b,
                   BC: tl.constexpr, PREC: tl.constexpr, BT: tl.constexpr, BJ: tl.constexpr):
    # grid (query blocks, batch, head groups of HPP heads): dq and dw of a head need no cross-program sum
    offs_t = tl.program_id(0) * BT + tl.arange(0, BT)
    b = tl.program_id(1).to(tl.int64)
    offs_c = tl.arange(0, BC)
    tmask, cmask = offs_t < S, offs_c < C
    tc = tmask[:, None] & cmask[None, :]
    limit = (offs_t + 1) // ratio
    jend = tl.minimum((tl.minimum(tl.program_id(0) * BT + BT, S)) // ratio, T)   # entries any row can see
    q_off = offs_t[:, None].to(tl.int64) * sq_s + b * sq_b + offs_c[None, :]
    w_off = offs_t.to(tl.int64) * sw_s + b * sw_b
    for h in range(tl.program_id(2) * HPP, tl.minimum(tl.program_id(2) * HPP + HPP, NH)):
        q = tl.load(Q + q_off + h * sq_h, mask=tc, other=0.0)
        wh = tl.load(Wt + w_off + h, mask=tmask, other=0.0).to(tl.float32)
        dq = tl.zeros([BT, BC], tl.float32)
        dw = tl.zeros([BT], tl.float32)
        for j0 in range(0, jend, BJ):
            offs_j = j0 + tl.arange(0, BJ)
            k = tl.load(K + offs_j[:, None] * sk_t + b * sk_b + offs_c[None, :],
                        mask=(offs_j[:, None] < T) & cmask[None, :], other=0.0)
            g = tl.load(DI + offs_t[:, None].to(tl.int64) * si_s + b * si_b + offs_j[None, :],
                        mask=tmask[:, None] & (offs_j[None, :] < limit[:, None]), other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PREC)
            dw += tl.sum(g * tl.maximum(s, 0.0), 1)
            ds = tl.where(s > 0, g * wh[:, None], 0.0)
            dq += tl.dot(ds.to(k.dtype), k, input_precision=PREC)
        tl.store(DQ + q_off + h * sq_h, (dq * coef).to(DQ.dtype.element_ty), mask=tc)
        tl.store(DW + w_off + h, (dw * coef).to(DW.dtype.element_ty), mask=tmask)


@triton.autotune(**_BWD_CONFIGS, key=["NH", "BC"])
@triton.jit
def _scores_bwd_dk(Q, K, Wt, DI, DK, S, T, NH, C, ratio, coef, HPP,
                   sq_s, sq_b, sq_h, sk_t, sk_b, sw_s, sw_b, si_s, si_b,
                   BC: tl.constexpr, PREC: tl.constexpr, BT: tl.constexpr, BJ: tl.constexpr):
    # grid (entry blocks, batch, head groups): each head group writes its partial dk to DK[group] (summed after)
    offs_j = tl.program_id(0) * BJ + tl.arange(0, BJ)
    b = tl.program_id(1).to(tl.int64)
    offs_c = tl.arange(0, BC)
    jmask, cmask = offs_j < T, offs_c < C
    k_off = offs_j[:, None] * sk_t + b * sk_b + offs_c[None, :]
    k = tl.load(K + k_off, mask=jmask[:, None] & cmask[None, :], other=0.0)
    dk = tl.zeros([BJ, BC], tl.float32)
    t_lo = (tl.program_id(0) * BJ + 1) * ratio - 1             # first query that sees entry j0
    t_lo = (t_lo // BT) * BT
    for h in range(tl.program_id(2) * HPP, tl.minimum(tl.program_id(2) * HPP + HPP, NH)):
        for t0 in range(t_lo, S, BT):
            offs_t = t0 + tl.arange(0, BT)
            tmask = offs_t < S
            q = tl.load(Q + offs_t[:, None].to(tl.int64) * sq_s + b * sq_b + h * sq_h + offs_c[None, :],
                        mask=tmask[:, None] & cmask[None, :], other=0.0)
            wh = tl.load(Wt + offs_t.to(tl.int64) * sw_s + b * sw_b + h, mask=tmask, other=0.0).to(tl.float32)
            g = tl.load(DI + offs_t[:, None].to(tl.int64) * si_s + b * si_b + offs_j[None, :],
                        mask=tmask[:, None] & jmask[None, :] & (offs_j[None, :] < ((offs_t + 1) // ratio)[:, None]),
                        other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PREC)                          # [BT, BJ]
            ds = tl.where(s > 0, g * wh[:, None], 0.0)
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PREC)
    tl.store(DK + tl.program_id(2).to(tl.int64) * (T * sk_t) + k_off, dk * coef, mask=jmask[:, None] & cmask[None, :])


def _prec(x):
    """fp32 inputs: exact fp32 products ("ieee"); bf16: tensor cores (flag ignored)."""
    return "ieee" if x.dtype in (torch.float32, torch.float64) else "tf32"


def _strides(q, k, w, i):
    return (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), w.stride(0), w.stride(1),
            i.stride(0), i.stride(1))


def _launch_fwd(qI, kI, w, ratio, t_off):
    """Scores of query rows at positions t_off .. t_off+S-1 -> [S, B, T] fp32."""
    qI, kI, w = qI.contiguous(), kI.contiguous(), w.contiguous()
    S, B, nI, cI = qI.shape
    T = kI.shape[0]
    I = torch.empty(S, B, T, device=qI.device, dtype=torch.float32)
    if S and T:
        grid = lambda meta: (triton.cdiv(S, meta["BT"]), triton.cdiv(T, meta["BJ"]), B)
        _scores_fwd[grid](qI, kI, w, I, S, T, nI, cI, ratio, nI ** -0.5 * cI ** -0.5, t_off,
                          *_strides(qI, kI, w, I), BC=pow2(cI), PREC=_prec(qI))
    return I


class _IndexerScores(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qI, kI, w, ratio):
        qI, kI, w = qI.contiguous(), kI.contiguous(), w.contiguous()
        I = _launch_fwd(qI, kI, w, ratio, 0)
        ctx.save_for_backward(qI, kI, w)
        ctx.cfg = (ratio, qI.shape[2] ** -0.5 * qI.shape[3] ** -0.5)
        return I

    @staticmethod
    def backward(ctx, dI):
        qI, kI, w = ctx.saved_tensors
        ratio, coef = ctx.cfg
        dI = dI.contiguous()
        S, B, nI, cI = qI.shape
        T = kI.shape[0]
        dq, dk, dw = torch.zeros_like(qI), torch.zeros_like(kI), torch.zeros_like(w)
        if S and T:
            st = _strides(qI, kI, w, dI)
            hpp = 2 if on_cpu(qI) else 8                       # heads per program (CPU tests: exercise the split)
            ng = triton.cdiv(nI, hpp)
            _scores_bwd_dq[lambda meta: (triton.cdiv(S, meta["BT"]), B, ng)](
                qI, kI, w, dI, dq, dw, S, T, nI, cI, ratio, coef, hpp, *st, BC=pow2(cI), PREC=_prec(qI))
            dk_part = torch.empty(ng, T, B, cI, device=kI.device, dtype=torch.float32)   # kI is contiguous
            _scores_bwd_dk[lambda meta: (triton.cdiv(T, meta["BJ"]), B, ng)](
                qI, kI, w, dI, dk_part, S, T, nI, cI, ratio, coef, hpp, *st, BC=pow2(cI), PREC=_prec(qI))
            dk = dk_part.sum(0).to(kI.dtype)
        return dq, dk, dw, None


def indexer_scores(qI: torch.Tensor, kI: torch.Tensor, w: torch.Tensor, ratio: int) -> torch.Tensor:
    """qI [S,B,nI,cI], kI [T,B,cI], w [S,B,nI] -> I [S,B,T] fp32 (-inf on non-causal entries), Triton."""
    naive.check_scores_args(qI, kI, w, ratio)
    return _IndexerScores.apply(qI, kI, w, int(ratio))


def _topk_rows(I: torch.Tensor, kk: int) -> torch.Tensor:
    """Top-kk of the last axis, ties lower index first, -1 for -inf picks. A stable descending segmented sort
    (CUB radix sort): measured on the H200 2.4x faster than torch.topk over an int64 (score, -index) key."""
    vals, idx = torch.sort(I.detach(), dim=-1, descending=True, stable=True)
    vals, idx = vals[..., :kk], idx[..., :kk]
    return torch.where(torch.isneginf(vals), torch.full_like(idx, -1), idx)


def indexer_topk(I: torch.Tensor, k: int, chunk: int = 4096) -> torch.Tensor:
    """I [S,B,T] -> idx [S,B,min(k,T)] long; -1 where the pick is not causal; ties lower index first."""
    if k < 1:
        raise ValueError(f"indexer_topk: k must be >= 1, got {k}")
    kk = min(k, I.shape[-1])
    if kk == 0:
        return torch.empty(*I.shape[:-1], 0, dtype=torch.long, device=I.device)
    return torch.cat([_topk_rows(I[s:s + chunk], kk) for s in range(0, I.shape[0], chunk)], 0)


def indexer_select(qI: torch.Tensor, kI: torch.Tensor, w: torch.Tensor, ratio: int, k: int,
                   chunk: int = 4096) -> torch.Tensor:
    """== indexer_topk(indexer_scores(qI, kI, w, ratio), k), computed per chunk of query rows so that only a
    [chunk, B, T] block of scores exists at a time (no autograd)."""
    S, B, nI, cI = qI.shape
    outs = []
    with torch.no_grad():
        for s0 in range(0, S, chunk):
            outs.append(indexer_topk(_launch_fwd(qI[s0:s0 + chunk], kI, w[s0:s0 + chunk], ratio, s0), k, chunk=chunk))
    return torch.cat(outs, 0)
