"""Cross-entropy rows of a logits block as one Triton kernel each way (naive.py has the math).

The eager composite reads and writes the [C, V] block many times: an fp32 copy, logsumexp's max / subtract / exp /
sum passes, then in backward the fp32 copy again, subtract, exp, scatter, multiply and the cast back (at the
`proxy` head, C = 8192 rows by V = 32768, each pass over fp32 is 1 GiB). Here the forward reads the block once
(an online max / sum per row, fp32 registers) and the backward reads it once and writes dlogits once.

One program per row; the row streams through BLOCK_V columns at a time. Online log-sum-exp:
    m' = max(m, max_j x_j),   s' = s exp(m - m') + sum_j exp(x_j - m'),   lse = m + log s.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.kernels._triton_util import on_cpu


@triton.jit
def _ce_lse(L, Y, LSE, TGT, V, stride, CT: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = L + row * stride
    cols = tl.arange(0, BLOCK_V)
    m = tl.full([BLOCK_V], float("-inf"), CT)                                 # per-lane running max
    s = tl.zeros([BLOCK_V], CT)                                               # per-lane sum of exp(x - m)
    for v0 in range(0, V, BLOCK_V):
        x = tl.load(base + v0 + cols, mask=v0 + cols < V, other=float("-inf")).to(CT)
        m_new = tl.maximum(m, x)
        ref = tl.where(m_new == float("-inf"), 0.0, m_new)                   # a lane with no column yet: s stays 0
        s = s * tl.exp(m - ref) + tl.exp(x - ref)
        m = m_new
    mx = tl.max(m, axis=0)                                                    # finite for V >= 1
    lse = mx + tl.log(tl.sum(s * tl.exp(m - mx), axis=0))
    y = tl.load(Y + row)
    tl.store(LSE + row, lse)
    tl.store(TGT + row, tl.load(base + y).to(CT))


@triton.jit
def _ce_dlogits(L, LSE, Y, SC, DL, V, stride, dstride, CT: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_V)
    lse = tl.load(LSE + row).to(CT)
    sc = tl.load(SC + row).to(CT)
    y = tl.load(Y + row)
    for v0 in range(0, V, BLOCK_V):
        c = v0 + cols
        x = tl.load(L + row * stride + c, mask=c < V, other=0.0).to(CT)
        p = tl.exp(x - lse)
        p = tl.where(c == y, p - 1.0, p) * sc
        tl.store(DL + row * dstride + c, p.to(DL.dtype.element_ty), mask=c < V)


def _ct(x: torch.Tensor):
    return tl.float64 if x.dtype == torch.float64 else tl.float32


def _block(V: int, x: torch.Tensor) -> tuple[int, int]:
    """(BLOCK_V, num_warps): 4096 columns a step on the GPU (8 KB of bf16 a load), 256 on the interpreter."""
    bv = min(triton.next_power_of_2(max(V, 1)), 256 if on_cpu(x) else 4096)
    return bv, (1 if on_cpu(x) else 8)


def _check(logits: torch.Tensor, labels: torch.Tensor) -> None:
    if logits.dim() != 2 or labels.shape != logits.shape[:1]:
        raise ValueError(f"cross_entropy: logits [C, V] and labels [C] expected, got {tuple(logits.shape)} "
                         f"and {tuple(labels.shape)}")
    if logits.stride(-1) != 1:
        raise ValueError("cross_entropy: logits rows must be contiguous (stride 1 along V)")


def ce_lse(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`naive.ce_lse` in one pass over the block."""
    _check(logits, labels)
    C, V = logits.shape
    dt = torch.promote_types(logits.dtype, torch.float32)
    lse = torch.empty(C, dtype=dt, device=logits.device)
    tgt = torch.empty(C, dtype=dt, device=logits.device)
    if C:
        bv, w = _block(V, logits)
        _ce_lse[(C,)](logits, labels.contiguous(), lse, tgt, V, logits.stride(0), CT=_ct(lse), BLOCK_V=bv,
                      num_warps=w)
    return lse, tgt


def ce_dlogits(logits: torch.Tensor, lse: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`naive.ce_dlogits` in one pass over the block."""
    _check(logits, labels)
    C, V = logits.shape
    dl = torch.empty_like(logits)
    if C:
        bv, w = _block(V, logits)
        _ce_dlogits[(C,)](logits, lse.contiguous(), labels.contiguous(), scale.to(lse.dtype).contiguous(), dl, V,
                          logits.stride(0), dl.stride(0), CT=_ct(lse), BLOCK_V=bv, num_warps=w)
    return dl
