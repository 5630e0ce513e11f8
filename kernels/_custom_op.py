"""One call path per custom op for eager and compiled code: `autograd_op(op, body, setup_context, backward)`.

`kernels/<op>/op.py` registers its Triton kernels as `torch.library` custom ops so that torch.compile sees one opaque
node per call. In eager mode that registration is pure overhead: a custom op with autograd goes through the
dispatcher twice and through a generated `autograd.Function`. Measured with empty bodies on the 2-core CPU host,
one forward + backward costs about 225 us beyond the work inside, against about 45 us for a plain
`torch.autograd.Function` (harness/perf_notes.md, at 051fc82); on the H200 the 4K eager step is host-bound, with
`dsv4::rms_norm_bwd` alone at 255 us a call in its profile.

So the function model code calls is `call = autograd_op(...)`:
  * while torch.compile traces (`torch.compiler.is_compiling()`), or when any argument is a FakeTensor: the custom
    op `op` (one node; its registered autograd is `setup_context` / `backward`, calling the backward custom op);
  * otherwise: one `autograd.Function` that runs `body` (the same Python function the custom op wraps), the same
    `setup_context`, and the same `backward` with `ctx.eager = True`, which each `backward` reads to call its
    backward op's body directly instead of through the dispatcher.
The kernels, their launch code and the math are the same on both paths (tests: kernels/test_custom_ops.py).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch._subclasses.fake_tensor import FakeTensor


def traced(args) -> bool:
    """Whether this call is being traced (torch.compile / fake tensors): then the custom op must be called."""
    return torch.compiler.is_compiling() or any(isinstance(a, FakeTensor) for a in args)


def autograd_op(op, body: Callable, setup_context: Callable, backward: Callable) -> Callable:
    """Register `backward` / `setup_context` as custom op `op`'s autograd; return `call(*args)` (module docstring)."""
    op.register_autograd(backward, setup_context=setup_context)

    class Eager(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *args):
            out = body(*args)
            setup_context(ctx, args, out)
            ctx.eager = True
            return out

        @staticmethod
        def backward(ctx, *grads):
            return backward(ctx, *grads)

    Eager.__name__ = Eager.__qualname__ = f"Eager{body.__name__}"

    def call(*args):
        return op(*args) if traced(args) else Eager.apply(*args)

    call.op, call.eager = op, Eager
    return call


def backward_op(ctx, op, body: Callable) -> Callable:
    """In a registered `backward`: the backward op's body in eager (`ctx.eager`), the custom op otherwise."""
    return body if getattr(ctx, "eager", False) else op
