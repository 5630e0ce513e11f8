"""Hybrid sparse attention with a sink, plain PyTorch reference (spec §5.2, §5.3). K = V (one shared head).

For query t (index 0..S-1 in the sequence) and head h, ONE softmax over
    window keys      {kv[s] : t - window < s <= t}
    compressed keys  comp_idx given (CSA): the entries listed in comp_idx[t] (-1 = none); an entry listed twice
                     counts once; a listed entry that is not complete (j >= floor((t+1)/ratio)) is ignored
                     comp_idx None, comp given (HCA): all complete entries j < floor((t+1)/ratio)
    the sink logit   sink[h] (no value)
with logits (q . k) * scale; o[t,h] = sum_s p_s * V_s.  Logits / softmax in fp32 (fp64 for fp64 q); output in q's dtype.
The reference materialises dense [B,H,S,S] and [B,H,S,T] logits (memory O(S^2)).
"""
from __future__ import annotations

import torch


def sparse_attn(q: torch.Tensor, kv: torch.Tensor, comp: torch.Tensor | None, comp_idx: torch.Tensor | None,
                sink: torch.Tensor, window: int, ratio: int, scale: float) -> torch.Tensor:
    """q [S,B,H,c], kv [S,B,c], comp [T,B,c] | None, comp_idx [S,B,k] long | None, sink [H] -> o [S,B,H,c]."""
    S, B, H, c = q.shape
    if tuple(kv.shape) != (S, B, c):
        raise ValueError(f"sparse_attn: kv shape {tuple(kv.shape)} != (S, B, c) = {(S, B, c)}")
    if tuple(sink.shape) != (H,):
        raise ValueError(f"sparse_attn: sink shape {tuple(sink.shape)} != (H,) = {(H,)}")
    if window < 1:
        raise ValueError(f"sparse_attn: window must be >= 1, got {window}")
    dev = q.device
    dt = torch.promote_types(q.dtype, torch.float32)                                   # fp32 (fp64 stays)
    qf, kvf = q.to(dt), kv.to(dt)
    t = torch.arange(S, device=dev)
    # window part: [B, H, S, S]
    logits_w = torch.einsum("sbhc,ubc->bhsu", qf, kvf) * scale
    band = (t[None, :] <= t[:, None]) & (t[None, :] > t[:, None] - window)        # [S(query), S(key)]
    logits_w = logits_w.masked_fill(~band, float("-inf"))
    parts = [logits_w]
    use_comp = comp is not None and comp.shape[0] > 0
    if use_comp:
        T = comp.shape[0]
        if tuple(comp.shape) != (T, B, c):
            raise ValueError(f"sparse_attn: comp shape {tuple(comp.shape)} != (T, B, c) = {(T, B, c)}")
        if ratio <= 0:
            raise ValueError(f"sparse_attn: ratio must be positive, got {ratio}")
        compf = comp.to(dt)
        logits_c = torch.einsum("sbhc,tbc->bhst", qf, compf) * scale                   # [B, H, S, T]
        causal = torch.arange(T, device=dev)[None, :] < torch.div(t + 1, ratio, rounding_mode="floor")[:, None]
        allowed = causal[None].expand(B, S, T)                                         # [B, S, T]
        if comp_idx is not None:
            if comp_idx.shape[:2] != (S, B):
                raise ValueError(f"sparse_attn: comp_idx shape {tuple(comp_idx.shape)} != (S, B, k)")
            idx = comp_idx.permute(1, 0, 2)                                            # [B, S, k]
            idx = torch.where(idx < 0, torch.full_like(idx, T), idx)                   # -1 -> dummy column T
            sel = torch.zeros(B, S, T + 1, dtype=torch.bool, device=dev)
            sel.scatter_(-1, idx, True)
            allowed = allowed & sel[..., :T]
        logits_c = logits_c.masked_fill(~allowed[:, None], float("-inf"))
        parts.append(logits_c)
    sink_col = sink.to(dt).view(1, H, 1, 1).expand(B, H, S, 1)
    logits = torch.cat(parts + [sink_col], dim=-1)                                     # [B, H, S, S(+T)+1]
    p = torch.softmax(logits, dim=-1)[..., :-1]                                        # drop the sink column
    o = torch.einsum("bhsu,ubc->sbhc", p[..., :S], kvf)                                # [S, B, H, c]
    if use_comp:
        o = o + torch.einsum("bhst,tbc->sbhc", p[..., S:], compf)
    return o.to(q.dtype)
