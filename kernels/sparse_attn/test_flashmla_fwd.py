"""Backend "triton+flashmla" of sparse attention (kernels/sparse_attn/flashmla.py, op.py `sparse_attn_flashmla`):
FlashMLA's SM90 sparse prefill forward + our Triton backward, the Triton forward as the fallback.

CPU (no FlashMLA here): the packed varlen index mapping attended the way FlashMLA defines it
(harness/flashmla_peer.gathered_attention) == naive.sparse_attn in fp64 (window / CSA / HCA, odd packed layouts with
padding, a CP halo); FlashMLA's lse (natural, no sink, +inf with no key) converted == naive's lse; the dispatch
(FlashMLA only when the call qualifies, the reason otherwise); and forward + gradients through the Triton backward
with a stand-in of flash_mla_sparse_fwd (its signature, checks and returns, after FlashMLA's tests/ref.py) passed
explicitly == the pure Triton path (interpreter, fp32).
GPU (skipped without CUDA SM90 and an importable flash_mla): FlashMLA forward + Triton backward vs the pure Triton
path and the naive reference at DSv4 shapes (H 64, c 512, window 128), 4K-16K packed tokens, bf16."""
from dsv4.kernels._testing import CUDA, assert_close, assert_rel, packed_meta, use_interpreter

use_interpreter()

import math  # noqa: E402
import re  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
from dsv4.harness.flashmla_peer import gathered_attention  # noqa: E402
from dsv4.kernels.compressor.naive import entry_slots  # noqa: E402
from dsv4.kernels.sparse_attn import cudnn_bwd as CB  # noqa: E402
from dsv4.kernels.sparse_attn import flashmla as FM  # noqa: E402
from dsv4.kernels.sparse_attn import naive  # noqa: E402
from dsv4.kernels.sparse_attn import op  # noqa: E402

# (document lengths, padding after each, q_offset): odd lengths, padding between documents, a CP halo
LAYOUTS = {"one_doc": ([13], None, 0), "packed": ([5, 11, 2, 9], [2, 0, 3, 1], 0), "halo": ([7, 12, 6], [0, 1, 0], 4)}
MODES = {"window": (4, 0), "csa": (3, 4), "hca": (4, 0)}          # mode -> (ratio, k)


def _case(mode, layout, H, c, window, dtype, dev="cpu", ratio=None, k=None, seed=0, scale_lens=1):
    lens, pads, q_off = LAYOUTS[layout]
    lens = [L * scale_lens for L in lens]
    r0, k0 = MODES[mode]
    ratio, k = ratio or r0, k if k is not None else k0
    gen = torch.Generator(device=dev).manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen, device=dev)
    seg, pos = packed_meta(lens, pads, dev)
    Tk = seg.numel()
    Tq = Tk - q_off
    q, kv, sink = rnd(Tq, H, c).to(dtype), rnd(Tk, c).to(dtype), rnd(H).to(dtype if dtype == torch.float64 else
                                                                           torch.float32)
    comp = idx = eseg = ej = None
    if mode != "window":
        ends, valid, ej = entry_slots(seg, pos, ratio, q_off)
        eseg = torch.where(valid, seg[ends], torch.full_like(ends, -1))
        comp = rnd(ends.numel(), c).to(dtype)
    if mode == "csa":                                  # unique picks, some -1, some of other documents / not complete
        N = comp.shape[0]
        idx = torch.rand(Tq, N, generator=gen, device=dev).topk(min(k, N), dim=-1).indices
        idx = torch.where(torch.rand(idx.shape, generator=gen, device=dev) < 0.2, -1, idx)
    meta = dict(seg=seg, pos=pos, entry_seg=eseg, entry_j=ej, q_offset=q_off)
    return (q, kv, comp, idx, sink), meta, (ratio if mode != "window" else 0)


