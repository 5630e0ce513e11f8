"""Static contiguous context parallelism for DSv4 attention (D7 layout + boundary primitives, D8 attention).

Layout (Megatron `cp_partition_mode='contiguous'`, megatron_dsv4.md §2.6): a packed stream of T tokens
(T % cp == 0; pad with `cu_seqlens_padded` first) is cut into cp rank-major chunks of C = T / cp tokens:
rank r holds tokens [r C, (r+1) C). Document metadata (cu_seqlens, cu_seqlens_padded) is replicated on every
rank, so each rank derives seg / pos of any token locally (model/thd.py) -- RoPE positions restart per
document, not per rank.

What crosses a rank boundary (and nothing else):
  * the left HALO: the `halo` tokens just before the chunk, owned by earlier ranks -- the window keys
    (n_win - 1 tokens) and the rows of compression windows that close in this chunk but start earlier
    (coff m - 1 tokens: the compressor's partial window and, for CSA, the overlap rows of the previous window).
    The halo carries the normalised attention input h; the rank recomputes the projections of those rows.
    If C < halo, the halo spans several earlier ranks (each contributes its last min(halo, C) rows).
  * compressed ENTRIES (main compressor and indexer keys): entry (doc, j) is computed by the rank holding its
    last token, then all ranks' entries are gathered (padded to the largest count: padding rows have doc -1),
    so HCA sees every causal entry and the indexer scores every causal candidate of the document.
Both exchanges are autograd-aware (`all_gather` whose backward all-reduces the gradient and keeps this rank's
slice), so the gradient of sum_r loss_r reaches the producing rank: parameter gradients summed over ranks and
input gradients equal the single-rank run.

Process groups: any torch.distributed group (gloo on CPU, NCCL on GPU); `cp_group()` returns Megatron-Core's
`parallel_state.get_context_parallel_group()` when Megatron's model parallel state is initialised, else WORLD.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .thd import THDError, attention_on_layout, seg_pos_from_cu_seqlens


# ---------------------------------------------------------------------------------------------- groups


def cp_group():
    """Megatron-Core's CP group when `parallel_state` is initialised, else the default group."""
    try:
        from megatron.core import parallel_state as ps
        if ps.model_parallel_is_initialized():
            return ps.get_context_parallel_group()
    except ImportError:
        pass
    return dist.group.WORLD


# ---------------------------------------------------------------------------------------------- layout (D7)


def cu_seqlens_from_packed_seq_params(psp):
    """(cu_seqlens, cu_seqlens_padded) of a Megatron `PackedSeqParams` for CP; DSv4 CP needs
    cp_partition_mode 'contiguous' (rank-major chunks), not TE's 'zigzag'."""
    from .thd import from_packed_seq_params
    mode = getattr(psp, "cp_partition_mode", "contiguous")
    if mode != "contiguous":
        raise THDError(f"packed_seq_params.cp_partition_mode: DSv4 CP needs 'contiguous', got {mode!r}")
    return from_packed_seq_params(psp)


def contiguous_chunk(T: int, cp: int, rank: int) -> tuple[int, int]:
    """[start, end) of rank's chunk in a stream of T tokens split into cp contiguous rank-major chunks."""
    if cp < 1 or not 0 <= rank < cp:
        raise THDError(f"cp_rank: rank {rank} outside 0..{cp - 1}")
    if T % cp:
        raise THDError(f"total: {T} tokens is not a multiple of cp={cp} (pad with cu_seqlens_padded)")
    C = T // cp
    return rank * C, (rank + 1) * C


def rank_layout(cu_seqlens, total: int, cp: int, rank: int, halo: int = 0, cu_seqlens_padded=None):
    """(seg [halo + C], pos [halo + C]) of the halo rows then the local chunk; halo rows before the stream get
    seg -1 (nothing to attend)."""
    seg, pos = seg_pos_from_cu_seqlens(cu_seqlens, total, cu_seqlens_padded)
    start, end = contiguous_chunk(total, cp, rank)
    gidx = torch.arange(start - halo, end)
    ok = gidx >= 0
    seg_e = torch.where(ok, seg[gidx.clamp(min=0)], torch.full_like(gidx, -1))
    pos_e = torch.where(ok, pos[gidx.clamp(min=0)], torch.zeros_like(gidx))
    return seg_e, pos_e


