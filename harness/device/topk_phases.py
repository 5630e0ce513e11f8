"""Where `row_topk`'s time goes on a GPU (issue 14's missed indexer targets): the kernel of
kernels/indexer/topk.py `_row_topk`, cut after each phase, timed on the indexer's select shape.

    python harness/device/topk_phases.py [--out F]      # CUDA only; F: JSON rows (default $OUT/topk_phases.json)

PHASE 0 = the row's load (and one sum); 1 = + the select (32 compare-and-count reductions); 2 = + the compaction
(two scans, the picks' int64 codes stored); 3 = + the sort of the picks and the decode (the whole kernel). Each
phase's time minus the previous one's is that phase's cost. A profiling copy of the product kernel, phase by phase
(the product is `topk._row_topk`; change both together): rows of a causal chunk, randn scores, k = 512.
Measured on the H200 at 69f64a7 (kernels/PERF_NOTES.md, 2026-12-04)."""
from __future__ import annotations

import argparse
import json
import os

import torch
import triton
import triton.language as tl

from dsv4.kernels.indexer.topk import SNINF_KEY, _keys


@triton.jit
def _phases(I, OUT, TOUT, N, kk, si, so, BLOCK: tl.constexpr, KP: tl.constexpr, PHASE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    key, _ = _keys(I + row * si, offs, N)
    if PHASE == 0:
        tl.store(TOUT + row, tl.sum(key, 0))
        return
    t = tl.zeros([], tl.uint32)
    for b in tl.static_range(31, -1, -1):
        cand = t | tl.full([], 1 << b, tl.uint32)
        t = tl.where(tl.sum((key >= cand).to(tl.int32), 0) >= kk, cand, t)
    if PHASE == 1:
        tl.store(TOUT + row, t)
        return
    gt = key > t
    eq = key == t
    need = kk - tl.sum(gt.to(tl.int32), 0)
    keep = gt | (eq & (tl.cumsum(eq.to(tl.int32), 0) <= need))
    pos = tl.cumsum(keep.to(tl.int32), 0) - 1
    skey = (key ^ 0x80000000).to(tl.int32, bitcast=True).to(tl.int64)
    c = (skey << 32) | (0x7FFFFFFF - offs).to(tl.int64)
    dst = OUT + row * so
    tl.store(dst + pos, c, mask=keep)
    if PHASE == 2:
        return
    tl.debug_barrier()
    ks = tl.arange(0, KP)
    c = tl.load(dst + ks, mask=ks < kk, other=-9223372036854775807 - 1, cache_modifier=".cg")
    c = tl.sort(c, descending=True)
    tl.debug_barrier()
    idx = 0x7FFFFFFF - (c & 0xFFFFFFFF)
    ninf = (c >> 32) == SNINF_KEY
    tl.store(dst + ks, tl.where(ninf, -1, idx), mask=ks < kk)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "topk_phases.json"))
    a = ap.parse_args()
    rows, k = [], 512
    for R, N in ((16384, 4096), (4096, 16384)):                # select at 16K tokens; [4096, N] rows of 64K
        vis = (torch.arange(4 * N - R, 4 * N, device="cuda") + 1) // 4
        I = torch.randn(R, N, device="cuda").masked_fill(torch.arange(N, device="cuda")[None] >= vis[:, None],
                                                        float("-inf"))
        idx = torch.empty(R, k, dtype=torch.long, device="cuda")
        tout = torch.empty(R, dtype=torch.int64, device="cuda")
        for w in (4, 8, 16):
            r = {"rows": R, "N": N, "k": k, "num_warps": w}
            for ph in range(4):
                f = lambda: _phases[(R,)](I, idx, tout, N, k, I.stride(0), k, BLOCK=N, KP=k, PHASE=ph,  # noqa: E731
                                          num_warps=w)
                r[f"phase{ph}_ms"] = triton.testing.do_bench(f, warmup=20, rep=100)
            print(json.dumps(r), flush=True)
            rows.append(r)
    tmp = a.out + ".tmp"
    with open(tmp, "w") as fh:
        json.dump({"rows": rows, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "triton": triton.__version__}, fh, indent=1)
    os.replace(tmp, a.out)


if __name__ == "__main__":
    main()
