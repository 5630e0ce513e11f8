"""Compressor softmax pooling on a packed token stream, plain PyTorch reference (spec §6.2 HCA, §6.3 CSA).

Only the gated pooling lives here; the projections (wkv, wgate), the RMSNorm and the RoPE of the entries are
applied by `model/compressor.py`. Layout THD (token-major `[T, ...]`, Megatron's `t h d`) with the per-token
document metadata of the stream (model/layout.py): `seg [T]` (document id, -1 = padding), `pos [T]` (position
inside the document). A plain sequence is one document (seg 0, pos 0..S-1).

    entry (doc, j) closes at the token with pos = (j+1) m - 1 and pools that document's tokens j m .. (j+1) m - 1:
    HCA (overlap=False): softmax over the m tokens, per channel, of gate + ape;
    CSA (overlap=True):  2m slots per channel -- slots 0..m-1 = tokens (j-1) m .. j m - 1, FIRST half of the
                         channels ([..., :D], the "previous-window" series), slots m..2m-1 = window j, SECOND
                         half ([..., D:]). Entry j = 0 has no previous window: those slots get weight exactly 0.
An entry never pools two documents; trailing tokens that do not fill a window give no entry.

Static shapes (CUDA graphs, torch.compile): the entries are returned in N = ceil((T - first) / m) SLOTS, slot s
holding the entry that closes at a token index in [first + s m, first + (s+1) m) (at most one can: two entries
close at least m tokens apart), empty slots with seg -1 and value 0. Tokens before `first` are left context only
(a context-parallel halo): they feed windows that close at or after `first` and produce no entry themselves.
The softmax runs in fp32 (fp64 for fp64 inputs; ape is fp32); the pooled vector is returned in kv's dtype.

The slot metadata (`Slots`: ends, entry seg / j, window start r0, has-previous hp) depends only on seg / pos,
ratio, overlap and `first`, not on the layer: `compress_slots` computes it, `compress_pool(..., slots=)` takes it
precomputed (model/layout.Layout.compress_slots computes it once per layout and key for every layer).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from dsv4.kernels._varlen import clamp_rows


class LayoutError(ValueError):
    """Bad packed-stream input of a kernel op (one line, naming the field)."""


def num_slots(T: int, ratio: int, first: int = 0) -> int:
    """Static number of entry slots of a stream of T tokens whose first `first` are left context."""
    return -(-(T - first) // ratio)


def entry_slots(seg: torch.Tensor, pos: torch.Tensor, ratio: int, first: int = 0):
    """(ends [N] long, valid [N] bool, j [N] long): the token index where slot s's entry closes (any in-range
    index when empty), whether the slot holds an entry, and the entry's index j in its document (0 if empty)."""
    m = ratio
    T = seg.shape[0]
    L = T - first
    N = num_slots(T, m, first)
    closes = (seg[first:] >= 0) & ((pos[first:] + 1) % m == 0)                    # [L]
    closes = torch.cat([closes, closes.new_zeros(N * m - L)]).view(N, m)
    valid = closes.any(dim=1)
    off = closes.to(torch.int8).argmax(dim=1)                                    # the one closing token
    ends = torch.where(valid, first + torch.arange(N, device=seg.device) * m + off,
                       torch.full_like(off, T - 1))
    j = torch.where(valid, (pos[ends] + 1) // m - 1, torch.zeros_like(ends))
    return ends, valid, j


class Slots(NamedTuple):
    """The slot metadata of a stream for one (ratio, overlap, first): ends / entry_seg / j [N] (`entry_slots`;
    entry_seg -1 in an empty slot), r0 [N] int32 (first row of the entry's window, -1 when empty) and hp [N] int32
    (1: the entry has a previous window, CSA j > 0), all integer tensors without autograd; ratio / overlap / first
    name what it was computed for (checked by `compress_pool`)."""
    ends: torch.Tensor
    entry_seg: torch.Tensor
    j: torch.Tensor
    r0: torch.Tensor
    hp: torch.Tensor
    ratio: int
    overlap: bool
    first: int


def check_ratio(ratio: int, fn: str) -> None:
    """A compression ratio must be positive (`fn` names the op in the one-line error); every backend's check."""
    if ratio <= 0:
        raise LayoutError(f"{fn}: ratio must be positive, got {ratio}")


def compress_slots(seg: torch.Tensor, pos: torch.Tensor, ratio: int, overlap: bool, first: int = 0) -> Slots:
    """The `Slots` of the stream seg / pos [T] (the reference of the Triton `_slot_meta` kernel)."""
    check_ratio(ratio, "compress_slots")
    ends, valid, j = entry_slots(seg, pos, ratio, first)
    eseg = torch.where(valid, seg[ends], torch.full_like(ends, -1))
    r0 = torch.where(valid, ends - (ratio - 1), torch.full_like(ends, -1)).to(torch.int32)
    hp = (valid & (j > 0)) if overlap else torch.zeros_like(valid)
    return Slots(ends, eseg, j, r0, hp.to(torch.int32), int(ratio), bool(overlap), int(first))


def check_slots(slots: Slots, T: int, ratio: int, overlap: bool, first: int) -> None:
    """Precomputed slots must be those of this call's (ratio, overlap, first) and stream length (one line)."""
    got = (slots.ratio, slots.overlap, slots.first)
    if got != (ratio, bool(overlap), first):
        raise LayoutError(f"compress_pool: slots were computed for (ratio, overlap, first) = {got}, the call has "
                          f"{(ratio, bool(overlap), first)}")
    N = num_slots(T, ratio, first)
    if slots.ends.shape != (N,):
        raise LayoutError(f"compress_pool: slots hold {tuple(slots.ends.shape)} entries, a stream of {T} tokens "
                          f"(first {first}) has [{N}]")


def check_args(kv: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, ratio: int, overlap: bool,
               seg: torch.Tensor, pos: torch.Tensor) -> None:
    """The argument contract of compress_pool, shared by every backend (one-line errors)."""
    check_ratio(ratio, "compress_pool")
    if kv.dim() != 2:
        raise LayoutError(f"compress_pool: kv must be [T, coff*D], got {tuple(kv.shape)}")
    T, W = kv.shape
    if gate.shape != kv.shape:
        raise LayoutError(f"compress_pool: gate shape {tuple(gate.shape)} != kv shape {tuple(kv.shape)}")
    if tuple(ape.shape) != (ratio, W):
        raise LayoutError(f"compress_pool: ape shape {tuple(ape.shape)} != (ratio, coff*D) = {(ratio, W)}")
    if overlap and W % 2:
        raise LayoutError(f"compress_pool: overlap needs an even channel count, got {W}")
    if tuple(seg.shape) != (T,) or tuple(pos.shape) != (T,):
        raise LayoutError(f"compress_pool: seg / pos must be [T] = [{T}], got {tuple(seg.shape)} / {tuple(pos.shape)}")


def pool_rows(seg, pos, ends, valid, j, ratio: int, overlap: bool):
    """Token rows [N, m] of the current window and, with overlap, of the previous one (clamped; `has_prev` [N]),
    after checking (CPU tensors) that every valid entry's rows are inside the stream and its document (a CP halo
    must be long enough)."""
    m = ratio
    cur = ends[:, None] - (m - 1) + torch.arange(m, device=ends.device)           # [N, m]
    need = torch.where(j > 0, 2 * m, m) if overlap else torch.full_like(j, m)
    first_row = ends - need + 1
    bad = valid & ((first_row < 0) | (seg[clamp_rows(first_row)] != seg[ends]))
    # a data-dependent check (a host sync): made on CPU tensors (the tests, CI) only, never on an accelerator or
    # under torch.compile; the halo length itself is static (model/attention.attention_halo)
    if seg.device.type == "cpu" and not torch.compiler.is_compiling() and bool(bad.any()):
        raise LayoutError(f"kv: a compression window starts before the stream (halo shorter than "
                          f"{(2 if overlap else 1) * m - 1})")
    return clamp_rows(cur), clamp_rows(cur - m), j > 0


def compress_pool(kv: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, ratio: int, overlap: bool,
                  seg: torch.Tensor, pos: torch.Tensor, first: int = 0, slots: Slots | None = None):
    """kv, gate [T, coff*D]; ape [m, coff*D]; seg / pos [T] -> (pooled [N, D], entry_seg [N], entry_j [N],
    ends [N]) in N = ceil((T - first) / m) static slots (coff = 2 if overlap else 1; empty slots: seg -1, 0).
    `slots`: the stream's `compress_slots(seg, pos, ratio, overlap, first)`, precomputed (else computed here)."""
    check_args(kv, gate, ape, ratio, overlap, seg, pos)
    m = ratio
    W = kv.shape[1]
    D = W // 2 if overlap else W
    if slots is None:
        slots = compress_slots(seg, pos, m, overlap, first)
    else:
        check_slots(slots, kv.shape[0], m, overlap, first)
    ends, j = slots.ends, slots.j
    valid = slots.entry_seg >= 0
    cur, prev, has_prev = pool_rows(seg, pos, ends, valid, j, m, overlap)
    dt = torch.promote_types(kv.dtype, torch.float32)                            # fp32 (fp64 stays fp64)
    zc = gate[cur].to(dt) + ape.to(dt)[None]                                     # [N, m, coff*D]
    vc = kv[cur]
    if not overlap:
        logits, vals = zc, vc                                                    # [N, m, D]
    else:
        hp = has_prev[:, None, None]
        zp = torch.where(hp, gate[prev][..., :D].to(dt) + ape.to(dt)[None, :, :D],
                         torch.full((), float("-inf"), dtype=dt, device=kv.device))     # empty -> weight 0
        vp = torch.where(hp, kv[prev][..., :D], torch.zeros((), dtype=kv.dtype, device=kv.device))
        logits = torch.cat([zp, zc[..., D:]], dim=1)                             # [N, 2m, D] slots
        vals = torch.cat([vp, vc[..., D:]], dim=1)
    alpha = torch.softmax(logits, dim=1)                                         # per channel over slots
    comp = (alpha * vals.to(dt)).sum(1)                                          # [N, D]
    comp = torch.where(valid[:, None], comp, torch.zeros((), dtype=dt, device=kv.device)).to(kv.dtype)
    return comp, slots.entry_seg, j, ends
