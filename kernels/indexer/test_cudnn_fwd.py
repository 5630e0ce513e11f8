"""Backend "triton+cudnn" of the indexer scoring (kernels/indexer/cudnn_fwd.py, op.py `indexer_scores_cudnn`):
cuDNN's SM90 DSA indexer forward (bf16 / FP8 E4M3) + our Triton backward, the Triton forward as the fallback.

CPU (no cuDNN here): the mapping (one batch row, our scale folded into an fp32 W, the least covering
q_causal_offsets, our visibility mask afterwards) scored the way cuDNN defines it (`cudnn_math`, after
indexer_fwd_sm90.py) == naive.indexer_scores in fp64 on odd packed layouts (padding, several documents, empty
slots, entries out of stream order); the FP8 split of the indexer's FP8 features is exact; the dispatch (cuDNN only
when the call qualifies, the reason otherwise); forward + gradients with a stand-in of indexer_forward_wrapper (its
signature, SM90 checks and returns) passed explicitly == the pure Triton path (interpreter).
GPU (skipped without CUDA SM90 and an importable cudnn-frontend): bf16 and FP8 vs naive and Triton at DSv4 indexer
dims (nI 64, cI 128, ratio 4), packed ~9K and one 16K document; FP8 top-k recall vs bf16 >= 0.99."""
from dsv4.kernels._testing import CUDA, assert_close, assert_rel, bits, packed_meta, use_interpreter

use_interpreter()

import re  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
from dsv4.kernels.compressor.naive import entry_slots  # noqa: E402
from dsv4.kernels.indexer import cudnn_fwd as CF  # noqa: E402
from dsv4.kernels.indexer import naive, op  # noqa: E402
from dsv4.kernels.indexer.fp4 import qk_fake_quant, topk_recall  # noqa: E402

# (document lengths, padding after each): one document, several with padding, a one-token document
LAYOUTS = {"one_doc": ([29], None), "packed": ([9, 21, 3, 14], [1, 0, 2, 3]),
           "tiny_docs": ([1, 6, 2, 17], [0, 2, 0, 1])}
NO_GPU = ("CPU tensors through the Triton interpreter (a CUDA host compiles Triton for the GPU): the GPU tests run "
          "the real kernels")


def _case(layout, nI, cI, ratio, dtype, dev="cpu", seed=0, scale_lens=1, holes=False):
    lens, pads = LAYOUTS[layout]
    gen = torch.Generator(device=dev).manual_seed(seed)
    seg, pos = packed_meta([L * scale_lens for L in lens], pads, dev)
    ends, valid, ej = entry_slots(seg, pos, ratio)
    eseg = torch.where(valid, seg[ends], torch.full_like(ends, -1))
    if holes:                                        # padding inside a document, an empty slot between entries
        seg, pos, eseg, ej = seg.clone(), pos.clone(), eseg.clone(), ej.clone()
        seg[5], pos[5] = -1, 0
        live = torch.nonzero(eseg >= 0).flatten()
        eseg[live[2]], ej[live[2]] = -1, 0
    T, N = seg.numel(), ends.numel()
    rnd = lambda *s: torch.randn(*s, generator=gen, device=dev)
    return rnd(T, nI, cI).to(dtype), rnd(N, cI).to(dtype), rnd(T, nI).to(dtype), (seg, pos, eseg, ej)


def cudnn_math(q, k, w, ratio, sm_scale, offs, precision, q_scale=None, k_scale=None):
    """The SM90 kernel's scores, plainly (indexer_fwd_sm90.py:10-16, 296-303, 371-402; _interface_sm90.py:272):
    [B,S_q,S_k] = sm_scale * sum_h relu(q . k) * w (fp8: W * q_scale * sm_scale, or an fp32 W as given "pre-scaled",
    then * k_scale), -inf where j >= (offs[b] + i + 1) // ratio; in fp64 for fp64 inputs, else fp32."""
    dt = torch.promote_types(q.dtype if q.dtype == torch.float64 else torch.float32, torch.float32)
    B, Sq, H, D = q.shape
    dots = torch.einsum("bihd,bjd->bihj", q.to(dt), k[:, :, 0].to(dt))                # [B, S_q, H, S_k]
    if precision == "fp8":
        W = w.to(dt) if w.dtype == torch.float32 else w.to(dt) * q_scale.to(dt) * sm_scale
        s = torch.einsum("bihj,bih->bij", dots.relu(), W) * k_scale[:, None, :, 0].to(dt)
    else:
        s = torch.einsum("bihj,bih->bij", dots.relu(), w.to(dt)) * sm_scale
    off = torch.zeros(B, dtype=torch.long) if offs is None else offs.long().cpu()
    lim = torch.div(off[:, None] + torch.arange(1, Sq + 1)[None], ratio, rounding_mode="floor")   # [B, S_q]
    return s.masked_fill(torch.arange(s.shape[-1])[None, None] >= lim[..., None].to(s.device), float("-inf"))


