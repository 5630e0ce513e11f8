"""Pipeline stages with mHC streams (slice P3; spec §3, §4, §10.1): a thin adapter over model/parallel/pipeline.py.

The pipelined step runs on `torch.distributed.pipelining` (PipelineStage + ScheduleGPipe / Schedule1F1B /
ScheduleInterleaved1F1B), installed by `dsv4.model.parallel.parallelize(model, mesh, plan)`; the home-made
executor (send / recv transports, schedule tables, run_rank) is gone. What stays here:

  * `split_stages(model, stages)`: the model cut into its chunks (virtual stages), from layer lists, a
    HybridModel pattern (`|` cuts) or a HybridLayout; rank r of a pp-rank pipeline owns chunks r, r + pp, ...
    (`chunks_of_rank`, Megatron's interleaved assignment, which torch's interleaved schedule also uses);
  * `run_local(chunks, batches)`: every chunk run in one process, in pipeline order, per micro-batch (the
    one-process reference of a pipelined step: same chunk modules, same streams crossing each boundary, each
    checked to be the static n_hc streams [B, S, n_hc, d]); gradients of sum_mb loss_mb, then divided by M
    (torch's scale_grads), so the auxiliary losses attached to earlier chunks' streams weigh as in one model.

With mHC the state crossing a boundary (forward) and its gradient (backward) are the n_hc streams
[B, S, n, d]; the HyperHead collapse and MTP sit on the last chunk (see model/parallel/pipeline.py).
"""
from __future__ import annotations

import torch

from dsv4.model.config import ConfigError
from dsv4.model.model import DSv4Model
from dsv4.model.parallel.pipeline import METRICS, PipelineChunk, check_stages, even_stages

__all__ = ["PipelineChunk", "split_stages", "even_stages", "chunk_owner", "chunks_of_rank", "run_local", "METRICS"]


def _stages_from(model: DSv4Model, stages) -> list[list[int]]:
    if isinstance(stages, str):
        from dsv4.model.hybrid import parse_pattern
        stages = parse_pattern(stages, base=model.cfg).stages
    elif hasattr(stages, "stages"):                                                # HybridLayout
        stages = stages.stages
    return [list(s) for s in stages]


def split_stages(model: DSv4Model, stages) -> list[PipelineChunk]:
    """Cut `model` into its chunks (virtual pipeline stages), in pipeline order. Hash-routed layers must be on
    chunk 0 (with the embedding), as Megatron requires for PP > 1."""
    stages = _stages_from(model, stages)
    check_stages(model, stages)
    return [PipelineChunk(model, s, k, len(stages)) for k, s in enumerate(stages)]


def chunk_owner(chunk: int, pp: int) -> int:
    """Rank holding global chunk `chunk` (interleaved: rank r owns r, r + pp, ...)."""
    return chunk % pp


def chunks_of_rank(chunks: list, rank: int, pp: int) -> dict[int, PipelineChunk]:
    """{global chunk id: chunk} owned by `rank`, in local (virtual-stage) order."""
    if len(chunks) % pp:
        raise ConfigError(f"pipeline: {len(chunks)} chunks is not a multiple of pipeline size pp={pp}")
    return {k: chunks[k] for k in range(rank, len(chunks), pp)}


def run_local(chunks: list[PipelineChunk], batches: list, pp: int | None = None, vpp: int | None = None
              ) -> dict[str, float]:
    """One pipelined step in one process: per micro-batch (input_ids [B, S], labels [B, S][, layout]) the chunks in order,
    backward of loss / M. `pp` / `vpp` (optional) only check the chunk count. Returns the metrics averaged over
    micro-batches, plus "loss"."""
    if pp is not None and len(chunks) != pp * (vpp or 1):
        raise ConfigError(f"pipeline: {len(chunks)} chunks, expected pp * vpp = {pp} * {vpp or 1}")
    cfg = chunks[0].cfg
    M = len(batches)
    params = list({id(p): p for c in chunks for p in c.parameters()}.values())
    before = [p.grad for p in params]                     # gradients accumulate into .grad, as documented
    for p in params:
        p.grad = None
    for c in chunks:
        c.metrics = []
    for ids, labels, *lay in batches:                     # (ids, labels[, layout]): a packed micro-batch
        B, S = ids.shape
        shape = (B, S, cfg.hc_mult, cfg.hidden_size)
        x = ids
        for c in chunks:
            if not c.is_first and (tuple(x.shape) != shape or x.dtype != chunks[0].embed.weight.dtype):
                raise ValueError(f"pipeline boundary into chunk {c.chunk_id}: tensor {tuple(x.shape)} {x.dtype} "
                                 f"is not the streams shape [B, S, n_hc, d] = {shape} "
                                 f"{chunks[0].embed.weight.dtype}")
            x = c(x, input_ids=ids, labels=labels, layout=lay[0] if lay else None)
        x.backward()                                      # earlier chunks' aux losses join with gradient 1
    with torch.no_grad():                                 # then / M, as pipelining's scale_grads does
        for p, g in zip(params, before):
            if p.grad is not None:
                p.grad.div_(M)
                if g is not None:
                    p.grad.add_(g)
            elif g is not None:
                p.grad = g
    sums = {}
    for c in chunks:
        for m in c.metrics:
            for k, v in m.items():
                sums[k] = sums.get(k, 0.0) + float(v)
    out = {k: v / M for k, v in sums.items()}
    loss = out["lm loss"] + cfg.mtp_loss_scaling_factor * out.get("mtp_1 loss", 0.0)
    out["loss"] = loss + out.get("indexer loss", 0.0) + out.get("moe aux loss", 0.0)
    return out
