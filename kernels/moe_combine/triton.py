"""MoE combine as one Triton gather kernel forward and one backward (no atomics, no fp32 [T*K, d] buffer).

    out[t] = sum_{k < K} w[s_k] y[s_k],   s_0 < ... < s_{K-1} the slots of token t      (math in fp32)
    backward: dy[s] = w[s] g[tok[s]]   (y's dtype),   dw[s] = sum_j g[tok[s], j] y[s, j]   (w's dtype)

The forward gathers token t's K slots from `slot_of` [T, K] int32 = argsort(tok, stable) viewed [T, K] (each
token's slots in ascending slot index; `slots_of_tokens`: listed by an atomic counter a token, then each row sorted,
not a radix sort of tok: 8 passes of int64 keys, 10 a step in the proxy, 0.6 ms of its 4K CUDA-graph step) and
sums w * y in registers from 0.0 in that order: the order in which
the reference's CPU index_add_ accumulates, so fp32 results match `naive.moe_combine` bit for bit there; on the
GPU it is deterministic where index_add_'s atomics are not. ROWS tokens x BLOCK_D columns a program.
The backward runs over the sorted slots, ROWS a program, looping over d in BLOCK_D tiles (dw in registers).
Memory-bound: fwd reads y and writes out; bwd reads g (gathered by token), y, and writes dy.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.kernels._triton_util import on_cpu


@triton.jit
def _combine_fwd(Y, W, SLOT, OUT, T, D, K: tl.constexpr, CT: tl.constexpr, ROWS: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)                       # [ROWS] tokens
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)                 # [BLOCK_D]
    rm = rows < T
    m = rm[:, None] & (cols < D)[None, :]
    acc = tl.zeros([ROWS, BLOCK_D], dtype=CT)
    for k in tl.static_range(K):                                              # ascending slots: index_add_'s order
        s = tl.load(SLOT + rows.to(tl.int64) * K + k, mask=rm, other=0).to(tl.int64)   # [ROWS]
        w = tl.load(W + s, mask=rm, other=0.0).to(CT)
        y = tl.load(Y + s[:, None] * D + cols[None, :], mask=m, other=0.0).to(CT)     # [ROWS, BLOCK_D]
        acc += w[:, None] * y
    tl.store(OUT + rows.to(tl.int64)[:, None] * D + cols[None, :], acc.to(OUT.dtype.element_ty), mask=m)


@triton.jit
def _list_slots(TOK, CNT, SLOT, N, T, K: tl.constexpr, BLOCK: tl.constexpr):
    s = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)                       # [BLOCK] slots
    t = tl.load(TOK + s, mask=s < N, other=0).to(tl.int64)                    # [BLOCK] their tokens
    sm = (s < N) & (t >= 0) & (t < T)
    j = tl.atomic_add(CNT + t, 1, mask=sm)                                    # [BLOCK] a free place in t's row (any order)
    tl.store(SLOT + t * K + j, s.to(tl.int32), mask=sm & (j < K))             # j >= K only if tok is not K-regular


def slots_of_tokens(tok: torch.Tensor, T: int) -> torch.Tensor:
    """tok [T*K] (each token exactly K times) -> [T, K] int32, row t = token t's slots ascending (= argsort(tok,
    stable) viewed [T, K]). The places a counter hands out race; the row sort makes the result exact. Input that is
    not K-regular (the caller's contract) leaves zeros in some rows, never an index out of range."""
    N = tok.numel()
    K = N // T
    cnt = torch.zeros(T, dtype=torch.int32, device=tok.device)
    slot = torch.zeros(T, K, dtype=torch.int32, device=tok.device)
    BLOCK = 32 if on_cpu(tok) else 1024
    _list_slots[(triton.cdiv(N, BLOCK),)](tok.contiguous(), cnt, slot, N, T, K=K, BLOCK=BLOCK)
    return slot.sort(dim=1).values                                            # [T, K] ascending


@triton.jit
def _combine_bwd(G, Y, W, TOK, DY, DW, N, D, CT: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    s = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)             # [ROWS] sorted slots
    sm = s < N
    t = tl.load(TOK + s, mask=sm, other=0).to(tl.int64)                       # [ROWS] their tokens
    w = tl.load(W + s, mask=sm, other=0.0).to(CT)
    dw = tl.zeros([ROWS], dtype=CT)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)                                     # [BLOCK_D]
        m = sm[:, None] & (cols < D)[None, :]
        g = tl.load(G + t[:, None] * D + cols[None, :], mask=m, other=0.0).to(CT)     # [ROWS, BLOCK_D]
        y = tl.load(Y + s[:, None] * D + cols[None, :], mask=m, other=0.0).to(CT)
        tl.store(DY + s[:, None] * D + cols[None, :], (g * w[:, None]).to(DY.dtype.element_ty), mask=m)
        dw += tl.sum(g * y, axis=1)
    tl.store(DW + s, dw.to(DW.dtype.element_ty), mask=sm)


def _ct(dtype: torch.dtype):
    """Compute dtype of a combine whose output (forward) / incoming gradient (backward) has `dtype`: fp32, or fp64
    for fp64 (the reference's promote(out_dtype, fp32); gradcheck)."""
    return tl.float64 if dtype == torch.float64 else tl.float32


def _tiles(D: int, x: torch.Tensor) -> tuple[int, int]:
    """(ROWS, BLOCK_D): 4 rows of up to 512 columns a program on the GPU, 4 of up to 32 on CPU (interpreter)."""
    return 4, min(triton.next_power_of_2(max(D, 1)), 32 if on_cpu(x) else 512)


def moe_combine_fwd(y: torch.Tensor, w: torch.Tensor, tok: torch.Tensor, T: int,
                    out_dtype: torch.dtype) -> torch.Tensor:
    """y [T*K, d], w [T*K], tok [T*K] (each token K times) -> [T, d] in out_dtype."""
    N, D = y.shape
    out = torch.empty(T, D, dtype=out_dtype, device=y.device)
    if T == 0:
        return out
    slot_of = slots_of_tokens(tok, T)                                           # [T, K] ascending slots
    ROWS, BLOCK_D = _tiles(D, y)
    _combine_fwd[(triton.cdiv(T, ROWS), triton.cdiv(D, BLOCK_D))](
        y.contiguous(), w.contiguous(), slot_of, out, T, D, K=N // T, CT=_ct(out_dtype), ROWS=ROWS, BLOCK_D=BLOCK_D)
    return out


def moe_combine_bwd(g: torch.Tensor, y: torch.Tensor, w: torch.Tensor,
                    tok: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """g [T, d] (out_dtype) -> (dy [T*K, d] in y's dtype, dw [T*K] in w's dtype)."""
    N, D = y.shape
    dy, dw = torch.empty_like(y, memory_format=torch.contiguous_format), torch.empty_like(w)
    if N == 0:
        return dy, dw
    ROWS, BLOCK_D = _tiles(D, y)
    _combine_bwd[(triton.cdiv(N, ROWS),)](g.contiguous(), y.contiguous(), w.contiguous(), tok.contiguous(), dy, dw,
                                          N, D, CT=_ct(g.dtype), ROWS=ROWS, BLOCK_D=BLOCK_D)
    return dy, dw
