"""mHC -- manifold-constrained hyper-connections around one sublayer, and the HyperHead (spec §4).

The residual stream is widened to n_hc = `cfg.hc_mult` streams X [B, S, n, d], initialised as copies of the
embedding (spec §3). Around each sublayer F (attention or FFN):

    u, post, comb = hc_pre(X)                         # u = sum_j pre[j] X[j]          (spec §4.2)
    X' = hc_post(X, F(u), post, comb)                 # X'[k] = post[k] F(u) + sum_j comb[j,k] X[j]

comb is consumed TRANSPOSED (X' = post (x) out + comb^T X). All mHC math is fp32 (kernels/mhc). The
parameters live on the owning module under DeepSeek's official names (`hc_attn_fn`, `hc_attn_base`,
`hc_attn_scale`, `hc_ffn_*`, `hc_head_*`), so this file holds functions, not parameters.

`CheckpointWithoutOutput` is the activation-recompute primitive of Megatron-LM #4531 (slice ext_4531): a
function is run without building a graph, its outputs are handed to the following ops, then their storage is
freed ("discarded") and refilled by re-running the function in backward, just before the first op that needs
them runs its backward.
"""
from __future__ import annotations

import torch
from torch import nn

from dsv4.kernels import mhc as mhc_ops
from dsv4.model.recompute import recomputing


def mhc_parameters(cfg, head: bool = False) -> tuple[nn.Parameter, nn.Parameter, nn.Parameter]:
    """(fn, base, scale) fp32 parameters, initialised as HF does (spec §4.4): fn ~ N(0, 0.02), base 0, scale 1.

    Sublayer: fn [(2+n)n, n*d], base [(2+n)n], scale [3]. HyperHead (head=True): fn [n, n*d], base [n], scale [1].
    """
    n, d = cfg.hc_mult, cfg.hidden_size
    rows = n if head else (2 + n) * n
    fn = nn.Parameter(torch.randn(rows, n * d, dtype=torch.float32) * cfg.initializer_range)
    base = nn.Parameter(torch.zeros(rows, dtype=torch.float32))
    scale = nn.Parameter(torch.ones(1 if head else 3, dtype=torch.float32))
    return fn, base, scale


def expand_streams(e: torch.Tensor, n: int) -> torch.Tensor:
    """[B, S, d] embedding -> [B, S, n, d] streams, n identical copies (spec §3)."""
    return e.unsqueeze(2).expand(-1, -1, n, -1).contiguous()


