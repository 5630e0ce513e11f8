"""Multi-process workers for the X3 tests (FSDP2 / pipelining / CP / EP through `parallelize`, DCP checkpoints).

Each worker is forked by torch.multiprocessing (children inherit the imports; one intra-op thread each) and
initialises gloo with a timeout on every collective. The shared training step `train_steps` is the one the
one-rank oracle also runs (plain model), so a test compares like with like: per-step metrics, the first step's
gradient of every parameter (full tensors, model names) and the parameters after the last step.
"""
from __future__ import annotations

import datetime
import os
import socket
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn, world_size: int, *args) -> list:
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    with tempfile.TemporaryDirectory() as outdir:
        mp.start_processes(fn, args=(world_size, free_port(), outdir, *args), nprocs=world_size, join=True,
                           start_method=method)
        return [torch.load(os.path.join(outdir, f"rank{r}.pt")) for r in range(world_size)]


def init(rank, ws, port):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ws,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))


def build(cfg_name="debug", seed=0, **overrides):
    from dsv4.model.config import get_config
    from dsv4.model.model import DSv4Model
    torch.manual_seed(seed)
    model = DSv4Model(get_config(cfg_name, **overrides)).train()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():                                   # non-trivial mHC biases / sinks / norms
        for n, p in model.named_parameters():
            if ("hc_" in n and "base" in n) or n.endswith("attn_sink") or n.endswith(".ape"):
                p.add_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def batches(cfg, B, S, steps, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, cfg.vocab_size, (B, S), generator=g),
             torch.randint(0, cfg.vocab_size, (B, S), generator=g)) for _ in range(steps)]


def _full(t):
    from torch.distributed.tensor import DTensor
    return t.full_tensor() if isinstance(t, DTensor) else t


def train_steps(par, opt, data, clip=1.0, lr=1e-2):
    """The training step of harness/train/dist.py on `par` (a Parallelized, or None: the plain one-rank model
    given as `opt.model_`); returns (metrics per step, grads of step 1 {name: full tensor}, parameters after
    step 1)."""
    hist, grads, params = [], None, None
    for ids, labels in data:
        opt.set_lr(lr)
        opt.zero_grad(set_to_none=True)
        m = par.forward_backward(ids, labels)
        par.finish_backward()
        if grads is None:
            grads = {n: (None if p.grad is None else _full(p.grad).detach().clone())
                     for n, p in par.named_parameters()}
        m["grad-norm"] = par.clip_grad_norm_(clip)
        opt.step()
        if params is None:
            params = params_of(par)
        par.update_expert_bias()
        hist.append(m)
    return hist, grads, params


def params_of(par) -> dict:
    return {n: _full(p.detach()).clone() for n, p in par.named_parameters()}


