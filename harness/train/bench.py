"""`dsv4 bench train`: end-to-end training throughput of our DSv4 model against Hugging Face's DeepseekV4 on
the same config, in the same process and run (the peer measured in the same conditions).

Per (implementation, tokens): fwd+bwd steps of a random-token LM batch in bf16 on one GPU, after warm-up;
tokens/s, peak memory, and model FLOPs utilisation by our FLOP accounting (`harness/train/flops.py`) against the
H200's dense bf16 peak (989 TFLOP/s spec; 797 measured for a large matmul — both are reported).
Implementations: `ours` (FP32-kept tensors of P1, kernels by `--backend`), `hf_eager`, `hf_compile`
(torch.compile default mode). OOM is recorded as such, not as a crash.
"""
from __future__ import annotations

import gc
import json
import sys
import time

import click
import torch

H200_PEAK_BF16 = 989e12
H200_MEASURED_MATMUL = 797e12


def _log(msg):
    print(msg, file=sys.stderr, flush=True)


def build_ours(cfg, backend: str, device, compile_: bool = False):
    from dsv4.model import DSv4Model
    from dsv4.model.precision import cast_model
    model = DSv4Model(cfg).to(device)
    cast_model(model, torch.bfloat16)
    model.set_kernel_backend(backend)
    if compile_:
        model.compile_blocks()                     # torch.compile of every block (Triton ops: custom ops)
    return model.train()


def build_hf(cfg, device, compile_: bool):
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
    from dsv4.model.interop.hf_config import config_to_hf
    d = config_to_hf(cfg)
    d.pop("dsv4_config", None)
    d.pop("architectures", None)
    d.pop("model_type", None)
    hcfg = DeepseekV4Config(**d)
    hcfg._attn_implementation = "eager"
    model = DeepseekV4ForCausalLM(hcfg).to(device=device, dtype=torch.bfloat16).train()
    with torch.no_grad():   # HF initialises the hash table to zeros: give it distinct experts per token
        g = torch.Generator().manual_seed(0)
        for mod in model.modules():
            if hasattr(mod, "tid2eid"):
                t = torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)[:cfg.num_experts_per_tok]
                                 for _ in range(cfg.vocab_size)])
                mod.tid2eid.copy_(t.to(mod.tid2eid.device))
    return torch.compile(model) if compile_ else model


def time_steps(model, B, S, V, steps, warmup, device, is_hf: bool):
    g = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, V, (B, S), generator=g).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    # ours: the loss from row blocks of the head (no [B, S, V] logits kept; same loss), see DSv4Model.forward
    kw = {"use_cache": False} if is_hf else {"return_logits": False}

    def step():
        out = model(input_ids=ids, labels=ids, **kw)
        out.loss.backward()
        for p in params:
            p.grad = None

    cuda = torch.device(device).type == "cuda"          # CPU: smoke runs of the same loop (no memory counters)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for _ in range(warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    if cuda:
        torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / steps
    return {"step_s": dt, "tokens_per_s": B * S / dt,
            "peak_mem_bytes": torch.cuda.max_memory_allocated() if cuda else None}


def run(config: str, tokens: list[int], batch: int, steps: int, warmup: int, impls: list[str], backend: str,
        recompute_from: int = 32768, compile_: bool = False) -> dict:
    from dsv4.harness.train.flops import flops_per_token
    from dsv4.harness.goldens import provenance
    from dsv4.model.config import get_config
    from dsv4.harness.errors import need_cuda
    need_cuda("dsv4 bench train")
    device = torch.device("cuda")
    cfg = get_config(config)
    results = []
    for impl in impls:
        for T in tokens:
            S = T // batch
            rec = {"impl": impl, "tokens": T, "batch": batch, "seq": S}
            model = None
            try:
                model = build_ours(cfg, backend, device, compile_) if impl == "ours" else \
                    build_hf(cfg, device, impl == "hf_compile")
                if impl == "ours":
                    rec["recompute"] = T >= recompute_from       # whole-block activation recompute
                    model.set_recompute(rec["recompute"])
                rec.update(time_steps(model, batch, S, cfg.vocab_size, steps, warmup, device, impl != "ours"))
                f = flops_per_token(cfg, S)["total_training_flops_per_token"]
                rec["model_tflops"] = f * rec["tokens_per_s"] / 1e12
                rec["mfu_vs_989"] = f * rec["tokens_per_s"] / H200_PEAK_BF16
                rec["mfu_vs_797_measured"] = f * rec["tokens_per_s"] / H200_MEASURED_MATMUL
                _log(f"{impl:10} {T:>6} tokens: {rec['tokens_per_s']:,.0f} tok/s, "
                     f"{rec['peak_mem_bytes'] / 2**30:.1f} GiB, MFU {100 * rec['mfu_vs_989']:.1f}%")
            except torch.OutOfMemoryError:
                rec["error"] = "oom"
                _log(f"{impl:10} {T:>6} tokens: OOM")
            except Exception as e:  # noqa: BLE001 - a peer failing is a result, recorded with its reason
                rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                _log(f"{impl:10} {T:>6} tokens: {rec['error']}")
            results.append(rec)
            del model
            gc.collect()
            torch.cuda.empty_cache()
    by = {(r["impl"], r["tokens"]): r for r in results}
    ratios = {}
    for T in tokens:
        o = by.get(("ours", T), {}).get("tokens_per_s")
        for peer in ("hf_eager", "hf_compile"):
            p = by.get((peer, T), {}).get("tokens_per_s")
            if o and p:
                ratios[f"ours_over_{peer}@{T}"] = o / p
    return {"bench": "train", "config": config, "backend": backend, "compile": compile_, "steps": steps,
            "warmup": warmup,
            "recompute_from_tokens": recompute_from,
            "results": results, "ratios": ratios, "provenance": provenance("h200", config=cfg.to_dict())}


@click.command("train")
@click.option("--config", default="proxy")
@click.option("--tokens", default="4096,8192", help="Comma list of tokens per step (B * S).")
@click.option("--batch", default=2, type=int)
@click.option("--steps", default=5, type=int)
@click.option("--warmup", default=2, type=int)
@click.option("--impls", default="ours,hf_eager,hf_compile")
@click.option("--backend", default="triton", type=click.Choice(["naive", "triton"]))
@click.option("--recompute-from", default=32768, type=int,
              help="Ours: recompute block activations in backward from this many tokens per step on.")
@click.option("--compile", "compile_", is_flag=True, help="Ours: torch.compile every block.")
@click.option("--out", "out", default=None, type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True)
def bench_train_cmd(config, tokens, batch, steps, warmup, impls, backend, recompute_from, compile_, out, as_json):
    """Training tokens/s, peak memory and MFU of ours vs Hugging Face DeepseekV4 (eager, compiled)."""
    doc = run(config, [int(t) for t in tokens.split(",")], batch, steps, warmup, impls.split(","), backend,
              recompute_from, compile_)
    if out:
        from dsv4.harness.goldens import atomic_write_json
        atomic_write_json(out, doc)
    click.echo(json.dumps(doc, indent=1))    # the result, with or without --json (progress went to stderr)