def stand_in(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None):
    """flash_mla_sparse_fwd's signature, input checks (csrc/api/sparse_fwd.h, csrc/sm90/prefill/sparse/phase1.cuh)
    and returns, computed as FlashMLA's tests/ref.py `ref_sparse_attn_fwd` does: (out, max_logits, lse) with lse
    the natural log-sum-exp WITHOUT the sink and +inf for a query with no valid index."""
    s_q, h_q, d_qk = q.shape
    assert kv.dim() == 3 and kv.shape[1] == 1 and kv.shape[2] == d_qk and d_v == d_qk
    assert indices.dtype == torch.int32 and indices.shape[:2] == (s_q, 1)
    assert indices.shape[2] % 128 == 0 and indices.shape[2] > 0
    assert attn_sink is not None and attn_sink.dtype == torch.float32 and attn_sink.shape == (h_q,)
    ix = indices[:, 0].long()
    if topk_length is not None:
        assert topk_length.dtype == torch.int32 and topk_length.shape == (s_q,)
        ix = torch.where(torch.arange(ix.shape[1], device=ix.device) < topk_length[:, None], ix, -1)
    bad = (ix < 0) | (ix >= kv.shape[0])
    dt = torch.promote_types(q.dtype, torch.float32)
    g = kv[:, 0][torch.where(bad, 0, ix)].to(dt)                                  # [s_q, topk, d]
    P = (torch.einsum("shd,skd->shk", q.to(dt), g) * sm_scale).masked_fill(bad[:, None, :], float("-inf"))
    lse = torch.logsumexp(P, -1)
    lse_o = torch.logaddexp(lse, attn_sink.to(dt)[None, :])
    out = torch.einsum("shk,skd->shd", torch.exp(P - lse_o[..., None]), g[..., :d_v])
    return out.to(q.dtype), P.amax(-1), torch.where(torch.isneginf(lse), float("inf"), lse).float()


# --------------------------------------------------------------------------------- the mapping and the lse (fp64)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("window", [1, 5])
def test_indices_attended_as_flashmla_equal_naive(mode, layout, window):
    (q, kv, comp, idx, sink), meta, ratio = _case(mode, layout, H=3, c=8, window=window, dtype=torch.float64)
    Tq, Tk = q.shape[0], kv.shape[0]
    N = 0 if comp is None else comp.shape[0]
    ix, length = FM.indices(meta["seg"], meta["pos"], Tq, window, ratio, idx, meta["entry_seg"], meta["entry_j"], N,
                            meta["q_offset"])
    kva = FM.kv_all(kv, comp)
    K = window + (idx.shape[1] if mode == "csa" else N)
    assert ix.dtype == torch.int32 and ix.shape == (Tq, 1, FM.padded(K)) and ix.shape[2] % 128 == 0
    assert int(ix.min()) >= -1 and int(ix.max()) < kva.shape[0] == Tk + N
    slot = torch.arange(ix.shape[2])
    assert (ix[:, 0][slot >= length[:, None].long()] == -1).all()                # nothing live past topk_length
    live = length > 0
    assert (ix[live, 0, (length[live] - 1).long()] >= 0).all()
    got = gathered_attention(q, kva, ix, sink, q.shape[-1] ** -0.5)
    ref = naive.sparse_attn(q, kv, comp, idx, sink, window, ratio, q.shape[-1] ** -0.5, **meta)
    torch.testing.assert_close(got, ref, atol=1e-12, rtol=1e-12)
    seg_q = meta["seg"][meta["q_offset"]:]
    assert (length[seg_q < 0] == 0).all() and (length[seg_q >= 0] > 0).all()    # padding: no key at all


