"""The Triton ops are torch custom ops (`dsv4::*`, kernels/<op>/op.py) with consistent fake implementations and
registered autograd (`torch.library.opcheck`: schema, fake tensors, autograd registration, AOT dispatch), and
`kernels.get_op` is the one dispatch with one-line capability errors. CPU: Triton's interpreter, tiny shapes."""
from dsv4.kernels._testing import CUDA, use_interpreter

use_interpreter()

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
import dsv4.kernels as K  # noqa: E402

DEV = "cuda" if CUDA else "cpu"


def _r(*s, grad=True, dtype=torch.float32):
    return torch.randn(*s, device=DEV, dtype=dtype).requires_grad_(grad)


def _flashmla_ready() -> bool:
    """FlashMLA's forward can run here (CUDA SM90 and flash_mla importable): only then is its custom op checked."""
    from dsv4.kernels.sparse_attn import flashmla
    return CUDA and flashmla.load()[0] is not None and \
        flashmla.capability(torch.empty(0, device="cuda")) in flashmla.ARCHS


def _cudnn_ready() -> bool:
    """FlashMLA's forward and cudnn-frontend's DSA backward can both run here: only then is their op checked."""
    from dsv4.kernels.sparse_attn import cudnn_bwd
    return _flashmla_ready() and cudnn_bwd.load()[0] is not None


def _cudnn_indexer_ready() -> bool:
    """cudnn-frontend's SM90 indexer forward can run here (CUDA SM90, importable): only then is its op checked."""
    from dsv4.kernels.indexer import cudnn_fwd
    return CUDA and cudnn_fwd.load()[0] is not None and \
        cudnn_fwd.capability(torch.empty(0, device="cuda")) in cudnn_fwd.ARCHS