def stand_in(q, k, w, ratio=4, qhead_per_kv_head=None, m_block_size=128, n_block_size=128, q_stage=2, kv_stage=4,
             sm_scale=1.0, out=None, stream=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
             max_seqlen_k=None, q_causal_offsets=None, precision="bf16", q_scale=None, k_scale=None,
             cu_seqlens_q_scale_padded=None, cu_seqlens_k_scale_padded=None, sf_vec_size=32, return_lse=False,
             lse_out=None, _dtypes=True):
    """indexer_forward_wrapper's signature (api.py:211-237) with its SM90 checks (api.py:262-278,
    _interface_sm90.py:55-73, 117, 159-185; CUDA-only checks left out) and returns (TupleDict(scores=[B,S_q,S_k]
    fp32)), computed by `cudnn_math`. _dtypes=False: the dtype checks off (the fp64 mapping test)."""
    assert (m_block_size, n_block_size, q_stage, kv_stage) == (128, 128, 2, 4) and cu_seqlens_q is None
    assert out is None and not return_lse and lse_out is None
    if _dtypes:
        if precision == "bf16":
            assert q.dtype == k.dtype == torch.bfloat16 and q_scale is None and k_scale is None
        else:
            assert precision == "fp8" and q.dtype == k.dtype == torch.float8_e4m3fn
            assert q_scale.dtype == k_scale.dtype == torch.float32
        assert w.dtype in (torch.bfloat16, torch.float32)
    assert ratio >= 1 and q.dim() == 4 and k.dim() == 4 and w.dim() == 3
    B, Sq, H, D = q.shape
    assert k.shape[0] == B and k.shape[2] == 1 and k.shape[3] == D == 128 and tuple(w.shape) == (B, Sq, H)
    assert H in ((32, 64) if precision == "fp8" else (16, 32, 64))
    if precision == "fp8":
        assert tuple(q_scale.shape) == (B, Sq, H) and tuple(k_scale.shape) == (B, k.shape[1], 1)
    if q_causal_offsets is not None:
        assert q_causal_offsets.dtype == torch.int32 and tuple(q_causal_offsets.shape) == (B,)
    s = cudnn_math(q, k, w, ratio, sm_scale, q_causal_offsets, precision, q_scale, k_scale)
    return {"scores": s if s.dtype == torch.float64 else s.float().contiguous()}


def _lenient(*a, **kw):
    return stand_in(*a, _dtypes=False, **kw)


def _counting(fn):
    calls = []

    def f(*a, **k):
        calls.append(k.get("precision"))
        return fn(*a, **k)
    return f, calls


# ------------------------------------------------------------------------------------ the mapping (fp64, exact)
@pytest.mark.parametrize("holes", [False, True])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("ratio", [1, 4, 5])
def test_mapping_scored_as_cudnn_equals_naive(layout, ratio, holes):
    q, k, w, meta = _case(layout, 16, 128, ratio, torch.float64, holes=holes)
    got = CF.forward(_lenient, q, k, w, ratio, *meta)
    want = naive.indexer_scores(q, k, w, ratio, *meta)
    assert torch.equal(torch.isfinite(got), torch.isfinite(want))
    assert_close("I", got[torch.isfinite(want)], want[torch.isfinite(want)], 1e-12, 1e-12)


