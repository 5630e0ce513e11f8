"""The MoE slot bookkeeping's A/B on a GPU (model/moe.py Experts.forward): (a) the int64 stable argsort of the T*K
expert ids and wk = w[order] (backward: index_put with accumulate, which sorts the T*K slot indices again) against
(b) `_sort_keys` (int16 keys: 2 radix passes instead of 8) and wk = w.gather(0, order) (backward: a scatter into
zeros). Forward + backward of those ops alone, CUDA events, median of 50 after 10 warm-ups, at the proxy's
E and K for T tokens. Prints one JSON line. Usage: python3 harness/device/moe_slot_ab.py [T ...]"""
import json
import sys

import torch

from dsv4.model.config import get_config
from dsv4.model.moe import _sort_keys

cfg = get_config("proxy")
E, K = cfg.n_routed_experts, cfg.num_experts_per_tok


def old(idx, w):
    order = torch.argsort(idx.reshape(-1), stable=True)
    return order, w.reshape(-1)[order]


def new(idx, w):
    order = torch.argsort(_sort_keys(idx, E), stable=True)
    return order, w.reshape(-1).gather(0, order)


def ms(f, idx, w, dy):
    ts = []
    for i in range(60):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        _, wk = f(idx, w)
        wk.backward(dy)
        b.record()
        torch.cuda.synchronize()
        if i >= 10:
            ts.append(a.elapsed_time(b))
        w.grad = None
    return sorted(ts)[len(ts) // 2]


res = {"E": E, "K": K, "rows": []}
for T in [int(t) for t in sys.argv[1:]] or [4096, 16384, 65536]:
    g = torch.Generator(device="cuda").manual_seed(0)
    idx = torch.randint(0, E, (T, K), device="cuda", generator=g)
    w = torch.rand(T, K, device="cuda", generator=g, requires_grad=True)
    dy = torch.randn(T * K, device="cuda", generator=g)
    (o1, a1), (o2, a2) = old(idx, w), new(idx, w)
    same = bool(torch.equal(o1, o2) and torch.equal(a1, a2))
    t_old, t_new = ms(old, idx, w, dy), ms(new, idx, w, dy)
    res["rows"].append({"T": T, "same": same, "old_ms": t_old, "new_ms": t_new, "speedup": t_old / t_new})
res["gpu"] = torch.cuda.get_device_name()
res["torch"] = torch.__version__
print(json.dumps(res))
