"""A/B of the indexer scoring forward, this checkout vs an older kernels/indexer/triton.py (file OLD, e.g. from
`git show 3214bcf:kernels/indexer/triton.py`), in one process on a GPU: every GPU config of the new kernel forced,
one 16K-token call and the four 4096-row chunks of `indexer_select` (CUDA-graph device time), and the whole select
of both (graph and eager). Writes $OUT/indexer_fwd_ab.json. Run with the shim on PYTHONPATH (harness/device/shim.sh)."""
import importlib.util
import json
import os

import torch
from triton.testing import do_bench

from dsv4.harness.bench import _graph_ms
from dsv4.kernels.indexer import triton as new

spec = importlib.util.spec_from_file_location("dsv4.kernels.indexer.triton_old", os.environ["OLD"])
old = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old)

S, nI, cI, ratio, k = 16384, 64, 128, 4, 512
T = S // ratio
g = torch.Generator(device="cuda").manual_seed(1)
q = torch.randn(S, nI, cI, device="cuda", generator=g, dtype=torch.bfloat16)
kk = torch.randn(T, cI, device="cuda", generator=g, dtype=torch.bfloat16)
w = torch.randn(S, nI, device="cuda", generator=g, dtype=torch.bfloat16)
t = torch.arange(S, device="cuda")
meta = (torch.zeros(S, dtype=torch.long, device="cuda"), t, torch.zeros(T, dtype=torch.long, device="cuda"), torch.arange(T, device="cuda"))
pairs = ((t + 1) // ratio).clamp(max=T).sum().item()
fl = 2.0 * nI * cI * pairs
ref = old._launch_fwd(q, kk, w, ratio, old._meta(*meta))
res = {"S": S, "flops": fl}

def chunks(launch):
    def f():
        for s0 in range(0, S, 4096):
            launch(q[s0:s0 + 4096], meta[0][s0:s0 + 4096], meta[1][s0:s0 + 4096], w[s0:s0 + 4096])
    return f

def time_select(mod, tag):
    """res[<tag>_select_graph_ms] (or its capture error) and res[<tag>_select_eager_ms] of mod.indexer_select."""
    sel = lambda: mod.indexer_select(q, kk, w, ratio, k, *meta)      # noqa: E731
    try:
        res[f"{tag}_select_graph_ms"] = _graph_ms(sel)
    except Exception as e:  # noqa: BLE001
        res[f"{tag}_select_graph_err"] = repr(e)[:200]
    res[f"{tag}_select_eager_ms"] = do_bench(sel, rep=200)

res["old_full_ms"] = _graph_ms(lambda: old._launch_fwd(q, kk, w, ratio, old._meta(*meta)))
res["old_chunks_ms"] = _graph_ms(chunks(lambda qq, sq, pq, ww: old._launch_fwd(qq, kk, ww, ratio, old._meta(sq, pq, meta[2], meta[3]))))
res["old_config"] = str(old._scores_fwd.best_config)
time_select(old, "old")

cfgs = [c for c in new._scores_fwd.configs if c.kwargs.get("BT", 0) >= 32]        # the GPU configs
per = {}
for c in cfgs:
    kw = dict(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages)

    def launch(qq, sq, pq, ww=w, kw=kw):                                  # one config forced (`_launch_fwd`)
        return new._launch_fwd(qq, kk, ww, ratio, new._meta(sq, pq, meta[2], meta[3]), config=kw)

    key = str(c.kwargs) + f" w{c.num_warps} s{c.num_stages}"
    try:
        I = launch(q, meta[0], meta[1])
        fin = torch.isfinite(ref)
        ok = bool(torch.equal(fin, torch.isfinite(I))) and float(((I - ref)[fin]).abs().max() / ref[fin].abs().max()) < 1e-2
        per[key] = {"full_ms": _graph_ms(lambda: launch(q, meta[0], meta[1])), "chunks_ms": _graph_ms(chunks(launch)), "ok": ok}
        per[key]["full_tflops"] = fl / per[key]["full_ms"] * 1e-9
    except Exception as e:
        per[key] = {"error": repr(e)[:300]}
    print(key, per[key], flush=True)
res["new_per_config"] = per
res["new_full_tuned_ms"] = _graph_ms(lambda: new._launch_fwd(q, kk, w, ratio, new._meta(*meta)))
res["new_config"] = str(new._scores_fwd.best_config)
time_select(new, "new")
res["old_full_tflops"] = fl / res["old_full_ms"] * 1e-9
for kk_ in ("old_select_graph_ms", "new_select_graph_ms", "old_select_eager_ms", "new_select_eager_ms"):
    if kk_ in res:
        res[kk_.replace("_ms", "_tflops")] = fl / res[kk_] * 1e-9
print(json.dumps({k: v for k, v in res.items() if k != "new_per_config"}, indent=1))
json.dump(res, open(os.environ.get("OUT", "/tmp") + "/indexer_fwd_ab.json", "w"), indent=1)
