"""Where the sparse-attention backward's time goes, on a GPU: the kernel module re-built with its dKV add
(`_dk_add`, kernels/sparse_attn/triton.py) replaced, each variant in its own module (own autotuner, re-tuned):
  atomic  the kernel as it is (fp32 atomic adds of the key tile's dKV),
  store   plain stores to the same addresses (racy values: same bytes written, no read-modify-write),
  sum     the dKV tile summed to one float a tile (its two products kept, no dKV traffic),
  nodk    no dKV at all (its products dead-code eliminated: the dQ path alone).
So atomic - store = the RMW, store - sum = the dKV write traffic, sum - nodk = the two dKV products. Cases: H heads
x window / CSA / HCA at S tokens, the `dsv4 bench kernels` inputs. Timing only: the variants' gradients are wrong by
design. Writes $OUT/sparse_bwd_parts.json. Shim on PYTHONPATH (harness/device/shim.sh); CASES overrides."""
import json
import os
import re
from pathlib import Path

import torch

from dsv4.harness.bench import _fwd_bwd, _tuned_ms, sparse_case
from dsv4.harness.device.variants import module_variant
import dsv4.kernels.sparse_attn.triton as base

SRC = Path(base.__file__).read_text()
HEAD = "def _dk_add(DK, rows, s_row, offs_d, valid, dmask, dk, DKT: tl.constexpr):\n"
BODY = {
    "store": "    valid = tl.max(valid.to(tl.int32), 0) > 0\n"
             "    tl.store(DK + rows[:, None] * s_row + offs_d[None, :], dk, mask=valid[:, None] & dmask[None, :])\n",
    "sum": "    tl.store(DK + tl.max(rows, 0) * s_row, tl.sum(tl.sum(dk, 1), 0))\n",
    "nodk": "    pass\n",
}
mods = {"atomic": base}
for v, body in BODY.items():
    a = SRC.index(HEAD) + len(HEAD)
    b = SRC.index("\n\n\n", a)
    doc = re.match(r'\s*""".*?"""\n', SRC[a:b], re.S)
    src = SRC[:a] + (doc.group(0) if doc else "") + body + SRC[b:]
    mods[v] = module_variant(base, src, f"parts_{v}")

S, c, window = 16384, 512, 128
cases = [x.split(":") for x in os.environ.get("CASES", "16:window,16:csa,16:hca,64:csa").split(",")]
res = {"S": S, "rows": []}
for h, mode in cases:
    H = int(h)
    q, kv, comp, idx, sink, meta, ratio = sparse_case(S, H, mode, c, window)
    ins = [x for x in (q, kv, comp, sink) if x is not None]
    row = {"H": H, "mode": mode}
    for v, mod in mods.items():
        f = lambda: mod.sparse_attn(q, kv, comp, idx, sink, window, ratio, c ** -0.5, *meta)  # noqa: E731
        try:
            _, bwd = _fwd_bwd(f, ins)
            row[v] = {"bwd_ms": bwd, "config": str(mod._sparse_attn_bwd.best_config),
                      "tuned_ms": _tuned_ms(mod._sparse_attn_bwd)}
        except Exception as e:  # noqa: BLE001
            row[v] = {"error": repr(e)[:400]}
    print(json.dumps({"H": H, "mode": mode, **{v: row[v].get("bwd_ms", row[v].get("error")) for v in mods}}), flush=True)
    res["rows"].append(row)
    del q, kv, comp, idx, sink, ins
    torch.cuda.empty_cache()
with open(os.path.join(os.environ.get("OUT", "."), "sparse_bwd_parts.json"), "w") as fh:
    json.dump(res, fh, indent=1)