@pytest.mark.parametrize("layout", ["packed", "halo"])
@pytest.mark.parametrize("mode", ["csa", "hca"])
def test_flashmla_lse_converted_equals_naive_lse(mode, layout):
    """FlashMLA's lse (stand_in: natural log, sink not included, +inf for padding queries) -> ours (log2 units,
    sink included, what the Triton backward reads) == naive's natural lse * log2(e), fp64."""
    (q, kv, comp, idx, sink), meta, ratio = _case(mode, layout, H=3, c=8, window=5, dtype=torch.float64)
    Tq, N = q.shape[0], comp.shape[0]
    ix, length = FM.indices(meta["seg"], meta["pos"], Tq, 5, ratio, idx, meta["entry_seg"], meta["entry_j"], N,
                            meta["q_offset"])
    kva = FM.kv_all(kv, comp)
    dt = torch.float64                                                   # the stand-in's lse in fp64 for this check
    P = torch.einsum("shd,skd->shk", q, kva[:, 0][ix[:, 0].long().clamp(min=0)]) * 8 ** -0.5
    lse_fm = torch.logsumexp(P.masked_fill((ix[:, 0] < 0)[:, None, :], float("-inf")), -1)
    lse_fm = torch.where(torch.isneginf(lse_fm), float("inf"), lse_fm).to(dt)
    assert torch.isposinf(lse_fm).any()                                  # padding queries are in the case
    _, ref = naive.sparse_attn(q, kv, comp, idx, sink, 5, ratio, 8 ** -0.5, **meta, return_lse=True)
    torch.testing.assert_close(FM.lse_ours(lse_fm, sink), ref * FM.LOG2E, atol=1e-12, rtol=1e-12)
    assert FM.lse_ours(lse_fm.float(), sink.float()).dtype == torch.float32   # what the Triton kernels store


# --------------------------------------------------------------------------------------------------- dispatch
def test_unqualified_names_each_reason():
    bf = torch.bfloat16
    q, kv, comp = torch.zeros(5, 64, 512, dtype=bf), torch.zeros(9, 512, dtype=bf), torch.zeros(2, 512, dtype=bf)
    ok = FM.unqualified(q, kv, comp, stand_in, (9, 0))
    assert ok is None and FM.unqualified(torch.zeros(5, 128, 512, dtype=bf), kv, None, stand_in, (9, 0)) is None
    cases = {"flash_mla not importable": (q, kv, comp, None, (9, 0)),
             "needs an SM90 GPU": (q, kv, comp, stand_in, (8, 0)),
             "no CUDA device": (q, kv, comp, stand_in, None),
             "needs bf16": (q, kv, comp.float(), stand_in, (9, 0)),
             "needs H in (64, 128)": (torch.zeros(5, 16, 512, dtype=bf), kv, comp, stand_in, (9, 0)),
             "needs c = d_qk = d_v = 512": (torch.zeros(5, 64, 576, dtype=bf), torch.zeros(9, 576, dtype=bf),
                                            None, stand_in, (9, 0)),
             "no queries": (q[:0], kv, comp, stand_in, (9, 0))}
    for want, args in cases.items():
        why = FM.unqualified(*args)
        assert why is not None and want in why and "\n" not in why, (want, why)
    fn, why = FM.load()
    assert fn is not None or ("flash_mla not importable" in why and "flashmla_h200.sh" in why and "\n" not in why)


def _counting(fn):
    calls = []

    def f(*a, **k):
        calls.append(a[2].shape)
        return fn(*a, **k)
    return f, calls


