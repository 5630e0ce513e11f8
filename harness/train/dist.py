"""`dsv4 train --dp/--pp/--vpp/--cp/--ep --schedule ...`: the training loop on `parallelize` (model/parallel).

    torchrun --nproc_per_node 2 $(which dsv4) train --recipe debug --dp 2
    torchrun --nproc_per_node 4 $(which dsv4) train --recipe tiny --dp 2 --pp 2 --schedule 1f1b --microbatches 2

The same step as the one-device loop (harness/train/loop.py) on the same global batch per step (recipe.batch_size
sequences of recipe.seq_len tokens: dp / ep ranks take their rows, cp ranks their part of the token stream,
pipeline stages split it into --microbatches), so a run on any mesh follows the one-rank loss curve within fp
reassociation (slices/X3 tests). World size 1 (e.g. `--dp 1` without torchrun) runs the same code without a
process group. Every collective has a timeout (--timeout, default 120 s): a dead rank is an error, not a hang.

Outputs as the one-device loop, written by rank 0: metrics.jsonl, golden_values.json, run.json (with the mesh);
checkpoints are DCP (harness/train/dcp_checkpoint.py) and reshardable: a run saved at dp=2 / pp=2 resumes on any
mesh, e.g. `--dp 1`. Not supported here: --packing (THD batches under dp / pp), CUDA beyond what torch's
engines do by themselves (NCCL and multi-GPU were not validated: gloo on CPU processes only).
"""
from __future__ import annotations

import json
import os
import platform
import sys
import time
from dataclasses import asdict

import torch
import torch.distributed as dist

from dsv4.harness.train import dcp_checkpoint as dcpk
from dsv4.harness.train.data import GPTSamples, IndexedTokens, build_text_dataset, text_documents
from dsv4.harness.train.flops import flops_per_token
from dsv4.harness.train.optim import build_optimizer, lr_at
from dsv4.harness.goldens import atomic_write_json
from dsv4.harness.train.loop import (RESUME_MAY_CHANGE, Recipe, TrainError, _git_sha, config_hash, golden_values,
                                     stored_recipe)
from dsv4.model.config import get_config
from dsv4.model.parallel import ParallelPlan, build_mesh, init_distributed, parallelize, single
from dsv4.model.parallel.parallelize import PlanError


class _Params(torch.nn.Module):
    def __init__(self, par):
        super().__init__()
        self._par = par

    def named_parameters(self, *a, **k):
        return self._par.named_parameters()


def validate(recipe: Recipe, plan: ParallelPlan, world: int) -> None:
    """Refusals before any process group exists (so every rank exits at once, exit 2)."""
    if recipe.packing:
        raise PlanError("parallel: --packing is not implemented with --dp/--pp/--cp/--ep")
    plan.validate(get_config(recipe.config), world, recipe.batch_size, recipe.seq_len)


