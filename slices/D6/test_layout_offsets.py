"""D6: the packed layout's seg / pos, derived on the tokens' device from cu_seqlens (+ padded offsets, + a trailing
dummy sequence), against a plain Python walk over the documents written here; the checks that reject bad
offsets; and on a GPU, the host synchronisations one `Layout.packed` costs (offsets on the host: none; offsets on
the device: the one copy its checks need).

Oracle: for each document i, its real tokens occupy stream slots start_i .. start_i + len_i - 1 (start_i =
cu_padded[i], or cu[i] unpadded), seg = i and pos = 0.. there; every other token is padding (seg -1, pos 0).
"""
import warnings

import pytest
import torch

from dsv4.model.layout import Layout, LayoutError, seg_pos_from_cu_seqlens
from dsv4.model.packed_seq import seg_pos_static


def _oracle(cu, total, cup=None):
    seg, pos = [-1] * total, [0] * total
    starts = cu[:-1] if cup is None else cup[:len(cu) - 1]
    for i in range(len(cu) - 1):
        for p in range(cu[i + 1] - cu[i]):
            seg[starts[i] + p], pos[starts[i] + p] = i, p
    return seg, pos


def _random_offsets(g, n_docs, padded, dummy):
    lens = torch.randint(0, 9, (n_docs,), generator=g)                      # zero-length documents included
    cu = [0] + torch.cumsum(lens, 0).tolist()
    if not padded:
        return cu, None, cu[-1] + int(torch.randint(0, 4, (1,), generator=g))
    pad = torch.randint(0, 4, (n_docs,), generator=g)
    cup = [0] + torch.cumsum(lens + pad, 0).tolist()
    if dummy:
        cup.append(cup[-1] + 5)                                             # a trailing dummy sequence
    return cu, cup, cup[-1] + int(torch.randint(0, 3, (1,), generator=g))


@pytest.mark.parametrize("padded,dummy", [(False, False), (True, False), (True, True)])
def test_seg_pos_equals_the_document_walk(padded, dummy):
    g = torch.Generator().manual_seed(7)
    for trial in range(40):
        cu, cup, T = _random_offsets(g, 1 + trial % 9, padded, dummy)
        want = _oracle(cu, T, cup)
        for dtype in (torch.int32, torch.long):
            cup_t = None if cup is None else torch.tensor(cup, dtype=dtype)
            seg, pos = seg_pos_from_cu_seqlens(torch.tensor(cu, dtype=dtype), T, cup_t)
            assert (seg.tolist(), pos.tolist()) == want, (cu, cup, T)
            lay = Layout.packed(torch.tensor(cu, dtype=dtype), (1, T), cup_t)
            assert (lay.seg.tolist(), lay.pos.tolist()) == want
            assert lay.seg.dtype == lay.pos.dtype == torch.long


def test_static_buffer_equals_the_document_walk():
    """model/packed_seq.py's static buffer (zero-length documents appended) gives the same seg / pos."""
    cu, cup = [0, 3, 3, 8], [0, 4, 6, 12]
    buf = torch.tensor([cu + [8, 8], cu + [8, 8], cup + [12, 12], cup + [12, 12]], dtype=torch.int32)
    seg, pos = seg_pos_static(buf, 14)
    assert (seg.tolist(), pos.tolist()) == _oracle(cu, 14, cup)


def test_longest_document_from_the_host_offsets_only():
    """Layout.longest_document (the all-visible CSA read's host decision, DSv4Attention._lists_every_visible): the
    longest real document of the walk (padding and zero-length documents aside), S for a plain batch, and None where
    the offsets are a static CUDA-graph buffer (rewritten between replays) or absent; carried by a dataclass copy."""
    import dataclasses
    g = torch.Generator().manual_seed(3)
    for trial in range(20):
        cu, cup, T = _random_offsets(g, 1 + trial % 7, trial % 2 == 1, trial % 4 == 3)
        lay = Layout.packed(torch.tensor(cu), (1, T), None if cup is None else torch.tensor(cup))
        assert lay.longest_document == max(b - a for a, b in zip(cu[:-1], cu[1:]))
        assert dataclasses.replace(lay).longest_document == lay.longest_document
    assert Layout.batch(3, 17).longest_document == 17
    buf = torch.tensor([[0, 3, 8, 8]] * 4, dtype=torch.int32)
    assert Layout.from_static_buffer(buf, (1, 8)).longest_document is None
    assert Layout(torch.zeros(4, dtype=torch.long), torch.arange(4), (1, 4)).longest_document is None


def test_rows_of_a_batch_and_the_checks():
    # two rows of 8: docs 0, 1 in row 0 (1 ends at 7), doc 2 in row 1, a zero-length doc at the row boundary
    lay = Layout.packed(torch.tensor([0, 3, 8, 8, 13]), (2, 8))
    assert (lay.seg.tolist(), lay.pos.tolist()) == _oracle([0, 3, 8, 8, 13], 16)
    with pytest.raises(LayoutError, match="crosses a row"):
        Layout.packed(torch.tensor([0, 3, 10]), (2, 8))
    with pytest.raises(LayoutError, match="crosses a row"):          # padded slot 1 starts at 6, 4 real tokens
        Layout.packed(torch.tensor([0, 3, 7]), (2, 8), torch.tensor([0, 6, 16]))
    with pytest.raises(LayoutError, match="cu_seqlens_padded: a padded length"):
        Layout.packed(torch.tensor([0, 3, 7]), (1, 8), torch.tensor([0, 2, 8]))
    with pytest.raises(LayoutError, match="cu_seqlens: must start at 0"):
        Layout.packed(torch.tensor([1, 3]), (1, 8))
    with pytest.raises(LayoutError, match="cu_seqlens: must be non-decreasing"):
        Layout.packed(torch.tensor([0, 3, 2]), (1, 8))
    with pytest.raises(LayoutError, match="cu_seqlens: must be a 1-D integer"):
        Layout.packed(torch.tensor([0.0, 3.0]), (1, 8))
    with pytest.raises(LayoutError, match="total"):
        Layout.packed(torch.tensor([0, 3, 9]), (1, 8))
    with pytest.raises(LayoutError, match="cu_seqlens_padded: has 5 entries"):
        Layout.packed(torch.tensor([0, 3]), (1, 8), torch.tensor([0, 3, 4, 5, 6]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host synchronisations exist on a GPU only")
@pytest.mark.parametrize("where", ["host", "device"])
def test_packed_layout_host_syncs(where):
    """Offsets on the host: seg / pos are computed on the GPU from non-blocking copies, no synchronisation.
    Offsets on the GPU (the bench, Megatron's PackedSeqParams): one copy to the host for the checks."""
    cu, cup = [0, 300, 800, 1500], [0, 512, 1024, 2048]                  # slots of 512, 512, 1024
    dev = "cpu" if where == "host" else "cuda"
    args = (torch.tensor(cu, dtype=torch.int32, device=dev), (1, 2048), torch.tensor(cup, dtype=torch.int32, device=dev))
    Layout.packed(*args, device="cuda")                                     # warm-up (allocator, kernels)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            lay = Layout.packed(*args, device="cuda")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == (0 if where == "host" else 1), [str(w.message)[:200] for w in syncs]
    assert lay.seg.is_cuda and (lay.seg.tolist(), lay.pos.tolist()) == _oracle(cu, 2048, cup)
