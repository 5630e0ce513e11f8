"""Multi-process worker for the P3 pipeline tests: spawned with torch.multiprocessing over gloo.

It lives in the package (not in a test file) so that spawned children can import it. Each rank rebuilds the
model from the given config and state dict, keeps its chunks, runs the pipelined step through `P2PTransport`
and writes `<outdir>/rank<r>.pt`: metrics, the gradients of the parameters it owns (full-model names) and the
transport's log of the shapes it sent / received.
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
    """runs: [(stages (pattern or list of layer lists), vpp)]; pp = world size. One result per run."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ws)
    from dsv4.model import pipeline as P
    from dsv4.model.model import DSv4Model
    results = []
    for stages, vpp in runs:
        model = DSv4Model(cfg)
        model.load_state_dict(state_dict)
        chunks = P.chunks_of_rank(P.split_stages(model, stages), rank, ws)
        B, S = batches[0][0].shape
        transport = P.P2PTransport((B, S, cfg.hc_mult, cfg.hidden_size), torch.float32)
        group = P.embedding_group(ws, vpp, mtp=cfg.num_nextn_predict_layers > 0)
        metrics = P.run_rank(chunks, batches, ws, vpp, rank, transport)
        P.allreduce_embedding_grads(chunks, group)
        grads = {}
        for c in chunks.values():
            for n, p in c.named_parameters():
                grads[n] = None if p.grad is None else p.grad.clone()
        results.append({"metrics": metrics, "grads": grads, "log": transport.log,
                         "chunks": sorted(chunks)})
    torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