@pytest.mark.skipif(CUDA, reason="CPU tensors through the Triton interpreter (a CUDA host compiles Triton for the GPU): the GPU tests below run the real kernels")
def test_dispatch_flashmla_only_when_the_call_qualifies():
    """A qualifying call (bf16, H 64, c 512, SM90 given explicitly) runs the stand-in: its output, our lse; a call
    that does not qualify (fp32, H 3 on the CPU) never calls it and is the Triton path bit for bit."""
    fn, calls = _counting(stand_in)
    (q, kv, comp, idx, sink), meta, ratio = _case("csa", "halo", H=64, c=512, window=5, dtype=torch.bfloat16)
    with torch.no_grad():
        o, lse = op.sparse_attn_flashmla(q, kv, comp, idx, sink, 5, ratio, 512 ** -0.5, **meta, return_lse=True,
                                         fwd_fn=fn, capability=(9, 0))
    assert len(calls) == 1 and calls[0][2] == 128
    ix, length = FM.indices(meta["seg"], meta["pos"], q.shape[0], 5, ratio, idx, meta["entry_seg"],
                            meta["entry_j"], comp.shape[0], meta["q_offset"])
    o_si, _, lse_si = stand_in(q, FM.kv_all(kv, comp), ix, 512 ** -0.5, 512, sink, length)
    assert torch.equal(o, o_si) and torch.equal(lse, FM.lse_ours(lse_si, sink) * math.log(2.0))
    # not qualifying: fp32 and H = 3 (and no CUDA device when capability is read from the tensors)
    (q, kv, comp, idx, sink), meta, ratio = _case("csa", "packed", H=3, c=16, window=4, dtype=torch.float32)
    for cap in (None, (9, 0)):
        with torch.no_grad():
            got = op.sparse_attn_flashmla(q, kv, comp, idx, sink, 4, ratio, 0.25, **meta, fwd_fn=fn, capability=cap)
            want = op.sparse_attn(q, kv, comp, idx, sink, 4, ratio, 0.25, **meta)
        assert torch.equal(got, want)
    assert len(calls) == 1
    import dsv4.kernels as K                                              # the backend name resolves to it
    assert K.get_op("sparse_attn", "triton+flashmla", q.device) is op.sparse_attn_flashmla


def test_model_switch_and_bench_row_reason():
    """`DSv4Model.set_attn_fwd` sets every attention layer's forward (unknown modes refused, the choice shown in the
    module's repr); the `dsv4 bench kernels` backend row gives the fallback's reason instead of timing it."""
    from dsv4.harness import bench
    from dsv4.model.attention import DSv4Attention
    from dsv4.model.config import get_config
    from dsv4.model.model import DSv4Model
    m = DSv4Model(get_config("debug"))
    layers = [a for a in m.modules() if isinstance(a, DSv4Attention)]
    assert layers and all(a.attn_fwd == "triton" for a in layers)                # the default
    assert m.set_attn_fwd("flashmla") is m and all(a.attn_fwd == "flashmla" for a in layers)
    assert "attn_fwd=flashmla" in repr(layers[0])
    with pytest.raises(ValueError, match=re.escape("unknown mode 'cudnn'; known: triton, flashmla, flashmla+cudnn")):
        m.set_attn_fwd("cudnn")
    m.set_attn_fwd("triton")
    assert all(a.attn_fwd == "triton" for a in layers) and "attn_fwd" not in repr(layers[0])
    (q, kv, comp, idx, sink), meta, ratio = _case("csa", "packed", H=3, c=16, window=4, dtype=torch.float32)
    r = bench._flashmla_backend_row(stand_in, q, kv, comp, idx, sink, 4, ratio, 16, 1, {}, list(meta.values())[:4],
                                    [q], capability=(9, 0))
    assert r == {"triton_flashmla": {"skipped": FM.unqualified(q, kv, comp, stand_in, (9, 0))}}
    assert "needs bf16" in r["triton_flashmla"]["skipped"]


# ------------------------------------------------------------------ forward + Triton backward, stand-in forward
@pytest.mark.skipif(CUDA, reason="CPU tensors through the Triton interpreter (a CUDA host compiles Triton for the GPU): the GPU tests below run the real kernels")
@pytest.mark.parametrize("mode,layout,topk_length", [("window", "packed", True), ("csa", "halo", True),
                                                     ("csa", "packed", False), ("hca", "halo", True)])
