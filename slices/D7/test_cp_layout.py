"""D7: static contiguous-CP layout and boundary primitives.

Single process: chunk bounds, per-rank (seg, pos) with halo rows, per-rank cu_seqlens pieces, halo sizes.
Multi-process (gloo, cp = 3 and 4, WORLD group): `left_halo` (incl. a halo longer than a chunk) and
`gather_entries` (uneven entry counts) -- values and gradients against index arithmetic done here.
"""
import pytest
import torch

from dsv4.model import context_parallel as cpl
from dsv4.model.config import get_config
from dsv4.model.attention import attention_halo
from dsv4.model.layout import LayoutError, seg_pos_from_cu_seqlens
from dsv4.slices.D8._workers import primitives_worker, spawn

CU = torch.tensor([0, 5, 24, 27, 64, 66, 76])


def test_chunks_and_rank_layout():
    assert [cpl.contiguous_chunk(76, 4, r) for r in range(4)] == [(0, 19), (19, 38), (38, 57), (57, 76)]
    with pytest.raises(LayoutError, match="multiple of cp"):
        cpl.contiguous_chunk(75, 4, 0)
    seg, pos = seg_pos_from_cu_seqlens(CU)
    for r in range(4):
        s_e, p_e = cpl.rank_layout(CU, 76, 4, r, halo=7)
        g = torch.arange(r * 19 - 7, (r + 1) * 19)
        for i, gi in enumerate(g.tolist()):
            want = (int(seg[gi]), int(pos[gi])) if gi >= 0 else (-1, 0)
            assert (int(s_e[i]), int(p_e[i])) == want


@pytest.mark.parametrize("padded", [False, True])
def test_rank_cu_seqlens_rebuild_the_chunk(padded):
    cup = torch.tensor([0, 10, 32, 38, 80, 86, 100]) if padded else None
    T = 100 if padded else 76
    seg, pos = seg_pos_from_cu_seqlens(CU, T, cup)
    C = T // 4
    for r in range(4):
        cu_l, cup_l, docs, first = cpl.rank_cu_seqlens(CU, T, 4, r, cup)
        s_l, p_l = seg_pos_from_cu_seqlens(cu_l, C, cup_l)                      # local pieces -> per token
        g_seg, g_pos = seg[r * C:(r + 1) * C], pos[r * C:(r + 1) * C]
        real = s_l >= 0
        assert torch.equal(real, g_seg >= 0)
        assert torch.equal(docs[s_l[real]], g_seg[real])                        # piece -> global doc id
        assert torch.equal(p_l[real] + first[s_l[real]], g_pos[real])           # positions continue


def test_halo_sizes():
    cfg = get_config("debug")                                                   # window 8, CSA 4, HCA 16
    assert [attention_halo(cfg, i) for i in range(3)] == [7, 7, 15]
    flash = get_config("flash")
    assert attention_halo(flash, 2) == 127 and attention_halo(flash, 3) == 127


@pytest.mark.parametrize("ws,C,halo", [(3, 5, 4), (4, 3, 7)])                 # 7 > C: halo spans ranks
def test_left_halo_and_gather_entries(ws, C, halo):
    counts = [2, 0, 3, 1][:ws]
    res = spawn(primitives_worker, ws, C, halo, counts)
    x_full = torch.arange(ws * C * 2, dtype=torch.float64).view(ws * C, 2)
    x_grad = torch.zeros_like(x_full)
    for r in range(ws):
        g = torch.arange(r * C - halo, r * C)
        want = torch.stack([x_full[i] if i >= 0 else torch.zeros(2, dtype=torch.float64) for i in g.tolist()])
        assert torch.equal(res[r]["halo"], want)
        w = torch.arange(1, halo * 2 + 1, dtype=torch.float64).view(halo, 2) * (r + 1)
        for k, i in enumerate(g.tolist()):
            if i >= 0:
                x_grad[i] += w[k]
    assert torch.equal(torch.cat([res[r]["x_grad"] for r in range(ws)]), x_grad)
    n_max = max(counts)
    for r in range(ws):                                                         # gathered entries, stream order
        assert res[r]["seg"].tolist() == sum([[q] * counts[q] + [-1] * (n_max - counts[q]) for q in range(ws)], [])
        assert res[r]["j"].tolist() == sum([list(range(counts[q])) + [0] * (n_max - counts[q]) for q in range(ws)], [])
    for r in range(ws):
        n = counts[r]
        rows = torch.arange(r * n_max, r * n_max + n, dtype=torch.float64)
        want = (rows[:, None] + 1).expand(n, 3) * sum(q + 1 for q in range(ws))  # d/dcomp of sum_q loss_q
        assert torch.equal(res[r]["comp_grad"], want)


def test_packed_seq_params_partition_mode():
    from types import SimpleNamespace
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    ok = SimpleNamespace(qkv_format="thd", cu_seqlens_q=cu, cp_partition_mode="contiguous")
    assert cpl.cu_seqlens_from_packed_seq_params(ok)[0].tolist() == [0, 3, 8]
    with pytest.raises(LayoutError, match="contiguous"):
        cpl.cu_seqlens_from_packed_seq_params(SimpleNamespace(qkv_format="thd", cu_seqlens_q=cu,
                                                              cp_partition_mode="zigzag"))
