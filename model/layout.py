"""One layout description per forward: the token batch as documents (Megatron's PackedSeqParams, D5 / D6).

Every forward of the network runs on a `Layout`. It describes the B*S tokens of `input_ids [B, S]`, flattened
row-major into one token stream, as documents:
  cu_seqlens        [n_docs+1]  cumulative REAL lengths of the documents,
  cu_seqlens_padded [n_docs+1]  cumulative PADDED lengths = the offsets of the documents in the stream
                                (document i occupies tokens cu_padded[i] .. cu_padded[i] + len_i - 1; the rest
                                of its padded slot is padding). Without it, the documents are back to back.
                                [n_docs+2]: a trailing dummy sequence of padding (harness/train/packing.py's
                                `append_dummy_seq` tail policy, Megatron's thd_tail_padding_policy).
A plain [B, S] batch is B documents of S tokens (`Layout.batch`), built at the API edge (DSv4Model.forward).
From the offsets follow, once per forward, two per-token integer vectors, the only metadata the kernels take
(kernels/<op>/naive.py):
  seg [T]  document id of the token, -1 for padding,
  pos [T]  position of the token inside its document (0 for padding); `rope_pos` (default pos) feeds RoPE.
Everything DSv4 does across tokens then restarts at document starts (spec §5.2, §6.2-6.3, §7.2; the four
classic THD bugs of peers_matrix §3: window clamped to the stream start, stream-wide RoPE positions,
compressor groups crossing documents, indexer scoring the whole stream).

Derived metadata that every layer of a kind shares is computed once per layout: `compress_slots` (the compressor's
entry slots of the rows a layer sees, per ratio / overlap / halo / batch row) is memoised on the layout, so a
forward computes it once per layer kind, not once per layer and compressor. DSv4Model.forward fills the memo
before the blocks run (eagerly, outside compiled blocks, `DSv4Attention.prepare_layout`). The memo assumes what
the layout promises anyway: seg / pos are not modified in place after the layout is built.

The layout is also the interface through which a parallel layout transforms the attention's view of the stream
(model/context_parallel.py's `CPLayout`): `context` (the rows a layer sees: local tokens plus a left halo),
`gather_entries` (the compressed entries of the other ranks), `roll_next` (the MTP input t+1 inside a
document) and `global_count` (loss denominators over ranks). This single-rank layout does nothing in each.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dsv4.kernels.compressor import compress_slots
from dsv4.kernels.compressor.naive import LayoutError, Slots

IGNORE = -100


def _check_cu(name: str, cu: torch.Tensor) -> None:
    if cu.dim() != 1 or cu.numel() < 1 or cu.dtype.is_floating_point:
        raise LayoutError(f"{name}: must be a 1-D integer tensor [n_docs+1], got {tuple(cu.shape)} {cu.dtype}")
    if int(cu[0]) != 0:
        raise LayoutError(f"{name}: must start at 0, got {int(cu[0])}")
    if bool((cu[1:] < cu[:-1]).any()):
        raise LayoutError(f"{name}: must be non-decreasing, got {cu.tolist()}")


def _host_offsets(cu_seqlens, total: int | None, cu_seqlens_padded=None):
    """The checked offsets of a packed stream on the host: (cu [n+1], slot starts / ends cup [n+1], T) as long
    CPU tensors (cup = cu without padding; a trailing dummy sequence's entry dropped). Device tensors are copied
    to the host in ONE transfer (one synchronisation); every check is a host computation."""
    given = [torch.as_tensor(x) for x in (cu_seqlens, cu_seqlens_padded) if x is not None]
    if len(given) == 2 and given[0].dim() == given[1].dim() == 1 and given[0].dtype == given[1].dtype \
            and given[0].device == given[1].device:
        host = torch.cat(given).cpu()                                           # one copy
        given = [host[:given[0].numel()], host[given[0].numel():]]
    else:
        given = [x.cpu() for x in given]
    cu, cup = given[0], (given[1] if len(given) == 2 else None)
    _check_cu("cu_seqlens", cu)
    cu = cu.long()
    lens = cu[1:] - cu[:-1]                                                     # [n_docs] real lengths
    if cup is None:
        cup = cu
        end = int(cu[-1])
    else:
        _check_cu("cu_seqlens_padded", cup)
        cup = cup.long()
        end = int(cup[-1])
        if cup.numel() == cu.numel() + 1:
            cup = cup[:-1]                                                      # a trailing dummy sequence
        elif cup.numel() != cu.numel():
            raise LayoutError(f"cu_seqlens_padded: has {cup.numel()} entries, cu_seqlens "
                              f"{cu.numel()} (or one more: a trailing dummy sequence)")
        if bool(((cup[1:] - cup[:-1]) < lens).any()):
            raise LayoutError("cu_seqlens_padded: a padded length is shorter than its real length")
    T = end if total is None else int(total)
    if T < end:
        raise LayoutError(f"total: {T} tokens is shorter than the packed documents ({end})")
    return cu, cup, T


def seg_pos_of_offsets(cu: torch.Tensor, cup: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(seg [T], pos [T]) from checked offsets cu / cup [n+1] (real / padded; equal without padding), on their
    device, with static shapes and no host synchronisation: token t lies in the padded slot i with
    cup[i] <= t < cup[i+1]; it is real (seg i, pos t - cup[i]) when t - cup[i] < cu[i+1] - cu[i], else padding
    (seg -1, pos 0). Zero-length slots hold no token (searchsorted skips them)."""
    n = cu.numel() - 1
    t = torch.arange(total, device=cu.device)                                   # [T]
    if n == 0:
        return torch.full_like(t, -1), torch.zeros_like(t)
    cu, cup = cu.long(), cup.long()
    doc = torch.searchsorted(cup[1:].contiguous(), t, right=True)               # [T] slot holding token t (n: past)
    doc_c = doc.clamp(max=n - 1)
    pos = t - cup[doc_c]                                                        # [T] offset inside the slot
    inside = (doc < n) & (pos < cu[doc_c + 1] - cu[doc_c])
    return torch.where(inside, doc_c, -1), torch.where(inside, pos, 0)


def seg_pos_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int | None = None,
                            cu_seqlens_padded: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(seg [T], pos [T]) of a packed stream, on the host; T = `total` (default: the last offset); trailing
    tokens = padding. Checks the offsets (LayoutError naming the field)."""
    cu, cup, T = _host_offsets(cu_seqlens, total, cu_seqlens_padded)
    return seg_pos_of_offsets(cu, cup, T)


QKV_FORMATS = ("thd", "sbhd")      # Megatron-Core PackedSeqParams.qkv_format values DSv4 reads


def qkv_format_of(psp) -> str:
    """A PackedSeqParams' qkv_format (duck-typed; an object without the field is 'thd'), checked."""
    fmt = getattr(psp, "qkv_format", "thd")
    if fmt not in QKV_FORMATS:
        raise LayoutError(f"packed_seq_params.qkv_format: must be 'thd' or 'sbhd', got {fmt!r}")
    return fmt


def _cu_of(psp) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(cu_seqlens_q, cu_seqlens_q_padded) on the host; DSv4 attention is self-attention, so the kv metadata
    must agree with q's where it is given. max_seqlen_q / kv are not read: every mask follows from the documents."""
    cu, cup = getattr(psp, "cu_seqlens_q", None), getattr(psp, "cu_seqlens_q_padded", None)
    kv, kvp = getattr(psp, "cu_seqlens_kv", None), getattr(psp, "cu_seqlens_kv_padded", None)
    if kv is not None and (cu is None or not torch.equal(torch.as_tensor(kv).cpu(), torch.as_tensor(cu).cpu())):
        raise LayoutError("packed_seq_params.cu_seqlens_kv: differs from cu_seqlens_q (self-attention only)")
    if kvp is not None and cup is not None and not torch.equal(torch.as_tensor(kvp).cpu(), torch.as_tensor(cup).cpu()):
        raise LayoutError("packed_seq_params.cu_seqlens_kv_padded: differs from cu_seqlens_q_padded")
    return (None if cu is None else torch.as_tensor(cu).cpu()), (None if cup is None else torch.as_tensor(cup).cpu())


def from_packed_seq_params(psp) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(cu_seqlens, cu_seqlens_padded) of a Megatron-Core `PackedSeqParams` of a packed stream (duck-typed:
    qkv_format 'thd', cu_seqlens_q / cu_seqlens_q_padded)."""
    if qkv_format_of(psp) != "thd":
        raise LayoutError(f"packed_seq_params.qkv_format: must be 'thd' for a packed stream, got {psp.qkv_format!r}")
    cu, cup = _cu_of(psp)
    if cu is None:
        raise LayoutError("packed_seq_params.cu_seqlens_q: missing ('thd' needs the documents' offsets)")
    return cu, cup


def roll_packed(x: torch.Tensor, seg: torch.Tensor, fill: float = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """y[t] = x[t+1] if tokens t and t+1 belong to the same document, else `fill`; x [T, ...] (token-major).

    Returns (y [T, ...], valid [T] bool). Padding tokens (seg -1) are never valid.
    """
    T = x.shape[0]
    nxt_seg = torch.cat([seg[1:], seg.new_full((1,), -1)])
    valid = (seg >= 0) & (nxt_seg == seg)
    nxt = torch.cat([x[1:], x[:1]], dim=0)                                     # x[t+1] (wraps; masked below)
    vshape = (T,) + (1,) * (x.dim() - 1)
    return torch.where(valid.view(vshape), nxt, fill), valid             # a Python fill: no host->device copy


@dataclass(eq=False)
class Layout:
    """The documents of a token batch [B, S] (flattened row-major to T = B*S tokens), single rank.

    seg / pos / rope_pos [T] (long, on the tokens' device); `shape` = (B, S); cu_seqlens (+ padded: the slot
    offsets, a trailing dummy sequence's entry dropped) on the host.
    """
    seg: torch.Tensor
    pos: torch.Tensor
    shape: tuple[int, int]
    cu_seqlens: torch.Tensor | None = None
    cu_seqlens_padded: torch.Tensor | None = None
    rope_pos: torch.Tensor | None = None
    # (ratio, overlap, halo, row) -> kernels.compressor Slots (`compress_slots`); filled in eager code only. An
    # init field: a copy by dataclasses.replace (FSDP's input cast does one per wrapped module) carries the memo
    _slots: dict = field(default_factory=dict, repr=False)
    # a static CUDA-graph buffer's layout (`from_static_buffer`): its offsets change between replays, so no host
    # decision may read them
    static: bool = False
    # the longest document in tokens, from the host offsets (every document of the stream, not only this rank's
    # piece under CP): a plain int that compiled code sees as a constant; None where the offsets live on the device
    # or in a static buffer. Filled by __post_init__ when not given.
    longest_document: int | None = None

    def __post_init__(self):
        if self.rope_pos is None:
            self.rope_pos = self.pos
        cu = self.cu_seqlens
        if self.longest_document is None and not self.static and cu is not None and cu.device.type == "cpu" \
                and cu.numel() >= 2:
            self.longest_document = int((cu[1:] - cu[:-1]).max())

    # ---------------------------------------------------------------- construction (the API edge)
    @classmethod
    def batch(cls, B: int, S: int, device=None, positions: torch.Tensor | None = None) -> "Layout":
        """B documents of S tokens (a plain batch). `positions` [S]: RoPE positions (default 0..S-1; the masks
        always use the index inside the document)."""
        pos = torch.arange(S, device=device).repeat(B)
        seg = torch.arange(B, device=device).repeat_interleave(S)
        rope = None
        if positions is not None:
            positions = torch.as_tensor(positions, device=device)
            if tuple(positions.shape) != (S,):
                raise LayoutError(f"positions: shape {tuple(positions.shape)} != (S,) = {(S,)}")
            rope = positions.long().repeat(B)
        cu = torch.arange(B + 1) * S
        return cls(seg, pos, (B, S), cu, None, rope, longest_document=S)

    @classmethod
    def packed(cls, cu_seqlens, shape: tuple[int, int], cu_seqlens_padded=None, device=None) -> "Layout":
        """The documents of `cu_seqlens` (+ `cu_seqlens_padded`) in the B*S tokens of a [B, S] batch (a document
        must not cross a row when B > 1). Offsets given on the host (as the data loader yields them) cost no
        host synchronisation; device offsets cost one (their copy to the host for the checks)."""
        B, S = shape
        given = [torch.as_tensor(x) for x in (cu_seqlens, cu_seqlens_padded) if x is not None]
        cu, cup, T = _host_offsets(given[0], B * S, given[1] if len(given) == 2 else None)   # one copy to the host
        if B > 1:                                                               # first / last token's row
            lens = cu[1:] - cu[:-1]
            real = lens > 0
            if bool(((cup[:-1] // S != (cup[:-1] + lens - 1) // S) & real).any()):
                raise LayoutError("cu_seqlens: a document crosses a row of the [B, S] batch")
        # seg / pos on the tokens' device: from the given offsets where they already live there (no copy),
        # else from a non-blocking copy of the checked host offsets
        dev = torch.device(device) if device is not None else given[0].device
        if all(x.device == dev for x in given):
            cu_d = given[0]
            cup_d = given[-1][:cu_d.numel()]                                    # (a trailing dummy entry dropped)
        else:
            cu_d, cup_d = (x.to(dev, non_blocking=True) for x in (cu, cup))
        seg, pos = seg_pos_of_offsets(cu_d, cup_d, T)
        return cls(seg, pos, (B, S), cu, None if cu_seqlens_padded is None else cup)

    @classmethod
    def from_static_buffer(cls, buf: torch.Tensor, shape: tuple[int, int]) -> "Layout":
        """The layout of a static PackedSeqParams buffer (model/packed_seq.py, #5672): seg / pos derived on the
        buffer's device with static shapes and no host synchronisation (CUDA-graph capturable)."""
        from .packed_seq import seg_pos_static
        B, S = shape
        seg, pos = seg_pos_static(buf, B * S)
        return cls(seg, pos, (B, S), buf[0], buf[2], static=True)

    @classmethod
    def from_packed_seq_params(cls, psp, shape: tuple[int, int], device=None) -> "Layout":
        """The layout of Megatron's tokens [s, b] (hidden states [s, b, h]) described by a `PackedSeqParams`
        (duck-typed; megatron.core.packed_seq_params), as the [b, s] batch of `shape` = (b, s):
          None                   b documents of s tokens (a plain batch);
          qkv_format 'thd'       one packed row (b = 1): the documents of cu_seqlens_q (+ cu_seqlens_q_padded);
          qkv_format 'sbhd'      row i is document i; with cu_seqlens_q [b+1], its first cu_q[i+1] - cu_q[i]
                                 tokens are real and the rest of the row is padding (Transformer Engine's padding
                                 mask for sbhd); without it, b documents of s tokens.
        Used by the Megatron entry points (DSv4Attention.forward_megatron, DSv4Model.forward_megatron)."""
        b, s = shape
        if psp is None:
            return cls.batch(b, s, device)
        if qkv_format_of(psp) == "thd":
            if b != 1:
                raise LayoutError(f"packed_seq_params.qkv_format: 'thd' tokens are one packed row [t, 1], got b = {b}")
            cu, cup = from_packed_seq_params(psp)
            return cls.packed(cu, shape, cup, device)
        cu, cup = _cu_of(psp)                                                   # sbhd
        if cu is None:
            return cls.batch(b, s, device)
        rows = torch.arange(b + 1) * s                                          # [b+1] row offsets
        if cu.dim() != 1 or cu.numel() != b + 1:
            raise LayoutError(f"packed_seq_params.cu_seqlens_q: 'sbhd' needs one length per row, [b+1] = [{b + 1}], "
                              f"got {tuple(cu.shape)}")
        if bool(((cu[1:] - cu[:-1]) > s).any()):
            raise LayoutError(f"packed_seq_params.cu_seqlens_q: a row's length exceeds s = {s}: {cu.tolist()}")
        if cup is not None and not torch.equal(cup.long(), rows):
            raise LayoutError(f"packed_seq_params.cu_seqlens_q_padded: 'sbhd' rows hold s = {s} tokens each, so it "
                              f"must be {rows.tolist()} or absent, got {cup.tolist()}")
        return cls.packed(cu, shape, rows, device)

    @property
    def num_tokens(self) -> int:
        return self.seg.shape[0]

    # ---------------------------------------------------------------- what a parallel layout transforms
    def context(self, x: torch.Tensor, halo: int):
        """The rows an attention layer sees for local tokens x [T, d]: (rows [T', d], seg, pos, rope_pos [T'],
        q_offset): rows q_offset.. are the local tokens, earlier rows left context. One rank: (x, ..., 0).
        seg / pos / rope_pos / q_offset are `context_meta(halo)`'s (a parallel layout keeps them so)."""
        return (x, *self.context_meta(halo))

    def context_meta(self, halo: int):
        """(seg, pos, rope_pos [T'], q_offset) of the rows `context(x, halo)` returns; needs no x."""
        return self.seg, self.pos, self.rope_pos, 0

    def compress_slots(self, ratio: int, overlap: bool, halo: int, row: int | None = None,
                       backend: str = "naive") -> Slots:
        """The compressor's slot metadata (kernels.compressor.compress_slots: entry ends / seg / j, window starts)
        of the rows a layer with left context `halo` sees (`context_meta(halo)`; first = its q_offset), of batch
        row `row` of a [B, S] layout (None: the whole stream), for windows of `ratio` tokens (overlap: CSA). It
        depends on the documents only, not on the layer: computed on the first call (integer tensors, no
        autograd graph) and kept on this layout for every later call with the same (ratio, overlap, halo, row) --
        the other layers of the kind, the indexer's compressor. Under torch.compile a miss is computed and not
        kept (no side effect in a graph; DSv4Model.forward fills the memo before its blocks run)."""
        key = (int(ratio), bool(overlap), int(halo), None if row is None else int(row))
        s = self._slots.get(key)
        if s is not None:
            return s
        seg, pos, _, q0 = self.context_meta(halo)
        if row is not None:
            if q0:
                raise LayoutError("compress_slots: a layout with a halo (context parallel) has one row")
            S = self.shape[1]
            seg, pos = seg[row * S:(row + 1) * S], pos[row * S:(row + 1) * S]
        with torch.no_grad():
            s = compress_slots(seg, pos, ratio, overlap, q0, backend=backend)
        if not torch.compiler.is_compiling():
            self._slots[key] = s
        return s

    def gather_entries(self, comp: torch.Tensor, entry_seg: torch.Tensor, entry_j: torch.Tensor):
        """All compressed entries a local query may see, from this rank's (one rank: its own)."""
        return comp, entry_seg, entry_j

    def roll_next(self, x: torch.Tensor, fill) -> torch.Tensor:
        """x [B, S, ...] -> x[t+1] inside t's document, else `fill` (MTP input ids / labels, spec §10.1)."""
        B, S = self.shape
        y, _ = roll_packed(x.reshape(B * S, *x.shape[2:]), self.seg, fill)
        return y.view(x.shape)

    def global_count(self, n: torch.Tensor) -> torch.Tensor:
        """A count summed over the ranks sharing the loss (one rank: n)."""
        return n