def test_stand_in_forward_with_triton_backward_equals_triton(mode, layout, topk_length):
    """The backend's forward (indices, kv_all, FlashMLA's call, lse conversion) with the stand-in, then the
    unchanged Triton backward on its o and lse == the pure Triton forward and backward (fp32, interpreter).
    The shape check is the dispatch's (test above): here the eager Function runs directly at a tiny shape."""
    (q, kv, comp, idx, sink), meta, ratio = _case(mode, layout, H=3, c=24, window=5, dtype=torch.float32)
    ins = [x.requires_grad_() for x in (q, kv, comp, sink) if x is not None]
    args = (q, kv, comp, idx, sink, meta["seg"], meta["pos"], meta["entry_seg"], meta["entry_j"], 5, ratio,
            24 ** -0.5, meta["q_offset"], topk_length)
    o, lse2 = op._FlashMLAEager.apply(stand_in, *args)
    o_t, lse_t = op.sparse_attn(q, kv, comp, idx, sink, 5, ratio, 24 ** -0.5, **meta, return_lse=True)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(1))
    got = torch.autograd.grad(o, ins, do)
    want = torch.autograd.grad(o_t, ins, do)
    # the bounds of test_sparse_attn.py's fp32 Triton-vs-naive checks (summation order only): o / lse 2e-5 / 1e-5,
    # grads 5e-5 / 1e-4
    assert_close("o", o, o_t, 2e-5, 1e-5)
    assert_close("lse", lse2 * math.log(2.0), lse_t, 2e-5, 1e-5)
    for n, a, b in zip(("dq", "dkv", "dcomp", "dsink") if comp is not None else ("dq", "dkv", "dsink"), got, want):
        assert_close(n, a, b, 5e-5, 1e-4)


# ------------------------------------------------------------------------------------------------- GPU: FlashMLA
def _flashmla_here():
    if not CUDA:
        return "no CUDA"
    if FM.load()[0] is None:
        return FM.load()[1]
    if FM.capability(torch.empty(0, device="cuda")) not in FM.ARCHS:
        return "not an SM90 GPU"
    return None


# DSv4 shapes, 4K-16K tokens: the packed / halo layouts scaled (x 350: 9,450 and 9,100 tokens with padding) and
# one 16K document
GPU_LAYOUTS = {"packed_9k": ("packed", 350), "halo_9k": ("halo", 350), "one_doc_16k": ("one_doc", 1261)}


@pytest.mark.skipif(_flashmla_here() is not None, reason=f"FlashMLA forward: {_flashmla_here()}")
@pytest.mark.parametrize("topk_length", [True, False])
@pytest.mark.parametrize("layout", list(GPU_LAYOUTS))
@pytest.mark.parametrize("mode", ["window", "csa", "hca"])
def test_gpu_flashmla_forward_triton_backward(mode, layout, topk_length):
    """H 64, c 512, window 128, CSA (ratio 4, top-k 512) / HCA (ratio 128), bf16: backend "triton+flashmla" (FlashMLA
    ran: its call is counted) vs the pure Triton path and the fp32 naive reference: output, lse and gradients."""
    base, mul = GPU_LAYOUTS[layout]
    ratio, k = {"window": (4, 0), "csa": (4, 512), "hca": (128, 0)}[mode]
    (q, kv, comp, idx, sink), meta, ratio = _case(mode, base, H=64, c=512, window=128, dtype=torch.bfloat16,
                                                  dev="cuda", ratio=ratio, k=k, scale_lens=mul)
    ins = [x.requires_grad_() for x in (q, kv, comp, sink) if x is not None]
    names = [n for n, x in zip(("dq", "dkv", "dcomp", "dsink"), (q, kv, comp, sink)) if x is not None]
    fn, calls = _counting(FM.load()[0])
    scale = 512 ** -0.5
    o, lse = op.sparse_attn_flashmla(q, kv, comp, idx, sink, 128, ratio, scale, **meta, return_lse=True, fwd_fn=fn,
                                     topk_length=topk_length)
    assert len(calls) == 1
    o_t, lse_t = op.sparse_attn(q, kv, comp, idx, sink, 128, ratio, scale, **meta, return_lse=True)
    with torch.no_grad():                                   # the default call (fwd_fn None) is the same kernel
        assert torch.equal(op.sparse_attn_flashmla(q, kv, comp, idx, sink, 128, ratio, scale, **meta,
                                                   topk_length=topk_length), o)
    do = torch.randn_like(o)
    got = torch.autograd.grad(o, ins, do)
    tri = torch.autograd.grad(o_t, ins, do)
    # lse: the QK logits are bf16 x bf16 products summed in fp32 in both kernels, so only the summation order
    # differs (not measured on the H200 yet; 1e-3 absolute on values of about 1..10 is far above fp32 rounding)
    assert_close("lse vs triton", lse, lse_t, 1e-3, 1e-4)
    # Bounds, vs the fp32 naive reference: test_sparse_attn.py's bf16 bounds for the Triton path (o 1e-2, grads
    # 2e-2, CSA dcomp 5e-2; measured on the H200 there: o 2.2e-3, dq 2.7e-3, dkv 1.6e-2, CSA dcomp 3.8e-2); FlashMLA's
    # own test allows its bf16 out 8e-4 abs + 3.01/128 rel of the fp32 reference (FlashMLA
    # tests/test_flash_mla_sparse_prefill.py:46): the same bf16 rounding of P and o. FlashMLA + Triton backward vs
    # the pure Triton path: both within those bounds of the reference, so within twice them of each other.
    assert_rel("o vs triton", o, o_t, 2e-2)
    for n, a, b in zip(names, got, tri):
        assert_rel(f"{n} vs triton", a, b, 1e-1 if (n == "dcomp" and mode == "csa") else 4e-2)
    if layout == "one_doc_16k":                             # naive at 16K: a [16K, 512, 512] fp32 gather (17 GB)
        return
    ref = naive.sparse_attn(q, kv, comp, idx, sink, 128, ratio, scale, **meta)
    want = torch.autograd.grad(ref, ins, do)
    assert_rel("o vs naive", o, ref, 1e-2)
    for n, a, b in zip(names, got, want):
        assert_rel(f"{n} vs naive", a, b, 5e-2 if (n == "dcomp" and mode == "csa") else 2e-2)


