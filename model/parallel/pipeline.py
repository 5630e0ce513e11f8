"""Pipeline stages of DSv4Model on `torch.distributed.pipelining` (P3 on an existing engine).

With mHC the state between two layers is the n_hc residual streams X [B, S, n, d], so a stage boundary sends
X forward and its gradient backward (the static shape of every `PipelineStage` input / output):

    chunk 0          : ids -> Embed -> expand_streams -> layers                    -> X [b, S, n, d]
    chunk k (middle) : X                              -> layers                    -> X [b, S, n, d]
    chunk last       : X                              -> layers -> HyperHead -> norm -> head -> lm loss
                                                                -> MTP(X_L, Embed(ids_next)) -> mtp loss

b = the micro-batch rows. `input_ids` and `labels` reach EVERY stage as keyword arguments of `schedule.step`
(pipelining splits them into micro-batches with the positional input): hash routing and MTP read the token ids,
the last stage forms the loss. The last stage returns its scalar objective lm + w * mtp + its own auxiliary
losses; the schedule's loss_fn is the identity.

Auxiliary losses of earlier stages (indexer KL, MoE balance) are attached to that stage's output streams by
`attach_aux` (Megatron's MoEAuxLossAutoScaler): forward passes X through, backward adds d(aux)/d(params) with
gradient 1, so the pipelined step back-propagates sum over stages of their losses = the whole model's loss.
The schedule divides every parameter gradient by the number of micro-batches (scale_grads), as gradient
accumulation of loss / M does.

Chunks (Megatron's virtual stages): the layers are cut into pp * vpp chunks; rank r owns chunks r, r + pp, ...
(the interleaved assignment torch's ScheduleInterleaved1F1B expects). The embedding is used by chunk 0 and,
with MTP, by the last chunk: each holds the same weights and their gradients are summed over the embedding
group after backward (`Parallelized.finish_backward`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsv4.model.config import ConfigError
from dsv4.model.layout import Layout
from dsv4.model.losses import AuxLosses, assemble_losses
from dsv4.model.mhc import expand_streams, hc_head
from dsv4.model.model import IGNORE, DSv4Model, prepare_layout, run_block

METRICS = ("lm loss", "mtp_1 loss", "indexer loss", "moe aux loss")


class _AttachAux(torch.autograd.Function):
    """y = x; backward: dx = dy and d(aux) = 1 (the auxiliary loss joins the backward through x)."""

    @staticmethod
    def forward(ctx, x, aux):
        ctx.aux_shape, ctx.aux_dtype = aux.shape, aux.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g, torch.ones(ctx.aux_shape, dtype=ctx.aux_dtype, device=g.device)


def attach_aux(x: torch.Tensor, aux: torch.Tensor | None) -> torch.Tensor:
    return x if aux is None or not torch.is_grad_enabled() else _AttachAux.apply(x, aux)


class PipelineChunk(nn.Module):
    """One virtual stage: a contiguous range of the model's blocks plus, at the ends, embed / head / MTP.

    Submodules are the model's own objects registered under the model's names, so `named_parameters()` (and
    DCP's keys) are `embed.weight`, `layers.{i}.*`, `norm.weight`, `hc_head_*`, `head.weight`, `mtp.0.*` as in
    the whole model. `metrics` collects each micro-batch's detached metrics (cleared by the caller).
    """

    def __init__(self, model: DSv4Model, layer_ids: list[int], chunk_id: int, num_chunks: int):
        super().__init__()
        self.cfg, self.chunk_id, self.num_chunks = model.cfg, chunk_id, num_chunks
        self.is_first, self.is_last = chunk_id == 0, chunk_id == num_chunks - 1
        self.layer_ids = list(layer_ids)
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layer_ids})
        self.backend = model.backend
        self.recompute = model.recompute                     # whole-block recompute (model/recompute.py)
        self.metrics: list[dict] = []
        if self.is_first or (self.is_last and len(model.mtp)):
            self.embed = model.embed
        if self.is_last:
            self.norm, self.head, self.mtp = model.norm, model.head, model.mtp
            self.hc_head_fn, self.hc_head_base, self.hc_head_scale = (model.hc_head_fn, model.hc_head_base,
                                                                      model.hc_head_scale)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, labels: torch.Tensor,
                layout: Layout | None = None) -> torch.Tensor:
        """x: input_ids [b, S] on chunk 0, else the streams [b, S, n, d] -> streams, or the scalar objective.
        layout: the micro-batch's documents (default b documents of S tokens; `run_local` passes packed ones;
        under torch.distributed.pipelining micro-batches are plain rows)."""
        cfg = self.cfg
        B, S = input_ids.shape
        if layout is None:
            layout = Layout.batch(B, S, input_ids.device)                          # b documents of S tokens
        aux = AuxLosses()
        X = expand_streams(self.embed(input_ids), cfg.hc_mult) if self.is_first else x   # [b, S, n, d]
        ckpt = self.recompute and torch.is_grad_enabled()
        prepare_layout(layout, [self.layers[str(i)] for i in self.layer_ids] +
                       (list(self.mtp) if self.is_last else []))
        for i in self.layer_ids:
            layer = self.layers[str(i)]
            X = run_block(ckpt, layer, aux, X, input_ids, layout)
        lm = mtp = None
        if self.is_last:
            y = self.norm(hc_head(X, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, cfg, self.backend))
            lm = _ce_sum(self.head(y), labels)
            if len(self.mtp):                                                      # MTP reads the final X
                ids_next = layout.roll_next(input_ids, 0)
                e_next = self.embed(ids_next)
                y_mtp = run_block(ckpt, self.mtp[0], aux, X, e_next, ids_next, layout)
                mtp = _ce_sum(self.head(y_mtp), layout.roll_next(labels, IGNORE))
        main, extra, metrics = assemble_losses(cfg, aux, lm, mtp)
        self.metrics.append({k: v.detach().double() for k, v in metrics.items()})
        if self.is_last:
            return main if extra is None else main + extra
        return attach_aux(X, extra)


def _ce_sum(logits, labels):
    labels = labels.reshape(-1)
    s = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels, ignore_index=IGNORE, reduction="sum")
    return s, (labels != IGNORE).sum().to(s.dtype)


def even_stages(num_layers: int, num_chunks: int) -> list[list[int]]:
    """Layers 0..L-1 cut into num_chunks contiguous chunks, sizes differing by at most one (earlier ones larger)."""
    if not 1 <= num_chunks <= num_layers:
        raise ConfigError(f"pipeline: {num_chunks} stages (pp * vpp) cannot split num_hidden_layers={num_layers}")
    q, r = divmod(num_layers, num_chunks)
    out, start = [], 0
    for k in range(num_chunks):
        n = q + (k < r)
        out.append(list(range(start, start + n)))
        start += n
    return out


def check_stages(model: DSv4Model, stages: list[list[int]]) -> None:
    L = model.cfg.num_hidden_layers
    if [i for s in stages for i in s] != list(range(L)):
        raise ConfigError(f"pipeline stages: {stages} must list layers 0..{L - 1} contiguously, in order")
    if len(stages) > 1 and any(model.cfg.is_hash(i) for s in stages[1:] for i in s):
        raise ConfigError(f"pipeline stages: hash layers (num_hash_layers={model.cfg.num_hash_layers}) must be "
                          f"on the first stage with the embedding, got stages {stages}")


def rank_chunks(model: DSv4Model, stages: list[list[int]], pp_rank: int, pp: int) -> list[PipelineChunk]:
    """This pipeline rank's chunks (global ids pp_rank, pp_rank + pp, ...), in local order."""
    check_stages(model, stages)
    return [PipelineChunk(model, stages[k], k, len(stages)) for k in range(pp_rank, len(stages), pp)]


def stage_io(chunk: PipelineChunk, mb_rows: int, S: int, dtype: torch.dtype, device) -> tuple:
    """(input_args, output_args) of a chunk's PipelineStage: static shapes, so no shape-inference forward.
    The streams (and the last stage's objective) carry requires_grad: the stage derives from these examples
    which boundaries send a gradient back."""
    cfg = chunk.cfg
    streams = torch.empty(mb_rows, S, cfg.hc_mult, cfg.hidden_size, dtype=dtype, device=device, requires_grad=True)
    inp = torch.zeros(mb_rows, S, dtype=torch.long, device=device) if chunk.is_first else streams
    out = torch.empty((), dtype=torch.float32, device=device, requires_grad=True) if chunk.is_last else streams
    return inp, out
