"""ext #4495: the MTP roll on packed THD uses the PADDED document offsets; each label rolled exactly once.

Oracle: each document alone (Megatron-style shifted labels), rolled left by one with a Python loop.
"""
import torch

from dsv4.model import mtp_roll
from dsv4.model.layout import seg_pos_from_cu_seqlens

IGNORE = -100
LENS = [5, 1, 7, 2, 4]
PADDED = [8, 4, 8, 2, 6]          # a doc with no padding, a 1-token doc, trailing padding


def _stream():
    cu = torch.tensor([0] + torch.tensor(LENS).cumsum(0).tolist())
    cup = torch.tensor([0] + torch.tensor(PADDED).cumsum(0).tolist())
    T = int(cup[-1]) + 2
    seg, pos = seg_pos_from_cu_seqlens(cu, T, cup)
    ids = torch.full((T,), 255)                                                # padding token id
    labels = torch.full((T,), IGNORE)
    docs = []
    g = torch.Generator().manual_seed(0)
    for d, L in enumerate(LENS):
        doc = torch.randint(1, 200, (L + 1,), generator=g)                     # tokens + the one after
        rows = torch.nonzero(seg == d).flatten()
        ids[rows] = doc[:L]
        lab = doc[1:].clone(); lab[-1] = IGNORE                                # last token: no target in doc
        labels[rows] = lab
        docs.append((rows, doc[:L], lab))
    return cu, cup, T, seg, ids, labels, docs


def test_packed_padded_roll_equals_each_document_alone():
    cu, cup, T, seg, ids, labels, docs = _stream()
    ids_next, mtp_labels = mtp_roll.mtp_inputs(ids[None], labels[None], cu, cup)
    for rows, doc_ids, lab in docs:
        L = len(doc_ids)
        want_next = [int(doc_ids[t + 1]) if t + 1 < L else 0 for t in range(L)]       # doc run alone
        want_lab = [int(lab[t + 1]) if t + 1 < L else IGNORE for t in range(L)]
        assert ids_next[0, rows].tolist() == want_next
        assert mtp_labels[0, rows].tolist() == want_lab
    pad = seg < 0
    assert (mtp_labels[0, pad] == IGNORE).all() and (ids_next[0, pad] == 0).all()
    # rolled once: the number of MTP targets is sum(L - 2) over docs with L >= 2 (no target lost or reused)
    assert int((mtp_labels != IGNORE).sum()) == sum(max(L - 2, 0) for L in LENS)


def test_unpadded_offsets_would_be_wrong():
    """Using cu_seqlens as offsets (the #4495 bug) misplaces documents when padding exists: check it differs."""
    cu, cup, T, seg, ids, labels, docs = _stream()
    good, _ = mtp_roll.mtp_inputs(ids[None], labels[None], cu, cup)
    bad, _ = mtp_roll.mtp_inputs(ids[None], labels[None], cu, None)
    assert not torch.equal(good, bad)


def test_roll_packed_float_grad():
    seg = torch.tensor([0, 0, 0, -1, 1, 1, 2])
    x = torch.arange(7.0, dtype=torch.float64).requires_grad_()
    y, valid = mtp_roll.roll_packed(x, seg, fill=0.0)
    assert y.tolist() == [1, 2, 0, 0, 5, 0, 0] and valid.tolist() == [1, 1, 0, 0, 1, 0, 0]
    y.sum().backward()
    assert x.grad.tolist() == [0, 1, 1, 0, 0, 1, 0]
