"""MoE combine (spec §9), the reference: out[t] = sum over the slots s of token t of w[s] * y[s].

    acc = promote(out_dtype, fp32)                                 (fp32; fp64 stays fp64, for gradchecks)
    out = zeros([T, d], acc).index_add_(0, tok, y.to(acc) * w[:, None].to(acc)).to(out_dtype)

y [T*K, d] holds the expert outputs of the expert-sorted slots (model/moe.py `Experts`, "grouped" mode), w [T*K]
their routing weights, tok [T*K] the token of each slot. This is the formula the grouped path always used, so the
naive backend keeps every CPU golden; on CPU index_add_ adds a token's slots in ascending slot order.
"""
from __future__ import annotations

import torch


def moe_combine(y: torch.Tensor, w: torch.Tensor, tok: torch.Tensor, T: int, out_dtype: torch.dtype) -> torch.Tensor:
    """y [T*K, d], w [T*K], tok [T*K] int64 -> [T, d] in out_dtype."""
    acc = torch.promote_types(out_dtype, torch.float32)
    out = torch.zeros(T, y.shape[1], dtype=acc, device=y.device)
    return out.index_add_(0, tok, y.to(acc) * w[:, None].to(acc)).to(out_dtype)
