"""Hybrid sparse attention op (spec §5.2-5.3): `sparse_attn(..., backend="naive"|"triton"|"triton+flashmla")` via
`kernels.get_op`.

Backends: "naive" (naive.py, the reference), "triton" (triton.py / op.py, forward and backward), and the optional
"triton+flashmla" (flashmla.py, op.py `sparse_attn_flashmla`): deepseek-ai/FlashMLA's SM90 sparse prefill forward
`flash_mla_sparse_fwd` (imported at run time when installed; nothing of it is in this repo) with our Triton
backward consuming its output and its log-sum-exp (converted: natural log without the sink -> log2 with the sink),
used when the call qualifies -- flash_mla importable, an SM90 GPU, bf16, H in (64, 128), c = 512 -- and the Triton
forward otherwise (the fallback, same results within bf16 rounding). The model selects it per attention layer
with `DSv4Model.set_attn_fwd("flashmla")` (default "triton"); `dsv4 bench kernels --only sparse_attn` times it
(`triton_flashmla_*` columns)."""
from __future__ import annotations

from dsv4.kernels import get_op


def sparse_attn(q, kv, comp, comp_idx, sink, window: int, ratio: int, scale: float, seg, pos, entry_seg=None,
                entry_j=None, q_offset: int = 0, return_lse: bool = False, backend: str = "naive"):
    """q [Tq,H,c], kv [Tk,c], comp [N,c] | None, comp_idx [Tq,k] | None, sink [H], seg/pos [Tk], entry_seg /
    entry_j [N] -> o [Tq,H,c] (with return_lse: (o, lse [Tq,H])). See `naive.sparse_attn`; backends above."""
    return get_op("sparse_attn", backend, q.device)(q, kv, comp, comp_idx, sink, window, ratio, scale, seg, pos,
                                                     entry_seg, entry_j, q_offset, return_lse)


def entry_probs(q, comp, comp_idx, lse, ratio: int, scale: float, seg, pos, entry_seg, entry_j, q_offset: int = 0,
                backend: str = "naive"):
    """The attention's mass on each listed entry, summed over heads: [Tq,k]. See `naive.entry_probs`."""
    return get_op("sparse_attn_entry_probs", backend, q.device)(q, comp, comp_idx, lse, ratio, scale, seg, pos,
                                                                 entry_seg, entry_j, q_offset)
