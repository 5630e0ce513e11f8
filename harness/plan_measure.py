"""Saved-for-backward bytes of every block of a DSv4 model, measured (used by `dsv4 plan`, harness/plan.py).

    python -m dsv4.harness.plan_measure CONFIG_JSON SEQ TOPK        -> one JSON document on stdout

Runs ONE training forward (labels, `return_logits=False`, as `dsv4 bench train`) of the model built from the
config (bf16, FP32-kept tensors of P1, grouped expert GEMMs, the Triton kernels on Triton's CPU interpreter) on one
row of SEQ random tokens, with `torch.autograd.graph.saved_tensors_hooks` recording every tensor autograd keeps
for backward. Each storage is counted once (views of one storage, or one tensor saved by two ops), parameters and
buffers are not counted (they are the parameter memory), and each storage is charged to the block that saved it
first (forward pre-hooks on the blocks; "top" = embedding, HyperHead, norm and the head's cross-entropy).

Per label and per saved tensor the shape is reported, classified by its dimensions so that `dsv4 plan` can scale
it to any sequence length (SEQ and TOPK are chosen so that T, the entry count N = T/m and k are distinct from every
other dimension of the config):
    "token"   bytes proportional to T: shapes with a multiple of T (T, the T*K expert slots, ...) and neither
              N of a CSA layer nor k, or [N, ...] entries (CSA or HCA);
    "entry"   bytes proportional to T * N_csa (shapes holding both T and the CSA entry count: the indexer's
              [T, N] scores and their loss);
    "topk"    bytes proportional to T * k (shapes holding T and k: the selected entry indices);
    "const"   anything else (e.g. [H] vectors).
Must run with TRITON_INTERPRET=1 in the environment before triton is imported: `run_measure` starts it so.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys


def measure(cfg_dict: dict, S: int, topk: int) -> dict:
    import torch
    from dsv4.model.config import DSv4Config
    from dsv4.model.model import DSv4Model
    from dsv4.model.precision import cast_model
    torch.manual_seed(0)                      # harness/plan.py MEASURE_SEED
    cfg = DSv4Config.from_dict({**cfg_dict, "index_topk": topk})
    model = DSv4Model(cfg)
    cast_model(model, torch.bfloat16)
    model.set_kernel_backend("triton")
    model.set_expert_gemm("grouped")
    model.train()
    own = {t.untyped_storage()._cdata for t in list(model.parameters()) + list(model.buffers())}
    label = ["top"]
    blocks = [(f"layers.{i}", b) for i, b in enumerate(model.layers)] + [(f"mtp.{j}", b) for j, b in enumerate(model.mtp)]
    hooks = []
    for name, b in blocks:
        hooks.append(b.register_forward_pre_hook(lambda m, a, name=name: label.__setitem__(0, name)))
        hooks.append(b.register_forward_hook(lambda m, a, o: label.__setitem__(0, "top")))
    saved: dict[int, tuple] = {}

    def pack(t):
        st = t.untyped_storage()
        k = st._cdata
        if k not in own and k not in saved:
            saved[k] = (label[0], st.nbytes(), list(t.shape), str(t.dtype).replace("torch.", ""))
        return t

    ids = torch.randint(0, cfg.vocab_size, (1, S))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids, ids, return_logits=False)
    for h in hooks:
        h.remove()
    N = S // cfg.csa_ratio
    k = min(topk, N)
    Nh = S // cfg.hca_ratio
    has_csa = any(cfg.layer_kind(i) == "csa" for i in range(len(cfg.compress_ratios)))
    out: dict[str, dict] = {}
    for lab, nbytes, shape, dt in saved.values():
        has_t = any(x > 0 and x % S == 0 for x in shape)          # T, or T*K slots, 2T rows, ...
        if has_t and N in shape and has_csa:
            cls = "entry"
        elif has_t and k in shape:
            cls = "topk"
        elif has_t or N in shape or (Nh > 1 and Nh in shape):
            cls = "token"
        else:
            cls = "const"
        o = out.setdefault(lab, {"token": 0, "entry": 0, "topk": 0, "const": 0, "tensors": []})
        o[cls] += nbytes
        o["tensors"].append([nbytes, shape, dt, cls])
    return {"seq": S, "topk": k, "entries": N, "labels": out}


def run_measure(cfg_dict: dict, S: int, topk: int, timeout: float = 1800) -> dict:
    """`measure` in a fresh interpreter with TRITON_INTERPRET=1 (the Triton kernels' saved tensors on CPU)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    p = subprocess.run([sys.executable, "-m", "dsv4.harness.plan_measure", json.dumps(cfg_dict), str(S), str(topk)],
                       capture_output=True, text=True, env=env, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"plan_measure failed (exit {p.returncode}): {p.stderr.strip().splitlines()[-1:]}")
    return json.loads(p.stdout)


if __name__ == "__main__":
    import torch
    torch.set_num_threads(1)
    print(json.dumps(measure(json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))))
