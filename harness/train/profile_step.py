"""Profile one fwd+bwd training step of our DSv4 model on a GPU (torch.profiler), for `dsv4 bench train` work.

    python -m dsv4.harness.train.profile_step --tokens 4096 --out DIR [--recompute-from 32768] [--backend triton]

Writes DIR/profile_<T>.txt: key_averages sorted by CUDA time (self and total), with record_function ranges
around each block's attention / FFN / mHC and the heads (forward only; backward kernels are listed by name),
plus step time and peak memory. Not a benchmark: timings under the profiler carry its overhead.
"""
from __future__ import annotations

import argparse
import os
import time

import torch


def _label(model):
    """record_function ranges around the forward of the interesting submodules (pre/post hooks)."""
    from torch.autograd.profiler import record_function

    def pre(name):
        def hook(mod, args):
            mod._rf = record_function(name)
            mod._rf.__enter__()
        return hook

    def post(mod, args, out):
        mod._rf.__exit__(None, None, None)

    for name, mod in model.named_modules():
        last = name.split(".")[-1]
        if last in ("attn", "ffn", "indexer", "compressor", "head", "experts", "shared_experts", "gate"):
            mod.register_forward_pre_hook(pre(name))
            mod.register_forward_hook(post)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="proxy")
    ap.add_argument("--tokens", default="4096")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--recompute-from", type=int, default=32768)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    from torch.profiler import ProfilerActivity, profile

    from dsv4.harness.train.bench import build_ours
    from dsv4.model.config import get_config
    cfg = get_config(args.config)
    dev = torch.device("cuda")
    for T in [int(t) for t in args.tokens.split(",")]:
        S = T // args.batch
        model = build_ours(cfg, args.backend, dev)
        model.set_recompute(T >= args.recompute_from)
        _label(model)
        ids = torch.randint(0, cfg.vocab_size, (args.batch, S), device=dev)
        params = [p for p in model.parameters() if p.requires_grad]

        def step():
            out = model(input_ids=ids, labels=ids, return_logits=False)
            out.loss.backward()
            for p in params:
                p.grad = None

        torch.cuda.reset_peak_memory_stats()
        for _ in range(2):
            step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / 3
        peak = torch.cuda.max_memory_allocated() / 2**30
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        ka = prof.key_averages()
        head = f"T={T} B={args.batch} S={S} step {dt * 1e3:.1f} ms, {T / dt:,.0f} tok/s, peak {peak:.1f} GiB\n"
        txt = head + ka.table(sort_by="self_cuda_time_total", row_limit=60, max_name_column_width=70) + \
            "\n\n" + ka.table(sort_by="cuda_time_total", row_limit=60, max_name_column_width=70)
        with open(os.path.join(args.out, f"profile_{T}.txt"), "w") as f:
            f.write(txt)
        print(head, flush=True)
        print(ka.table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=60), flush=True)
        del model, prof
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
