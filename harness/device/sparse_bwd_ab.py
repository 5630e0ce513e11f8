"""A/B of the sparse-attention backward's dKV adds, in one process on a GPU: Triton's scalar fp32 `atomic_add`
against the 16-byte vector reds (`_red_add_v4`, kernels/sparse_attn/triton.py), chosen by the launcher's `_vred`.
For each case (H heads x window / CSA / HCA at S tokens, the `dsv4 bench kernels` inputs) and each form: the
autotuner re-tunes the backward (its per-config timings are the A/B of every config), the backward's median ms,
and the largest difference of dq / dkv / dcomp / dsink between the two forms (atomic order differs: fp32 sums in
another order, then bf16). Writes $OUT/sparse_bwd_ab.json. Run with the shim on PYTHONPATH (harness/device/shim.sh);
HEADS / SEQ / MODES override the cases."""
import json
import os

import torch

from dsv4.harness.bench import _csa_idx, _fwd_bwd, _tuned_ms
from dsv4.kernels.sparse_attn import sparse_attn
from dsv4.kernels.sparse_attn import triton as tri

heads = [int(h) for h in os.environ.get("HEADS", "16,64").split(",")]
S = int(os.environ.get("SEQ", "16384"))
modes = os.environ.get("MODES", "window,csa,hca").split(",")
c, window = 512, 128
vred = tri._vred
res = {"S": S, "rows": []}
for H in heads:
    for mode in modes:
        g = torch.Generator(device="cuda").manual_seed(0)
        ratio, k = (4, 512) if mode == "csa" else (128, 0)
        q = torch.randn(S, H, c, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
        kv = torch.randn(S, c, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
        sink = torch.randn(H, device="cuda", generator=g).requires_grad_()
        comp = idx = None
        if mode != "window":
            comp = torch.randn(S // ratio, c, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
        if mode == "csa":
            idx = _csa_idx(S, S // ratio, k, ratio, "cuda", g)[:, 0]
        N = 0 if comp is None else comp.shape[0]
        t = torch.arange(S, device="cuda")
        meta = (torch.zeros(S, dtype=torch.long, device="cuda"), t, torch.zeros(N, dtype=torch.long, device="cuda"),
                torch.arange(N, device="cuda"))
        ins = [x for x in (q, kv, comp, sink) if x is not None]
        f = lambda: sparse_attn(q, kv, comp, idx, sink, window, ratio, c ** -0.5, *meta, backend="triton")  # noqa
        row = {"H": H, "mode": mode}
        grads = {}
        for form in ("scalar", "v4"):
            tri._vred = vred if form == "v4" else (lambda *a: False)
            tri._sparse_attn_bwd.cache.clear()
            try:
                fwd, bwd = _fwd_bwd(f, ins)
                row[form] = {"bwd_ms": bwd, "bwd_config": str(tri._sparse_attn_bwd.best_config),
                             "bwd_tuned_ms": _tuned_ms(tri._sparse_attn_bwd)}
                out = f()
                grads[form] = torch.autograd.grad(out, ins, torch.ones_like(out) * 1e-2)
            except Exception as e:  # noqa: BLE001
                row[form] = {"error": repr(e)[:400]}
        tri._vred = vred
        if len(grads) == 2:
            names = ["dq", "dkv"] + (["dcomp"] if comp is not None else []) + ["dsink"]
            row["max_abs_diff"] = {n: float((a.float() - b.float()).abs().max())
                                   for n, a, b in zip(names, grads["scalar"], grads["v4"])}
            row["max_abs"] = {n: float(a.float().abs().max()) for n, a in zip(names, grads["scalar"])}
            row["speedup"] = row["scalar"]["bwd_ms"] / row["v4"]["bwd_ms"]
        print(json.dumps(row), flush=True)
        res["rows"].append(row)
        del q, kv, comp, idx, sink, ins, grads
        torch.cuda.empty_cache()
out = os.path.join(os.environ.get("OUT", "."), "sparse_bwd_ab.json")
with open(out, "w") as fh:
    json.dump(res, fh, indent=1)