# ----------------------------------------------------------- backend "triton+flashmla+cudnn": + cuDNN's backward
def bwd_stand_in(q, kv, out, dout, lse, attn_sink, topk_idxs, softmax_scale=None, topk_length=None):
    """cudnn-frontend's sparse_attention_backward_wrapper: its signature, input checks (_interface_sm90.py
    flash_attn_bwd_sm90) and returns ({"dq", "dkv", "d_sink"}), the gradients by fp64 autograd of the gathered
    attention (the contract: entries outside [0, S_kv) ignored). It also checks what it is given: `lse` is the
    KV-only natural log-sum-exp (FlashMLA's, +inf with no key) and `out` the attention output of these inputs."""
    S_q, H, D = q.shape
    assert kv.dim() == 2 and kv.shape[1] == D and out.shape == dout.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == (S_q, H)
    assert attn_sink.dtype == torch.float32 and attn_sink.shape == (H,)
    assert topk_idxs.dtype == torch.int32 and topk_idxs.dim() == 2 and topk_idxs.shape[0] == S_q
    assert topk_length is None and all(t.is_contiguous() for t in (q, kv, out, dout, lse, attn_sink, topk_idxs))
    ix = topk_idxs.long()
    bad = (ix < 0) | (ix >= kv.shape[0])
    with torch.enable_grad():
        qq, kk, ss = (t.detach().double().requires_grad_() for t in (q, kv, attn_sink))
        g = kk[torch.where(bad, 0, ix)]                                               # [S_q, K, D]
        P = (torch.einsum("shd,skd->shk", qq, g) * softmax_scale).masked_fill(bad[:, None, :], float("-inf"))
        lse_kv = torch.logsumexp(P, -1)
        o = torch.einsum("shk,skd->shd", torch.exp(P - torch.logaddexp(lse_kv, ss[None, :])[..., None]), g)
        dq, dkv, dsink = torch.autograd.grad(o, (qq, kk, ss), dout.double())
    # fp32 lse / out of the fp32 stand-in forward vs this fp64 recomputation: worst measured on the CPU cases below
    # 1.3e-7 relative (lse; the 1e-5 bound is ~75x that) and 1.4e-6 of (0.1 + |o|) (out; the bound, 1e-5 + 1e-4 |o|,
    # is >= 7x that)
    seen = torch.where(torch.isneginf(lse_kv), float("inf"), lse_kv).detach()
    assert torch.allclose(seen, lse.double(), rtol=1e-5, atol=1e-5, equal_nan=False), "lse is not FlashMLA's"
    assert torch.allclose(o.detach(), out.double(), rtol=1e-4, atol=1e-5), "out is not this attention's output"
    return {"dq": dq.to(q.dtype), "dkv": dkv.to(kv.dtype), "d_sink": dsink.float()}


