"""Static-shape PackedSeqParams: flatten / rebuild for CUDA-graph capture (external prerequisite #5672).

A CUDA graph replays fixed tensor shapes and fixed Python scalars, but each packed (THD) micro-batch has its own
number of documents and its own `cu_seqlens`. #5672 makes PackedSeqParams capturable by
  * padding every cu_seqlens vector to a fixed length `max_seqs + 1` by repeating its last offset, i.e. adding
    zero-length documents at the end, which attend nothing and are attended by nothing;
  * replacing the per-batch `max_seqlen_*` Python ints by a static bound (the micro-batch token budget);
  * flattening all of it into ONE int32 buffer [4, max_seqs + 1] (rows: cu_seqlens_q, cu_seqlens_kv,
    cu_seqlens_q_padded, cu_seqlens_kv_padded) that a captured graph reads, and that `copy_into` overwrites
    in place before each replay.
`rebuild` turns the buffer back into Megatron's `PackedSeqParams` (megatron.core.packed_seq_params) whose
tensors are views of the buffer, so a replay sees the new batch. Transformer Engine itself is not installable on
these machines: the TE graph capture is not exercised here; the same buffer is exercised with
torch.cuda.graphs when a GPU is present (slices/ext_5672/test_packed_seq.py).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .layout import seg_pos_of_offsets

ROWS = ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded")


class PackedSeqError(ValueError):
    """Bad packed-sequence metadata (one line naming the field)."""


def _packed_seq_params_cls():
    try:
        from megatron.core.packed_seq_params import PackedSeqParams
        return PackedSeqParams
    except ImportError:   # megatron-core is a dependency; keep a clear message if it is missing
        raise PackedSeqError("megatron-core is not installed: PackedSeqParams unavailable") from None


def flatten(params, max_seqs: int, max_seqlen: int, device=None) -> torch.Tensor:
    """PackedSeqParams (thd) -> int32 buffer [4, max_seqs + 1] (static shape for any batch with <= max_seqs docs)."""
    if getattr(params, "qkv_format", "thd") != "thd":
        raise PackedSeqError(f"PackedSeqParams.qkv_format: must be 'thd', got {params.qkv_format!r}")
    buf = torch.empty(len(ROWS), max_seqs + 1, dtype=torch.int32, device=device)
    copy_into(buf, params, max_seqlen)
    return buf


def copy_into(buf: torch.Tensor, params, max_seqlen: int) -> torch.Tensor:
    """Overwrite a static buffer in place with a new batch's metadata (before a graph replay)."""
    max_seqs = buf.shape[1] - 1
    for r, name in enumerate(ROWS):
        cu = getattr(params, name, None)
        if cu is None:                        # unpadded params: the padded offsets equal the real ones
            cu = getattr(params, ROWS[r - 2]) if r >= 2 else None
        if cu is None:
            raise PackedSeqError(f"PackedSeqParams.{name}: missing")
        cu = torch.as_tensor(cu).flatten()
        n = cu.numel() - 1
        if n < 0 or int(cu[0]) != 0:
            raise PackedSeqError(f"PackedSeqParams.{name}: must start at 0")
        if n > max_seqs:
            raise PackedSeqError(f"PackedSeqParams.{name}: {n} documents exceed the static max_seqs {max_seqs}")
        if n and bool((cu[1:] < cu[:-1]).any()):
            raise PackedSeqError(f"PackedSeqParams.{name}: must be non-decreasing")
        lens = cu[1:] - cu[:-1]
        if n and int(lens.max()) > max_seqlen:
            raise PackedSeqError(f"PackedSeqParams.{name}: a document of {int(lens.max())} tokens exceeds "
                                 f"the static max_seqlen {max_seqlen}")
        row = torch.cat([cu, cu[-1:].expand(max_seqs - n)])    # zero-length documents at the end
        buf[r].copy_(row.to(torch.int32))
    return buf


def rebuild(buf: torch.Tensor, max_seqlen: int):
    """int32 buffer [4, max_seqs + 1] -> PackedSeqParams whose cu_seqlens are views of `buf`."""
    if buf.dim() != 2 or buf.shape[0] != len(ROWS) or buf.dtype != torch.int32:
        raise PackedSeqError(f"buffer: must be int32 [4, max_seqs+1], got {buf.dtype} {tuple(buf.shape)}")
    PSP = _packed_seq_params_cls()
    return PSP(qkv_format="thd", cu_seqlens_q=buf[0], cu_seqlens_kv=buf[1], cu_seqlens_q_padded=buf[2],
               cu_seqlens_kv_padded=buf[3], max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen)


class StreamOffsets(NamedTuple):
    """The fields `copy_into` reads, for self-attention on one packed stream (q and kv share the offsets): a
    duck-typed PackedSeqParams that needs no megatron-core (the GPU machines have none; P11's static step)."""
    cu_seqlens_q: torch.Tensor
    cu_seqlens_kv: torch.Tensor
    cu_seqlens_q_padded: torch.Tensor | None
    cu_seqlens_kv_padded: torch.Tensor | None
    qkv_format: str = "thd"


def stream_offsets(cu_seqlens, cu_seqlens_padded=None) -> StreamOffsets:
    """cu_seqlens (+ the padded slot offsets) of a packed stream -> its `StreamOffsets`."""
    return StreamOffsets(cu_seqlens, cu_seqlens, cu_seqlens_padded, cu_seqlens_padded)


def make_params(cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor | None = None):
    """PackedSeqParams for self-attention on a packed stream (q and kv share the offsets)."""
    PSP = _packed_seq_params_cls()
    cu = torch.as_tensor(cu_seqlens, dtype=torch.int32)
    cup = cu if cu_seqlens_padded is None else torch.as_tensor(cu_seqlens_padded, dtype=torch.int32)
    mx = int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0
    return PSP(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cup,
               cu_seqlens_kv_padded=cup, max_seqlen_q=mx, max_seqlen_kv=mx)


def seg_pos_static(buf: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(seg [T], pos [T]) of the packed stream described by `buf`, with no host synchronisation and static
    shapes, so it can run inside a captured CUDA graph. Same result as model.layout.seg_pos_from_cu_seqlens."""
    return seg_pos_of_offsets(buf[0], buf[2], total)                         # real / padded offsets [n+1]
