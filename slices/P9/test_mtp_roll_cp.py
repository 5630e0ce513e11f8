"""P9: contiguous-CP packed MTP roll (cp = 2, 4; gloo) == the roll of each document alone.

Each rank rolls its chunk; the last local token takes row 0 of the next rank (ids, and a float tensor whose
gradient must return to the owner rank). Oracle: per-document loop in this process.
"""
import pytest
import torch

from dsv4.model.layout import seg_pos_from_cu_seqlens
from dsv4.slices.D8._workers import cp_roll_worker, spawn

LENS = [5, 19, 3, 37, 2, 10]
PADDED = [10, 22, 6, 42, 6, 14]          # T = 100: documents and padding straddle the rank boundaries


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_roll_equals_per_document(cp):
    cu = torch.tensor([0] + torch.tensor(LENS).cumsum(0).tolist())
    cup = torch.tensor([0] + torch.tensor(PADDED).cumsum(0).tolist())
    T = int(cup[-1])
    per_rank = spawn(cp_roll_worker, cp, cu, cup, T)
    ids_next = torch.cat([r["ids_next"] for r in per_rank])
    valid = torch.cat([r["valid"] for r in per_rank])
    x_next = torch.cat([r["x_next"] for r in per_rank])
    x_grad = torch.cat([r["x_grad"] for r in per_rank])
    seg, _ = seg_pos_from_cu_seqlens(cu, T, cup)
    ids = (torch.arange(T) * 7 + 3) % 97
    x = torch.randn(T, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    w = torch.randn(T, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    want_ids = torch.zeros(T, dtype=torch.long); want_x = torch.zeros(T, 3, dtype=torch.float64)
    want_grad = torch.zeros(T, 3, dtype=torch.float64)
    crossings = 0
    for d in range(len(LENS)):
        rows = torch.nonzero(seg == d).flatten().tolist()
        for a, b in zip(rows[:-1], rows[1:]):                                  # t -> t+1 inside the doc
            want_ids[a], want_x[a] = ids[b], x[b]
            want_grad[b] += w[a]
            crossings += (a // (T // cp)) != (b // (T // cp))
    assert crossings > 0                                                        # some pairs cross ranks
    assert torch.equal(ids_next, want_ids)
    assert valid.sum() == sum(L - 1 for L in LENS)
    assert torch.equal(x_next, want_x)
    assert (x_grad - want_grad).abs().max() == 0
