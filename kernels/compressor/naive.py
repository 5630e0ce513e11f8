"""Compressor softmax pooling, plain PyTorch reference (spec §6.2 HCA, §6.3 CSA).

Only the gated pooling lives here; the projections (wkv, wgate), the RMSNorm and the RoPE of the entries are
applied by `model/compressor.py`. Layout SBHD-style: sequence first.

    entry w (HCA, overlap=False): softmax over the m tokens of window w, per channel, of gate + ape
    entry w (CSA, overlap=True):  2m slots per channel -- slots 0..m-1 = window w-1, FIRST half of the channels
                                  ([..., :D], the "previous-window" series), slots m..2m-1 = window w, SECOND half
                                  ([..., D:]). Entry 0 has no previous window: those slots get weight exactly 0.

Trailing tokens that do not fill a window produce no entry (S < m gives zero entries).
The softmax runs in fp32 (fp64 for fp64 inputs; ape is fp32); the pooled vector is returned in kv's dtype.
"""
from __future__ import annotations

import torch


def check_args(kv: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, ratio: int, overlap: bool) -> None:
    """The argument contract of compress_pool, shared by every backend (one-line errors)."""
    if ratio <= 0:
        raise ValueError(f"compress_pool: ratio must be positive, got {ratio}")
    S, B, W = kv.shape
    if gate.shape != kv.shape:
        raise ValueError(f"compress_pool: gate shape {tuple(gate.shape)} != kv shape {tuple(kv.shape)}")
    if tuple(ape.shape) != (ratio, W):
        raise ValueError(f"compress_pool: ape shape {tuple(ape.shape)} != (ratio, coff*D) = {(ratio, W)}")
    if overlap and W % 2:
        raise ValueError(f"compress_pool: overlap needs an even channel count, got {W}")


def compress_pool(kv: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, ratio: int, overlap: bool) -> torch.Tensor:
    """kv, gate [S,B,coff*D]; ape [m, coff*D] -> pooled entries [S//m, B, D] (coff = 2 if overlap else 1)."""
    check_args(kv, gate, ape, ratio, overlap)
    S, B, W = kv.shape
    D = W // 2 if overlap else W
    n = S // ratio
    if n == 0:
        return kv.new_zeros(0, B, D)
    m = ratio
    dt = torch.promote_types(kv.dtype, torch.float32)                    # fp32 (fp64 stays fp64, for gradcheck)
    c = kv[: n * m].reshape(n, m, B, W)                                  # [n, m, B, coff*D]
    z = gate[: n * m].reshape(n, m, B, W).to(dt) + ape.to(dt)[None, :, None, :]   # fp32 logits
    if overlap:
        prev_c, cur_c = c[..., :D], c[..., D:]                            # [n, m, B, D] each
        prev_z, cur_z = z[..., :D], z[..., D:]
        # slots 0..m-1 of entry w come from window w-1 (entry 0: value 0, logit -inf -> weight 0)
        pad_c = torch.zeros_like(prev_c[:1])
        pad_z = torch.full_like(prev_z[:1], float("-inf"))
        prev_c = torch.cat([pad_c, prev_c[:-1]], dim=0)                  # [n, m, B, D]
        prev_z = torch.cat([pad_z, prev_z[:-1]], dim=0)
        c = torch.cat([prev_c, cur_c], dim=1)                             # [n, 2m, B, D]
        z = torch.cat([prev_z, cur_z], dim=1)
    alpha = torch.softmax(z, dim=1)                                       # over the slots, per channel
    out = (c.to(dt) * alpha).sum(dim=1)                                  # [n, B, D] fp32
    return out.to(kv.dtype)
