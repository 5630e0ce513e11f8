"""MTP roll on packed THD streams, with padded cu_seqlens and across contiguous CP ranks (#4495, P9).

MTP depth 1 (spec §10.1) reads token t+1 at position t (`ids_next`) and predicts label t+1 (= token t+2).
On a packed stream "t+1" must stay inside t's document: the last real token of each document gets `fill`
(as a document run alone: its MTP input is the pad id, its MTP label is ignored). Two Megatron bugs this avoids:
  * #4495: with CP, boundaries must come from `cu_seqlens_padded` (the real offsets of the documents in the
    stream), not from cu_seqlens -- we derive (seg, pos) from both (model/layout.py), so padding never counts;
  * #5011 review: the loss mask rolled twice -- here labels / masks are rolled ONCE, by the same function, and
    an ignored label is never "un-ignored" by a second roll.
The model reads the roll from its layout (`Layout.roll_next`; `CPLayout.roll_next` = `roll_packed_cp`).
Under contiguous CP (rank r holds tokens [r C, (r+1) C)) the last local token needs row 0 of rank r+1's
chunk (and its document id): one autograd-aware all-gather of the first rows (backward returns the gradient to
the owner rank).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .layout import IGNORE, roll_packed, seg_pos_from_cu_seqlens

__all__ = ["IGNORE", "roll_packed", "mtp_inputs", "roll_packed_cp", "roll_chunk"]


def mtp_inputs(input_ids: torch.Tensor, labels: torch.Tensor | None, cu_seqlens,
               cu_seqlens_padded=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Packed [1, T] ids (and labels, already shifted: labels[t] = target of t) -> (ids_next [1, T],
    mtp_labels [1, T]): ids_next[t] = ids[t+1] within the document (else 0), mtp_labels[t] = labels[t+1]
    within the document (else IGNORE)."""
    T = input_ids.shape[1]
    seg, _ = seg_pos_from_cu_seqlens(cu_seqlens, T, cu_seqlens_padded)
    seg = seg.to(input_ids.device)
    ids_next, _ = roll_packed(input_ids[0], seg, fill=0)
    mtp_labels = None
    if labels is not None:
        mtp_labels, _ = roll_packed(labels[0], seg, fill=IGNORE)
        mtp_labels = mtp_labels[None]
    return ids_next[None], mtp_labels


# ---------------------------------------------------------------------------------------------- CP


class _NextRankFirstRow(torch.autograd.Function):
    """row 0 of rank r+1's chunk (zeros on the last rank); backward sends the gradient back to rank r+1."""

    @staticmethod
    def forward(ctx, x0, group):
        ctx.group = group
        ws, rank = dist.get_world_size(group), dist.get_rank(group)
        parts = [torch.empty_like(x0) for _ in range(ws)]
        dist.all_gather(parts, x0.contiguous(), group=group)
        return parts[rank + 1].clone() if rank + 1 < ws else torch.zeros_like(x0)

    @staticmethod
    def backward(ctx, g):
        ws, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        parts = [torch.empty_like(g) for _ in range(ws)]
        dist.all_gather(parts, g.contiguous(), group=ctx.group)
        return (parts[rank - 1].clone() if rank > 0 else torch.zeros_like(g)), None


def roll_packed_cp(x_local: torch.Tensor, seg_local: torch.Tensor, group=None, fill=0):
    """`roll_packed` of the whole stream, computed on a contiguous CP chunk: x_local [C, ...], seg_local [C]
    (document ids of the local tokens, e.g. `context_parallel.rank_layout(..., halo=0)[0]`) -> (y, valid)."""
    group = group or dist.group.WORLD
    first = x_local[:1]
    if x_local.is_floating_point() and x_local.requires_grad:
        nxt_row = _NextRankFirstRow.apply(first, group)
    else:
        with torch.no_grad():
            nxt_row = _NextRankFirstRow.forward(_Ctx(), first, group)
    with torch.no_grad():
        nxt_seg = _NextRankFirstRow.forward(_Ctx(), seg_local[:1], group)
        if dist.get_rank(group) + 1 == dist.get_world_size(group):
            nxt_seg = nxt_seg.fill_(-1)                                        # after the stream: nothing
    return roll_chunk(x_local, seg_local, nxt_row, nxt_seg, fill)


def roll_chunk(x_local: torch.Tensor, seg_local: torch.Tensor, next_row: torch.Tensor, next_seg: torch.Tensor,
               fill=0):
    """The roll of one contiguous chunk given the next chunk's first row [1, ...] and its doc id [1] (-1 after
    the stream's end) -> (y [C, ...], valid [C])."""
    ext = torch.cat([x_local, next_row], dim=0)                                # [C + 1, ...]
    ext_seg = torch.cat([seg_local, next_seg])
    y, valid = roll_packed(ext, ext_seg, fill)
    return y[:-1], valid[:-1]


class _Ctx:
    pass
