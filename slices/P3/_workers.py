"""Multi-process worker for the P3 pipeline tests: spawned with torch.multiprocessing over gloo.

It lives in the package (not in a test file) so that spawned children can import it. Each rank rebuilds the
model from the given config and state dict, applies `parallelize` (torch.distributed.pipelining stages and
schedule), runs the pipelined step and writes `<outdir>/rank<r>.pt`: metrics, the gradients of the parameters
it owns (full-model names) and the shapes that crossed its chunks' boundaries.
"""
from __future__ import annotations

import os
import socket
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn, world_size: int, *args) -> list[dict]:
    """Run fn(rank, world_size, port, outdir, *args) on world_size gloo processes; per-rank result dicts.

    Forked where the platform allows (children start in ~0.3 s instead of ~10 s re-importing torch on busy
    cores); the children set one intra-op thread before any tensor work.
    """
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    with tempfile.TemporaryDirectory() as outdir:
        mp.start_processes(fn, args=(world_size, free_port(), outdir, *args), nprocs=world_size, join=True,
                           start_method=method)
        return [torch.load(os.path.join(outdir, f"rank{r}.pt")) for r in range(world_size)]


def pipeline_worker(rank, ws, port, outdir, cfg, state_dict, batches, runs):
    """runs: [(stages (pattern or list of layer lists), vpp, schedule)]; pp = world size. One result per run:
    the step through `parallelize` (torch.distributed.pipelining), this rank's gradients (full-model names),
    the global chunk ids it holds and the shapes that entered / left its chunks at stage boundaries."""
    import datetime
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ws,
                            timeout=datetime.timedelta(seconds=60))
    from dsv4.model import pipeline as P
    from dsv4.model.model import DSv4Model
    from dsv4.model.parallel import ParallelPlan, build_mesh, parallelize
    ids = torch.cat([b[0] for b in batches])                     # the M micro-batches as one global batch
    labels = torch.cat([b[1] for b in batches])
    results = []
    for stages, vpp, schedule in runs:
        model = DSv4Model(cfg)
        model.load_state_dict(state_dict)
        stage_lists = [c.layer_ids for c in P.split_stages(model, stages)]
        plan = ParallelPlan(pp=ws, vpp=vpp, schedule=schedule, microbatches=len(batches), stages=stage_lists)
        par = parallelize(model, build_mesh(plan, timeout_s=60), plan, batch_shape=tuple(ids.shape))
        log = []
        for c in par.parts:
            if not c.is_first:
                c.register_forward_pre_hook(lambda m, a: log.append(("recv", tuple(a[0].shape))))
            if not c.is_last:
                c.register_forward_hook(lambda m, a, o: log.append(("send", tuple(o.shape))))
        metrics = par.forward_backward(ids, labels)
        par.finish_backward()
        grads = {n: None if p.grad is None else p.grad.clone() for n, p in par.named_parameters()}
        results.append({"metrics": metrics, "grads": grads, "log": log, "chunks": [c.chunk_id for c in par.parts]})
        dist.barrier()
    torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