def test_causal_offset_is_the_least_covering_one():
    """One document in stream order: 0 (cuDNN's own triangle); entries out of stream order (a permutation) or
    documents whose entries sit later than their tokens: larger, still exact, and off - 1 would cut a visible one."""
    q, k, w, (seg, pos, eseg, ej) = _case("one_doc", 16, 128, 4, torch.float64)
    mask = naive.causal_entry_mask(seg, pos, eseg, ej, 4)
    assert CF.causal_offset(mask, 4).tolist() == [0] and CF.causal_offset(mask, 4).dtype == torch.int32
    for layout, perm in (("packed", True), ("tiny_docs", True), ("packed", False)):
        q, k, w, (seg, pos, eseg, ej) = _case(layout, 16, 128, 4, torch.float64)
        p = torch.randperm(k.shape[0], generator=torch.Generator().manual_seed(1)) if perm else \
            torch.arange(k.shape[0]).roll(-1)                      # roll: the first entry slot moved to the end
        k, eseg, ej = k[p], eseg[p], ej[p]
        mask = naive.causal_entry_mask(seg, pos, eseg, ej, 4)
        off = int(CF.causal_offset(mask, 4))
        lim = (off + torch.arange(1, seg.numel() + 1)) // 4
        cols = torch.arange(k.shape[0])
        assert not (mask & (cols[None] >= lim[:, None])).any()
        lim1 = (off - 1 + torch.arange(1, seg.numel() + 1)) // 4
        assert off == 0 or (mask & (cols[None] >= lim1[:, None])).any()
        got = CF.forward(_lenient, q, k, w, 4, seg, pos, eseg, ej)
        want = naive.indexer_scores(q, k, w, 4, seg, pos, eseg, ej)
        assert torch.equal(torch.isfinite(got), torch.isfinite(want))
        assert_close("I", got[torch.isfinite(want)], want[torch.isfinite(want)], 1e-12, 1e-12)


def test_fp8_split_of_the_fp8_features_is_exact():
    q, k, w, meta = _case("packed", 32, 128, 4, torch.float32)
    q[3, 1] *= 1e-3                                                   # rows of very different magnitudes
    k[2] *= 300.0
    for x in (qk_fake_quant(q, "fp8"), qk_fake_quant(k, "fp8")):
        x8, s = CF.fp8_split(x)
        assert x8.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and tuple(s.shape) == x.shape[:-1]
        assert torch.equal(x8.float() * s[..., None], x)
        assert torch.equal(s, torch.exp2(torch.log2(s).round()))   # powers of two


DEV = "cuda" if CUDA else "cpu"                        # the fp8_split tests: compiled Triton on a GPU host


def _assert_split_same(x, use_triton=True):
    """fp8_split through the Triton quantiser == the `quantize` path, bit for bit."""
    (q, s), (qr, sr) = CF.fp8_split(x, use_triton=use_triton), CF.fp8_split(x, use_triton=False)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert q.shape == x.shape and s.shape == x.shape[:-1]
    assert torch.equal(bits(q), bits(qr)) and torch.equal(bits(s), bits(sr))


