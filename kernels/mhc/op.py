"""`dsv4::hc_pre_fwd|bwd`, `dsv4::hc_post_fwd|bwd`: the fused Triton mHC kernels as torch custom ops (opaque to
torch.compile; fake implementations for shapes). The bodies run `triton._HcPre` / `triton._HcPost`'s forward /
backward with a plain ctx record (`FnCtx`), so the numerics are those of the autograd.Functions. hc_pre's
forward also returns the tensors its backward needs (mix, rinv, pre, fn3); `hc_head` runs on the hc_pre op (its
formula is hc_pre's pre / u part); `sinkhorn` has no Triton kernel (the reference is used, see `kernels.OPS`)."""
from typing import Optional

import torch

from dsv4.kernels._custom_op import autograd_op, backward_op, traced
from dsv4.kernels._triton_util import FnCtx
from dsv4.kernels.mhc import triton as T

Tensor = torch.Tensor


# ------------------------------------------------------------------------------------------------ hc_pre
def _hc_pre_fwd(x: Tensor, fn: Tensor, base: Tensor, scale: Tensor, iters: int, eps: float,
                norm_eps: float) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """-> (u [N,d] x.dtype, post [N,n], comb [N,n,n], and for the backward mix [N,RP], rinv [N], pre [N,n],
    fn's bf16 pieces fn3 [3,R,n*d])."""
    ctx = FnCtx()
    u, post, comb = T._HcPre.forward(ctx, x, fn, base, scale, iters, eps, norm_eps)
    _, _, _, _, mix, rinv, pre, fn3 = ctx.saved_tensors
    return u, post, comb, mix, rinv, pre, fn3


hc_pre_fwd = torch.library.custom_op("dsv4::hc_pre_fwd", mutates_args=())(_hc_pre_fwd)


@hc_pre_fwd.register_fake
def _(x, fn, base, scale, iters, eps, norm_eps):
    N, n, d = x.shape
    f32 = dict(dtype=torch.float32)
    return (x.new_empty(N, d), x.new_empty(N, n, **f32), x.new_empty(N, n, n, **f32),
            x.new_empty(N, T.pow2(fn.shape[0]), **f32), x.new_empty(N, **f32), x.new_empty(N, n, **f32),
            x.new_empty(3, *fn.shape, dtype=torch.bfloat16))


