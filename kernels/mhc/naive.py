"""mHC -- manifold-constrained hyper-connections (spec §4), the reference implementation.

Plain PyTorch, differentiable by autograd, all arithmetic in fp32 (results cast back to the input dtype
only where an activation leaves mHC; autocast is disabled inside (fp64 inputs are computed in fp64, for gradcheck): `u` of `hc_pre`, the new streams of `hc_post`, `y` of `hc_head`).

Shapes (N = tokens, n = streams n_hc, d = hidden):
    x    [N, n, d]   the residual streams of N tokens
    fn   [(2+n)n, n*d], base [(2+n)n], scale [3]      rows 0..n-1 "pre", n..2n-1 "post", 2n.. "comb"
                                                       (row-major n x n: flat row 2n + n*j + k <-> comb[j,k])
    comb [N, n, n]   comb[j, k] = weight of INPUT stream j in OUTPUT stream k (columns sum to 1)

Sinkhorn follows DeepSeek's code order exactly (spec §4.2 / §13.3): softmax over the LAST axis (k) + eps,
a column normalisation, then (iters - 1) rounds of (row, column) normalisation, eps in every denominator.
The streams are consumed TRANSPOSED: X'[k] = post[k] * out + sum_j comb[j, k] X[j]  (X' = post (x) out + comb^T X).
"""
from __future__ import annotations

import functools

import torch


def _fp32_region(fn):
    """Run `fn` with autocast disabled: under torch.autocast(bf16) the projections stay fp32 (spec §4.2)."""
    @functools.wraps(fn)
    def wrapper(x, *args, **kwargs):
        with torch.autocast(device_type=x.device.type, enabled=False):
            return fn(x, *args, **kwargs)
    return wrapper


def _f32(t: torch.Tensor) -> torch.Tensor:
    """fp32 compute copy (fp64 stays fp64 so gradcheck can run in double precision)."""
    return t if t.dtype == torch.float64 else t.float()


@_fp32_region
def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """[N, n, n] comb logits -> [N, n, n] (approximately) doubly stochastic comb, fp32 (spec §4.2)."""
    c = torch.softmax(_f32(logits), dim=-1) + eps                  # softmax over k, then + eps
    c = c / (c.sum(dim=-2, keepdim=True) + eps)                      # column normalisation (sum over j)
    for _ in range(iters - 1):
        c = c / (c.sum(dim=-1, keepdim=True) + eps)                  # row normalisation (sum over k)
        c = c / (c.sum(dim=-2, keepdim=True) + eps)                  # column normalisation
    return c


def _mix(x: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """Unweighted RMSNorm of the flattened streams, then the linear map: [N, n, d] -> [N, rows] fp32."""
    xf = _f32(x).flatten(-2)                                       # [N, n*d], streams in stream order
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm_eps)
    return xf @ _f32(fn).t()                                       # [N, rows]


@_fp32_region
def hc_pre(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int,
           eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC weights and the collapsed sublayer input (spec §4.2).

    Returns u [N, d] (x's dtype) = sum_j pre[j] X[j], post [N, n] fp32 (in (0, 2)), comb [N, n, n] fp32.
    """
    N, n, d = x.shape
    mix = _mix(x, fn, norm_eps)                                      # [N, (2+n)n]
    base, scale = _f32(base), _f32(scale)
    pre = torch.sigmoid(mix[:, :n] * scale[0] + base[:n]) + eps      # [N, n]
    post = 2 * torch.sigmoid(mix[:, n:2 * n] * scale[1] + base[n:2 * n])   # [N, n]
    logits = mix[:, 2 * n:].view(N, n, n) * scale[2] + base[2 * n:].view(n, n)   # [N, n(j), n(k)]
    comb = sinkhorn(logits, iters, eps)
    u = (pre.unsqueeze(-1) * _f32(x)).sum(dim=1)                   # [N, d]
    return u.to(x.dtype), post, comb


def hc_pre_residual(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int,
                    eps: float, norm_eps: float):
    """hc_pre and x itself for hc_post's residual input (autograd sums x's two gradients). hc_pre runs on a view of
    x of its own, so its internal uses of x are summed first and the residual's gradient added last: the same
    order, bit for bit, as when hc_pre and hc_post each took x."""
    return (*hc_pre(x.view_as(x), fn, base, scale, iters, eps, norm_eps), x)


@_fp32_region
def hc_post(x: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New streams X'[k] = post[k] * out + sum_j comb[j, k] X[j]; [N, n, d] in x's dtype (fp32 math)."""
    mixed = torch.einsum("njk,njd->nkd", _f32(comb), _f32(x))    # comb^T X: [N, n(k), d]
    y = _f32(post).unsqueeze(-1) * _f32(out).unsqueeze(-2) + mixed
    return y.to(x.dtype)


@_fp32_region
def hc_head(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, eps: float,
            norm_eps: float) -> torch.Tensor:
    """HyperHead collapse (spec §4.3): fn [n, n*d], base [n], scale [1]; y [N, d] = sum_j pre[j] X[j]."""
    mix = _mix(x, fn, norm_eps)                                      # [N, n]
    pre = torch.sigmoid(mix * _f32(scale) + _f32(base)) + eps    # [N, n]
    return (pre.unsqueeze(-1) * _f32(x)).sum(dim=1).to(x.dtype)