def test_fp8_split_triton_equals_quantize():
    """fp32 rows of 128 (the Triton path): random magnitudes, zero / -0 rows, huge, subnormal and non-finite
    entries, a row spanning 2^±64; [T, nI, 128], [nI, 128] and strided rows; the indexer's FP8 features."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 8, 128, generator=g) * torch.exp2(torch.randint(-20, 20, (37, 8, 1), generator=g).float())
    x[0, 0] = 0.0
    x[0, 1] = -0.0
    x[1, 0] = 3e38
    x[1, 1, :5] = torch.tensor([448.0, -449.0, 1e30, 1.0, -0.0])
    x[2, 0] = 1e-40
    x[2, 1, ::3] = 0.0
    x[3, 0, 7] = float("nan")
    x[3, 1, 9] = float("inf")
    x[3, 2, 11] = -float("inf")
    x[4, 0] = 448.0 * 2.0 ** torch.arange(-64, 64).float()
    x = x.to(DEV)
    for v in (x, x[5], x[:, 3]):
        _assert_split_same(v)
    q = torch.randn(41, 32, 128, generator=g)
    q[3, 1] *= 1e-3
    for f in (qk_fake_quant(q, "fp8"), qk_fake_quant(torch.randn(23, 128, generator=g) * 300.0, "fp8")):
        _assert_split_same(f.to(DEV))


def test_fp8_split_takes_quantize_off_the_triton_path(monkeypatch):
    """c != 128, fp64 or bf16 x: the `quantize` path whatever use_triton says (the Triton quantiser is never
    called); fp32 rows of 128 do call it."""
    calls = []
    real = CF.QT.fp8_quantize
    monkeypatch.setattr(CF.QT, "fp8_quantize", lambda *a, **k: calls.append(1) or real(*a, **k))
    g = torch.Generator().manual_seed(2)
    for x in (torch.randn(9, 64, generator=g), torch.randn(9, 128, generator=g).double(),
              torch.randn(9, 128, generator=g).bfloat16()):
        _assert_split_same(x.to(DEV))
    assert calls == []
    _assert_split_same(torch.randn(9, 128, generator=g).to(DEV))
    assert calls == [1]


def test_fp8_stand_in_equals_naive_on_the_fp8_features():
    """precision "fp8": cuDNN's FP8 scoring of the split features (W pre-scaled by our scale and the q descale)
    == naive on the fake-quantised features (fp32; the products are exact, only the summation order differs)."""
    q, k, w, meta = _case("packed", 32, 128, 4, torch.float32, holes=True)
    qq, kq = qk_fake_quant(q, "fp8"), qk_fake_quant(k, "fp8")
    fn, calls = _counting(stand_in)
    got = CF.forward(fn, qq, kq, w, 4, *meta, precision="fp8")
    want = naive.indexer_scores(qq, kq, w, 4, *meta)
    assert calls == ["fp8"] and torch.equal(torch.isfinite(got), torch.isfinite(want))
    assert_close("I fp8", got[torch.isfinite(want)], want[torch.isfinite(want)], 1e-4, 1e-5)


# ------------------------------------------------------------------------------------------ dispatch / fallback
def test_unqualified_names_each_reason():
    bf = torch.bfloat16
    q, k, w = torch.zeros(5, 64, 128, dtype=bf), torch.zeros(3, 128, dtype=bf), torch.zeros(5, 64)
    assert CF.unqualified(q, k, w, "bf16", stand_in, (9, 0)) is None
    assert CF.unqualified(q.float(), k.float(), w, "fp8", stand_in, (9, 0)) is None
    assert CF.unqualified(q[:, :16], k, w, "bf16", stand_in, (9, 0)) is None
    cases = {"precision must be one of ('bf16', 'fp8')": (q, k, w, "fp4", stand_in, (9, 0)),
             "not importable": (q, k, w, "bf16", None, (9, 0)),
             "needs an SM90 GPU": (q, k, w, "bf16", stand_in, (10, 0)),
             "no CUDA device": (q, k, w, "bf16", stand_in, None),
             "bf16 needs bf16 qI / kI": (q.float(), k, w, "bf16", stand_in, (9, 0)),
             "fp8 needs nI in (32, 64)": (q[:, :16], k, w, "fp8", stand_in, (9, 0)),
             "bf16 needs nI in (16, 32, 64)": (q[:, :8], k, w, "bf16", stand_in, (9, 0)),
             "needs cI = 128": (q[..., :64], k[:, :64], w, "bf16", stand_in, (9, 0)),
             "no queries or no entries": (q, k[:0], w, "bf16", stand_in, (9, 0))}
    for want, args in cases.items():
        why = CF.unqualified(*args)
        assert why is not None and want in why and "\n" not in why, (want, why)
    fn, why = CF.load()
    assert fn is not None or ("not importable" in why and "cudnn_h200.sh" in why and "\n" not in why)


@pytest.mark.skipif(CUDA, reason=NO_GPU)
def test_dispatch_cudnn_only_when_the_call_qualifies():
    """Qualifying (bf16 nI 32 / fp8, SM90 given): the stand-in runs, the masked mapping is returned; not qualifying
    (fp32 at "bf16", nI 4, no CUDA device): never called, the Triton path bit for bit; a bad precision raises."""
    fn, calls = _counting(stand_in)
    q, k, w, meta = _case("packed", 32, 128, 4, torch.bfloat16)
    with torch.no_grad():
        got = op.indexer_scores_cudnn(q, k, w, 4, *meta, fwd_fn=fn, capability=(9, 0))
        assert torch.equal(got, CF.forward(stand_in, q, k, w, 4, *meta))
        qq, kq = qk_fake_quant(q, "fp8"), qk_fake_quant(k, "fp8")
        op.indexer_scores_cudnn(qq, kq, w, 4, *meta, "fp8", fwd_fn=fn, capability=(9, 0))
    assert calls == ["bf16", "fp8"]
    q4, k4, w4, meta4 = _case("tiny_docs", 4, 16, 3, torch.float32)
    for args, cap in (((q.float(), k.float(), w.float(), 4, *meta), (9, 0)), ((q4, k4, w4, 3, *meta4), (9, 0)),
                      ((qq, kq, w.float(), 4, *meta, "fp8"), None)):
        with torch.no_grad():
            assert torch.equal(op.indexer_scores_cudnn(*args, fwd_fn=fn, capability=cap), op.indexer_scores(*args[:8]))
    assert len(calls) == 2
    with pytest.raises(ValueError, match="precision must be one of"):
        op.indexer_scores_cudnn(q, k, w, 4, *meta, "fp4", fwd_fn=fn, capability=(9, 0))
    import dsv4.kernels as K                                              # the backend name resolves to it
    from dsv4.kernels.indexer import indexer_scores
    assert K.get_op("indexer_scores", "triton+cudnn", q.device) is op.indexer_scores_cudnn
    if CF.load()[0] is None:                                             # no cuDNN here: the fallback, by name
        with torch.no_grad():
            assert torch.equal(indexer_scores(qq, kq, w, 4, *meta, backend="triton+cudnn", precision="fp8"),
                               op.indexer_scores(qq, kq, w, 4, *meta))
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = op.indexer_scores_cudnn_fwd(q, k, w, 4, *meta, "bf16")
    assert tuple(fake.shape) == (q.shape[0], k.shape[0]) and fake.dtype == torch.float32


@pytest.mark.skipif(CUDA, reason=NO_GPU)
def test_stand_in_forward_with_triton_backward_equals_triton():
    """Forward through the stand-in, backward through our Triton kernels: the gradients are the Triton path's on the
    same inputs (the backward reads only the inputs), bit for bit; the forward equals it to rounding. At "fp8" (fp32
    features): Triton's CPU interpreter does not compute bf16 (its bf16 scores are garbage here; the GPU test
    covers bf16)."""
    precision = "fp8"
    q, k, w, meta = _case("tiny_docs", 32, 128, 4, torch.float32, holes=True)
    q, k = qk_fake_quant(q, "fp8"), qk_fake_quant(k, "fp8")
    ins = [x.detach().requires_grad_() for x in (q, k, w)]
    fn, calls = _counting(stand_in)
    got = op.indexer_scores_cudnn(*ins, 4, *meta, precision, fwd_fn=fn, capability=(9, 0))
    want = op.indexer_scores(*ins, 4, *meta)
    fin = torch.isfinite(want)
    assert calls == [precision] and torch.equal(torch.isfinite(got), fin)
    assert_close("I", got[fin], want[fin], 1e-4, 1e-5)
    dI = torch.randn(got.shape, generator=torch.Generator().manual_seed(3))
    for n, a, b in zip(("dqI", "dkI", "dw"), torch.autograd.grad(got, ins, dI), torch.autograd.grad(want, ins, dI)):
        assert torch.equal(a, b), n


def test_model_switch_and_bench_reason():
    """`DSv4Model.set_indexer_fwd` sets every indexer's scoring forward (unknown modes refused, shown in the repr);
    the `dsv4 bench kernels` indexer row's cudnn columns give the reason instead of timing it."""
    from dsv4.model.config import get_config
    from dsv4.model.indexer import Indexer
    from dsv4.model.model import DSv4Model
    m = DSv4Model(get_config("debug"))
    ixs = [x for x in m.modules() if isinstance(x, Indexer)]
    assert ixs and all(x.scores_fwd == "triton" for x in ixs) and "scores_fwd" not in repr(ixs[0])
    assert m.set_indexer_fwd("cudnn") is m and all(x.scores_fwd == "cudnn" for x in ixs)
    assert "scores_fwd=cudnn" in repr(ixs[0])
    with pytest.raises(ValueError, match=re.escape("unknown mode 'flashmla'; known: triton, cudnn")):
        m.set_indexer_fwd("flashmla")
    m.set_indexer_fwd("triton")
    assert all(x.scores_fwd == "triton" for x in ixs)
    from dsv4.harness import bench
    q, k, w, meta = _case("packed", 32, 128, 4, torch.float32)
    r = bench._cudnn_indexer_cols(q, k, w, 4, meta, 8, {}, fn=stand_in, capability=(9, 0))
    assert r == {"cudnn": {"skipped": CF.unqualified(q, k, w, "bf16", stand_in, (9, 0))}} and "bf16 needs" in str(r)
    r = bench._cudnn_indexer_cols(q.bfloat16(), k.bfloat16(), w, 4, meta, 8, {}, fn=stand_in, capability=None)
    assert "no CUDA device" in r["cudnn"]["skipped"]


