"""P11's traced-region check on a torch of the device's version: the region's forward under
torch.compile(fullgraph=True, dynamic=False, backend="aot_eager") against the eager packed step
(`PackedGraphStep.step`), three micro-batches of slices/P11/cases.py, on CPU. Prints whether each loss is bit-equal
and, per parameter whose gradient is not, max |a - b| / max |b| (the tolerance source of
slices/P11/test_packed_graph.py), and over all of them |a|, |b| and <a, b> / <b, b> (0: the compiled gradient is
missing, 1: rounding, 2: counted twice), for each head cross-entropy mode (model.set_head_ce: grad_in_forward
writes dy / dW through `out=` into views inside a custom Function's forward, recompute only in its backward).
Session 26 on an H100 host (torch 2.11, grad_in_forward): every parameter's rel diff ~1.0, loss bit-equal; session
27: the same in both head-CE modes, while the head CE alone ("mean") was exact. Suspect: the model's "sum" head CE
returned its in-place accumulator (pytorch#180642); `head_ce_alone` now runs both reductions and
`control_inplace_return` shows whether this torch has that bug.
Usage: python3 harness/device/p11_grad_diff.py [threads] > out.json"""
import json
import sys

import torch

from dsv4.harness.train.packed_graph import PackedGraphStep
from dsv4.slices.P11.cases import BATCHES, B, S
from dsv4.slices.P11.cases import debug_model
from dsv4.slices.P11.cases import micro_batch

if len(sys.argv) > 1:
    torch.set_num_threads(int(sys.argv[1]))
res = {"torch": torch.__version__, "threads": torch.get_num_threads(), "modes": {}}
for head_ce in ("grad_in_forward", "recompute"):
    model = debug_model().set_head_ce(head_ce)
    step = PackedGraphStep(model, (B, S), max_seqs=8)
    torch._dynamo.reset()
    compiled = torch.compile(step.forward, fullgraph=True, dynamic=False, backend="aot_eager")
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    out = res["modes"][head_ce] = []
    for i, rows in enumerate(BATCHES):
        step.load(*micro_batch(rows, i, model.cfg.vocab_size))
        for p in step.params:
            p.grad = None
        got = compiled()
        got.backward()
        grads = [p.grad.clone() for p in step.params]
        ref = step.step()
        diff = {n: ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
                for n, a, b in zip(names, grads, (p.grad for p in step.params)) if not torch.equal(a, b)}
        a = torch.cat([g.flatten().double() for g in grads])
        b = torch.cat([p.grad.flatten().double() for p in step.params])
        out.append({"loss_bit_equal": torch.equal(got.detach(), ref), "n_params": len(names), "n_differ": len(diff),
                    "norm_compiled": a.norm().item(), "norm_eager": b.norm().item(),
                    "proj_compiled_on_eager": (a @ b / (b @ b).clamp_min(1e-300)).item(), "grad_rel_diff": diff})

# the prime suspect alone: the head cross-entropy (a custom Function whose grad_in_forward mode writes dy by
# `torch.mm(..., out=dy[rows])` into a view inside its forward) under the same compile, vs eager, on its own inputs
from dsv4.model.model import head_cross_entropy  # noqa: E402

res["head_ce_alone"] = {}
g = torch.Generator().manual_seed(0)
y0, w0 = torch.randn(37, 64, generator=g), torch.randn(256, 64, generator=g) * 0.1
lab = torch.randint(0, 256, (37,), generator=g)
lab[::5] = -100
for head_ce, red in (("grad_in_forward", "mean"), ("recompute", "mean"), ("grad_in_forward", "sum"),
                     ("recompute", "sum")):          # "sum" (the model's): the Function returns its accumulator
    f = lambda y, w: head_cross_entropy(y, w, lab, chunk=16, grads=head_ce, reduction=red)   # 3 blocks of rows
    outs = {}
    for name, fn in (("eager", f), ("aot_eager", torch.compile(f, fullgraph=True, backend="aot_eager"))):
        y, w = y0.clone().requires_grad_(), w0.clone().requires_grad_()
        loss = fn(y, w)
        loss.backward()
        outs[name] = (loss.detach(), y.grad, w.grad)
    (le, ye, we), (lc, yc, wc) = outs["eager"], outs["aot_eager"]
    rel = lambda a, b: ((a - b).abs().max() / b.abs().max()).item()
    res["head_ce_alone"][f"{head_ce}/{red}"] = {"loss_bit_equal": torch.equal(le, lc), "dy_rel": rel(yc, ye),
                                                 "dw_rel": rel(wc, we)}
    torch._dynamo.reset()


# the control: a Function whose forward returns a tensor it mutated in place (pytorch#180642: with a side effect
# in the forward, torch 2.11's Dynamo routes the gradient to the wrong output slot; fixed in 2.12), without and with
# a list append; d/dx of sum(x) is 1 everywhere, so each grad sum is 10
_SEEN = []


class _InplaceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, side):
        total = torch.zeros((), dtype=x.dtype)
        for a in range(0, x.shape[0], 4):
            total += x[a:a + 4].sum()
        if side:
            _SEEN.append(1)
        ctx.n = x.shape
        return total

    @staticmethod
    def backward(ctx, g):
        return g.expand(ctx.n).clone(), None


res["control_inplace_return"] = {}
for side in (False, True):
    x = torch.randn(10, requires_grad=True)
    _InplaceSum.apply(x, side).backward()
    ge, x.grad = x.grad, None
    torch._dynamo.reset()
    torch.compile(lambda t: _InplaceSum.apply(t, side), fullgraph=True, backend="aot_eager")(x).backward()
    res["control_inplace_return"]["with_list_append" if side else "plain"] = {
        "eager_grad_sum": ge.sum().item(), "aot_eager_grad_sum": None if x.grad is None else x.grad.sum().item()}
json.dump(res, sys.stdout, indent=1)
