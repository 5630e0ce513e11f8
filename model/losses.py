"""The auxiliary losses of one forward and the one loss assembler (plain, packed, CP and pipeline paths).

`AuxLosses` is created per forward and passed down (DSv4Model -> Block -> attention / MoE): a CSA attention
layer adds its indexer KL loss (spec §10.3) with the number of queries its mean ran over, and its top-k
selection (a diagnostic); an MoE layer adds its sequence-wise balance loss (spec §9.4). Nothing is stashed on
modules. During a whole-block recompute (model/recompute.py) the re-run forward adds nothing: the losses of the
forward pass are the ones back-propagated.

`assemble_losses` is the one place the objective is formed:
    loss = lm + mtp_loss_scaling_factor * mtp_1 + sum_l indexer_l + sum_l moe_aux_l
with lm / mtp_1 = CE sums over the targets divided by the number of targets and each indexer term a mean over
its queries with candidates. Counts go through `count` (a layout's `global_count`): on one rank the identity;
under context parallelism the sum over ranks, so each rank's loss is its SHARE of the global loss (the ranks'
losses sum to the single-rank loss). `losses` holds detached scalars under Megatron's metric names ("lm loss",
"mtp_1 loss" (unscaled CE), "indexer loss", "moe aux loss").
"""
from __future__ import annotations


import torch

from dsv4.model.recompute import recomputing


class AuxLosses:
    """Not a dataclass on purpose: FSDP2's pre-forward hook rebuilds dataclass arguments field by field
    (torch.distributed.utils._apply_to_tensors), which would hand each wrapped block a copy and lose the
    losses it adds; a plain object passes through by reference.
    `always`: record during a recompute too (a checkpointed block's own container, see `merge`)."""

    def __init__(self, always: bool = False):
        self.indexer: list = []       # (loss scalar, n_queries scalar tensor) per CSA layer
        self.moe: list = []           # loss scalar per score-routed MoE layer
        self.selections: dict = {}    # layer_idx -> (idx [T, k], entry_seg [N], entry_j [N]); key None: the
        #                               selection of an attention called directly (a block's own container)
        self.always = always

    def _on(self) -> bool:
        return self.always or not recomputing()

    def add_indexer(self, loss: torch.Tensor, n_queries: torch.Tensor) -> None:
        if self._on():
            self.indexer.append((loss, n_queries))

    def add_moe(self, loss: torch.Tensor) -> None:
        if self._on():
            self.moe.append(loss)

    def add_selection(self, idx, entry_seg, entry_j) -> None:
        """Recorded under key None: the attention does not read its layer index here (under torch.compile a
        module's int attribute is a guarded constant, one recompile per layer); `merge` files it by layer."""
        if self._on():
            self.selections[None] = (idx, entry_seg, entry_j)

    def merge(self, other: "AuxLosses", layer_idx: int | None = None) -> None:
        """Add a block's own container (its forward-pass terms) to this forward's; its selection is filed
        under the block's `layer_idx`."""
        self.indexer += other.indexer
        self.moe += other.moe
        for k, v in other.selections.items():
            self.selections[layer_idx if k is None else k] = v

    def picks(self, layer_idx: int | None, shape: tuple[int, int] | None = None) -> torch.Tensor:
        """The layer's selected entries as their index j inside the document (-1 = none): [T, k], or [B, S, k]
        with `shape` -- for a plain batch exactly the per-sequence entry indices."""
        idx, _, ej = self.selections[layer_idx]
        j = torch.where(idx >= 0, ej[idx.clamp(min=0)], torch.full_like(idx, -1))
        return j if shape is None else j.view(*shape, j.shape[-1])

    def picks_doc(self, layer_idx: int | None) -> list[list[tuple[int, int]]]:
        """Per query, the selected entries as (document, j) pairs in selection order."""
        idx, es, ej = self.selections[layer_idx]
        return [[(int(es[i]), int(ej[i])) for i in row if i >= 0] for row in idx.tolist()]


def _one(n: torch.Tensor) -> torch.Tensor:
    return n


def acc(t: torch.Tensor) -> torch.Tensor:
    """Loss precision: fp32 for half types, fp64 stays fp64 (the cross-host fp64 golden runs)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def assemble_losses(cfg, aux: AuxLosses | None = None, lm: tuple | None = None, mtp: tuple | None = None,
                    count=None):
    """(main, extra, losses): main = lm + w * mtp (None without lm), extra = indexer + MoE aux terms (None if
    there are none), losses = detached metrics. lm / mtp: (CE sum, number of targets) pairs."""
    count = _one if count is None else count       # (not `count or _one`: Dynamo 2.11 cannot branch on a method)
    losses = {}
    main = None
    if lm is not None:
        s, n = lm
        main = s / count(n)
        losses["lm loss"] = main.detach()
        if mtp is not None:
            s, n = mtp
            m = s / count(n)
            main = main + cfg.mtp_loss_scaling_factor * m
            losses["mtp_1 loss"] = m.detach()
    extra = None
    if aux is not None and aux.indexer:
        terms = [acc(l) * (n / count(n).clamp_min(1)).to(acc(l).dtype) for l, n in aux.indexer]   # 1.0 on one rank
        il = torch.stack(terms).sum()
        losses["indexer loss"] = il.detach()
        extra = il
    if aux is not None and aux.moe:
        al = torch.stack([acc(t) for t in aux.moe]).sum()
        losses["moe aux loss"] = al.detach()
        extra = al if extra is None else extra + al
    return main, extra, losses
