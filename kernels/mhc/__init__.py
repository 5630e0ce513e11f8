"""mHC ops (spec §4): `sinkhorn`, `hc_pre`, `hc_pre_residual`, `hc_post`, `hc_head`, each with
`backend="naive"|"triton"` via `kernels.get_op` (the table `kernels.OPS` names the reference for the ops without a
Triton kernel)."""
from __future__ import annotations

from dsv4.kernels import get_op


def sinkhorn(logits, iters, eps, backend: str = "naive"):
    return get_op("sinkhorn", backend, logits.device)(logits, iters, eps)


def hc_pre(x, fn, base, scale, iters, eps, norm_eps, backend: str = "naive"):
    return get_op("hc_pre", backend, x.device)(x, fn, base, scale, iters, eps, norm_eps)


def hc_pre_residual(x, fn, base, scale, iters, eps, norm_eps, backend: str = "naive"):
    """hc_pre's (u, post, comb) and xr, x for hc_post's residual input; on the Triton backend x's two gradients
    are summed inside hc_pre's backward kernel."""
    return get_op("hc_pre_residual", backend, x.device)(x, fn, base, scale, iters, eps, norm_eps)


def hc_post(x, out, post, comb, backend: str = "naive"):
    return get_op("hc_post", backend, x.device)(x, out, post, comb)


def hc_head(x, fn, base, scale, eps, norm_eps, backend: str = "naive"):
    return get_op("hc_head", backend, x.device)(x, fn, base, scale, eps, norm_eps)