@pytest.mark.skipif(CUDA, reason="CPU tensors through the Triton interpreter (a CUDA host compiles Triton for the GPU): the GPU tests below run the real kernels")
@pytest.mark.parametrize("mode,layout", [("window", "packed"), ("csa", "halo"), ("csa", "packed"), ("hca", "halo"),
                                         ("hca", "one_doc")])
def test_stand_ins_forward_and_cudnn_backward_equal_triton(mode, layout):
    """Backend "triton+flashmla+cudnn" with both stand-ins (FlashMLA's forward, cuDNN's backward; tiny shapes, the
    eager Function directly): output, lse and the gradients -- dkv_all split into the key stream's and the entries'
    rows, d_sink -- == the pure Triton path (fp32, interpreter), and the backward got FlashMLA's own lse."""
    (q, kv, comp, idx, sink), meta, ratio = _case(mode, layout, H=3, c=24, window=5, dtype=torch.float32)
    ins = [x.requires_grad_() for x in (q, kv, comp, sink) if x is not None]
    args = (q, kv, comp, idx, sink, meta["seg"], meta["pos"], meta["entry_seg"], meta["entry_j"], 5, ratio,
            24 ** -0.5, meta["q_offset"])
    o, lse_fm, ix = op._FlashMLACudnnEager.apply(stand_in, bwd_stand_in, *args)
    assert ix.dtype == torch.int32 and ix.shape[1] % 128 == 0 and not lse_fm.requires_grad
    o_t, lse_t = op.sparse_attn(q, kv, comp, idx, sink, 5, ratio, 24 ** -0.5, **meta, return_lse=True)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(1))
    got = torch.autograd.grad(o, ins, do)
    want = torch.autograd.grad(o_t, ins, do)
    # the bounds of test_sparse_attn.py's fp32 Triton-vs-naive checks (summation order only), as above
    assert_close("o", o, o_t, 2e-5, 1e-5)
    assert_close("lse", FM.lse_ours(lse_fm, sink.detach()) * math.log(2.0), lse_t, 2e-5, 1e-5)
    for n, a, b in zip(("dq", "dkv", "dcomp", "dsink") if comp is not None else ("dq", "dkv", "dsink"), got, want):
        assert_close(n, a, b, 5e-5, 1e-4)


@pytest.mark.skipif(CUDA, reason="CPU tensors through the Triton interpreter (a CUDA host compiles Triton for the GPU): the GPU tests below run the real kernels")
def test_cudnn_dispatch_and_fallback():
    """A qualifying call with both stand-ins runs them (lse returned as ours); with no cuDNN (bwd_fn None and
    cudnn-frontend not importable here) the call is backend "triton+flashmla" bit for bit, and the reason says so;
    the fake of the forward op gives the index width FM.indices builds."""
    (q, kv, comp, idx, sink), meta, ratio = _case("csa", "halo", H=64, c=512, window=5, dtype=torch.bfloat16)
    fn, calls = _counting(stand_in)
    with torch.no_grad():
        o, lse = op.sparse_attn_flashmla_cudnn(q, kv, comp, idx, sink, 5, ratio, 512 ** -0.5, **meta,
                                               return_lse=True, fwd_fn=fn, bwd_fn=bwd_stand_in, capability=(9, 0))
        o_f, lse_f = op.sparse_attn_flashmla(q, kv, comp, idx, sink, 5, ratio, 512 ** -0.5, **meta, return_lse=True,
                                             fwd_fn=fn, capability=(9, 0))
    assert len(calls) == 2 and torch.equal(o, o_f) and torch.equal(lse, lse_f)
    if CB.load()[0] is None:
        assert CB.unqualified(q, kv, comp, fn, None, (9, 0)) == "cudnn-frontend's DSA backward not importable"
        with torch.no_grad():
            o2 = op.sparse_attn_flashmla_cudnn(q, kv, comp, idx, sink, 5, ratio, 512 ** -0.5, **meta, fwd_fn=fn,
                                               capability=(9, 0))
        assert torch.equal(o2, o_f) and len(calls) == 3
    ix, _ = FM.indices(meta["seg"], meta["pos"], q.shape[0], 5, ratio, idx, meta["entry_seg"], meta["entry_j"],
                       comp.shape[0], meta["q_offset"])
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode(allow_non_fake_inputs=True):
        _o, _l, fix = op.sparse_attn_fmla_cudnn_fwd(q, kv, comp, idx, sink, meta["seg"], meta["pos"],
                                                    meta["entry_seg"], meta["entry_j"], 5, ratio, 0.1,
                                                    meta["q_offset"])
    assert tuple(fix.shape) == tuple(ix[:, 0].shape) and fix.dtype == torch.int32
    import dsv4.kernels as K
    assert K.get_op("sparse_attn", "triton+flashmla+cudnn", q.device) is op.sparse_attn_flashmla_cudnn


