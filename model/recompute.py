"""Activation recompute of whole blocks (`DSv4Model.set_recompute`), for long sequences on one GPU.

A block's forward runs under `torch.utils.checkpoint` (non-reentrant): only its input streams are kept, and
its forward is re-run during backward. Side effects that must happen once per step (the router's token
counts of the auxiliary-loss-free balancing) check `recomputing()` and are skipped during the re-run.

The re-run may happen more than once per checkpoint: non-reentrant checkpoint recomputes once per autograd
graph task that unpacks the block's saved tensors (`torch.autograd.grad(..., retain_graph=True)` followed by
`.backward()`, or a backward run inside a forward or inside another backward). So `context_fn` returns fresh
context managers on every call, and the recompute scope is a class-based, re-entrant counter (a
`@contextmanager` generator object can be entered only once: entering it again raised
`AttributeError: '_GeneratorContextManager' object has no attribute 'args'` on the H200).
"""
from __future__ import annotations

import contextlib

from torch.utils.checkpoint import checkpoint

_DEPTH = [0]                       # how many recompute scopes are active (nested re-runs count each)


def recomputing() -> bool:
    """True while a checkpointed block's forward is being re-run in backward."""
    return _DEPTH[0] > 0


class RecomputeScope:
    """Marks a recompute (re-run) of a checkpointed forward. Re-entrant and reusable: each `__enter__`
    increments a depth counter, each `__exit__` decrements it, so the same object may be entered any number
    of times, nested or in sequence."""

    def __enter__(self) -> "RecomputeScope":
        _DEPTH[0] += 1
        return self

    def __exit__(self, *exc) -> bool:
        _DEPTH[0] -= 1
        return False


def _contexts():
    """context_fn of torch.utils.checkpoint: (forward context, recompute context), fresh objects per call."""
    return contextlib.nullcontext(), RecomputeScope()


def checkpoint_block(fn, *args):
    """fn(*args) with its activations recomputed in backward (same math, same outputs)."""
    return checkpoint(fn, *args, use_reentrant=False, context_fn=_contexts)