def rank_cu_seqlens(cu_seqlens, total: int, cp: int, rank: int, cu_seqlens_padded=None):
    """Per-rank THD metadata of the local chunk, one row per document piece inside the chunk:
    (cu_seqlens_local [k+1] real lengths, cu_seqlens_padded_local [k+1] offsets in the chunk (the piece plus
    the padding after it), doc_ids [k], first_pos [k] = position in its document of the piece's first token)."""
    seg, pos = rank_layout(cu_seqlens, total, cp, rank, 0, cu_seqlens_padded)
    vals, counts = torch.unique_consecutive(seg, return_counts=True)           # runs of one doc / padding
    offs = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])[:-1]
    real = vals >= 0
    lens = counts[real]
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
    starts = offs[real]
    doc_ids, first_pos = vals[real], pos[starts]
    if starts.numel() == 0 or int(starts[0]) > 0:                              # chunk starts with padding:
        cu = torch.cat([torch.zeros(1, dtype=torch.long), cu])                 # an empty piece (doc -1) first
        starts = torch.cat([torch.zeros(1, dtype=torch.long), starts])
        doc_ids = torch.cat([torch.full((1,), -1, dtype=torch.long), doc_ids])
        first_pos = torch.cat([torch.zeros(1, dtype=torch.long), first_pos])
    cup = torch.cat([starts, torch.tensor([seg.numel()])])
    return cu, cup, doc_ids, first_pos


def attention_halo(cfg, layer_idx: int) -> int:
    """Left context a rank needs for layer `layer_idx`: max(n_win - 1, coff m - 1 of its compressors)."""
    need = cfg.sliding_window - 1
    kind = cfg.layer_kind(layer_idx)
    if kind == "hca":
        need = max(need, cfg.hca_ratio - 1)
    if kind == "csa":
        need = max(need, 2 * cfg.csa_ratio - 1)            # main and indexer compressors, overlapping windows
    return need


# ---------------------------------------------------------------------------------------------- collectives


