"""The sparse-attention backward's transposed-dKV form (DKT, kernels/sparse_attn/triton.py `_bwd_tile`) at H = 16, on a
GPU: the module re-built with the backward's configs replaced by DKT=True ones at BH 16 (mma.sync; the DKT faults
seen on the H200 were at BH 64, wgmma), each in its own module (own autotuner). Why: the ncu profile of the CSA
backward at 16K (session 26, goldens/h100/D3/ncu_sparse_bwd_csa16k_h16_69c89cb.metrics.json) is bound by L1 / shared
memory (l1tex 79% of peak, shared wavefronts 66%, 106M bank conflicts; tensor pipe 17.5% active; 254 registers, 8
warps an SM); the plain form reads q and dO from shared memory as the B operands of dKV = dSᵀ Q + Pᵀ dO on every key
tile, the DKT form uses them as (transposed) A operands. Per case: the as-is backward and each DKT config, ms (do_bench
median, L2 flushed) and the gradients' max relative difference to the as-is ones (bf16; atomics: not bit-equal).
Shim on PYTHONPATH (harness/device/shim.sh). Usage: python3 harness/device/sparse_bwd_dkt_ab.py [S] > out.jsonl"""
import importlib
import json
import sys
from pathlib import Path

import torch

import dsv4.kernels.sparse_attn.triton as base
from dsv4.harness.bench import _fwd_bwd, sparse_case

SRC = Path(base.__file__).read_text()
HEAD = "_BWD_CONFIGS = configs("
VARIANTS = {          # the plain one first: a DKT fault would poison the context for what follows
    "plain_bn32_w4_s2": "dict(BH=16, BN=32, DKT=False, num_warps=4, num_stages=2)",
    "dkt_bn16_w4_s2": "dict(BH=16, BN=16, DKT=True, num_warps=4, num_stages=2)",
    "dkt_bn32_w4_s1": "dict(BH=16, BN=32, DKT=True, num_warps=4, num_stages=1)",
    "dkt_bn32_w8_s1": "dict(BH=16, BN=32, DKT=True, num_warps=8, num_stages=1)",
}
mods = {"as_is": base}
for v, cfg in VARIANTS.items():
    a = SRC.index(HEAD)
    b = SRC.index("prune=_bh_at_least_hb)", a) + len("prune=_bh_at_least_hb)")
    src = SRC[:a] + f"{HEAD}gpu=[{cfg}], cpu=dict(BH=16, BN=16, DKT=False, num_warps=4, num_stages=1), " \
                    "prune=_bh_at_least_hb)" + SRC[b:]
    p = Path(base.__file__).with_name(f"_dkt_{v}.py")
    p.write_text(src)
    try:
        mods[v] = importlib.import_module(f"dsv4.kernels.sparse_attn._dkt_{v}")
    finally:
        p.unlink()                                        # imported (Triton keeps the source): leave no file behind

S = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
c, window = 512, 128
for mode in ("csa", "window", "hca"):
    q, kv, comp, idx, sink, meta, ratio = sparse_case(S, 16, mode, c, window)
    ins = [x for x in (q, kv, comp, sink) if x is not None]
    row, ref = {"S": S, "H": 16, "mode": mode}, None
    for v, mod in mods.items():
        f = lambda: mod.sparse_attn(q, kv, comp, idx, sink, window, ratio, c ** -0.5, *meta)  # noqa: E731
        try:
            o = f()
            g = torch.autograd.grad(o, ins, torch.ones_like(o) * 0.01)
            ref = ref or g
            rel = max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for a, b in zip(g, ref))
            _, bwd = _fwd_bwd(f, ins)
            row[v] = {"bwd_ms": bwd, "max_rel_vs_as_is": rel, "config": str(mod._sparse_attn_bwd.best_config)}
        except Exception as e:  # noqa: BLE001
            row[v] = {"error": repr(e)[:300]}
    print(json.dumps(row), flush=True)
    del q, kv, comp, idx, sink, ins
    torch.cuda.empty_cache()
