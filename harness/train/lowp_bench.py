"""Slice X1 on one GPU: training tokens/s and a loss comparison of the precision recipes on `proxy`, and the
fused FP8 quantiser's speed.

    python -m dsv4.harness.train.lowp_bench --tokens 4096 --loss-steps 50 --out x1_bench.json
    python -m dsv4.harness.train.lowp_bench --smoke --out /tmp/x1_smoke.json        # CPU: the same code, debug sizes

Per recipe (model/lowp/recipe.py: bf16, fp8_tensor, fp8_block, fp4_qat): the model of `dsv4 bench train`
(`build_ours`: bf16 with P1's FP32-kept tensors, Triton kernels), the recipe applied from outside (expert QAT
reading bf16; the FP8 linears quantise with the kernel backend's quantiser: the fused Triton one under
--backend triton), fwd+bwd tokens/s by `bench_train.time_steps` and the ratio to bf16; then `--loss-steps` AdamW
steps from the same initialisation on the same random batch stream, lm loss per step, the largest per-step
|loss - loss(bf16)| and the windowed gap of slices/X1/curves.py (`curve_gap`, windows of 10 steps).
Quantiser: kernels/quant `fp8_quantize` exact vs fused on a [tokens, hidden] activation (1x128 + transposed
copy) and a [hidden, hidden] weight (128x128 + transposed copy), ms and GB/s (bytes read + written).
Not a golden: a measurement to read (and to store through `dsv4 goldens` import once its shape is agreed).
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time

import torch


def _build(cfg, recipe: str, backend: str, device):
    from dsv4.harness.train.bench import build_ours
    from dsv4.model.lowp.recipe import apply_precision_recipe, get_recipe
    torch.manual_seed(0)
    model = build_ours(cfg, backend, device)
    rep = apply_precision_recipe(model, get_recipe(recipe, expert_compute_dtype=torch.bfloat16), backend)
    return model, rep


def _losses(model, V, B, S, steps, device, lr=1e-3):
    g = torch.Generator(device="cpu").manual_seed(1)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, V, (B, S), generator=g).to(device)
        o = model(input_ids=ids, labels=ids, return_logits=False)
        opt.zero_grad(set_to_none=True)
        o.loss.backward()
        opt.step()
        model.update_expert_bias()
        out.append(float(o.losses["lm loss"]))
    return out


def _provenance(a) -> dict:
    import triton
    from dsv4.harness.goldens import git_sha
    sha, dirty = git_sha()
    return {"git_sha": sha, "git_dirty": dirty, "triton": triton.__version__, "cuda": torch.version.cuda,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "command": "python -m dsv4.harness.train.lowp_bench " + " ".join(sys.argv[1:])}


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def bench_quantizer(R: int, C: int, device, backends, reps: int = 20) -> list[dict]:
    """ms and GB/s of kernels/quant `fp8_quantize` (bf16 input, e4m3, ue8m0, with the transposed copy)."""
    from dsv4.kernels.quant import fp8_quantize
    x = torch.randn(R, C, device=device).to(torch.bfloat16)
    rows = []
    for block in ((1, 128), (128, 128)):
        for be in backends:
            rec = {"shape": [R, C], "block": list(block), "backend": be}
            try:
                f = lambda: fp8_quantize(x, "e4m3", block, "ue8m0", True, backend=be)  # noqa: E731
                out = f()
                _sync(device)
                t0 = time.perf_counter()
                for _ in range(reps):
                    out = f()
                _sync(device)
                dt = (time.perf_counter() - t0) / reps
                nbytes = x.numel() * x.element_size() + sum(t.numel() * t.element_size() for t in out)
                rec.update(ms=dt * 1e3, gb_per_s=nbytes / dt / 1e9)
            except Exception as e:  # noqa: BLE001 - recorded
                rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            rows.append(rec)
    ref = {tuple(r["block"]): r.get("ms") for r in rows if r["backend"] == "naive"}
    for r in rows:
        if r.get("ms") and ref.get(tuple(r["block"])):
            r["speedup_vs_exact"] = ref[tuple(r["block"])] / r["ms"]
    return rows


def main(argv=None) -> int:
    from dsv4.harness.train.bench import time_steps
    from dsv4.harness.goldens import atomic_write_json
    from dsv4.model.config import get_config
    from dsv4.model.lowp import fp8_linear as L
    from dsv4.slices.X1.curves import curve_gap
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="proxy")
    ap.add_argument("--recipes", default="bf16,fp8_tensor,fp8_block,fp4_qat")
    ap.add_argument("--tokens", default="4096")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--loss-steps", type=int, default=50)
    ap.add_argument("--loss-tokens", type=int, default=4096)
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--smoke", action="store_true", help="CPU, debug config, a few steps: checks the code path")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.smoke:
        a.config, a.tokens, a.batch, a.steps, a.warmup = "debug", "64", 2, 1, 1
        a.loss_steps, a.loss_tokens, a.backend = 10, 64, "naive"
        dev = torch.device("cpu")
    elif not torch.cuda.is_available():
        print(json.dumps({"status": "cannot judge: no CUDA device (use --smoke on a CPU)"}))
        return 2
    else:
        dev = torch.device("cuda")
    cfg = get_config(a.config)
    doc = {"bench": "x1 lowp", "config": a.config, "smoke": a.smoke, "backend": a.backend,
           "torch": torch.__version__,
           "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "speed": [], "loss": {},
           "provenance": _provenance(a)}
    qR = 64 if a.smoke else max(int(t) for t in a.tokens.split(","))
    qbe = ["naive"] + (["triton"] if a.backend == "triton" else [])
    doc["quantizer"] = bench_quantizer(qR, cfg.hidden_size, dev, qbe, reps=2 if a.smoke else 20) + \
        bench_quantizer(cfg.hidden_size, cfg.hidden_size, dev, qbe, reps=2 if a.smoke else 20)
    for q in doc["quantizer"]:
        print(json.dumps(q), file=sys.stderr, flush=True)
    for r in a.recipes.split(","):
        model, rep = _build(cfg, r, a.backend, dev)
        for T in (int(t) for t in a.tokens.split(",")):
            rec = {"recipe": r, "tokens": T, "n_fp8_linears": len(rep.fp8), "n_qat_experts": len(rep.experts),
                   "indexer_qk_precision": sorted({getattr(model.get_submodule(p), "qk_precision", "?")
                                                   for p in rep.indexers})}
            try:
                L.LAST_PATH.clear()
                rec.update(time_steps(model, a.batch, T // a.batch, cfg.vocab_size, a.steps, a.warmup, dev, False))
                rec["paths"] = dict(L.LAST_PATH)
            except Exception as e:  # noqa: BLE001 - recorded
                rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            print(json.dumps(rec), file=sys.stderr, flush=True)
            doc["speed"].append(rec)
        if a.loss_steps:
            del model
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            model, _ = _build(cfg, r, a.backend, dev)
            t0 = time.perf_counter()
            try:
                doc["loss"][r] = _losses(model, cfg.vocab_size, a.batch, a.loss_tokens // a.batch, a.loss_steps, dev)
            except Exception as e:  # noqa: BLE001
                doc["loss"][r] = f"{type(e).__name__}: {str(e)[:300]}"
            print(r, "loss", doc["loss"][r] if isinstance(doc["loss"][r], str) else doc["loss"][r][-1],
                  f"{time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
        del model
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    base = doc["speed"]
    ref = {x["tokens"]: x.get("tokens_per_s") for x in base if x["recipe"] == "bf16"}
    doc["speed_ratio_vs_bf16"] = {f'{x["recipe"]}@{x["tokens"]}': x["tokens_per_s"] / ref[x["tokens"]]
                                  for x in base if x.get("tokens_per_s") and ref.get(x["tokens"])}
    doc["step_time_ratio_vs_bf16"] = {k: 1 / v for k, v in doc["speed_ratio_vs_bf16"].items()}
    lb = doc["loss"].get("bf16")
    if isinstance(lb, list):
        curves = {r: l for r, l in doc["loss"].items() if isinstance(l, list) and r != "bf16"}
        doc["max_abs_loss_delta_vs_bf16"] = {r: max(abs(p - q) for p, q in zip(l, lb)) for r, l in curves.items()}
        win = min(10, len(lb))
        doc["windowed_loss_gap_vs_bf16"] = {"window": win, **{r: curve_gap(lb, l, win) for r, l in curves.items()}}
        doc["final_loss"] = {r: l[-1] for r, l in doc["loss"].items() if isinstance(l, list)}
    txt = json.dumps(doc, indent=1)
    print(txt)
    if a.out:
        atomic_write_json(a.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
