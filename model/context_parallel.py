"""Static contiguous context parallelism for DSv4 attention (D7 layout + boundary primitives, D8 attention).

Layout (Megatron `cp_partition_mode='contiguous'`, megatron_dsv4.md §2.6): a packed stream of T tokens
(T % cp == 0; pad with `cu_seqlens_padded` first) is cut into cp rank-major chunks of C = T / cp tokens:
rank r holds tokens [r C, (r+1) C). Document metadata (cu_seqlens, cu_seqlens_padded) is replicated on every
rank, so each rank derives seg / pos of any token locally (model/layout.py) -- RoPE positions restart per
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
input gradients equal the single-rank run. Every rank has the same static number of entry slots,
ceil(C / m) per compressor (kernels/compressor), so the gather needs no count exchange.

CP is a LAYOUT TRANSFORMATION (`CPLayout`, a model/layout.Layout): the same DSv4Model / DSv4Attention forward
runs on a rank's chunk with `layout=CPLayout(...)`; the layout supplies the halo rows (`context`), the other
ranks' entries (`gather_entries`), the MTP roll across the rank boundary (`roll_next`, model/mtp_roll.py) and
the global target / query counts of the loss (`global_count`: each rank's loss is its share of the global
loss, model/losses.assemble_losses). Nothing is patched. The MoE sequence-wise balance loss under CP uses the
rank's chunk as its sequence.

Process groups: any torch.distributed group (gloo on CPU, NCCL on GPU); `cp_group()` returns Megatron-Core's
`parallel_state.get_context_parallel_group()` when Megatron's model parallel state is initialised, else WORLD.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from dsv4.kernels._varlen import clamp_rows

from .layout import Layout, LayoutError, from_packed_seq_params, seg_pos_from_cu_seqlens


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
    mode = getattr(psp, "cp_partition_mode", "contiguous")
    if mode != "contiguous":
        raise LayoutError(f"packed_seq_params.cp_partition_mode: DSv4 CP needs 'contiguous', got {mode!r}")
    return from_packed_seq_params(psp)


def contiguous_chunk(T: int, cp: int, rank: int) -> tuple[int, int]:
    """[start, end) of rank's chunk in a stream of T tokens split into cp contiguous rank-major chunks."""
    if cp < 1 or not 0 <= rank < cp:
        raise LayoutError(f"cp_rank: rank {rank} outside 0..{cp - 1}")
    if T % cp:
        raise LayoutError(f"total: {T} tokens is not a multiple of cp={cp} (pad with cu_seqlens_padded)")
    C = T // cp
    return rank * C, (rank + 1) * C


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
    out = tails[clamp_rows(row)]
    return torch.where(ok.view(-1, *([1] * (x_local.dim() - 1))), out, torch.zeros_like(out))


def gather_entries(comp: torch.Tensor, entry_seg: torch.Tensor, entry_j: torch.Tensor, group=None,
                   static: bool = False):
    """All ranks' compressed entries, rank-major (= stream order), differentiable in comp.

    comp [n_r, D], entry_seg/entry_j [n_r] -> [ws * n, D], [ws * n]. static=True: every rank has the same n
    (the static entry slots of kernels/compressor; no count exchange, no host sync). Otherwise each rank is
    padded to the largest count (padding rows: seg -1, j 0, value 0).
    """
    group = group or dist.group.WORLD
    if not static:
        n = torch.tensor([comp.shape[0]], dtype=torch.long, device=comp.device)
        n_max = int(all_gather_cat(n, group).max())
        if n_max == 0:                                                         # no entry anywhere yet
            return comp, entry_seg, entry_j
        pad = n_max - comp.shape[0]
        comp = torch.cat([comp, comp.new_zeros(pad, *comp.shape[1:])])
        entry_seg = torch.cat([entry_seg, entry_seg.new_full((pad,), -1)])
        entry_j = torch.cat([entry_j, entry_j.new_zeros(pad)])
    return all_gather_cat(comp, group), all_gather_cat(entry_seg, group), all_gather_cat(entry_j, group)


# ---------------------------------------------------------------------------------------------- the layout


class CPLayout(Layout):
    """This rank's contiguous chunk [1, C] of a packed stream of `total` tokens, as a layout (see module doc)."""

    def __init__(self, cu_seqlens, total: int, cu_seqlens_padded=None, group=None, device=None):
        self.group = group or cp_group()
        self.cp, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        self.total = int(total)
        self.start, self.end = contiguous_chunk(self.total, self.cp, self.rank)
        gseg, gpos = seg_pos_from_cu_seqlens(cu_seqlens, self.total, cu_seqlens_padded)
        self._gseg, self._gpos = gseg.to(device), gpos.to(device)
        cu = torch.as_tensor(cu_seqlens).cpu()
        cup = None if cu_seqlens_padded is None else torch.as_tensor(cu_seqlens_padded).cpu()
        super().__init__(self._gseg[self.start:self.end], self._gpos[self.start:self.end],
                         (1, self.end - self.start), cu, cup)

    @classmethod
    def from_packed_seq_params(cls, psp, total: int, group=None, device=None) -> "CPLayout":
        cu, cup = cu_seqlens_from_packed_seq_params(psp)
        return cls(cu, total, cup, group, device)

    def context(self, x, halo):
        return (torch.cat([left_halo(x, halo, self.group), x], dim=0), *self.context_meta(halo))

    def context_meta(self, halo):
        rows = torch.arange(self.start - halo, self.end, device=self._gseg.device)
        ok = rows >= 0
        seg = torch.where(ok, self._gseg[clamp_rows(rows)], torch.full_like(rows, -1))
        pos = torch.where(ok, self._gpos[clamp_rows(rows)], torch.zeros_like(rows))
        return seg, pos, pos, halo

    def gather_entries(self, comp, entry_seg, entry_j):
        return gather_entries(comp, entry_seg, entry_j, self.group, static=True)

    def roll_next(self, x, fill):
        from .mtp_roll import roll_packed_cp
        return roll_packed_cp(x[0], self.seg, self.group, fill)[0][None]

    def global_count(self, n):
        t = n.detach().to(torch.float64).clone().reshape(1)
        dist.all_reduce(t, group=self.group)
        return t[0].to(n.dtype)


