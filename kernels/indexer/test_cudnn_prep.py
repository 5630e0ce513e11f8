"""kernels/indexer/cudnn_prep.py (backend "triton+cudnn"'s offset, mask and FP8 split) == the mask-based PyTorch code
it replaces, exactly, on CPU through Triton's interpreter (use_triton=True): `mask_scores_` == masked_fill_ of
naive.causal_entry_mask bit for bit (NaN / ±inf scores of visible entries untouched, strided I); `causal_offset_meta`
== causal_offset(mask) on random packed layouts (odd lengths, several documents, padding and holes, empty and
incomplete entries, entries out of stream order, ratio 4 and 128) and on arbitrary metadata (negative positions);
`fp8_split` through the Triton quantiser == the `quantize` path bit for bit (random rows, the indexer's FP8
features, zero / huge / subnormal / non-finite rows, fp32 / bf16 inputs; bf16 subnormals are left out: Triton
3.9's interpreter misconverts them to fp32). On a CUDA host the same checks run the compiled kernels on GPU
tensors (DEV)."""
from dsv4.kernels._testing import CUDA, packed_meta, use_interpreter

use_interpreter()

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
from dsv4.kernels.compressor.naive import entry_slots  # noqa: E402
from dsv4.kernels.indexer import cudnn_prep as P  # noqa: E402
from dsv4.kernels.indexer import naive  # noqa: E402
from dsv4.kernels.indexer.fp4 import qk_fake_quant  # noqa: E402
from dsv4.kernels.quant.naive import quantize  # noqa: E402

DEV = "cuda" if CUDA else "cpu"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t.view(torch.int32)


def _layout(seed: int, ratio: int, permute: bool = False):
    """Random packed stream: 1-5 documents of odd lengths (some shorter than ratio: no entry), padding after some,
    padding holes inside documents, some entries emptied (seg -1) or moved later than their window (incomplete
    for more queries); optionally the entry slots permuted. -> seg_q, pos_q [T], entry_seg, entry_j [N]."""
    g = torch.Generator().manual_seed(seed)
    ri = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=g))          # noqa: E731
    nd = ri(1, 6)
    lens = [ri(1, 6 * ratio) | 1 for _ in range(nd)]
    pads = [ri(0, 4) for _ in range(nd)]
    seg, pos = packed_meta(lens, pads)
    ends, valid, ej = entry_slots(seg, pos, ratio)
    eseg = torch.where(valid, seg[ends], torch.full_like(ends, -1))
    T, N = seg.numel(), ends.numel()
    holes = torch.rand(T, generator=g) < 0.05                                       # padding inside documents
    seg, pos = torch.where(holes, -1, seg), torch.where(holes, 0, pos)
    empty = torch.rand(N, generator=g) < 0.15
    eseg, ej = torch.where(empty, -1, eseg), torch.where(empty, 0, ej)
    late = torch.rand(N, generator=g) < 0.1                                          # j later than its slot
    ej = torch.where(late & (eseg >= 0), ej + torch.randint(1, 4, (N,), generator=g), ej)
    if permute:
        p = torch.randperm(N, generator=g)
        eseg, ej = eseg[p], ej[p]
    return tuple(x.to(DEV) for x in (seg, pos, eseg, ej))


def _arbitrary(seed: int, T: int, N: int):
    """Metadata with no stream structure at all: random documents (-1 .. 3), positions -9 .. 99 (floor division of
    negative pos + 1), entry j -3 .. 29."""
    g = torch.Generator().manual_seed(seed)
    r = lambda lo, hi, n: torch.randint(lo, hi, (n,), generator=g).to(DEV)          # noqa: E731
    return r(-1, 4, T), r(-9, 100, T), r(-1, 4, N), r(-3, 30, N)


def _cases():
    for ratio in (4, 128):
        for seed in range(6):
            yield ratio, f"packed{seed}", _layout(seed, ratio)
        for seed in range(3):
            yield ratio, f"permuted{seed}", _layout(100 + seed, ratio, permute=True)
    yield 4, "arbitrary", _arbitrary(0, 301, 77)
    yield 5, "arbitrary_r5", _arbitrary(1, 133, 200)
    yield 4, "arbitrary_b", _arbitrary(2, 257, 66)


CASES = list(_cases())
IDS = [f"r{r}-{n}" for r, n, _ in CASES]


@pytest.mark.parametrize("ratio,name,meta", CASES, ids=IDS)
def test_causal_offset_from_metadata_equals_the_mask_one(ratio, name, meta):
    want = P.causal_offset(naive.causal_entry_mask(*meta, ratio), ratio)
    got = P.causal_offset_meta(*meta, ratio, use_triton=True)
    assert got.dtype == torch.int32 and tuple(got.shape) == (1,) and got.device == want.device
    assert torch.equal(got, want), (name, got.tolist(), want.tolist())
    assert torch.equal(P.causal_offset_meta(*meta, ratio, use_triton=False), want)