def test_bench_columns_run_on_the_cpu_with_a_stand_in(monkeypatch):
    """A dry run of the `dsv4 bench kernels` cudnn columns (bf16, fp8, the fp8 re-rank margins) on the CPU: the
    stand-in as cuDNN, SM90 claimed, one call in place of do_bench (1 ms), the Triton top-k / listed scores on the
    interpreter. It checks that the GPU row's code runs and emits its columns; the CPU numbers (timings, and
    recalls computed with the interpreter's bf16 tl.dot, which is wrong) mean nothing."""
    from dsv4.harness import bench
    monkeypatch.setattr(bench, "_ms", lambda fn, rep=None: (fn(), 1.0)[1])
    q, k, w, meta = _case("packed", 32, 128, 4, torch.bfloat16)
    pairs = int(torch.isfinite(naive.indexer_scores(q, k, w, 4, *meta)).sum())
    r = bench._cudnn_indexer_cols(q, k, w, 4, meta, 4, {"causal_pairs": pairs}, fn=stand_in, capability=(9, 0))
    assert "cudnn" not in r, r
    for m in bench.RERANK_MARGINS:
        assert r[f"cudnn_fp8_rerank{m}_select_ms"] > 0 and 0.0 <= r[f"cudnn_fp8_rerank{m}_topk_recall_vs_bf16"] <= 1.0
    assert 0.0 <= r["cudnn_fp8_topk_recall_vs_bf16"] <= 1.0 and r["cudnn_fp8_mask_equal"]


