"""`python -m dsv4.harness.bench_generate`: decode throughput and KV-cache memory of cached generation (X2).

Per context length C: a random-weight model (bf16, Triton kernels on a GPU), a batch of B random prompts of C tokens
prefilled through the DSv4 cache in chunks (`forward_step`, model/generate.py), then `--new` greedy decode steps of
one token per row. Reports prefill and decode tokens/s (decode: B * new / wall time of the decode steps, CUDA
synchronised), the cache's bytes (`DSv4Cache.nbytes`: ring buffers, compressor states, compressed entries, indexer
keys, the kept mHC streams) per cached token beside the formula (`cache_elements_per_token`), and the peak memory.
An out-of-memory context is recorded as such. `--smoke`: the debug config on the CPU with tiny contexts (a check
that the script runs, not a measurement).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def bench(config: str, contexts: list[int], batch: int, new: int, prefill_chunk: int, device: str,
          backend: str) -> dict:
    from dsv4.model.config import get_config
    from dsv4.model.generate import DSv4Cache, cache_elements_per_token, forward_step
    from dsv4.model.model import DSv4Model
    from dsv4.model.precision import cast_model
    dev = torch.device(device)
    cfg = get_config(config)
    torch.manual_seed(0)
    model = DSv4Model(cfg).to(dev)
    cast_model(model, torch.bfloat16)
    model.set_kernel_backend(backend)
    model.eval()
    elem = 2
    rows = []
    # warm-up, untimed: one short generation at the smallest context (Triton compiles each kernel on first use:
    # on the H200 a cold first row measured 471 ms a decode step against 35 ms warm), and below 2 decode steps
    # per context before its timed ones
    with torch.no_grad():
        W = min(min(contexts), prefill_chunk)
        wc = DSv4Cache(model, batch)
        wl = forward_step(model, wc, torch.ones(batch, W, dtype=torch.long, device=dev))
        for _ in range(2):
            wl = forward_step(model, wc, wl[:, -1].argmax(-1)[:, None])
        del wc, wl
        _sync(dev)
    for C in contexts:
        rec = {"context": C, "batch": batch, "new_tokens": new}
        cache = None
        try:
            if dev.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            ids = torch.randint(1, cfg.vocab_size, (batch, C), generator=torch.Generator().manual_seed(C)).to(dev)
            cache = DSv4Cache(model, batch)
            with torch.no_grad():
                _sync(dev)
                t0 = time.perf_counter()
                for a in range(0, C, prefill_chunk):
                    lg = forward_step(model, cache, ids[:, a:a + prefill_chunk])
                nxt = lg[:, -1].argmax(-1)
                _sync(dev)
                t1 = time.perf_counter()
                for _ in range(2):                                  # decode warm-up at this context, untimed
                    nxt = forward_step(model, cache, nxt[:, None])[:, -1].argmax(-1)
                _sync(dev)
                t1b = time.perf_counter()
                for _ in range(new):
                    nxt = forward_step(model, cache, nxt[:, None])[:, -1].argmax(-1)
                _sync(dev)
                t2 = time.perf_counter()
            n = cache.nbytes()
            rec.update(prefill_s=t1 - t0, prefill_tokens_per_s=batch * C / (t1 - t0), decode_s=t2 - t1b,
                       decode_tokens_per_s=batch * new / (t2 - t1b), decode_ms_per_step=1e3 * (t2 - t1b) / max(new, 1),
                       cache_bytes=n, cache_bytes_per_token=n / (batch * (C + 2 + new)),
                       cache_formula_bytes_per_token=cache_elements_per_token(cfg) * elem)
            if dev.type == "cuda":
                rec["peak_mem_bytes"] = torch.cuda.max_memory_allocated()
            print(f"context {C}: decode {rec['decode_tokens_per_s']:.1f} tok/s, prefill "
                  f"{rec['prefill_tokens_per_s']:.0f} tok/s, cache {n / 2**20:.1f} MiB "
                  f"({rec['cache_bytes_per_token']:.0f} B/token)", file=sys.stderr, flush=True)
        except torch.OutOfMemoryError:
            rec["error"] = "oom"
            print(f"context {C}: OOM", file=sys.stderr, flush=True)
        del cache
        rows.append(rec)
    return {"bench": "generate", "config": config, "backend": backend, "device": device, "prefill_chunk": prefill_chunk,
            "warmup": "one untimed generation at the smallest context, then 2 untimed decode steps per context",
            "results": rows}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="proxy")
    ap.add_argument("--contexts", default="4096,65536")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--prefill-chunk", type=int, default=8192)
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="debug config, CPU, naive kernels, contexts 48,96")
    a = ap.parse_args(argv)
    if a.smoke:
        doc = bench("debug", [48, 96], a.batch, 4, 32, "cpu", "naive")
    else:
        from dsv4.harness.errors import need_cuda
        need_cuda("bench_generate")
        doc = bench(a.config, [int(c) for c in a.contexts.split(",")], a.batch, a.new, a.prefill_chunk, "cuda",
                    "triton")
    from dsv4.harness.goldens import atomic_write_json, platform_of, provenance
    doc["provenance"] = provenance(platform_of("cpu" if a.smoke else "cuda"), config=None)
    if torch.cuda.is_available() and not a.smoke:
        doc["provenance"]["gpu"] = torch.cuda.get_device_name()
    if a.out:
        atomic_write_json(a.out, doc)
    print(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
