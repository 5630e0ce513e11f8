"""Token-level KV compressor (spec §6): gated softmax pooling of m tokens into one entry, RMSNorm, RoPE.

Parameters (official names, spec §6.1 / §11.3): `wkv` [coff*D, d], `wgate` [coff*D, d], `ape` [m, coff*D] fp32,
`norm` (RMSNorm weight [D]); coff = 1 for HCA (non-overlapping windows of m' tokens), coff = 2 for CSA and the
indexer's compressor (width 2m, stride m: the FIRST half of the channels of window w-1 and the SECOND half of
window w feed entry w -- the code layout, not the paper's letters, spec §13.2).

On a packed token stream (model/layout.py: seg / pos per token): entry (doc, j) covers its document's tokens
[j*m, (j+1)*m) and is rotated at the RoPE position of its FIRST token (= j*m by default). Trailing tokens that
do not fill a window give no entry. The pooling itself is the kernel op `dsv4.kernels.compressor.compress_pool`
(THD, static entry slots, softmax in fp32).
"""
from __future__ import annotations

import torch
from torch import nn

from dsv4.kernels.compressor import compress_pool
from dsv4.kernels._varlen import clamp_rows

from .norm import RMSNorm
from .rope import RotaryTable


class Compressor(nn.Module):
    def __init__(self, dim: int, head_dim: int, ratio: int, overlap: bool, rope: RotaryTable, eps: float = 1e-6):
        super().__init__()
        if ratio <= 0:
            raise ValueError(f"Compressor: ratio must be positive, got {ratio}")
        if head_dim < rope.rope_dim:
            raise ValueError(f"Compressor: head_dim {head_dim} < rope dims {rope.rope_dim}")
        self.dim, self.head_dim, self.ratio, self.overlap = dim, head_dim, ratio, overlap
        coff = 2 if overlap else 1
        self.wkv = nn.Linear(dim, coff * head_dim, bias=False)
        self.wgate = nn.Linear(dim, coff * head_dim, bias=False)
        self.ape = nn.Parameter(torch.zeros(ratio, coff * head_dim, dtype=torch.float32))   # fp32-kept
        self.norm = RMSNorm(head_dim, eps)
        self.rope = rope     # shared table ("compress"); holds no parameters

    def forward(self, x: torch.Tensor, seg: torch.Tensor, pos: torch.Tensor, rope_pos: torch.Tensor,
                first: int = 0, backend: str = "naive", slots=None):
        """x [T,d] (THD), seg / pos / rope_pos [T] -> (entries [N,D], entry_seg [N], entry_j [N]) for the windows
        closing at tokens >= `first`, in N = ceil((T - first) / m) static slots (empty: seg -1, value 0).
        `slots`: the stream's slot metadata for (ratio, overlap, first), precomputed once per layout
        (`Layout.compress_slots`); None: computed here."""
        pooled, eseg, ej, ends = compress_pool(self.wkv(x), self.wgate(x), self.ape, self.ratio, self.overlap,
                                               seg, pos, first, backend=backend, slots=slots)      # [N, D]
        comp = self.norm(pooled)
        if comp.shape[0] == 0:
            return comp, eseg, ej
        return self.rope(comp, rope_pos[clamp_rows(ends - (self.ratio - 1))]), eseg, ej   # at its first token

    def extra_repr(self) -> str:
        return f"ratio={self.ratio}, overlap={self.overlap}, head_dim={self.head_dim}"
