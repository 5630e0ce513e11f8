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
from dsv4.kernels.rope import rope_rows


def sparse_attn(q, kv, comp, comp_idx, sink, window: int, ratio: int, scale: float, seg, pos, entry_seg=None,
                entry_j=None, q_offset: int = 0, return_lse: bool = False, out_rope=None, backend: str = "naive",
                return_probs: bool = False, probs_idx=None):
    """q [Tq,H,c], kv [Tk,c], comp [N,c] | None, comp_idx [Tq,k] | None, sink [H], seg/pos [Tk], entry_seg /
    entry_j [N] -> o [Tq,H,c] (with return_lse: (o, lse [Tq,H])). See `naive.sparse_attn`; backends above.

    out_rope (cos, sin) [Tq, r/2] (model/rope.py `RotaryTable.tables` at the query positions): o's last r dims
    rotated back by them (spec §5.4's inverse RoPE of the output). Backend "triton" rotates in its forward kernel's
    epilogue (no separate pass, o rounded to the output dtype once) and keeps only the rotated output for its
    backward (Megatron-LM dev #7036's output inverse-RoPE reconstruction: no second [Tq,H,c] tensor), whose first
    pass takes delta = rowsum(O ∘ dO) from the rotated pair (the rotation's adjoint gives the same) and rotates
    dO's last r dims forward into the dO the kernel reads (which then does not read O). The other backends run
    kernels/rope's `rope_rows` on the output (its own "naive" / "triton" backend), the same math; so does "triton"
    when c - r is odd (the kernels' pairs are (2i, 2i+1) of the whole row, the rotation's start at c - r).

    return_probs (with return_lse): a third element, the attention's mass on each listed entry summed over heads
    [Tq,k] fp32 (= `entry_probs(q, comp, comp_idx, lse, ...)`), which backend "triton" forms from its forward's
    own logits of the picks (no second pass over them). Without comp_idx (every visible entry attended), probs_idx
    [Tq,k] lists the entries whose mass is returned: a listing of every entry each query sees (at most k a query:
    DSv4Attention._lists_every_visible), in any order, -1 for none; "triton" forms it from the same forward's
    logits, stored by each entry's index in its document (entry_j). None from the other backends, and without
    comp_idx or probs_idx (the caller then calls `entry_probs`)."""
    fn = get_op("sparse_attn", backend, q.device)
    more = {"return_probs": True, "probs_idx": probs_idx} if return_lse and return_probs and backend == "triton" \
        else {}
    if out_rope is not None and backend == "triton" and (q.shape[-1] - 2 * out_rope[0].shape[-1]) % 2 == 0:
        return fn(q, kv, comp, comp_idx, sink, window, ratio, scale, seg, pos, entry_seg, entry_j, q_offset,
                  return_lse, out_rope=out_rope, **more)
    out = fn(q, kv, comp, comp_idx, sink, window, ratio, scale, seg, pos, entry_seg, entry_j, q_offset, return_lse,
             **more)
    o, rest = (out[0], out[1:]) if return_lse else (out, ())            # rest: (lse,) or (lse, probs)
    if out_rope is not None:
        o = rope_rows(o, out_rope[0], out_rope[1], True, backend="naive" if backend == "naive" else "triton")
    if return_lse and return_probs and len(rest) == 1:
        rest += (None,)                                                  # a backend without the forward's probs
    return (o, *rest) if return_lse else o


def entry_probs(q, comp, comp_idx, lse, ratio: int, scale: float, seg, pos, entry_seg, entry_j, q_offset: int = 0,
                backend: str = "naive"):
    """The attention's mass on each listed entry, summed over heads: [Tq,k]. See `naive.entry_probs`."""
    return get_op("sparse_attn_entry_probs", backend, q.device)(q, comp, comp_idx, lse, ratio, scale, seg, pos,
                                                                 entry_seg, entry_j, q_offset)
