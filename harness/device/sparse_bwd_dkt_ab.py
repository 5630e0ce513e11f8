"""Variants of the sparse-attention backward's config at H = 16 on a GPU (the proxy's CSA / window / HCA at S tokens):
the module re-built with its tuner given one config (VARIANTS), each in its own module, against the module as it is.
Why: the ncu profile of the CSA backward at 16K (session 26, goldens/h100/D3/ncu_sparse_bwd_csa16k_h16_69c89cb.metrics
.json) is bound by L1 / shared memory (l1tex 79% of peak, shared wavefronts 66%, 106M bank conflicts; tensor pipe 17.5%
active; 254 registers and 83 KB of shared memory a block: 8 warps an SM; stalls: wait 34%, short scoreboard 26%, long
scoreboard 13%). The plain form reads q and dO from shared memory as the B operands of dKV = dSᵀ Q + Pᵀ dO on every
key tile; the transposed form (DKT, `_bwd_tile`) uses them as transposed A operands (its faults on the H200 were at
BH 64, wgmma; at BH 16 it is mma.sync; interpreter-checked against naive in session 26, not yet run on a GPU). Per
case and variant: bwd ms (do_bench median, L2 flushed), the gradients' max relative difference to the as-is ones
(bf16, atomics: not bit-equal) and the config; a variant that faults prints its error (and poisons the context for
the rest, so the DKT ones run last). Shim on PYTHONPATH (harness/device/shim.sh).
Usage: python3 harness/device/sparse_bwd_dkt_ab.py [S] > out.jsonl"""
import json
import sys
from pathlib import Path

import torch

import dsv4.kernels.sparse_attn.triton as base
from dsv4.harness.bench import _fwd_bwd, sparse_case
from dsv4.harness.device.variants import module_variant

SRC = Path(base.__file__).read_text()
HEAD = "_BWD_CONFIGS = configs("
# name -> the one GPU config of the variant's tuner: (meta-parameters, num_warps, num_stages, maxnreg). The
# profile's occupancy: 2 blocks of 4 warps an SM, capped by registers (254) and by shared memory (83 KB a block);
# the maxnreg / one-stage rows ask whether more resident warps hide the "wait" / short-scoreboard stalls (60%)
# BN 32 / 64 at 4 warps: the [16, BN] logits and dP tiles of the tuned BN 16 are 2 n8 mma tiles for 4 warps, so
# (probably) replicated across warps: 281M ldmatrix, ~220 KB of shared reads a 16-key tile, where the operands are ~110
VARIANTS = {          # the plain ones first: a DKT fault would poison the context for what follows
    "plain_bn32_w4_s2": (dict(BH=16, BN=32, DKT=False), 4, 2, None),
    "plain_bn32_w4_s1": (dict(BH=16, BN=32, DKT=False), 4, 1, None),
    "plain_bn64_w4_s1": (dict(BH=16, BN=64, DKT=False), 4, 1, None),
    "plain_bn16_w4_s1_r128": (dict(BH=16, BN=16, DKT=False), 4, 1, 128),
    "plain_bn16_w4_s2_r168": (dict(BH=16, BN=16, DKT=False), 4, 2, 168),
    "plain_bh32_bn32_w4_s1": (dict(BH=32, BN=32, DKT=False), 4, 1, None),   # 2 queries share window / HCA tiles
    "dkt_bn16_w4_s2": (dict(BH=16, BN=16, DKT=True), 4, 2, None),
    "dkt_bn32_w4_s1": (dict(BH=16, BN=32, DKT=True), 4, 1, None),
    "dkt_bn32_w8_s1": (dict(BH=16, BN=32, DKT=True), 8, 1, None),
}
mods = {"as_is": base}
for v, (meta, w, st, reg) in VARIANTS.items():
    a = SRC.index(HEAD)
    b = SRC.index("prune=_bh_at_least_hb)", a) + len("prune=_bh_at_least_hb)")
    src = SRC[:a] + f"_BWD_CONFIGS = dict(configs=[triton.Config({meta!r}, num_warps={w}, num_stages={st}, " \
                    f"maxnreg={reg})])" + SRC[b:]
    mods[v] = module_variant(base, src, f"dkt_{v}")

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
