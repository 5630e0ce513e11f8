"""mHC ops (spec §4): `sinkhorn`, `hc_pre`, `hc_post`, `hc_head`, each with `backend="naive"|"triton"`.

Backends are registered in `BACKENDS` (name -> module exposing the four functions); "triton" is imported
lazily from `.triton` (written by the kernels helper) the first time it is asked for. A function that a
backend module does not provide (e.g. `hc_head` in Triton) falls back to the naive reference.
"""
from __future__ import annotations

import importlib

from . import naive

BACKENDS = {"naive": naive}


def _impl(backend: str, name: str):
    if backend not in BACKENDS and backend == "triton":
        BACKENDS["triton"] = importlib.import_module(f"{__name__}.triton")
    if backend not in BACKENDS:
        raise ValueError(f"mhc.{name}: unknown backend {backend!r}; known: {', '.join(BACKENDS)}")
    return getattr(BACKENDS[backend], name, None) or getattr(naive, name)


def sinkhorn(logits, iters, eps, backend: str = "naive"):
    return _impl(backend, "sinkhorn")(logits, iters, eps)


def hc_pre(x, fn, base, scale, iters, eps, norm_eps, backend: str = "naive"):
    return _impl(backend, "hc_pre")(x, fn, base, scale, iters, eps, norm_eps)


def hc_post(x, out, post, comb, backend: str = "naive"):
    return _impl(backend, "hc_post")(x, out, post, comb)


def hc_head(x, fn, base, scale, eps, norm_eps, backend: str = "naive"):
    return _impl(backend, "hc_head")(x, fn, base, scale, eps, norm_eps)
