"""Compressor softmax pooling (spec §6.2 HCA, §6.3 CSA) in Triton, forward and backward.

The kernel pools contiguous windows: kv, gate [S,B,coff*D], ape [m, coff*D] -> [S//m, B, D] in kv's dtype,
softmax in fp32; `compress_pool` (the packed contract of `naive.compress_pool`) gathers each slot's rows into
such windows first. One program per (entry w, batch b, block of BD channels) holds the slots of its entry as a
[slots, BD] tile: non-overlapping (HCA) slots are the m tokens of window w; overlapping (CSA) slots are the
2m consecutive tokens (w-1)m .. (w+1)m-1, the first m read from the first channel half, the last m from the
second half (entry 0's previous-window slots are empty: weight exactly 0).

Backward recomputes the softmax: d value = α·dout, d logit = α·dout·(value - out). Every (token, channel) of
kv / gate is a slot of at most one entry, so each program writes its slots' gradients directly (no atomics,
deterministic); rows that are no slot (trailing tokens, the last window's first half) stay zero. d ape is the
sum of d gate over windows and batch (a PyTorch reduction).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.kernels._triton_util import on_cpu, pow2

from . import naive


@triton.jit
def _slots(w, b, d0, m, D, W, B, OVERLAP: tl.constexpr, MP: tl.constexpr, BD: tl.constexpr):
    """Token index, channel, ape offset and validity of the [MP, BD] slot tile of entry w."""
    r = tl.arange(0, MP)
    offs_d = d0 + tl.arange(0, BD)
    if OVERLAP:
        tok = w * m - m + r                                     # tokens (w-1)m .. (w+1)m-1
        chan = offs_d[None, :] + (r[:, None] >= m).to(tl.int64) * D
        valid_r = (r < 2 * m) & (tok >= 0)
    else:
        tok = w * m + r
        chan = offs_d[None, :] + r[:, None] * 0
        valid_r = r < m
    mask = valid_r[:, None] & (offs_d[None, :] < D)
    slot = valid_r[:, None] & (offs_d[None, :] >= 0)            # row validity only (keeps padded channels finite)
    off = tok[:, None] * (B * W) + b * W + chan                 # kv / gate are contiguous [S, B, W]
    ape_off = (r % m)[:, None] * W + chan
    return off, ape_off, mask, slot, offs_d


@triton.jit
def _pool_fwd(KV, GATE, APE, OUT, m, D, W, B, OVERLAP: tl.constexpr, MP: tl.constexpr, BD: tl.constexpr):
    w = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    off, ape_off, mask, slot, offs_d = _slots(w, b, tl.program_id(2) * BD, m, D, W, B, OVERLAP, MP, BD)
    z = tl.load(GATE + off, mask=mask, other=0.0).to(tl.float32) + tl.load(APE + ape_off, mask=mask, other=0.0)
    z = tl.where(slot, z, float("-inf"))
    c = tl.load(KV + off, mask=mask, other=0.0).to(tl.float32)
    zmax = tl.max(z, 0)
    e = tl.exp(z - zmax[None, :])
    out = tl.sum(e * c, 0) / tl.sum(e, 0)
    tl.store(OUT + w * (B * D) + b * D + offs_d, out.to(OUT.dtype.element_ty), mask=offs_d < D)


@triton.jit
def _pool_bwd(KV, GATE, APE, DOUT, DKV, DGATE, m, D, W, B,
              OVERLAP: tl.constexpr, MP: tl.constexpr, BD: tl.constexpr):
    w = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    off, ape_off, mask, slot, offs_d = _slots(w, b, tl.program_id(2) * BD, m, D, W, B, OVERLAP, MP, BD)
    z = tl.load(GATE + off, mask=mask, other=0.0).to(tl.float32) + tl.load(APE + ape_off, mask=mask, other=0.0)
    z = tl.where(slot, z, float("-inf"))
    c = tl.load(KV + off, mask=mask, other=0.0).to(tl.float32)
    zmax = tl.max(z, 0)
    e = tl.exp(z - zmax[None, :])
    a = e / tl.sum(e, 0)[None, :]                               # α [MP, BD]
    out = tl.sum(a * c, 0)
    dout = tl.load(DOUT + w * (B * D) + b * D + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)
    dc = a * dout[None, :]
    dz = dc * (c - out[None, :])
    tl.store(DKV + off, dc.to(DKV.dtype.element_ty), mask=mask)
    tl.store(DGATE + off, dz.to(DGATE.dtype.element_ty), mask=mask)


def _blocks(m, overlap, D, x):
    MP = pow2(2 * m if overlap else m, lo=1)
    BD = min(pow2(D), max(16, (256 if on_cpu(x) else 4096) // MP))
    return MP, BD


class _CompressPool(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kv, gate, ape, ratio, overlap):
        kv, gate, ape = kv.contiguous(), gate.contiguous(), ape.contiguous()
        S, B, W = kv.shape
        D = W // 2 if overlap else W
        n = S // ratio
        out = kv.new_empty(n, B, D)
        MP, BD = _blocks(ratio, overlap, D, kv)
        if n > 0:
            _pool_fwd[(n, B, triton.cdiv(D, BD))](kv, gate, ape.float(), out, ratio, D, W, B,
                                                   OVERLAP=overlap, MP=MP, BD=BD, num_warps=4)
        ctx.save_for_backward(kv, gate, ape)
        ctx.cfg = (ratio, overlap)
        return out

    @staticmethod
    def backward(ctx, dout):
        kv, gate, ape = ctx.saved_tensors
        ratio, overlap = ctx.cfg
        S, B, W = kv.shape
        D = W // 2 if overlap else W
        n = S // ratio
        dkv, dgate = torch.zeros_like(kv), torch.zeros_like(gate)
        MP, BD = _blocks(ratio, overlap, D, kv)
        if n > 0:
            _pool_bwd[(n, B, triton.cdiv(D, BD))](kv, gate, ape.float(), dout.contiguous(), dkv, dgate, ratio, D, W,
                                                   B, OVERLAP=overlap, MP=MP, BD=BD, num_warps=4)
        dape = dgate[: n * ratio].float().reshape(n, ratio, B, W).sum((0, 2)).to(ape.dtype)
        return dkv, dgate, dape, None, None


def compress_pool(kv: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, ratio: int, overlap: bool,
                  seg: torch.Tensor, pos: torch.Tensor, first: int = 0, pool=None):
    """Packed-stream pooling (same contract as `naive.compress_pool`) on the Triton window kernel.

    The rows each slot pools are gathered into a stream of contiguous windows (the gather is PyTorch): HCA
    slot s -> window s; CSA slot s -> windows 2s (previous rows) and 2s+1 (current rows), so the kernel's entry
    2s+1 is slot s (even entries are computed and dropped: 2x the pooling work of a direct kernel). A slot
    with j = 0 has no previous window: its previous rows' gate logits are -inf (weight exactly 0)."""
    naive.check_args(kv, gate, ape, ratio, overlap, seg, pos)
    pool = pool or _CompressPool.apply          # op.py passes the custom op dsv4::compress_pool_fwd (same kernel)
    m = ratio
    W = kv.shape[1]
    D = W // 2 if overlap else W
    ends, valid, j = naive.entry_slots(seg, pos, m, first)
    cur, prev, has_prev = naive.pool_rows(seg, pos, ends, valid, j, m, overlap)
    N = ends.shape[0]
    if N == 0:
        return kv.new_zeros(0, D), ends.clone(), j, ends
    if overlap:
        rows = torch.stack([prev, cur], dim=1).reshape(-1)                       # [N*2m] windows 2s, 2s+1
        g = gate[rows].view(N, 2, m, W)
        first_half = torch.zeros(1, 1, 1, W, dtype=torch.bool, device=kv.device)
        first_half[..., :D] = True
        no_prev = (~has_prev).view(N, 1, 1, 1) & first_half & \
            (torch.arange(2, device=kv.device) == 0).view(1, 2, 1, 1)
        g = torch.where(no_prev, torch.full((), float("-inf"), dtype=g.dtype, device=g.device), g)
        out = pool(kv[rows].view(-1, 1, W), g.view(-1, 1, W), ape, m, True)[1::2, 0]   # [N, D]
    else:
        rows = cur.reshape(-1)
        out = pool(kv[rows].view(-1, 1, W), gate[rows].view(-1, 1, W), ape, m, False)[:, 0]
    out = torch.where(valid[:, None], out, torch.zeros((), dtype=out.dtype, device=out.device))
    return out, torch.where(valid, seg[ends], torch.full_like(ends, -1)), j, ends
