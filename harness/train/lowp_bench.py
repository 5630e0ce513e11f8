"""Slice X1 on one GPU: training tokens/s and a short loss comparison of the precision recipes on `proxy`.

    python -m dsv4.harness.train.lowp_bench --tokens 4096,16384 --loss-steps 30 --out x1_bench.json

Per recipe (model/lowp/recipe.py: bf16, fp8_tensor, fp8_block, fp4_qat): the model of `dsv4 bench train`
(`build_ours`: bf16 with P1's FP32-kept tensors, Triton kernels), the recipe applied from outside (expert QAT
reading bf16), fwd+bwd tokens/s by `bench_train.time_steps`; then `--loss-steps` AdamW steps from the same
initialisation on the same random batch stream, lm loss per step, and the largest |loss - loss(bf16)|.
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
    rep = apply_precision_recipe(model, get_recipe(recipe, expert_compute_dtype=torch.bfloat16))
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


def main(argv=None) -> int:
    from dsv4.harness.train.bench import time_steps
    from dsv4.model.config import get_config
    from dsv4.model.lowp import fp8_linear as L
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="proxy")
    ap.add_argument("--recipes", default="bf16,fp8_tensor,fp8_block,fp4_qat")
    ap.add_argument("--tokens", default="4096")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--loss-steps", type=int, default=30)
    ap.add_argument("--loss-tokens", type=int, default=4096)
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print(json.dumps({"status": "cannot judge: no CUDA device"}))
        return 2
    dev = torch.device("cuda")
    cfg = get_config(a.config)
    doc = {"bench": "x1 lowp", "config": a.config, "torch": torch.__version__, "device": torch.cuda.get_device_name(),
           "speed": [], "loss": {}}
    for r in a.recipes.split(","):
        model, rep = _build(cfg, r, a.backend, dev)
        for T in (int(t) for t in a.tokens.split(",")):
            rec = {"recipe": r, "tokens": T, "n_fp8_linears": len(rep.fp8), "n_qat_experts": len(rep.experts)}
            try:
                rec.update(time_steps(model, a.batch, T // a.batch, cfg.vocab_size, a.steps, a.warmup, dev, False))
                rec["paths"] = dict(L.LAST_PATH)
            except Exception as e:  # noqa: BLE001 - recorded
                rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            print(json.dumps(rec), file=sys.stderr, flush=True)
            doc["speed"].append(rec)
        if a.loss_steps:
            del model
            gc.collect()
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
        torch.cuda.empty_cache()
    base = doc["speed"]
    ref = {x["tokens"]: x.get("tokens_per_s") for x in base if x["recipe"] == "bf16"}
    doc["speed_ratio_vs_bf16"] = {f'{x["recipe"]}@{x["tokens"]}': x["tokens_per_s"] / ref[x["tokens"]]
                                  for x in base if x.get("tokens_per_s") and ref.get(x["tokens"])}
    lb = doc["loss"].get("bf16")
    if isinstance(lb, list):
        doc["max_abs_loss_delta_vs_bf16"] = {r: max(abs(p - q) for p, q in zip(l, lb))
                                             for r, l in doc["loss"].items() if isinstance(l, list) and r != "bf16"}
        doc["final_loss"] = {r: l[-1] for r, l in doc["loss"].items() if isinstance(l, list)}
    txt = json.dumps(doc, indent=1)
    print(txt)
    if a.out:
        with open(a.out, "w") as f:
            f.write(txt + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
