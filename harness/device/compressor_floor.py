"""The read floor of the compressor forward's bytes on a GPU: for each `dsv4 bench kernels` compressor case (CSA
D=512, indexer D=128, HCA D=512 at T tokens), a plain Triton kernel that reads kv and gate [T, W] bf16 once, in
row blocks of BR rows x W channels, and writes one fp32 per program (no softmax, no pooling), timed as a CUDA
graph with L2 flushed (bench._graph_ms, the compressor rows' timer) for several BR / warps; beside it the compressor
forward itself (slots precomputed) with each of its GPU configs forced, and for HCA (m = 128, few entries) the
slot-loop form at 1-2 entries a program, which the configs do not offer. If the floor is under 2.5 TB/s at a size,
the issue-14 target cannot be met there by any pooling kernel. Writes $OUT/compressor_floor.json; shim on
PYTHONPATH (harness/device/shim.sh); TOKENS overrides the sizes."""
import json
import os

import torch
import triton
import triton.language as tl

from dsv4.harness.bench import _graph_ms
from dsv4.kernels.compressor import compress_slots
from dsv4.kernels.compressor import triton as tri


@triton.jit
def _read(KV, GATE, OUT, T, W, BR: tl.constexpr, BW: tl.constexpr):
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    acc = tl.zeros([BR, BW], tl.float32)
    for w0 in range(0, W, BW):
        c = w0 + tl.arange(0, BW)
        off = r[:, None].to(tl.int64) * W + c[None, :]
        m = (r < T)[:, None] & (c < W)[None, :]
        acc += tl.load(KV + off, mask=m, other=0.0).to(tl.float32) * tl.load(GATE + off, mask=m, other=0.0).to(tl.float32)
    tl.store(OUT + tl.program_id(0), tl.sum(tl.sum(acc, 1), 0))


res = {"rows": []}
for S in [int(x) for x in os.environ.get("TOKENS", "16384,65536").split(",")]:
    for name, D, m, ov in (("csa_main", 512, 4, True), ("csa_indexer", 128, 4, True), ("hca_main", 512, 128, False)):
        W = 2 * D if ov else D
        g = torch.Generator(device="cuda").manual_seed(2)
        kv = torch.randn(S, W, device="cuda", generator=g, dtype=torch.bfloat16)
        gate = torch.randn(S, W, device="cuda", generator=g, dtype=torch.bfloat16)
        ape = torch.randn(m, W, device="cuda", generator=g)
        by = 2 * S * W * 2 + (S // m) * D * 2
        row = {"case": name, "S": S, "bytes": by, "floor": {}, "pool": {}}
        for BR in (4, 8, 16, 32, 64):
            for BW in sorted({min(W, 256), W}):
                for w in (4, 8):
                    if BR * BW < 32 * w * 4:
                        continue
                    out = torch.empty(triton.cdiv(S, BR), device="cuda")
                    f = lambda: _read[(triton.cdiv(S, BR),)](kv, gate, out, S, W, BR=BR, BW=BW, num_warps=w)  # noqa
                    ms = _graph_ms(f)
                    row["floor"][f"BR{BR} BW{BW} w{w}"] = {"ms": ms, "tbps": by / ms * 1e-9}
        seg, pos = torch.zeros(S, dtype=torch.long, device="cuda"), torch.arange(S, device="cuda")
        sl = compress_slots(seg, pos, m, ov, 0, backend="triton")
        r0, hp = sl[3], sl[4]
        args = {"MP": tri._mp(m, ov), "D": D, "N": r0.shape[0]}
        extra = [triton.Config(dict(BE=be, BD=bd, NIT=1, LOOP=True), num_warps=w, num_stages=st)
                 for be in (1, 2) for bd in (64, 128, 256, 512) for w in (1, 2, 4) for st in (2, 4)
                 if not ov and bd >= 32 * w]                     # HCA: the slot loop with 1-2 entries a program
        for c in tri._fits(tri._FWD["configs"][:-1], args) + extra:
            kw = dict(c.kwargs)
            N = r0.shape[0]
            o = kv.new_empty(N, D)
            grid = (triton.cdiv(N, kw["BE"] * kw["NIT"]), triton.cdiv(D, kw["BD"]))
            fn = tri._pool_fwd.fn
            f = lambda: fn[grid](kv, gate, ape, r0, hp, o, N, m, D, W, N.bit_length(), OVERLAP=ov,  # noqa
                                 MP=args["MP"], num_warps=c.num_warps, num_stages=c.num_stages, **kw)
            try:
                ms = _graph_ms(f)
                row["pool"][str(kw) + f" w{c.num_warps} s{c.num_stages}"] = {"ms": ms, "tbps": by / ms * 1e-9}
            except Exception as e:  # noqa: BLE001
                row["pool"][str(kw)] = {"error": repr(e)[:200]}
        best = lambda d: max((v.get("tbps", 0), k) for k, v in d.items())  # noqa
        row["floor_best"], row["pool_best"] = best(row["floor"]), best(row["pool"])
        print(json.dumps({k: row[k] for k in ("case", "S", "floor_best", "pool_best")}), flush=True)
        res["rows"].append(row)
with open(os.path.join(os.environ.get("OUT", "."), "compressor_floor.json"), "w") as fh:
    json.dump(res, fh, indent=1)