# ------------------------------------------------------------------------------------------------------ GPU
def _cudnn_here():
    if not CUDA:
        return "no CUDA"
    if CF.load()[0] is None:
        return CF.load()[1]
    if CF.capability(torch.empty(0, device="cuda")) not in CF.ARCHS:
        return "not an SM90 GPU"
    return None


GPU_LAYOUTS = {"packed_9k": ("packed", 200), "tiny_docs_9k": ("tiny_docs", 350), "one_doc_16k": ("one_doc", 565)}


@pytest.mark.skipif(_cudnn_here() is not None, reason=f"cuDNN indexer forward: {_cudnn_here()}")
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize("layout", list(GPU_LAYOUTS))
def test_gpu_cudnn_scores_vs_naive_and_triton(layout, precision):
    """nI 64, cI 128, ratio 4, bf16 (fp8: the indexer's FP8 features of the bf16 inputs): cuDNN ran (counted), the
    -inf pattern equals naive's, values vs Triton and the fp32 naive reference; the Triton backward's gradients."""
    base, mul = GPU_LAYOUTS[layout]
    q, k, w, meta = _case(base, 64, 128, 4, torch.bfloat16, dev="cuda", scale_lens=mul, holes=True)
    if precision == "fp8":
        q, k = qk_fake_quant(q, "fp8"), qk_fake_quant(k, "fp8")
    ins = [x.detach().requires_grad_() for x in (q, k, w)]
    fn, calls = _counting(CF.load()[0])
    got = op.indexer_scores_cudnn(*ins, 4, *meta, precision, fwd_fn=fn)             # the real one, counted
    assert calls == [precision]
    tri = op.indexer_scores(*ins, 4, *meta)
    fin = torch.isfinite(tri)
    assert torch.equal(torch.isfinite(got), fin)
    assert_rel("I vs triton", got[fin], tri[fin], 1e-2 if precision == "bf16" else 2e-2)
    dI = torch.randn_like(got)
    for n, a, b in zip(("dqI", "dkI", "dw"), torch.autograd.grad(got, ins, dI), torch.autograd.grad(tri, ins, dI)):
        assert_rel(n, a, b, 1e-6)                         # the same Triton backward on the same inputs
    if layout != "one_doc_16k":
        with torch.no_grad():
            ref = naive.indexer_scores(q.float(), k.float(), w.float(), 4, *meta)
        assert torch.equal(torch.isfinite(ref), fin)
        assert_rel("I vs naive", got[fin], ref[fin], 1e-2 if precision == "bf16" else 2e-2)


