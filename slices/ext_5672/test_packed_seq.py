"""#5672: static-shape PackedSeqParams. The padded (static) metadata must mean exactly what the original means:
same (seg, pos) per token, same DSv4 THD attention output, one buffer shape for every batch, and refusals."""
import pytest
import torch

from dsv4.model import get_config
from dsv4.model.attention import DSv4Attention
from dsv4.model.packed_seq import (PackedSeqError, copy_into, flatten, make_params, rebuild, seg_pos_static)
from dsv4.model.layout import Layout, seg_pos_from_cu_seqlens


def _batch(lens, pad_to=1, seed=0):
    lens = torch.tensor(lens)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
    plens = (lens + pad_to - 1) // pad_to * pad_to
    cup = torch.cat([torch.zeros(1, dtype=torch.long), plens.cumsum(0)])
    return cu, cup


def test_round_trip_and_static_shape():
    cu, cup = _batch([5, 1, 9], pad_to=4)
    p = make_params(cu, cup)
    buf = flatten(p, max_seqs=6, max_seqlen=16)
    assert buf.shape == (4, 7) and buf.dtype == torch.int32
    q = rebuild(buf, 16)
    assert q.qkv_format == "thd" and q.max_seqlen_q == 16
    assert q.cu_seqlens_q[:4].tolist() == cu.tolist() and q.cu_seqlens_q[4:].tolist() == [15, 15, 15]
    assert q.cu_seqlens_kv_padded[:4].tolist() == cup.tolist()
    ptr = buf.data_ptr()
    cu2, cup2 = _batch([2, 3, 4, 1, 6], pad_to=4)
    copy_into(buf, make_params(cu2, cup2), 16)                 # a new batch, same buffer, same shape
    assert buf.data_ptr() == ptr and q.cu_seqlens_q[:6].tolist() == cu2.tolist()


@pytest.mark.parametrize("lens,pad_to", [([5, 1, 9], 1), ([7, 3], 4), ([1], 8), ([3, 3, 3, 3], 2)])
def test_static_seg_pos_equals_dynamic(lens, pad_to):
    cu, cup = _batch(lens, pad_to)
    T = int(cup[-1]) + 3                                       # trailing padding tokens too
    buf = flatten(make_params(cu, cup), max_seqs=8, max_seqlen=32)
    seg, pos = seg_pos_static(buf, T)
    seg_ref, pos_ref = seg_pos_from_cu_seqlens(cu, T, cup)
    assert torch.equal(seg, seg_ref) and torch.equal(pos, pos_ref)


@pytest.mark.parametrize("layer", [1, 2])          # debug config: 1 = CSA, 2 = HCA
def test_padded_metadata_gives_identical_attention(layer):
    cfg = get_config("debug")
    torch.manual_seed(0)
    attn = DSv4Attention(cfg, layer).eval()
    with torch.no_grad():
        attn.attn_sink.normal_()
    cu, cup = _batch([13, 3, 21], pad_to=4)
    T = int(cup[-1])
    h = torch.randn(1, T, cfg.hidden_size)
    buf = flatten(make_params(cu, cup), max_seqs=7, max_seqlen=64)
    with torch.no_grad():
        ref = attn(h, Layout.packed(cu, tuple(h.shape[:2]), cup))
        got = attn(h, Layout.packed(buf[0].long(), tuple(h.shape[:2]), buf[2].long()))   # 4 zero-length docs
        static = attn(h, Layout.from_static_buffer(buf, tuple(h.shape[:2])))              # no host sync
    assert torch.equal(got, ref) and torch.equal(static, ref)


def test_refusals():
    cu, cup = _batch([5, 1, 9])
    with pytest.raises(PackedSeqError, match=r"3 documents exceed the static max_seqs 2"):
        flatten(make_params(cu, cup), max_seqs=2, max_seqlen=16)
    with pytest.raises(PackedSeqError, match=r"a document of 9 tokens exceeds the static max_seqlen 8"):
        flatten(make_params(cu, cup), max_seqs=4, max_seqlen=8)
    p = make_params(cu, cup)
    p.qkv_format = "sbhd"
    with pytest.raises(PackedSeqError, match=r"qkv_format: must be 'thd'"):
        flatten(p, 4, 16)
    with pytest.raises(PackedSeqError, match=r"buffer: must be int32"):
        rebuild(torch.zeros(4, 3), 16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a GPU")
def test_cuda_graph_replay_sees_new_batch():
    cu, cup = _batch([5, 1, 9], pad_to=4)
    T = 64
    buf = flatten(make_params(cu, cup), max_seqs=8, max_seqlen=32, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        seg_pos_static(buf, T)                                  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        seg, pos = seg_pos_static(buf, T)
    for lens in ([2, 3, 4, 1, 6], [31], [1, 1, 1, 1, 1, 1, 1, 1]):
        cu2, cup2 = _batch(lens, pad_to=4)
        copy_into(buf, make_params(cu2, cup2), 32)
        g.replay()
        ref = seg_pos_from_cu_seqlens(cu2, T, cup2)
        assert torch.equal(seg.cpu(), ref[0]) and torch.equal(pos.cpu(), ref[1])