def train_distributed(recipe: Recipe, out: str, plan: ParallelPlan, seed: int = 1234, resume: str | None = None,
                      timeout_s: float = 120.0, optimizer: str = "muon", fsdp_bf16: bool = False,
                      log=lambda s: print(s, file=sys.stderr)) -> dict:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    validate(recipe, plan, world)
    if fsdp_bf16 and (plan.dp < 2 or plan.pp > 1 or recipe.dtype != "fp32"):
        raise PlanError("parallel: --fsdp-bf16 needs --dp > 1, --pp 1 and --dtype fp32")
    if recipe.steps < 1:
        raise TrainError(f"train.steps: must be >= 1, got {recipe.steps}")
    device = torch.device(recipe.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise TrainError("train.device: cuda requested but no CUDA device is available")
    if world > 1:
        init_distributed("nccl" if device.type == "cuda" else "gloo", timeout_s)
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
    rank = dist.get_rank() if world > 1 else 0
    saved = (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled())
    try:
        if device.type == "cpu":
            torch.set_num_threads(recipe.threads)
            torch.use_deterministic_algorithms(True)
        res = _loop(recipe, out, plan, seed, resume, device, world, rank, log, optimizer, fsdp_bf16)
        if world > 1:
            dist.barrier()                                   # orderly shutdown: no rank leaves mid-collective
        return res
    finally:
        torch.set_num_threads(saved[0])
        torch.use_deterministic_algorithms(saved[1])
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()


def _loop(recipe, out, plan, seed, resume, device, world, rank, log, optimizer="muon", fsdp_bf16=False) -> dict:
    t_start = time.time()
    cfg = get_config(recipe.config)
    corpus_dir = os.path.join(out, "data", "corpus")
    if rank == 0:
        os.makedirs(out, exist_ok=True)
        docs = text_documents(list(recipe.text)) if recipe.text else None
        data_info = build_text_dataset(corpus_dir, docs)
    if world > 1:
        dist.barrier()
    if rank != 0:
        data_info = None
    samples = GPTSamples(IndexedTokens(corpus_dir), recipe.seq_len, seed)

    torch.manual_seed(seed)                                              # the same weights on every rank
    from dsv4.model.model import DSv4Model
    model = DSv4Model(cfg).to(device)
    if recipe.backend != "naive":
        model.set_kernel_backend(recipe.backend)
    model.train()
    if world > 1:
        mesh = build_mesh(plan, device.type)                          # groups get --timeout too
        par = parallelize(model, mesh, plan, batch_shape=(recipe.batch_size, recipe.seq_len), dtype=recipe.dtype,
                          fsdp_param_dtype=torch.bfloat16 if fsdp_bf16 else None)
    else:
        par = single(model, recipe.dtype)
    opt = build_optimizer(_Params(par), lr=recipe.lr, weight_decay=recipe.weight_decay,
                          ns_dtype=torch.bfloat16 if recipe.dtype == "bf16" else torch.float32,
                          muon=optimizer == "muon")
    fl = flops_per_token(cfg, recipe.seq_len)["total_training_flops_per_token"]
    mesh_info = {k: getattr(plan, k) for k in ("dp", "pp", "vpp", "cp", "ep", "schedule", "microbatches")}

    step0, history = 0, []
    if resume:
        meta = dcpk.load(resume, par.parts, opt)
        def core(r):
            return {k: v for k, v in r.items() if k not in ("steps", "save_interval") + RESUME_MAY_CHANGE}
        now = json.loads(json.dumps(asdict(recipe)))
        if meta["config_hash"] != config_hash(cfg) or core(stored_recipe(meta["recipe"])) != core(now):
            raise TrainError(f"resume: checkpoint {resume!r} was made with another recipe/config")
        if meta["seed"] != seed:
            raise TrainError(f"resume: checkpoint seed {meta['seed']} != --seed {seed}")
        if meta.get("optimizer", "muon") != optimizer:
            raise TrainError(f"resume: checkpoint optimizer {meta.get('optimizer', 'muon')} != --optimizer {optimizer}")
        step0, history = meta["step"], meta["history"]
        log(f"resumed from {resume} at step {step0} (saved on mesh {meta.get('mesh')}, now {mesh_info})")

    if rank == 0:
        atomic_write_json(os.path.join(out, "run.json"), {
            "recipe": asdict(recipe), "config": recipe.config, "config_hash": config_hash(cfg), "seed": seed,
            "git_sha": _git_sha(), "torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "machine": platform.machine(), "device": str(device),
            "world_size": world, "mesh": mesh_info, "optimizer": optimizer, "fsdp_bf16": fsdp_bf16, "backend": dist.get_backend() if world > 1 else None,
            "threads": torch.get_num_threads(), "deterministic": torch.are_deterministic_algorithms_enabled(),
            "data": data_info, "flops_per_token": fl, "resumed_from": resume, "start_step": step0 + 1,
            "command": " ".join(sys.argv)})
    metrics_f = open(os.path.join(out, "metrics.jsonl"), "a" if resume else "w") if rank == 0 else None
    ckpt_dir = os.path.join(out, "checkpoints")
    tokens = recipe.batch_size * recipe.seq_len

    def save(step):
        dcpk.save(ckpt_dir, step, par.parts, opt, {
            "history": history, "consumed_samples": step * recipe.batch_size, "seed": seed,
            "config_hash": config_hash(cfg), "recipe": asdict(recipe), "mesh": mesh_info, "optimizer": optimizer})

    for step in range(step0 + 1, recipe.steps + 1):
        t0 = time.perf_counter()
        lr = lr_at(step, recipe.lr, recipe.warmup, recipe.steps, recipe.min_lr)
        opt.set_lr(lr)
        x, y = samples.batch((step - 1) * recipe.batch_size, recipe.batch_size)   # the global batch
        x, y = torch.from_numpy(x).to(device), torch.from_numpy(y).to(device)
        opt.zero_grad(set_to_none=True)
        m = par.forward_backward(x, y)
        par.finish_backward()
        gnorm = par.clip_grad_norm_(recipe.clip_grad)
        opt.step()
        par.update_expert_bias()
        dt = time.perf_counter() - t0
        rec = {"step": step, "lr": lr, "total loss": m.pop("loss"), "grad-norm": gnorm, "iteration-time": dt,
               "tokens-per-sec": tokens / dt, "tflops": fl * tokens / dt / 1e12, "tokens": float(tokens)}
        rec.update(m)
        history.append(rec)
        if metrics_f is not None:
            metrics_f.write(json.dumps(rec) + "\n")
            metrics_f.flush()
            log(f"step {step}: lm loss {rec['lm loss']:.5f} grad-norm {gnorm:.4f} ({dt:.2f} s)")
        if recipe.save_interval and step % recipe.save_interval == 0 and step < recipe.steps:
            save(step)
    if recipe.save_interval:
        save(recipe.steps)
    lm = [h["lm loss"] for h in history]
    summary = {"out": os.path.abspath(out), "recipe": recipe.config, "steps": recipe.steps, "start_step": step0 + 1,
               "seed": seed, "device": str(device), "dtype": recipe.dtype, "world_size": world, "mesh": mesh_info,
               "lm_loss_first": lm[0] if lm else None, "lm_loss_last": lm[-1] if lm else None,
               "lm loss": [round(v, 5) for v in lm], "wall_s": round(time.time() - t_start, 3),
               "tokens_per_sec": tokens / sorted(h["iteration-time"] for h in history[step0 - len(history):] or
                                                 [float("nan")])[0] if history else 0.0,
               "golden_values": os.path.join(os.path.abspath(out), "golden_values.json"),
               "config_hash": config_hash(cfg)}
    if rank == 0:
        metrics_f.close()
        atomic_write_json(os.path.join(out, "golden_values.json"), golden_values(history))
    return summary
