"""A/B of `listed_width` (kernels/sparse_attn/triton.py) on a GPU: the CSA attention's forward and backward at the
proxy's shape (H 16, c 512, window 128, ratio 4, top-k 512) on one document of S tokens, with the listing in the
indexer's top-k order (each query's visible picks first, -1 after: `_csa_idx` of the bench without its sort), read
(a) up to each query's last entry (as the kernels do) and (b) to the full width k (`listed_width` patched to k, what
the kernels did before). Prints one JSON line: ms of each (do_bench median, L2 flushed), the share of -1 slots, and
the outputs' max abs difference (0 expected: the skipped slots hold no entry).
Shim on PYTHONPATH (harness/device/shim.sh). Usage: python3 harness/device/listed_width_ab.py [S ...]"""
import json
import sys

import torch

import dsv4.kernels.sparse_attn.triton as T
from dsv4.harness.bench import _csa_idx, _fwd_bwd, sparse_case

width = T.listed_width
res = []
for S in [int(a) for a in sys.argv[1:]] or [8192, 16384]:
    q, kv, comp, _, sink, meta, ratio = sparse_case(S, 16, "csa")
    g = torch.Generator(device="cuda").manual_seed(1)
    idx = _csa_idx(S, comp.shape[0], 512, ratio, "cuda", g)[:, 0]
    idx = idx.flip(-1)                                     # descending: the -1 of a short row last, as a top-k
    row = {"S": S, "minus_one_share": (idx < 0).float().mean().item()}
    outs = {}
    for name, fn in (("last_entry", width), ("full_width", lambda i: torch.full_like(i[:, 0], i.shape[1],
                                                                                      dtype=torch.int32))):
        T.listed_width = fn
        f = lambda: T.sparse_attn(q, kv, comp, idx, sink, 128, ratio, 512 ** -0.5, *meta)
        outs[name] = f().detach()
        row[name + "_fwd_ms"], row[name + "_bwd_ms"] = _fwd_bwd(f, [q, kv, comp, sink])
    T.listed_width = width
    row["max_abs_diff"] = (outs["last_entry"].float() - outs["full_width"].float()).abs().max().item()
    res.append(row)
    print(json.dumps(row), flush=True)
