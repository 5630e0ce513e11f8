"""Whole-block recompute composes (issue 12 §3): the recompute path may run twice in one step, and the
router's token counts (auxiliary-loss-free balancing) still happen once per step.

Non-reentrant `torch.utils.checkpoint` re-runs a block once per autograd graph task that unpacks its saved
tensors. Two graph tasks in one step (autograd.grad(..., retain_graph=True) then .backward(); a backward run
inside the checkpointed forward, as `model/moe.py`'s old grouped-GEMM probe did on the H200) entered the same
`@contextmanager` recompute scope twice -> `AttributeError: '_GeneratorContextManager' object has no attribute
'args'` at the old commit e2f880d (these tests fail there).
"""
from __future__ import annotations

import torch
from torch import nn

from dsv4.model import moe
from dsv4.model.config import get_config
from dsv4.model.model import DSv4Model
from dsv4.model.recompute import checkpoint_block, recomputing

# fp64 debug model: recompute re-runs the same kernels on the same inputs, so results agree to rounding of
# the gradient accumulation order only (measured 0 / < 1e-15 here); 1e-12 leaves a margin of > 1000x.
TOL = dict(atol=1e-12, rtol=1e-10)


def _model(recompute: bool) -> DSv4Model:
    torch.manual_seed(0)
    return DSv4Model(get_config("debug")).double().train().set_recompute(recompute)


def _ids():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 256, (2, 24), generator=g)


def _counts(m):
    return [g.tokens_per_expert.clone() for g in m.modules() if isinstance(g, moe.Gate)]


def _step(m, ids, twice: bool):
    """One step; twice=True differentiates in two graph tasks (autograd.grad with retain_graph, then
    backward), so every checkpointed block is recomputed twice in the step."""
    m.zero_grad(set_to_none=True)
    out = m(ids, labels=ids)
    first = None
    if twice:
        p = m.layers[0].hc_attn_fn
        first = torch.autograd.grad(out.loss, [p], retain_graph=True)[0]
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    return out.loss.detach(), grads, first


def test_recompute_twice_in_one_step_matches_plain():
    ids = _ids()
    plain = _model(False)
    loss0, g0, first0 = _step(plain, ids, twice=True)
    counts0 = _counts(plain)
    rc = _model(True)
    loss1, g1, first1 = _step(rc, ids, twice=True)          # old code: AttributeError ('args')
    torch.testing.assert_close(loss1, loss0, **TOL)
    torch.testing.assert_close(first1, first0, **TOL)
    assert g1.keys() == g0.keys() and len(g0) > 0
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], msg=n, **TOL)
    # router side effects once per step, although every block ran its forward three times
    assert any(int(c.sum()) > 0 for c in counts0)
    for a, b in zip(_counts(rc), counts0):
        assert torch.equal(a, b)
    assert not recomputing()


def test_recompute_plain_step_matches_no_recompute_and_counts_once():
    ids = _ids()
    plain, rc = _model(False), _model(True)
    loss0, g0, _ = _step(plain, ids, twice=False)
    loss1, g1, _ = _step(rc, ids, twice=False)
    torch.testing.assert_close(loss1, loss0, **TOL)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], msg=n, **TOL)
    for a, b in zip(_counts(rc), _counts(plain)):
        assert torch.equal(a, b)


class _InnerBackward(nn.Module):
    """A forward that runs a small backward of its own (the shape of the old `grouped_mm_ok` probe): inside a
    checkpoint this unpacks checkpointed tensors in a second graph task during the forward."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8).double()
        self.calls = 0

    def forward(self, x):
        if not recomputing():
            self.calls += 1
        with torch.enable_grad():
            probe = torch.randn(4, 8, dtype=torch.double, requires_grad=True)
            (self.lin(probe) ** 2).sum().backward(inputs=[probe])
        return torch.tanh(self.lin(x)) * x


def test_backward_inside_checkpointed_forward_and_nested_checkpoints():
    torch.manual_seed(0)
    inner = _InnerBackward()
    outer = nn.Linear(8, 8).double()
    x = torch.randn(5, 8, dtype=torch.double, requires_grad=True)

    def block(h):                                  # checkpoint inside checkpoint (nested recompute scopes)
        return outer(checkpoint_block(inner, h)).sin()

    ref = block(x).sum()
    gx_ref, = torch.autograd.grad(ref, [x])
    inner.calls = 0
    y = checkpoint_block(block, x).sum()
    gx, = torch.autograd.grad(y, [x], retain_graph=True)
    gx2, = torch.autograd.grad(y, [x])             # the recompute path again, in a second graph task
    torch.testing.assert_close(gx, gx_ref, **TOL)
    torch.testing.assert_close(gx2, gx_ref, **TOL)
    assert inner.calls == 1                        # the forward's side effect happened once
    assert not recomputing()


def test_recompute_scope_is_reentrant():
    from dsv4.model.recompute import RecomputeScope
    s = RecomputeScope()
    with s:
        with s:
            assert recomputing()
        assert recomputing()
    assert not recomputing()
    with s:                                        # and reusable after exit
        assert recomputing()
    assert not recomputing()


def test_whole_block_recompute_with_mhc_recompute():
    """Both recomputes on (whole block + Megatron #4531's hc_pre recompute): at e2f880d the block recompute's
    CheckpointWithoutOutput freed the very tensors checkpoint hands to the original graph -> segfault.
    One backward per forward: CheckpointWithoutOutput (like Megatron's) supports no second backward itself."""
    ids = _ids()
    plain = _model(False)
    loss0, g0, _ = _step(plain, ids, twice=False)
    both = _model(True)
    for b in list(both.layers) + list(both.mtp):         # per block, as Megatron's recompute_modules=["mhc"]
        b.recompute_mhc = True
    loss1, g1, _ = _step(both, ids, twice=False)
    torch.testing.assert_close(loss1, loss0, **TOL)
    assert g1.keys() == g0.keys()
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], msg=n, **TOL)
    for a, b in zip(_counts(both), _counts(plain)):
        assert torch.equal(a, b)