def _cases():
    torch.manual_seed(0)
    S, B, H, c, ratio = 9, 1, 2, 16, 4
    idx = torch.tensor([[0, -1], [1, 0]], device=DEV).repeat(S // 2 + 1, 1)[:S]             # [S, 2]
    seg, pos = torch.zeros(S, dtype=torch.long, device=DEV), torch.arange(S, device=DEV)   # one document
    eseg, ej = torch.zeros(S // ratio, dtype=torch.long, device=DEV), torch.arange(S // ratio, device=DEV)
    N, n, d = 5, 4, 8
    yield "sparse_attn_fwd", (_r(S, H, c), _r(S, c), _r(S // ratio, c), idx, _r(H), seg, pos, eseg, ej, 4, ratio,
                              0.25, 0)
    yield "sparse_attn_fwd", (_r(S, H, c), _r(S, c), None, None, _r(H), seg, pos, None, None, 4, 0, 0.25, 0)
    ang = torch.rand(S, 4, device=DEV) * 6.3                 # the output's fused inverse RoPE (r 8 of c 16)
    yield "sparse_attn_fwd", (_r(S, H, c), _r(S, c), _r(S // ratio, c), idx, _r(H), seg, pos, eseg, ej, 4, ratio,
                              0.25, 0, ang.cos(), ang.sin())
    yield "sparse_attn_fwd", (_r(S, H, c), _r(S, c), _r(S // ratio, c), idx, _r(H), seg, pos, eseg, ej, 4, ratio,
                              0.25, 0, None, None, True)     # the listed entries' probs as a third output
    if _flashmla_ready():       # backend "triton+flashmla": FlashMLA's forward needs bf16, H 64, c 512, SM90
        bf = torch.bfloat16
        yield "sparse_attn_flashmla_fwd", (_r(S, 64, 512, dtype=bf), _r(S, 512, dtype=bf),
                                           _r(S // ratio, 512, dtype=bf), idx, _r(64), seg, pos, eseg, ej, 4, ratio,
                                           512 ** -0.5, 0, True)
    if _cudnn_ready():          # backend "triton+flashmla+cudnn": its forward op, whose autograd is cuDNN's backward
        bf = torch.bfloat16
        yield "sparse_attn_fmla_cudnn_fwd", (_r(S, 64, 512, dtype=bf), _r(S, 512, dtype=bf),
                                             _r(S // ratio, 512, dtype=bf), idx, _r(64), seg, pos, eseg, ej, 4, ratio,
                                             512 ** -0.5, 0)
    cseg = torch.tensor([0] * 6 + [-1] + [1] * 5, device=DEV)                              # 2 documents + padding
    cpos = torch.tensor([0, 1, 2, 3, 4, 5, 0, 0, 1, 2, 3, 4], device=DEV)
    yield "compress_slots_fwd", (cseg, cpos, 2, True, 0)
    ends, eseg, ej, r0, hp = torch.ops.dsv4.compress_slots_fwd(cseg, cpos, 2, True, 0)
    yield "compress_pool_fwd", (_r(12, 2 * c), _r(12, 2 * c), _r(2, 2 * c), r0, hp, cpos, 2, True, 0)
    yield "indexer_scores_fwd", (_r(S, 2, c), _r(S // ratio, c), _r(S, 2), ratio, seg, pos, eseg, ej)
    if _cudnn_indexer_ready():  # backend "triton+cudnn": cuDNN's indexer forward needs nI 16/32/64, cI 128, SM90
        from dsv4.kernels.indexer.fp4 import qk_fake_quant
        bf = torch.bfloat16
        yield "indexer_scores_cudnn_fwd", (_r(S, 32, 128, dtype=bf), _r(S // ratio, 128, dtype=bf), _r(S, 32), ratio,
                                           seg, pos, eseg, ej, "bf16")
        qq, kq = (qk_fake_quant(x, "fp8").detach().requires_grad_() for x in (_r(S, 64, 128), _r(S // ratio, 128)))
        yield "indexer_scores_cudnn_fwd", (qq, kq, _r(S, 64), ratio, seg, pos, eseg, ej, "fp8")
    yield "indexer_scores_listed_fwd", (_r(S, 2, c), _r(S // ratio, c), _r(S, 2), idx)
    scores = _r(S, 7, grad=False).masked_fill(torch.arange(7, device=DEV) > torch.arange(S, device=DEV)[:, None],
                                             float("-inf"))
    yield "indexer_topk", (scores, 3)
    yield "indexer_topk", (scores.bfloat16(), 9)                                           # k > N
    yield "sparse_attn_entry_probs", (_r(S, H, c, grad=False), _r(S // ratio, c, grad=False), idx,
                                      _r(S, H, grad=False).abs() + 3, seg, pos, eseg, ej, ratio, 0.25, 0)
    yield "hc_pre_fwd", (_r(N, n, d), _r((2 + n) * n, n * d), _r((2 + n) * n), _r(3), 3, 1e-6, 1e-6)
    yield "hc_post_fwd", (_r(N, n, d), _r(N, d), _r(N, n), _r(N, n, n))
    yield "clamped_swiglu_fwd", (_r(6, 8), _r(6, 8), 0.5)
    yield "clamped_swiglu_packed_fwd", (_r(6, 2, 10), 0.5)
    yield "rms_norm_fwd", (_r(5, 24), _r(24), 1e-6)
    yield "rms_norm_fwd", (_r(2, 3, 16), None, 1e-6)
    ang = torch.rand(7, 4, device=DEV) * 9
    yield "rope_rows", (_r(7, 2, 12), ang.cos(), ang.sin(), False)
    yield "rope_rows", (_r(7, 1, 8), ang.cos(), ang.sin(), True)
    yield "norm_rope_fwd", (_r(7, 2, 12), ang.cos(), ang.sin(), 1e-6)
    yield "norm_rope_fwd", (_r(7, 3, 8), ang.cos() * 1.2, ang.sin() * 1.2, 1e-6)             # all rope, scaled
    order = torch.argsort(torch.rand(5, 3, device=DEV).argsort(1).view(-1), stable=True)   # 5 tokens, K = 3
    yield "moe_combine_fwd", (_r(15, 12), torch.rand(15, device=DEV, requires_grad=True), order // 3, 5, torch.float32)
    lab = torch.tensor([0, 6, 3, 6], device=DEV)
    yield "ce_lse", (_r(4, 7, grad=False), lab)
    yield "ce_dlogits", (_r(4, 7, grad=False), _r(4, grad=False), lab, torch.rand(4, device=DEV))


def test_opcheck_every_triton_custom_op():
    K.prepare("triton", torch.device(DEV))
    seen = set()
    for name, args in _cases():
        seen.add(name)
        torch.library.opcheck(getattr(torch.ops.dsv4, name).default, args)
    gpu_only = (set() if _flashmla_ready() else {"sparse_attn_flashmla_fwd"}) | (   # FlashMLA: SM90 + flash_mla only
        set() if _cudnn_ready() else {"sparse_attn_fmla_cudnn_fwd"}) | (              # and cudnn-frontend
        set() if _cudnn_indexer_ready() else {"indexer_scores_cudnn_fwd"})          # its indexer forward
    assert seen >= {n for n in dir(torch.ops.dsv4) if n.endswith("_fwd")} - gpu_only | {"rope_rows", "ce_lse",
                                                                                         "ce_dlogits", "indexer_topk"}


def test_get_op_names_what_is_missing(monkeypatch):
    with pytest.raises(ValueError, match="unknown backend 'cuda'; known: naive, triton"):
        K.get_op("sparse_attn", "cuda")
    with pytest.raises(ValueError, match="unknown op 'attn'"):
        K.get_op("attn", "naive")
    monkeypatch.setitem(K._TRITON, "on_cpu", False)       # a process whose Triton kernels are compiled for GPUs
    with pytest.raises(K.KernelUnavailable, match="backend 'triton' needs CUDA or TRITON_INTERPRET=1"):
        K.get_op("hc_post", "triton", torch.device("cpu"))
    assert K.get_op("hc_post", "naive", torch.device("cpu")) is not None


def _eager_calls():
    """custom op name -> the function model code calls (kernels/_custom_op.autograd_op)."""
    from dsv4.kernels.compressor import op as comp
    from dsv4.kernels.indexer import op as idx
    from dsv4.kernels.mhc import op as mhc
    from dsv4.kernels.moe_combine import op as moe
    from dsv4.kernels.norm_rope import op as nr
    from dsv4.kernels.rmsnorm import op as rms
    from dsv4.kernels.rope import op as rope
    from dsv4.kernels.sparse_attn import op as sa
    from dsv4.kernels.swiglu import op as sw
    return {"sparse_attn_fwd": sa._sparse_attn, "compress_pool_fwd": comp._compress_pool,
            "indexer_scores_fwd": idx._scores, "indexer_scores_listed_fwd": idx._scores_listed,
            "hc_pre_fwd": mhc._hc_pre, "hc_post_fwd": mhc._hc_post, "clamped_swiglu_fwd": sw._swiglu,
            "clamped_swiglu_packed_fwd": sw._swiglu_packed,
            "rms_norm_fwd": rms._rms_norm, "rope_rows": rope._rope_rows, "moe_combine_fwd": moe._moe_combine,
            "norm_rope_fwd": nr._norm_rope}


def _leaves(args):
    return [a.detach().clone().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) and a.is_floating_point()
            else a for a in args]


def test_eager_calls_equal_the_custom_ops_bit_for_bit_and_skip_the_dispatcher():
    """Every op with autograd: the eager path (one autograd.Function over the custom op's own body and backward)
    gives the custom op's outputs and input gradients bit for bit, dispatches no `dsv4::` op (that is the
    overhead it removes), and under fake tensors (what torch.compile traces with) the call is the custom op."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from dsv4.kernels._testing import dispatched_ops
    K.prepare("triton", torch.device(DEV))
    calls, seen = _eager_calls(), set()
    for name, args in _cases():
        if name not in calls:
            continue
        seen.add(name)
        a_op, a_eager = _leaves(args), _leaves(args)
        out_op = getattr(torch.ops.dsv4, name)(*a_op)
        out_eager = calls[name](*a_eager)
        out_op = out_op if isinstance(out_op, tuple) else (out_op,)
        out_eager = out_eager if isinstance(out_eager, tuple) else (out_eager,)
        assert len(out_op) == len(out_eager), name
        g = torch.Generator(device=DEV).manual_seed(1)
        loss_op, loss_eager = 0, 0
        for o, e in zip(out_op, out_eager):
            assert torch.equal(o, e), name
            if o.requires_grad and o.is_floating_point():
                w = torch.randn(o.shape, generator=g, device=DEV, dtype=o.dtype)
                loss_op, loss_eager = loss_op + (o * w).sum(), loss_eager + (e * w).sum()
        loss_op.backward()
        loss_eager.backward()
        for x, y in zip(a_op, a_eager):
            if isinstance(x, torch.Tensor) and x.requires_grad:
                assert x.grad is not None and torch.equal(x.grad, y.grad), name
        ops = dispatched_ops(lambda: calls[name](*_leaves(args)))
        assert not any(k.startswith(("rms_norm", "rope_rows", "hc_", "sparse_attn", "compress_pool", "indexer_scores",
                                     "clamped_swiglu", "moe_combine", "norm_rope")) for k in ops), (name, ops)
        with FakeTensorMode() as mode:
            fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
            out = calls[name](*fake)                   # the eager body would launch Triton on fake tensors
        assert all(type(o).__name__ == "FakeTensor" for o in (out if isinstance(out, tuple) else (out,))), name
    assert seen == set(calls)


def test_cross_entropy_ops_eager_bodies_equal_the_custom_ops():
    """The cross-entropy row ops carry no autograd (model/model.py `_HeadCrossEntropy` is the autograd.Function):
    eager calls run the body directly, bit-equal to the custom op, dispatching no `dsv4::` op; traced calls
    (fake tensors) are the custom op."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from dsv4.kernels._testing import dispatched_ops
    from dsv4.kernels.cross_entropy import op as ce
    K.prepare("triton", torch.device(DEV))
    calls = {"ce_lse": ce.ce_lse, "ce_dlogits": ce.ce_dlogits}
    for name, args in _cases():
        if name not in calls:
            continue
        got = calls[name](*args)
        ref = getattr(torch.ops.dsv4, name)(*args)
        for a, b in zip(got if isinstance(got, tuple) else (got,), ref if isinstance(ref, tuple) else (ref,)):
            assert torch.equal(a, b), name
        assert not any(k.startswith("ce_") for k in dispatched_ops(lambda: calls[name](*args))), name
        with FakeTensorMode() as mode:
            out = calls[name](*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args])
        assert all(type(o).__name__ == "FakeTensor" for o in (out if isinstance(out, tuple) else (out,))), name
