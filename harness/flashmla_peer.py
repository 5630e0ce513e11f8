"""FlashMLA's SM90 sparse prefill forward (deepseek-ai/FlashMLA, `flash_mla_sparse_fwd`) as a peer of our sparse
attention forward in `dsv4 bench kernels` (issue 14): same inputs, timed in the same process, and its output
compared with ours (a kernel we did not write, at DSv4's H = 64, c = 512).

FlashMLA is not a dependency and nothing of it is in this repo: harness/device/flashmla_h200.sh builds it on the
H200 from a carried source archive, and the bench imports `flash_mla` when it is on the path (else the row says
why not).

The mapping (one document, the bench's case): FlashMLA attends each query to the rows of ONE kv tensor that its
index list names (-1 = none), with logits (q . k) * sm_scale, V = the first d_v = 512 channels of the same rows,
and an optional per-head sink logit (out *= e^lse / (e^lse + e^sink)); that is our sparse_attn (K = V = kv, one
shared head, the sink a logit without value: kernels/sparse_attn/naive.py) once the window keys and the
compressed entries are one tensor:
    kv_all  [S + N, 1, c] = kv rows 0..S-1, then the N compressed entries
    indices [S, 1, W + K] int32 = window rows t - W + 1 .. t (-1 below 0), then S + the visible entries: the listed
            ones (CSA, comp_idx [S, K]) or every entry (HCA, K = N), -1 where not visible (entry j needs
            j < (t + 1) // ratio)
"""
from __future__ import annotations

import torch


def load():
    """(the flash_mla module, None) or (None, one line saying why it cannot run here)."""
    try:
        import flash_mla
        fn = flash_mla.flash_mla_sparse_fwd
    except Exception as e:  # noqa: BLE001 - any import failure is a reason, recorded in the bench row
        return None, f"flash_mla not importable ({type(e).__name__}: {str(e)[:160]}); build it with " \
                     "harness/device/flashmla_h200.sh"
    return fn, None


def indices(S: int, window: int, ratio: int, comp_idx: torch.Tensor | None, n_entries: int,
            device) -> torch.Tensor:
    """[S, 1, window + K] int32 indices into kv_all (module docstring): window keys, then the visible entries."""
    t = torch.arange(S, device=device)
    win = t[:, None] + torch.arange(-(window - 1), 1, device=device)                 # [S, W]
    win = torch.where(win >= 0, win, -1)
    if n_entries == 0:
        return win.to(torch.int32)[:, None]
    lim = ((t + 1) // ratio)[:, None]                                               # entries complete before t
    ent = comp_idx if comp_idx is not None else torch.arange(n_entries, device=device).expand(S, n_entries)
    ent = torch.where((ent >= 0) & (ent < lim), S + ent, -1)                        # [S, K]
    return torch.cat([win, ent], 1).to(torch.int32)[:, None]                       # [S, 1, W + K]


def kv_all(kv: torch.Tensor, comp: torch.Tensor | None) -> torch.Tensor:
    """kv [S, c] (+ comp [N, c]) -> [S + N, 1, c]."""
    return (kv if comp is None else torch.cat([kv, comp], 0))[:, None]


def gathered_attention(q: torch.Tensor, kvs: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor,
                       scale: float) -> torch.Tensor:
    """The attention the mapping asks FlashMLA for, by gathering (fp32; fp64 stays; tests: == naive.sparse_attn):
    q [S, H, c], kvs [R, 1, c], idx [S, 1, K] -> o [S, H, c]."""
    dt = torch.promote_types(q.dtype, torch.float32)
    ix = idx[:, 0].long()                                                           # [S, K]
    g = kvs[:, 0][ix.clamp(min=0)].to(dt)                                           # [S, K, c]
    P = torch.einsum("shc,skc->shk", q.to(dt), g) * scale                           # [S, H, K]
    P = P.masked_fill((ix < 0)[:, None, :], float("-inf"))
    lse = torch.logsumexp(torch.cat([P, sink.to(dt)[None, :, None].expand(P.shape[0], -1, 1)], -1), -1)
    return torch.einsum("shk,skc->shc", torch.exp(P - lse[..., None]), g).to(q.dtype)
