"""P11's traced-region check on a torch of the device's version: the region's forward under
torch.compile(fullgraph=True, dynamic=False, backend="aot_eager") against the eager packed step
(`PackedGraphStep.step`), three micro-batches of slices/P11/cases.py, on CPU. Prints whether each loss is bit-equal
and, per parameter whose gradient is not, max |a - b| / max |b| (the tolerance source of
slices/P11/test_packed_graph.py). Usage: python3 harness/device/p11_grad_diff.py [threads] > out.json"""
import json
import sys

import torch

from dsv4.harness.train.packed_graph import PackedGraphStep
from dsv4.slices.P11.cases import BATCHES, B, S
from dsv4.slices.P11.cases import debug_model
from dsv4.slices.P11.cases import micro_batch

if len(sys.argv) > 1:
    torch.set_num_threads(int(sys.argv[1]))
model = debug_model()
step = PackedGraphStep(model, (B, S), max_seqs=8)
compiled = torch.compile(step.forward, fullgraph=True, dynamic=False, backend="aot_eager")
names = [n for n, p in model.named_parameters() if p.requires_grad]
res = {"torch": torch.__version__, "threads": torch.get_num_threads(), "micro_batches": []}
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
    res["micro_batches"].append({"loss_bit_equal": torch.equal(got.detach(), ref), "grad_rel_diff": diff})
json.dump(res, sys.stdout, indent=1)
