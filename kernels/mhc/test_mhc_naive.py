"""Naive mHC ops vs independent per-token loop oracles (spec §4.2), gradcheck in fp64, the transpose."""
import math

import torch

from dsv4.kernels.mhc import hc_head, hc_post, hc_pre, sinkhorn

N, n, d, ITERS, EPS, NEPS = 7, 4, 5, 20, 1e-6, 1e-6


def _oracle_sinkhorn(L, iters, eps):
    """Scalar loops, one matrix at a time, in fp64."""
    n = len(L)
    C = [[0.0] * n for _ in range(n)]
    for j in range(n):
        m = max(L[j])
        e = [math.exp(v - m) for v in L[j]]
        s = sum(e)
        for k in range(n):
            C[j][k] = e[k] / s + eps

    def col():
        for k in range(n):
            s = sum(C[j][k] for j in range(n))
            for j in range(n):
                C[j][k] /= s + eps

    def row():
        for j in range(n):
            s = sum(C[j])
            for k in range(n):
                C[j][k] /= s + eps

    col()
    for _ in range(iters - 1):
        row()
        col()
    return C


def _oracle_pre_post(x, fn, base, scale):
    """Per token: returns u, post, comb with the comb consumed as X'[k] = post[k] out + sum_j comb[j,k] X[j]."""
    us, posts, combs = [], [], []
    for t in range(x.shape[0]):
        flat = x[t].reshape(-1).double()
        flat = flat / torch.sqrt((flat ** 2).mean() + NEPS)
        mix = fn.double() @ flat
        pre = [1 / (1 + math.exp(-(mix[i].item() * scale[0].item() + base[i].item()))) + EPS for i in range(n)]
        post = [2 / (1 + math.exp(-(mix[n + i].item() * scale[1].item() + base[n + i].item()))) for i in range(n)]
        L = [[mix[2 * n + n * j + k].item() * scale[2].item() + base[2 * n + n * j + k].item() for k in range(n)]
             for j in range(n)]
        us.append(sum(pre[j] * x[t, j].double() for j in range(n)))
        posts.append(torch.tensor(post, dtype=torch.float64))
        combs.append(torch.tensor(_oracle_sinkhorn(L, ITERS, EPS), dtype=torch.float64))
    return torch.stack(us), torch.stack(posts), torch.stack(combs)


def _params(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, n, d, generator=g, dtype=dtype)
    fn = torch.randn((2 + n) * n, n * d, generator=g, dtype=dtype) * 0.5
    base = torch.randn((2 + n) * n, generator=g, dtype=dtype)
    scale = torch.rand(3, generator=g, dtype=dtype) + 0.5
    return x, fn, base, scale


def test_sinkhorn_matches_loop_oracle_and_columns_sum_to_one():
    logits = torch.randn(6, n, n, generator=torch.Generator().manual_seed(1)) * 3
    c = sinkhorn(logits, ITERS, EPS)
    ref = torch.tensor([_oracle_sinkhorn(L.tolist(), ITERS, EPS) for L in logits.double()], dtype=torch.float64)
    # measured worst 8.4e-8 (same on all 11 simulated hosts: native, ATEN default/avx2/avx512, MKL_CBWR=COMPATIBLE/AVX2,
    # MKL_ENABLE_INSTRUCTIONS=SSE4_2/AVX2, DNNL_MAX_CPU_ISA=AVX2, 2 combinations), x12
    torch.testing.assert_close(c.double(), ref, atol=1e-6, rtol=0)
    assert c.dtype == torch.float32
    col = c.sum(dim=-2)
    # last step is a column normalisation: measured 1.1e-6 (11 hosts), x9
    assert (col - 1).abs().max() < 1e-5
    # rows only approximately (20 rounds): an algorithmic bound, measured 2.7e-2 on every host
    assert (c.sum(dim=-1) - 1).abs().max() < 0.1


def test_hc_pre_matches_oracle():
    x, fn, base, scale = _params()
    u, post, comb = hc_pre(x, fn, base, scale, ITERS, EPS, NEPS)
    ru, rpost, rcomb = _oracle_pre_post(x, fn, base, scale)
    # measured worst |diff| 3.6e-7 / 1.9e-7 / 2.7e-7 (11 hosts); the checks use <= 1/22 of atol + rtol*|ref|, x22+
    torch.testing.assert_close(u.double(), ru, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(post.double(), rpost, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(comb.double(), rcomb, atol=2e-6, rtol=1e-5)


def test_hc_post_consumes_comb_transposed():
    x, fn, base, scale = _params(2)
    _, post, comb = hc_pre(x, fn, base, scale, ITERS, EPS, NEPS)
    out = torch.randn(N, d)
    y = hc_post(x, out, post, comb)
    ref = torch.empty(N, n, d, dtype=torch.float64)
    for t in range(N):
        for k in range(n):
            ref[t, k] = post[t, k].double() * out[t].double() + sum(comb[t, j, k].double() * x[t, j].double()
                                                                  for j in range(n))
    # measured worst 4.0e-7 (ATEN default + MKL_CBWR=COMPATIBLE + DNNL SSE41; 11 hosts), x100
    torch.testing.assert_close(y.double(), ref, atol=1e-5, rtol=1e-5)
    wrong = post.unsqueeze(-1) * out.unsqueeze(-2) + comb @ x          # un-transposed consumption
    assert (wrong - y).abs().max() > 1e-3                              # the matrices are not symmetric


def test_hc_head_matches_formula():
    x, fn, base, scale = _params(3)
    fh, bh, sh = fn[:n], base[:n], scale[:1]
    y = hc_head(x, fh, bh, sh, EPS, NEPS)
    flat = x.double().flatten(1)
    flat = flat / torch.sqrt((flat ** 2).mean(1, keepdim=True) + NEPS)
    pre = torch.sigmoid(flat @ fh.double().t() * sh.double() + bh.double()) + EPS
    # measured worst 2.5e-7 (ATEN default; 11 hosts), x64
    torch.testing.assert_close(y.double(), (pre[..., None] * x.double()).sum(1), atol=1e-5, rtol=1e-5)


def test_gradcheck_fp64():
    x, fn, base, scale = _params(4, torch.float64)
    x = x[:3]
    args = [t.clone().requires_grad_() for t in (x, fn, base, scale)]

    def f_pre(x, fn, base, scale):
        return hc_pre(x, fn, base, scale, 5, EPS, NEPS)

    # fp64 gradcheck with torch's default atol 1e-5 / rtol 1e-3 (the finite-difference truncation error, not
    # rounding, sets them); measured |analytic - numeric| <= 7.7e-10 on all 11 hosts
    assert torch.autograd.gradcheck(f_pre, args, eps=1e-6, atol=1e-5, fast_mode=True)
    out = torch.randn(3, d, dtype=torch.float64, requires_grad=True)
    post = torch.rand(3, n, dtype=torch.float64, requires_grad=True)
    comb = torch.rand(3, n, n, dtype=torch.float64, requires_grad=True)
    # torch's default gradcheck tolerances (as above); measured |analytic - numeric| <= 7.7e-10
    assert torch.autograd.gradcheck(hc_post, (args[0], out, post, comb), eps=1e-6, atol=1e-5)


def test_bf16_inputs_fp32_math():
    x, fn, base, scale = _params(5)
    u, post, comb = hc_pre(x.bfloat16(), fn, base, scale, ITERS, EPS, NEPS)
    assert u.dtype == torch.bfloat16 and post.dtype == torch.float32 and comb.dtype == torch.float32
    y = hc_post(x.bfloat16(), u, post, comb)
    assert y.dtype == torch.bfloat16