def plan_worker(rank, ws, port, outdir, plan_kw, cfg_kw, B, S, steps, optimizer="muon"):
    """Train `steps` steps under ParallelPlan(**plan_kw); write metrics, step-1 grads and final params."""
    init(rank, ws, port)
    from dsv4.harness.train.optim import build_optimizer
    from dsv4.model.parallel import ParallelPlan, build_mesh, parallelize
    model = build(**cfg_kw)
    data = batches(model.cfg, B, S, steps)
    plan = ParallelPlan(**plan_kw)
    mesh = build_mesh(plan, timeout_s=TIMEOUT_S)
    par = parallelize(model, mesh, plan, batch_shape=(B, S))
    opt = build_optimizer(_ParamsView(par), lr=1e-2, muon=optimizer == "muon")
    hist, grads, params = train_steps(par, opt, data)
    from dsv4.model.parallel.parallelize import _local, _mesh_dims
    local_rows = {n: _local(p).shape[0] for n, p in par.named_parameters() if _mesh_dims(p) == ("ep",)}
    res = {"hist": hist, "grads": grads, "params": params, "ep_local_rows": local_rows, "coords": dict(
        (d, mesh.get_local_rank(d)) for d in ("pp", "dp", "cp", "ep"))}
    torch.save(res, os.path.join(outdir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


class _ParamsView(torch.nn.Module):
    """named_parameters() of the modules a rank trains (for build_optimizer)."""

    def __init__(self, par):
        super().__init__()
        self._par = par

    def named_parameters(self, *a, **k):
        return self._par.named_parameters()


def dead_peer_worker(rank, ws, port, outdir):
    """Rank 1 writes its result and dies (os._exit) before the collective rank 0 then runs."""
    import time
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ws,
                            timeout=datetime.timedelta(seconds=10))
    dist.barrier()
    if rank == 1:
        torch.save({}, os.path.join(outdir, f"rank{rank}.pt"))
        os._exit(0)
    time.sleep(0.5)
    t0 = time.time()
    err = None
    try:
        dist.all_reduce(torch.ones(4))
    except Exception as e:  # noqa: BLE001 - the point is which error surfaces
        err = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    torch.save({"error": err, "seconds": time.time() - t0}, os.path.join(outdir, f"rank{rank}.pt"))
    os._exit(0)


def seeded_grads(named, seed=7):
    """The same full gradient for every parameter name on every rank (a sharded parameter gets its shard)."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    g = torch.Generator().manual_seed(seed)
    for n, p in sorted(named, key=lambda x: x[0]):
        full = torch.randn(p.shape, generator=g) * 1e-2
        if isinstance(p, DTensor):
            p.grad = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
        else:
            p.grad = full


def muon_step_worker(rank, ws, port, outdir, steps=2):
    """Optimizer steps of the FSDP2-sharded model on given (seeded) gradients: the update alone."""
    init(rank, ws, port)
    from dsv4.harness.train.optim import build_optimizer
    from dsv4.model.parallel import ParallelPlan, build_mesh, parallelize
    plan = ParallelPlan(dp=ws)
    par = parallelize(build(), build_mesh(plan, timeout_s=TIMEOUT_S), plan, batch_shape=(ws, 8))
    opt = build_optimizer(_ParamsView(par), lr=1e-2)
    for k in range(steps):
        seeded_grads(list(par.named_parameters()), seed=7 + k)
        opt.step()
    torch.save({"params": params_of(par)}, os.path.join(outdir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def dcp_save_worker(rank, ws, port, outdir, plan_kw, ckpt_dir, steps=1):
    """Train `steps` steps on a mesh, save a DCP checkpoint, return the gathered state of this rank."""
    init(rank, ws, port)
    from dsv4.harness.train import dcp_checkpoint as dcpk
    from dsv4.harness.train.optim import build_optimizer
    from dsv4.model.parallel import ParallelPlan, build_mesh, parallelize
    model = build()
    plan = ParallelPlan(**plan_kw)
    par = parallelize(model, build_mesh(plan, timeout_s=TIMEOUT_S), plan, batch_shape=(4, 16))
    opt = build_optimizer(_ParamsView(par), lr=1e-2)
    train_steps(par, opt, batches(model.cfg, 4, 16, steps))
    dcpk.save(ckpt_dir, steps, par.parts, opt, {"note": "test"})
    torch.save({"state": dcpk.full_state(par.parts, opt)}, os.path.join(outdir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def dcp_load_worker(rank, ws, port, outdir, plan_kw, ckpt_dir):
    """Load a DCP checkpoint (saved on any mesh) into other weights on this mesh; the gathered state."""
    init(rank, ws, port)
    from dsv4.harness.train import dcp_checkpoint as dcpk
    from dsv4.harness.train.optim import build_optimizer
    from dsv4.model.parallel import ParallelPlan, build_mesh, parallelize
    plan = ParallelPlan(**plan_kw)
    par = parallelize(build(seed=3), build_mesh(plan, timeout_s=TIMEOUT_S), plan, batch_shape=(4, 16))
    opt = build_optimizer(_ParamsView(par), lr=1e-2)
    dcpk.load(ckpt_dir, par.parts, opt)
    torch.save({"state": dcpk.full_state(par.parts, opt)}, os.path.join(outdir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def stuck_peer_worker(rank, ws, port, outdir, timeout_s=3.0):
    """Rank 1 stays alive but never joins; rank 0's collective on a mesh group must fail after the mesh's
    timeout (not torch's 30-minute default for new groups)."""
    import time
    init(rank, ws, port)
    from dsv4.model.parallel import ParallelPlan, build_mesh
    mesh = build_mesh(ParallelPlan(dp=ws), timeout_s=timeout_s)
    if rank == 1:
        time.sleep(3 * timeout_s)
        torch.save({}, os.path.join(outdir, f"rank{rank}.pt"))
        os._exit(0)
    t0 = time.time()
    err = None
    try:
        dist.all_reduce(torch.ones(4), group=mesh.get_group("dp"))
    except Exception as e:  # noqa: BLE001
        err = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    torch.save({"error": err, "seconds": time.time() - t0}, os.path.join(outdir, f"rank{rank}.pt"))
    os._exit(0)


def fsdp_bf16_worker(rank, ws, port, outdir, B=4, S=16):
    """One forward + backward under FSDP2's bf16 mixed precision (P1's FP32-kept parameters left out)."""
    init(rank, ws, port)
    from dsv4.model.parallel import ParallelPlan, build_mesh, parallelize
    model = build()
    plan = ParallelPlan(dp=ws)
    par = parallelize(model, build_mesh(plan, timeout_s=TIMEOUT_S), plan, batch_shape=(B, S),
                      fsdp_param_dtype=torch.bfloat16)
    ids, labels = batches(model.cfg, B, S, 1)[0]
    m = par.forward_backward(ids, labels)
    par.finish_backward()
    grads = {n: _full(p.grad).detach().clone() for n, p in par.named_parameters() if p.grad is not None}
    kept = sorted(n for n, p in par.named_parameters() if any(p is q for q in par.replicated))
    torch.save({"metrics": m, "grads": grads, "kept": kept,
                "dtypes": {n: str(_full(p).dtype) for n, p in par.named_parameters()}},
               os.path.join(outdir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
