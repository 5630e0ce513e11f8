"""Triton MoE combine vs the naive reference (model/moe.py's grouped expert path): values and the gradients of y and
w at odd sizes (T=7, K=3, d=37: two column tiles on CPU, two experts without tokens), T=0, a per-token fp64 loop
oracle, fp64 gradcheck, a wrong weight the comparisons catch, the model's grouped path on both backends. bf16 at
the `proxy` shapes is checked on the GPU only (Triton 3.9's interpreter truncates fp32 -> bf16 stores,
kernels/PERF_NOTES.md)."""
from dsv4.kernels._testing import CUDA, assert_rel, use_interpreter

use_interpreter()

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
from dsv4.kernels.moe_combine import moe_combine  # noqa: E402

DEV = "cuda" if CUDA else "cpu"


def _case(T, K, E, d, dt, seed):
    """Expert-sorted slots as model/moe.py builds them: y [T*K, d], w [T*K], tok [T*K]; and an output gradient."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    idx = torch.rand(T, E - 2, generator=g, device=DEV).argsort(1)[:, :K]    # [T, K] distinct; 2 experts unused
    order = torch.argsort(idx.reshape(-1), stable=True)
    tok = order // K
    w = torch.rand(T * K, generator=g, device=DEV)[order]
    y = (torch.randn(T * K, d, generator=g, device=DEV) * 3).to(dt)
    dout = torch.randn(T, d, generator=g, device=DEV).to(dt)
    return y, w.to(dt if dt == torch.float64 else torch.float32), tok, dout


def _run(fn, y, w, tok, T, dout):
    """(out, dy, dw) of fn(y, w, tok, T, out_dtype = dout's dtype)."""
    y, w = y.detach().requires_grad_(), w.detach().requires_grad_()
    out = fn(y, w, tok, T, dout.dtype)
    return (out.detach(), *torch.autograd.grad(out, (y, w), dout))


def _triton(y, w, tok, T, dt):
    return moe_combine(y, w, tok, T, dt, backend="triton")


def _naive(y, w, tok, T, dt):
    return moe_combine(y, w, tok, T, dt, backend="naive")


def _oracle(y, w, tok, T, dt):
    """fp64 loop over tokens: out[t] = sum of w[s] y[s] over t's slots in ascending s, from 0."""
    outs = []
    for t in range(T):
        acc = torch.zeros(y.shape[1], dtype=torch.float64, device=y.device)
        for s in (tok == t).nonzero().view(-1).tolist():
            acc = acc + w[s].double() * y[s].double()
        outs.append(acc)
    return torch.stack(outs).to(dt)


def _check(got, ref, y, w, tok, dout):
    """out bit for bit on CPU (the same products added in the same order; on the GPU within 8 eps x sum_k |w_k y_k|:
    Triton fuses w y + acc into an FMA and index_add_ adds in atomic order); dy bit for bit (the same product); dw
    (a dot product over d, summed in another order) within 8 eps x sum_j |g_j y_j| per slot: measured <= 1.15 eps
    (fp32 vs naive, fp64 vs the oracle; 4 shapes up to d=130, 20 seeds each), x7."""
    (o, dy, dw), (ro, rdy, rdw) = got, ref
    eps = torch.finfo(dw.dtype).eps
    if CUDA:
        terms = (w.double()[:, None] * y.double()).abs()
        bound = 8 * eps * torch.zeros(o.shape, dtype=torch.float64, device=DEV).index_add_(0, tok, terms)
        assert ((o.double() - ro.double()).abs() <= bound).all(), "out: beyond 8 eps x sum_k |w_k y_k|"
    else:
        assert torch.equal(o, ro), f"out: max |diff| {(o - ro).abs().max():.3e}"
    assert torch.equal(dy, rdy), f"dy: max |diff| {(dy - rdy).abs().max():.3e}"
    bound = 8 * eps * (dout[tok].double() * y.double()).abs().sum(1)
    err = (dw.double() - rdw.double()).abs()
    assert (err <= bound).all(), f"dw: max |diff| / bound {(err / bound).max():.2f}"


@pytest.mark.parametrize("T, K", [(7, 3), (5, 1), (70, 4), (1, 6),
                                  pytest.param(16384, 4, marks=pytest.mark.skipif(not CUDA, reason="GPU races"))])
def test_slots_of_tokens_is_the_stable_argsort(T, K):
    """The forward's [T, K] slot lists (an atomic counter a token, then a row sort) against argsort(tok, stable)
    viewed [T, K], exactly, on the model's layout (expert-sorted slots) and on a random K-regular permutation; a tok
    that is not K-regular stays in range (zeros where a row is short). The interpreter hands out the places in slot
    order; the counters race only on a GPU (the proxy's 16K case), where a missing row sort fails."""
    from dsv4.kernels.moe_combine.triton import slots_of_tokens
    _, _, tok, _ = _case(T, K, K + 3, 1, torch.float32, seed=T * K)
    g = torch.Generator(device=DEV).manual_seed(K)
    shuffled = torch.arange(T * K, device=DEV)[torch.randperm(T * K, generator=g, device=DEV)] // K
    for t in (tok, shuffled):
        got = slots_of_tokens(t, T)
        assert got.dtype == torch.int32 and got.shape == (T, K)
        assert torch.equal(got.long(), torch.argsort(t, stable=True).view(T, K))
    if T > 1 and K > 1:
        bad = tok.clone()
        bad[bad == 1] = 0                                                      # token 0: 2K slots, token 1: none
        got = slots_of_tokens(bad, T)
        assert got.min() >= 0 and got.max() < T * K and (got[1] == 0).all()


@pytest.mark.parametrize("T, K, d", [(7, 3, 37), (5, 1, 8), (3, 4, 70)])
def test_triton_matches_naive_fp32(T, K, d):
    y, w, tok, dout = _case(T, K, K + 3, d, torch.float32, seed=T * d)
    got = _run(_triton, y, w, tok, T, dout)
    assert [t.dtype for t in got] == [torch.float32] * 3
    _check(got, _run(_naive, y, w, tok, T, dout), y, w, tok, dout)


def test_fp64_matches_a_per_token_loop_oracle():
    y, w, tok, dout = _case(7, 3, 6, 37, torch.float64, seed=1)
    ref = _run(_oracle, y, w, tok, 7, dout)
    _check(_run(_triton, y, w, tok, 7, dout), ref, y, w, tok, dout)
    _check(_run(_naive, y, w, tok, 7, dout), ref, y, w, tok, dout)


def test_a_wrong_weight_fails_the_comparisons():
    """Every slot weighted by w (1 + 2^-20) (8 fp32 ulps; on the GPU, with its 8 eps bound on out, 1 + 2^-16) fails
    out and dy; y scaled by 1 + 2^-16 fails dw."""
    y, w, tok, dout = _case(7, 3, 6, 37, torch.float32, seed=2)
    ref = _run(_naive, y, w, tok, 7, dout)
    _check(_run(_triton, y, w, tok, 7, dout), ref, y, w, tok, dout)
    bad = _run(_triton, y, w * (1 + 2 ** (-16 if CUDA else -20)), tok, 7, dout)
    with pytest.raises(AssertionError, match="out"):
        _check(bad, ref, y, w, tok, dout)
    with pytest.raises(AssertionError, match="dy"):
        _check((ref[0], bad[1], ref[2]), ref, y, w, tok, dout)
    bad_dw = _run(_triton, y * (1 + 2 ** -16), w, tok, 7, dout)[2]
    with pytest.raises(AssertionError, match="dw"):
        _check((ref[0], ref[1], bad_dw), ref, y, w, tok, dout)


def test_no_tokens_and_bad_shapes():
    y, w, tok = torch.empty(0, 16, device=DEV), torch.empty(0, device=DEV), torch.empty(0, dtype=torch.long, device=DEV)
    out, dy, dw = _run(_triton, y, w, tok, 0, torch.empty(0, 16, device=DEV))
    assert out.shape == (0, 16) and dy.shape == (0, 16) and dw.shape == (0,)
    with pytest.raises(ValueError, match="need y"):
        moe_combine(torch.randn(7, 4, device=DEV), torch.rand(7, device=DEV), torch.arange(7, device=DEV), 3,
                    torch.float32, backend="triton")


@pytest.mark.skipif(CUDA, reason="fp64 gradcheck through the CPU interpreter")
def test_gradcheck_fp64():
    y, w, tok, _ = _case(4, 2, 5, 5, torch.float64, seed=3)
    # torch's default fp64 gradcheck tolerances (atol 1e-5, rtol 1e-3)
    assert torch.autograd.gradcheck(lambda a, b: moe_combine(a, b, tok, 4, torch.float64, backend="triton"),
                                    (y.requires_grad_(), w.requires_grad_()))


def test_the_grouped_expert_path_calls_it():
    """model/moe.py Experts, "grouped" (bf16): the triton backend combines with the op (its index_add_ is gone) and
    agrees with the naive backend within bf16 rounding (the backend also switches the clamped SwiGLU; the
    interpreter's truncating bf16 stores cost up to 2^-7 an element: out alone measured 4.2e-3 relative)."""
    from dsv4.kernels._testing import dispatched_ops
    from dsv4.model import moe
    from dsv4.model.config import get_config
    torch.manual_seed(0)
    cfg = get_config("debug", moe_intermediate_size=32, hidden_size=64)
    ex = moe.Experts(cfg).to(device=DEV, dtype=torch.bfloat16)
    ex.gemm = "grouped"
    T, K, E = 13, cfg.num_experts_per_tok, cfg.n_routed_experts
    x = torch.randn(T, cfg.hidden_size, device=DEV).to(torch.bfloat16).requires_grad_()
    idx = torch.rand(T, E - 1, device=DEV).argsort(1)[:, :K]                   # expert E-1 gets no token
    w = torch.rand(T, K, device=DEV, requires_grad=True)

    def run(backend):
        ex.backend = backend
        ex.zero_grad(set_to_none=True)
        y = ex(x, w, idx)
        return (y, *torch.autograd.grad((y.float() ** 2).sum(), (x, w, ex.w13, ex.w2)))

    for name, a, b in zip(("y", "dx", "dw", "dw13", "dw2"), run("triton"), run("naive")):
        assert_rel(name, a, b, 3e-2)          # measured <= 1.55e-2 (seeds 0-2), x2; a wrong combine is O(1) off
    ops = {be: dispatched_ops(lambda be=be: run(be)).get("index_add_", 0) for be in ("triton", "naive")}
    # the combine's and the slot permutation's backward (model/moe.py `_PermuteSlots`, the combine with unit weights);
    # expert_counts keeps its own
    assert ops["naive"] - ops["triton"] == 2, ops


@pytest.mark.parametrize("backend", ["naive", "triton"])
def test_slot_permutation_backward_is_the_combine(backend):
    """model/moe.py `_PermuteSlots` (xs = x[tok]): its backward sums each token's K slot gradients by the combine with
    unit weights, not by the indexing backward (a sort + scatter-add). Against x[tok]'s own autograd in fp32 (the
    same 3 fp32 additions a token, possibly in another order: measured bit-equal on 5 seeds, both backends; 1e-6)
    at odd sizes (T 7, K 3, d 37, two experts without tokens), fp64 gradcheck, and the graph holds no
    IndexBackward."""
    from dsv4.model.moe import _PermuteSlots
    _, _, tok, _ = _case(7, 3, 6, 37, torch.float32, seed=5)
    g = torch.Generator(device=DEV).manual_seed(6)
    x = torch.randn(7, 37, generator=g, device=DEV, requires_grad=True)
    dxs = torch.randn(21, 37, generator=g, device=DEV)
    xs = _PermuteSlots.apply(x, tok, backend)
    assert torch.equal(xs, x[tok]) and "Index" not in type(xs.grad_fn).__name__
    got, = torch.autograd.grad(xs, x, dxs)
    ref, = torch.autograd.grad(x[tok], x, dxs)
    assert_rel("dx", got, ref, 1e-6)
    x64 = x.detach().double().requires_grad_()
    assert torch.autograd.gradcheck(lambda a: _PermuteSlots.apply(a, tok, backend), (x64,))


@pytest.mark.skipif(not CUDA, reason="bf16 at proxy shapes: GPU only")
def test_proxy_shapes_bf16_gpu():
    T, K, E, d = 16384, 4, 18, 2048                                            # proxy: 16 experts, K 4, d 2048
    y, w, tok, dout = _case(T, K, E, d, torch.bfloat16, seed=4)
    got, ref = _run(_triton, y, w, tok, T, dout), _run(_naive, y, w, tok, T, dout)
    # Not yet measured on a GPU. out: fp32 sums of 4 products in another order (the reference's atomics; an FMA),
    # then one bf16 rounding: an element moves by one bf16 ulp (2^-8 relative) only where the two fp32 sums straddle
    # a rounding boundary, so 1e-3 (a quarter of bf16's unit roundoff in norm) is loose for that and still fails a
    # wrong weight off by > 0.1%; dy: the same fp32 product and rounding (bit-equal expected); dw: fp32 dot products
    # over d = 2048 in another order (~1e-7 relative expected), 1e-5
    for name, a, b, tol in zip(("out", "dy", "dw"), got, ref, (1e-3, 1e-3, 1e-5)):
        assert a.dtype == b.dtype, name
        assert_rel(name, a, b, tol)