def _cudnn_here():
    why = _flashmla_here()
    return why if why is not None else CB.load()[1]


@pytest.mark.skipif(_cudnn_here() is not None, reason=f"FlashMLA + cuDNN: {_cudnn_here()}")
@pytest.mark.parametrize("layout", list(GPU_LAYOUTS))
@pytest.mark.parametrize("mode", ["window", "csa", "hca"])
def test_gpu_flashmla_forward_cudnn_backward(mode, layout):
    """H 64, c 512, window 128, CSA (ratio 4, top-k 512) / HCA (ratio 128), bf16: backend "triton+flashmla+cudnn"
    vs the pure Triton path and the fp32 naive reference: output, lse and gradients (bounds as the test above)."""
    base, mul = GPU_LAYOUTS[layout]
    ratio, k = {"window": (4, 0), "csa": (4, 512), "hca": (128, 0)}[mode]
    (q, kv, comp, idx, sink), meta, ratio = _case(mode, base, H=64, c=512, window=128, dtype=torch.bfloat16,
                                                  dev="cuda", ratio=ratio, k=k, scale_lens=mul)
    ins = [x.requires_grad_() for x in (q, kv, comp, sink) if x is not None]
    names = [n for n, x in zip(("dq", "dkv", "dcomp", "dsink"), (q, kv, comp, sink)) if x is not None]
    bfn, calls = _counting(CB.load()[0])
    scale = 512 ** -0.5
    o, lse = op.sparse_attn_flashmla_cudnn(q, kv, comp, idx, sink, 128, ratio, scale, **meta, return_lse=True,
                                           bwd_fn=bfn)
    o_t, lse_t = op.sparse_attn(q, kv, comp, idx, sink, 128, ratio, scale, **meta, return_lse=True)
    do = torch.randn_like(o)
    got = torch.autograd.grad(o, ins, do)
    assert len(calls) == 1                                   # cuDNN's backward ran
    tri = torch.autograd.grad(o_t, ins, do)
    assert_close("lse vs triton", lse, lse_t, 1e-3, 1e-4)
    assert_rel("o vs triton", o, o_t, 2e-2)
    for n, a, b in zip(names, got, tri):
        assert_rel(f"{n} vs triton", a, b, 1e-1 if (n == "dcomp" and mode == "csa") else 4e-2)
    if layout == "one_doc_16k":
        return
    ref = naive.sparse_attn(q, kv, comp, idx, sink, 128, ratio, scale, **meta)
    want = torch.autograd.grad(ref, ins, do)
    assert_rel("o vs naive", o, ref, 1e-2)
    for n, a, b in zip(names, got, want):
        assert_rel(f"{n} vs naive", a, b, 5e-2 if (n == "dcomp" and mode == "csa") else 2e-2)