def cp_attention_forward(attn, h_local: torch.Tensor, cu_seqlens, total: int, cu_seqlens_padded=None,
                         group=None) -> torch.Tensor:
    """DSv4 attention on this rank's contiguous chunk: h_local [1, C, d] -> [1, C, d] (= rows [r C, (r+1) C)
    of the single-rank packed run, forward and backward): `attn(h_local, CPLayout(...))`."""
    layout = CPLayout(cu_seqlens, total, cu_seqlens_padded, group, h_local.device)
    if h_local.dim() != 3 or tuple(h_local.shape[:2]) != layout.shape:
        raise LayoutError(f"h_local: must be [1, C, d] = [1, {layout.shape[1]}, d], got {tuple(h_local.shape)}")
    return attn(h_local, layout)


class _SimRankLayout(Layout):
    """One rank of `simulate_cp_attention`: the CP halo / entry exchange emulated in one process."""

    def __init__(self, gseg, gpos, start, end, h, store, rank, cp):
        super().__init__(gseg[start:end], gpos[start:end], (1, end - start))
        self._gseg, self._gpos, self.start, self.end, self._h = gseg, gpos, start, end, h
        self.store, self.rank, self.cp = store, rank, cp

    def context(self, x, halo):
        # only the halo rows are gathered (the local rows are x); seg / pos / q_offset are context_meta's
        rows = torch.arange(self.start - halo, self.start, device=x.device)    # [halo] stream rows
        zero = torch.zeros((), dtype=x.dtype, device=x.device)
        xh = torch.where((rows >= 0)[:, None], self._h[0, clamp_rows(rows)], zero)          # [halo, d]
        return (torch.cat([xh, x], dim=0), *self.context_meta(halo))            # halo from the stream, then x

    def context_meta(self, halo):
        rows = torch.arange(self.start - halo, self.end, device=self._gseg.device)
        ok = rows >= 0
        rc = clamp_rows(rows)
        seg = torch.where(ok, self._gseg[rc], torch.full_like(rows, -1))
        pos = torch.where(ok, self._gpos[rc], torch.zeros_like(rows))
        return seg, pos, pos, halo

    def gather_entries(self, comp, entry_seg, entry_j):
        calls = self.store.setdefault("calls", {})
        k = calls.get(self.rank, 0)
        calls[self.rank] = k + 1
        if self.store["phase"] == 1:                                           # record this rank's entries
            self.store.setdefault((self.rank, k), (comp, entry_seg, entry_j))
            return comp, entry_seg, entry_j
        parts = [self.store[(q, k)] if q != self.rank else (comp, entry_seg, entry_j) for q in range(self.cp)]
        return tuple(torch.cat([p[i] for p in parts]) for i in range(3))


def simulate_cp_attention(attn, h: torch.Tensor, cu_seqlens, cp: int, cu_seqlens_padded=None) -> torch.Tensor:
    """Single-process emulation of CP attention on cp ranks (the same layout, halo and entry-gather math, no
    torch.distributed): h [1, T, d] -> [1, T, d], the cp chunk outputs concatenated. For goldens and quick
    checks; differentiable."""
    T = h.shape[1]
    gseg, gpos = (t.to(h.device) for t in seg_pos_from_cu_seqlens(cu_seqlens, T, cu_seqlens_padded))
    store = {"phase": 1}
    chunks = [contiguous_chunk(T, cp, r) for r in range(cp)]
    lays = [_SimRankLayout(gseg, gpos, s, e, h, store, r, cp) for r, (s, e) in enumerate(chunks)]
    for lay, (s, e) in zip(lays, chunks):                                      # phase 1: local entries
        attn(h[:, s:e], lay)
    store["phase"], store["calls"] = 2, {}
    return torch.cat([attn(h[:, s:e], lay) for lay, (s, e) in zip(lays, chunks)], dim=1)


def rank_layout(cu_seqlens, total: int, cp: int, rank: int, halo: int = 0, cu_seqlens_padded=None):
    """(seg [halo + C], pos [halo + C]) of the halo rows then the local chunk; halo rows before the stream get
    seg -1 (nothing to attend)."""
    seg, pos = seg_pos_from_cu_seqlens(cu_seqlens, total, cu_seqlens_padded)
    start, end = contiguous_chunk(total, cp, rank)
    gidx = torch.arange(start - halo, end)
    ok = gidx >= 0
    seg_e = torch.where(ok, seg[clamp_rows(gidx)], torch.full_like(gidx, -1))
    pos_e = torch.where(ok, pos[clamp_rows(gidx)], torch.zeros_like(gidx))
    return seg_e, pos_e


def cp_model_forward(model, input_ids: torch.Tensor, labels: torch.Tensor | None, cu_seqlens, total: int,
                     cu_seqlens_padded=None, group=None):
    """A `DSv4Model` on this rank's contiguous chunk of a packed stream: input_ids / labels [1, C] -> the
    model's output for the chunk; `out.loss` is this rank's SHARE of the global loss (sum over ranks = the
    single-rank packed loss). = `model(input_ids, labels, layout=CPLayout(...))`."""
    layout = CPLayout(cu_seqlens, total, cu_seqlens_padded, group, input_ids.device)
    return model(input_ids, labels, layout=layout)