def hc_pre(X: torch.Tensor, fn, base, scale, cfg, backend: str = "naive", residual: bool = False):
    """X [B, S, n, d] -> (u [B, S, d] in X's dtype, post [B, S, n] fp32, comb [B, S, n, n] fp32); residual=True
    appends Xr [B, S, n, d], X for hc_post's residual input (kernels/mhc `hc_pre_residual`: on the Triton backend
    X's two gradients are summed inside hc_pre's backward kernel)."""
    B, S, n, d = X.shape
    args = (X.reshape(B * S, n, d), fn, base, scale, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
    out = mhc_ops.hc_pre_residual(*args, backend=backend) if residual else mhc_ops.hc_pre(*args, backend=backend)
    u, post, comb = out[:3]
    res = (u.view(B, S, d), post.view(B, S, n), comb.view(B, S, n, n))
    return res + (out[3].view(B, S, n, d),) if residual else res


def hc_post(X: torch.Tensor, out: torch.Tensor, post, comb, backend: str = "naive") -> torch.Tensor:
    """X [B, S, n, d], out [B, S, d] -> X' [B, S, n, d] with X'[k] = post[k] out + sum_j comb[j,k] X[j]."""
    B, S, n, d = X.shape
    y = mhc_ops.hc_post(X.reshape(B * S, n, d), out.reshape(B * S, d), post.reshape(B * S, n),
                        comb.reshape(B * S, n, n), backend=backend)
    return y.view(B, S, n, d)


def hc_head(X: torch.Tensor, fn, base, scale, cfg, backend: str = "naive") -> torch.Tensor:
    """HyperHead collapse (spec §4.3): X [B, S, n, d] -> [B, S, d] = sum_j pre[j] X[j] (no post / comb)."""
    B, S, n, d = X.shape
    y = mhc_ops.hc_head(X.reshape(B * S, n, d), fn, base, scale, cfg.hc_eps, cfg.rms_norm_eps, backend=backend)
    return y.view(B, S, d)


# ---------------------------------------------------------------------------------------------------------
# Checkpoint without output (Megatron-LM #4531): recompute in backward, keep only the inputs.
# ---------------------------------------------------------------------------------------------------------

class _RunWithoutGraph(torch.autograd.Function):
    """Runs `fn(*inputs)` without a graph; in backward, back-propagates through the recomputed outputs."""

    @staticmethod
    def forward(ctx, fn, owner, *inputs):
        with torch.no_grad():
            outputs = fn(*inputs)
        ctx.save_for_backward(*inputs)
        owner._ctx = ctx
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        recomputed, leaf_inputs = ctx.recomputed, ctx.leaf_inputs
        if recomputed is None:
            raise RuntimeError("CheckpointWithoutOutput: backward ran before the recompute hook fired; "
                               "call discard_output_and_register_recompute(tensor) on a later tensor")
        pairs = [(o, g) for o, g in zip(recomputed, grads) if g is not None and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        ctx.recomputed = ctx.leaf_inputs = None
        return (None, None) + tuple(x.grad if x is not None else None for x in leaf_inputs)


class CheckpointWithoutOutput:
    """Recompute a function in backward without keeping its outputs alive in between (Megatron #4531).

        ckpt = CheckpointWithoutOutput()
        y = ckpt.checkpoint(f, x)          # tensors (or a tuple of tensors); f's graph is not kept
        z = g(y)                           # later ops may save y for their backward
        ckpt.discard_output_and_register_recompute(z)   # y's storage is freed now ...
        z.sum().backward()                 # ... and refilled by re-running f(x) when grad(z) is ready

    Parameters used inside `f` receive their gradients through the recompute (accumulated into `.grad`, as
    Megatron does; `torch.autograd.grad` callers do not see them). `f` must be deterministic (no dropout here).
    """

    def __init__(self):
        self._ctx = None
        self.fn = None
        self.outputs = None

    def checkpoint(self, fn, *inputs):
        self.fn = fn
        out = _RunWithoutGraph.apply(fn, self, *inputs)
        self.outputs = (out,) if isinstance(out, torch.Tensor) else tuple(out)
        self._ctx.recomputed = None
        return out

    def discard_output_and_register_recompute(self, hook_tensor: torch.Tensor) -> None:
        """Free the outputs' storage; re-run `fn` when the gradient of `hook_tensor` has been computed.

        Inside a whole-block recompute (`model/recompute.py`) this does nothing: there the outputs ARE the tensors
        torch.utils.checkpoint hands to the original graph's saved slots, and the recompute graph's hook would
        never fire (freeing them made the backward read empty storage: a segfault with both recomputes on)."""
        if recomputing():
            return
        for o in self.outputs:
            o.untyped_storage().resize_(0)
        if hook_tensor.requires_grad:
            hook_tensor.register_hook(self._recompute)

    def _recompute(self, _grad):
        ctx = self._ctx
        inputs = [x.detach().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x
                  for x in ctx.saved_tensors]
        with torch.enable_grad():
            out = self.fn(*inputs)
        out = (out,) if isinstance(out, torch.Tensor) else tuple(out)
        for kept, fresh in zip(self.outputs, out):            # refill the storage later ops saved
            kept.untyped_storage().resize_(fresh.untyped_storage().size())
            with torch.no_grad():
                kept.untyped_storage().copy_(fresh.untyped_storage())
        ctx.recomputed, ctx.leaf_inputs = out, inputs
        self.outputs, self._ctx = None, None