def _hc_pre_bwd(du: Optional[Tensor], dpost: Optional[Tensor], dcomb: Optional[Tensor], x: Tensor, fn: Tensor,
                base: Tensor, scale: Tensor, mix: Tensor, rinv: Tensor, pre: Tensor, fn3: Tensor, iters: int,
                eps: float, dres: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    ctx = FnCtx()                                      # what _HcPre.forward leaves
    ctx.save_for_backward(x.contiguous(), fn.float().contiguous(), base.float().contiguous(),
                          scale.float().contiguous(), mix, rinv, pre, fn3)
    ctx.cfg = (int(iters), float(eps), fn.dtype, base.dtype, scale.dtype)
    dx, dfn, dbase, dscale, _, _, _ = T._HcPre.backward(ctx, du, dpost, dcomb, dres)
    return dx, dfn, dbase, dscale


hc_pre_bwd = torch.library.custom_op("dsv4::hc_pre_bwd", mutates_args=())(_hc_pre_bwd)


@hc_pre_bwd.register_fake
def _(du, dpost, dcomb, x, fn, base, scale, mix, rinv, pre, fn3, iters, eps, dres=None):
    return x.new_empty(x.shape), fn.new_empty(fn.shape), base.new_empty(base.shape), scale.new_empty(scale.shape)


def _pre_setup(ctx, inputs, output):
    x, fn, base, scale, iters, eps, norm_eps = inputs
    ctx.save_for_backward(x, fn, base, scale, *output[3:])
    ctx.cfg = (int(iters), float(eps))


def _pre_backward(ctx, du, dpost, dcomb, *_extra):
    x, fn, base, scale, mix, rinv, pre, fn3 = ctx.saved_tensors
    bwd = backward_op(ctx, hc_pre_bwd, _hc_pre_bwd)
    dx, dfn, dbase, dscale = bwd(du, dpost, dcomb, x, fn, base, scale, mix, rinv, pre, fn3, *ctx.cfg)
    return dx, dfn, dbase, dscale, None, None, None


_hc_pre = autograd_op(hc_pre_fwd, _hc_pre_fwd, _pre_setup, _pre_backward)


def _check_fn(x: Tensor, fn: Tensor) -> None:
    N, n, d = x.shape
    if tuple(fn.shape) != ((2 + n) * n, n * d):
        raise ValueError(f"hc_pre: fn shape {tuple(fn.shape)} != ((2+n)n, n*d) = {((2 + n) * n, n * d)}")


def hc_pre(x: Tensor, fn: Tensor, base: Tensor, scale: Tensor, iters: int, eps: float, norm_eps: float):
    """x [N,n,d] -> (u [N,d] x.dtype, post [N,n] fp32, comb [N,n,n] fp32); same contract as `naive.hc_pre`."""
    _check_fn(x, fn)
    u, post, comb, *_ = _hc_pre(x, fn, base, scale, int(iters), float(eps), float(norm_eps))
    return u, post, comb


class _HcPreResidual(torch.autograd.Function):
    """Eager hc_pre that also returns xr, a view of x for hc_post's residual input (`hc_pre_residual`): xr's
    gradient arrives in this backward with hc_pre's own, and `_pre_bwd_dx` adds it into dx before its store, so the
    autograd engine does not sum x's two [N, n, d] gradients in a pass of its own (reads 2, writes 1)."""

    @staticmethod
    def forward(ctx, x, fn, base, scale, iters, eps, norm_eps):
        out = _hc_pre_fwd(x, fn, base, scale, iters, eps, norm_eps)
        _pre_setup(ctx, (x, fn, base, scale, iters, eps, norm_eps), out)
        ctx.mark_non_differentiable(*out[3:])                  # mix, rinv, pre, fn3: the backward's, not outputs
        ctx.set_materialize_grads(False)                       # no zero-filled gradient for an unused output
        return (*out, x.view_as(x))

    @staticmethod
    def backward(ctx, du, dpost, dcomb, _mix, _rinv, _pre, _fn3, dres):
        x, fn, base, scale, mix, rinv, pre, fn3 = ctx.saved_tensors
        dx, dfn, dbase, dscale = _hc_pre_bwd(du, dpost, dcomb, x, fn, base, scale, mix, rinv, pre, fn3, *ctx.cfg,
                                             dres)
        return dx, dfn, dbase, dscale, None, None, None


def hc_pre_residual(x: Tensor, fn: Tensor, base: Tensor, scale: Tensor, iters: int, eps: float, norm_eps: float):
    """hc_pre -> (u, post, comb, xr): xr is x for hc_post's residual input. Eager: a view of x whose gradient
    `_pre_bwd_dx` adds into dx (`_HcPreResidual`); traced by torch.compile: x itself (the custom op cannot return
    an alias of its input; the compiled graph sums the two gradients)."""
    if traced((x, fn, base, scale)):
        return (*hc_pre(x, fn, base, scale, iters, eps, norm_eps), x)
    _check_fn(x, fn)
    u, post, comb, *_, xr = _HcPreResidual.apply(x, fn, base, scale, int(iters), float(eps), float(norm_eps))
    return u, post, comb, xr


def hc_head(x: Tensor, fn: Tensor, base: Tensor, scale: Tensor, eps: float, norm_eps: float) -> Tensor:
    """HyperHead collapse (spec §4.3; `naive.hc_head`'s contract: fn [n, n*d], base [n], scale [1] -> y [N,d]) on the
    hc_pre kernels: its pre = sigmoid(mix[:, :n] scale[0] + base[:n]) + eps and u = Σ_j pre_j X_j are the head's
    formula, so the head runs as hc_pre with its n rows first and the post / comb rows zero (their outputs unused,
    one Sinkhorn step on zeros): one read of x to project, one to aggregate, where the PyTorch reference made
    six fp32 [N, n*d] passes each way (2 calls a step: the head and the MTP head)."""
    N, n, d = x.shape
    if tuple(fn.shape) != (n, n * d) or base.numel() != n or scale.numel() != 1:
        raise ValueError(f"hc_head: fn {tuple(fn.shape)}, base {tuple(base.shape)}, scale {tuple(scale.shape)} "
                         f"!= ({n}, {n * d}), ({n},), (1,)")
    R = (2 + n) * n
    fn_r = torch.cat([fn, fn.new_zeros(R - n, n * d)])                  # [(2+n)n, n*d]: pre rows, then zeros
    base_r = torch.cat([base.reshape(n), base.new_zeros(R - n)])
    scale_r = torch.cat([scale.reshape(1), scale.new_zeros(2)])
    u, *_ = _hc_pre(x, fn_r, base_r, scale_r, 1, float(eps), float(norm_eps))
    return u


# ----------------------------------------------------------------------------------------------- hc_post
def _hc_post_fwd(x: Tensor, out: Tensor, post: Tensor, comb: Tensor) -> Tensor:
    return T._HcPost.forward(FnCtx(), x, out, post, comb)


hc_post_fwd = torch.library.custom_op("dsv4::hc_post_fwd", mutates_args=())(_hc_post_fwd)


@hc_post_fwd.register_fake
def _(x, out, post, comb):
    return x.new_empty(x.shape)


def _hc_post_bwd(dy: Tensor, x: Tensor, out: Tensor, post: Tensor,
                 comb: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    ctx = FnCtx()                                      # what _HcPost.forward leaves
    ctx.save_for_backward(x.contiguous(), out.contiguous(), post.float().contiguous(), comb.float().contiguous())
    ctx.dts = (out.dtype, post.dtype, comb.dtype)
    return T._HcPost.backward(ctx, dy)


hc_post_bwd = torch.library.custom_op("dsv4::hc_post_bwd", mutates_args=())(_hc_post_bwd)


@hc_post_bwd.register_fake
def _(dy, x, out, post, comb):
    return x.new_empty(x.shape), out.new_empty(out.shape), post.new_empty(post.shape), comb.new_empty(comb.shape)


def _post_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _post_backward(ctx, dy):
    return backward_op(ctx, hc_post_bwd, _hc_post_bwd)(dy, *ctx.saved_tensors)


_hc_post = autograd_op(hc_post_fwd, _hc_post_fwd, _post_setup, _post_backward)


def hc_post(x: Tensor, out: Tensor, post: Tensor, comb: Tensor) -> Tensor:
    """X'[k] = post[k]·out + Σ_j comb[j,k] X[j]; [N,n,d] in x's dtype; same contract as `naive.hc_post`."""
    N, n, d = x.shape
    if tuple(out.shape) != (N, d) or tuple(post.shape) != (N, n) or tuple(comb.shape) != (N, n, n):
        raise ValueError(f"hc_post: shapes x {tuple(x.shape)}, out {tuple(out.shape)}, post {tuple(post.shape)}, "
                         f"comb {tuple(comb.shape)} do not match [N,n,d], [N,d], [N,n], [N,n,n]")
    return _hc_post(x, out, post, comb)
