"""Clamped SwiGLU op (spec §9.2). `clamped_swiglu(gate, up, limit, backend="naive"|"triton")`.

Backends are registered in `BACKENDS` (name -> function); "triton" is imported lazily from `.triton`
(written by the kernels helper) the first time it is asked for.
"""
from __future__ import annotations

import importlib

from .naive import clamped_swiglu as _naive_clamped_swiglu

BACKENDS = {"naive": _naive_clamped_swiglu}


def _impl(backend: str):
    if backend not in BACKENDS and backend == "triton":
        BACKENDS["triton"] = importlib.import_module(f"{__name__}.triton").clamped_swiglu
    if backend not in BACKENDS:
        raise ValueError(f"clamped_swiglu: unknown backend {backend!r}; known: {', '.join(BACKENDS)}")
    return BACKENDS[backend]


def clamped_swiglu(gate, up, limit, backend: str = "naive"):
    return _impl(backend)(gate, up, limit)