def test_causal_offset_layouts_cover_nonzero_offsets():
    """The cases are not all off = 0 (which a kernel that never finds an entry would also give)."""
    offs = [int(P.causal_offset(naive.causal_entry_mask(*m, r), r)) for r, _, m in CASES]
    assert sum(o > 0 for o in offs) >= len(offs) // 3, offs


@pytest.mark.parametrize("ratio,name,meta", CASES, ids=IDS)
def test_mask_scores_equals_masked_fill(ratio, name, meta):
    T, N = meta[0].numel(), meta[2].numel()
    g = torch.Generator().manual_seed(T * 7 + N)
    I = torch.randn(T, N, generator=g)
    special = torch.rand(T, N, generator=g)
    I[special < 0.05] = float("nan")
    I[(special >= 0.05) & (special < 0.1)] = float("-inf")
    I[(special >= 0.1) & (special < 0.12)] = float("inf")
    I = I.to(DEV)
    mask = naive.causal_entry_mask(*meta, ratio)
    want = I.clone().masked_fill_(~mask, float("-inf"))
    got = I.clone()
    assert P.mask_scores_(got, *meta, ratio, use_triton=True) is got                 # in place
    assert torch.equal(_bits(got), _bits(want))
    strided = I.t().contiguous().t()                                                  # column-major I
    P.mask_scores_(strided, *meta, ratio, use_triton=True)
    assert torch.equal(_bits(strided.contiguous()), _bits(want))
    assert torch.equal(_bits(P.mask_scores_(I.clone(), *meta, ratio, use_triton=False)), _bits(want))


def _split_ref(x):
    qt = quantize(x, "e4m3", (1, x.shape[-1]), "ue8m0")
    return qt.fp8(), qt.scale[..., 0].float()


def _assert_split_same(x):
    (q, s), (qr, sr) = P.fp8_split(x, use_triton=True), _split_ref(x)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert q.shape == x.shape and s.shape == x.shape[:-1]
    assert torch.equal(_bits(q), _bits(qr)) and torch.equal(_bits(s), _bits(sr))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_split_triton_equals_quantize(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 8, 128, generator=g) * torch.exp2(torch.randint(-20, 20, (37, 8, 1), generator=g).float())
    x[0, 0] = 0.0                                                                     # zero rows
    x[0, 1] = -0.0
    x[1, 0] = 3e38                                                                    # huge
    x[1, 1, :5] = torch.tensor([448.0, -449.0, 1e30, 1.0, -0.0])                    # boundary-ish, huge amax
    if dtype == torch.float32:                   # Triton 3.9's interpreter misconverts bf16 subnormals to fp32
        x[2, 0] = 1e-40                                                               # subnormal
    x[2, 1, ::3] = 0.0
    x[3, 0, 7] = float("nan")                                                         # non-finite entries
    x[3, 1, 9] = float("inf")
    x[3, 2, 11] = -float("inf")
    x[4, 0] = 448.0 * 2.0 ** torch.arange(-64, 64).float()                            # one row over 2^±64
    x = x.to(dtype).to(DEV)
    _assert_split_same(x)
    _assert_split_same(x[5])                                                          # [nI, 128]
    _assert_split_same(x[:, 3])                                                       # strided rows


def test_fp8_split_of_the_fp8_features():
    """The indexer's FP8 features (qk_fake_quant): the split is exact and the same bits by both paths."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(41, 32, 128, generator=g)
    q[3, 1] *= 1e-3
    k = torch.randn(23, 128, generator=g) * 300.0
    for x in (qk_fake_quant(q, "fp8"), qk_fake_quant(k, "fp8"), qk_fake_quant(q.bfloat16(), "fp8")):
        x = x.to(DEV)
        _assert_split_same(x)
        x8, s = P.fp8_split(x, use_triton=True)
        assert torch.equal(x8.float() * s[..., None], x.float())


def test_fp8_split_fallback_off_the_tile():
    """c != 128 (not the quantiser's tile) or fp64: the `quantize` path, whatever use_triton says."""
    g = torch.Generator().manual_seed(2)
    for x in (torch.randn(9, 64, generator=g), torch.randn(9, 128, generator=g).double()):
        (q, s), (qr, sr) = P.fp8_split(x.to(DEV), use_triton=True), _split_ref(x.to(DEV))
        assert torch.equal(_bits(q), _bits(qr)) and torch.equal(_bits(s), _bits(sr))