def structured(S, nI, cI, ratio, dev, seed, topics=32, spread=0.5, noise=0.5):
    """One document of S tokens, N = S / ratio entries with structure like trained features: entries are topic
    vectors (+ noise) with a log-normal importance, queries per head a sparse mixture of topics (+ noise), so the
    scores have a heavy upper tail (a random Gaussian draw has none: its top-k boundary is noise)."""
    g = torch.Generator(device=dev).manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, device=dev)
    N = S // ratio
    C = r(topics, cI)
    z = torch.randint(0, topics, (N,), generator=g, device=dev)
    k = torch.exp(spread * r(N))[:, None] * (C[z] + noise * r(N, cI))
    q = (torch.randn(S, nI, topics, generator=g, device=dev).relu() ** 2) @ C + noise * r(S, nI, cI)
    t = torch.arange(S, device=dev)
    meta = (torch.zeros_like(t), t, torch.zeros(N, dtype=torch.long, device=dev), torch.arange(N, device=dev))
    return q.bfloat16(), k.bfloat16(), r(S, nI).bfloat16(), meta


# FP8 top-512 recall vs bf16 on `structured` (nI 64, cI 128, ratio 4), emulated on the CPU (fp32 accumulation of the
# fake-quantised features, BF16 scores; 2026-12-03, /tmp scripts, not committed): S 4096: 0.9959 / 0.9959 (seeds
# 0 / 1), S 8192: 0.9930 / 0.9931, S 16384: 0.9907 (seed 0) -- more candidates per query, a denser top-k boundary.
# A plain Gaussian draw: 0.983 at S 2048, k 128. Bounds: issue 14's 0.99 at 8K; 0.985 at 16K (its emulation is at
# the target's edge; the GPU value is printed).
RECALL_BOUND = {8192: 0.99, 16384: 0.985}


@pytest.mark.skipif(_cudnn_here() is not None, reason=f"cuDNN indexer forward: {_cudnn_here()}")
@pytest.mark.parametrize("S", list(RECALL_BOUND))
def test_gpu_fp8_topk_recall_vs_bf16(S):
    """cuDNN FP8 (the indexer's FP8 features, BF16 scores as the model rounds them) vs cuDNN bf16: top-512 recall
    over the queries with at least 512 visible entries, on `structured` data (two seeds), >= RECALL_BOUND[S]."""
    k = 512
    for seed in range(2):
        q, kk, w, meta = structured(S, 64, 128, 4, "cuda", seed)
        with torch.no_grad():
            ref = op.indexer_scores_cudnn(q, kk, w, 4, *meta, "bf16")
            f8 = op.indexer_scores_cudnn(qk_fake_quant(q, "fp8"), qk_fake_quant(kk, "fp8"), w, 4, *meta,
                                         "fp8").bfloat16()
        r = topk_recall(f8.cpu(), ref.cpu(), k, min_visible=k)
        print(f"fp8 top-{k} recall vs bf16, S {S}, seed {seed}: {r:.4f}")
        assert r >= RECALL_BOUND[S], (S, seed, r)