class _AllGather(torch.autograd.Function):
    """cat over ranks of equally shaped x; backward: all-reduce the gradient, keep this rank's slice."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        ws = dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(ws)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g, op=dist.ReduceOp.SUM, group=ctx.group)
        ws, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        n = g.shape[0] // ws
        return g[rank * n:(rank + 1) * n], None


def all_gather_cat(x: torch.Tensor, group=None) -> torch.Tensor:
    """[n, ...] on each rank -> [ws * n, ...] rank-major, differentiable (integer tensors: no grad)."""
    group = group or dist.group.WORLD
    if not x.is_floating_point():
        ws = dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(ws)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=0)
    return _AllGather.apply(x, group)


def left_halo(x_local: torch.Tensor, halo: int, group=None) -> torch.Tensor:
    """The `halo` rows just before this rank's chunk (zeros before the stream start), differentiable.

    x_local [C, ...]; every rank contributes its last min(halo, C) rows; rank r reads global rows
    [r C - halo, r C) from the owners' tails.
    """
    group = group or dist.group.WORLD
    rank = dist.get_rank(group)
    C = x_local.shape[0]
    if halo == 0:
        return x_local[:0]
    tl = min(halo, C)
    tails = all_gather_cat(x_local[C - tl:], group)                            # [ws * tl, ...]
    g = torch.arange(rank * C - halo, rank * C, device=x_local.device)                             # global rows wanted
    owner = torch.div(g, C, rounding_mode="floor")
    row = owner * tl + (g - owner * C - (C - tl))                              # row in `tails`
    ok = g >= 0
    out = tails[row.clamp(min=0)]
    return torch.where(ok.view(-1, *([1] * (x_local.dim() - 1))), out, torch.zeros_like(out))


def gather_entries(comp: torch.Tensor, entry_seg: torch.Tensor, entry_j: torch.Tensor, group=None):
    """All ranks' compressed entries, rank-major (= stream order), each rank padded to the largest count.

    comp [n_r, D], entry_seg/entry_j [n_r] -> [ws * n_max, D], [ws * n_max] (padding: seg -1, j 0, value 0).
    """
    group = group or dist.group.WORLD
    n = torch.tensor([comp.shape[0]], dtype=torch.long, device=comp.device)
    n_max = int(all_gather_cat(n, group).max())
    if n_max == 0:                                                             # no entry anywhere yet
        return comp, entry_seg, entry_j
    pad = n_max - comp.shape[0]
    comp_p = torch.cat([comp, comp.new_zeros(pad, *comp.shape[1:])])
    seg_p = torch.cat([entry_seg, entry_seg.new_full((pad,), -1)])
    j_p = torch.cat([entry_j, entry_j.new_zeros(pad)])
    return all_gather_cat(comp_p, group), all_gather_cat(seg_p, group), all_gather_cat(j_p, group)


# ---------------------------------------------------------------------------------------------- attention (D8)


def cp_attention_forward(attn, h_local: torch.Tensor, cu_seqlens, total: int, cu_seqlens_padded=None,
                         group=None) -> torch.Tensor:
    """DSv4 attention on this rank's contiguous chunk: h_local [1, C, d] -> [1, C, d].

    Equals rows [r C, (r+1) C) of the single-rank packed run (`thd.thd_attention_forward`), forward and backward.
    """
    group = group or cp_group()
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    if h_local.dim() != 3 or h_local.shape[0] != 1:
        raise THDError(f"h_local: must be [1, C, d], got {tuple(h_local.shape)}")
    C = h_local.shape[1]
    if C * cp != total:
        raise THDError(f"h_local: chunk of {C} tokens x cp={cp} != total {total}")
    halo = attention_halo(attn.cfg, attn.layer_idx)
    seg, pos = rank_layout(cu_seqlens, total, cp, rank, halo, cu_seqlens_padded)
    seg, pos = seg.to(h_local.device), pos.to(h_local.device)
    x = torch.cat([left_halo(h_local[0], halo, group), h_local[0]], dim=0)    # [halo + C, d]
    out = attention_on_layout(attn, x, seg, pos, halo,
                              gather_entries=lambda c, s, j: gather_entries(c, s, j, group))
    return out[None]                                                           # [C, d] -> [1, C, d]


def simulate_cp_attention(attn, h: torch.Tensor, cu_seqlens, cp: int, cu_seqlens_padded=None) -> torch.Tensor:
    """Single-process emulation of `cp_attention_forward` on cp ranks (same layout, halo and entry-gather
    math, no torch.distributed): h [1, T, d] -> [1, T, d], the cp chunk outputs concatenated. For goldens and
    quick checks; differentiable."""
    T = h.shape[1]
    halo = attention_halo(attn.cfg, attn.layer_idx)
    ranks = []
    for r in range(cp):
        s, e = contiguous_chunk(T, cp, r)
        seg, pos = rank_layout(cu_seqlens, T, cp, r, halo, cu_seqlens_padded)
        rows = torch.arange(s - halo, e, device=h.device)                      # halo rows, then the chunk
        x = torch.where((rows >= 0)[:, None], h[0, rows.clamp(min=0)], torch.zeros((), device=h.device))
        ranks.append((x, seg.to(h.device), pos.to(h.device)))                  # x [halo + C, d]

    local = [[] for _ in range(cp)]                 # phase 1: every rank's locally closed entries, per call

    def record(r):
        def fn(c, s, j):
            local[r].append((c, s, j))
            return c, s, j
        return fn

    for r, (x, seg, pos) in enumerate(ranks):
        attention_on_layout(attn, x, seg, pos, halo, gather_entries=record(r))

    def gathered(r):                                # phase 2: rank r sees all ranks' entries, rank-major
        calls = iter(range(len(local[0])))

        def fn(c, s, j):
            k = next(calls)
            return (torch.cat([local[q][k][0] if q != r else c for q in range(cp)]),
                    torch.cat([local[q][k][1] for q in range(cp)]), torch.cat([local[q][k][2] for q in range(cp)]))
        return fn

    outs = [attention_on_layout(attn, x, seg, pos, halo, gather_entries=gathered(r))
            for r, (x, seg, pos) in enumerate(ranks)]
    return torch.cat(outs)[None]


# ---------------------------------------------------------------------------------------------- full model


def cp_model_forward(model, input_ids: torch.Tensor, labels: torch.Tensor | None, cu_seqlens, total: int,
                     cu_seqlens_padded=None, group=None):
    """A `DSv4Model` on this rank's contiguous chunk of a packed stream: input_ids / labels [1, C] ->
    the model's output for the chunk (logits, mtp_logits). Attention layers run `cp_attention_forward`; the MTP
    block reads ids_next rolled inside documents across the rank boundary (model/mtp_roll.py). With labels,
    `out.loss` is this rank's SHARE of the global loss (sum over ranks = the single-rank packed loss): CE sums
    divided by the global target counts (all-reduced), indexer KL means weighted by global query counts.
    MoE auxiliary losses are not included (their per-sequence statistics would need a CP all-reduce).
    """
    import torch.nn.functional as F
    from .mtp_roll import IGNORE, roll_packed_cp
    group = group or cp_group()
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    seg, _ = rank_layout(cu_seqlens, total, cp, rank, 0, cu_seqlens_padded)
    seg = seg.to(input_ids.device)
    ids_roll, _ = roll_packed_cp(input_ids[0], seg, group, fill=0)             # [C] next token in the doc
    ids_roll = ids_roll[None]
    attns = [m for m in model.modules() if type(m).__name__ == "DSv4Attention"]
    mtps = list(getattr(model, "mtp", []))

    def attn_fwd(attn):
        return lambda h, positions=None, backend=None: cp_attention_forward(attn, h, cu_seqlens, total,
                                                                            cu_seqlens_padded, group)

    def mtp_fwd(orig):
        return lambda X, e_next, ids_next, positions=None: orig(X, model.embed(ids_roll), ids_roll, positions)

    recompute = getattr(model, "recompute", False)      # whole-block recompute would re-run after the patch
    try:
        model.recompute = False
        for a in attns:
            a.forward = attn_fwd(a)
        for blk in mtps:
            blk.forward = mtp_fwd(type(blk).forward.__get__(blk))
        out = model(input_ids)
    finally:
        model.recompute = recompute
        for m in attns + mtps:
            m.__dict__.pop("forward", None)
    if labels is None:
        return out

    def global_count(n):
        t = torch.tensor([float(n)], device=out.logits.device)
        dist.all_reduce(t, group=group)
        return float(t)

    V = out.logits.shape[-1]
    lm_sum = F.cross_entropy(out.logits.float().reshape(-1, V), labels.reshape(-1), ignore_index=IGNORE,
                             reduction="sum")
    loss = lm_sum / global_count((labels != IGNORE).sum())
    if out.mtp_logits is not None:
        mtp_labels, _ = roll_packed_cp(labels[0], seg, group, fill=IGNORE)
        mtp_sum = F.cross_entropy(out.mtp_logits.float().reshape(-1, V), mtp_labels.reshape(-1),
                                  ignore_index=IGNORE, reduction="sum")
        loss = loss + model.cfg.mtp_loss_scaling_factor * mtp_sum / global_count((mtp_labels != IGNORE).sum())
    for a in attns:
        if getattr(a, "indexer_loss", None) is not None:
            n = a.indexer_loss_queries
            loss = loss + a.indexer_loss * (n / max(global_count(n), 1.0))
    out.loss = loss
    return out
