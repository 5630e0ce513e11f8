"""Activation recompute of whole blocks (`DSv4Model.set_recompute`), for long sequences on one GPU.

A block's forward runs under `torch.utils.checkpoint` (non-reentrant): only its input streams are kept, and
its forward is re-run during backward. Side effects that must happen once per step (the router's token
counts of the auxiliary-loss-free balancing) check `recomputing()` and are skipped during the re-run.
"""
from __future__ import annotations

import contextlib

from torch.utils.checkpoint import checkpoint

_STATE = {"recomputing": False}


def recomputing() -> bool:
    """True while a checkpointed block's forward is being re-run in backward."""
    return _STATE["recomputing"]


@contextlib.contextmanager
def _recompute_scope():
    prev = _STATE["recomputing"]
    _STATE["recomputing"] = True
    try:
        yield
    finally:
        _STATE["recomputing"] = prev


def _contexts():
    return contextlib.nullcontext(), _recompute_scope()


def checkpoint_block(fn, *args):
    """fn(*args) with its activations recomputed in backward (same math, same outputs)."""
    return checkpoint(fn, *args, use_reentrant=False, context_fn=_contexts)
