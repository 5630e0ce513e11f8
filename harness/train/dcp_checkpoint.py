"""Reshardable training checkpoints on `torch.distributed.checkpoint` (DCP), for `dsv4 train --dp/--pp/...`.

Layout of `<out>/checkpoints/`:
    step_000012/.metadata, __<rank>_0.distcp   DCP: model + optimiser state keyed by the MODEL's parameter
                                               names (`layers.3.attn.wq_a.weight`, ...), whatever the mesh
    step_000012/meta.json                      step, metrics so far, recipe, config hash, seed, the mesh saved
    latest                                     text: the newest complete step directory

The state is gathered with `torch.distributed.checkpoint.state_dict.get_state_dict` (FSDP2 shards are DTensors,
pipeline chunks contribute their own names; the optimiser state is flattened to `state.<name>.<key>`, the
resharding form that also works across pipeline layouts), so a checkpoint saved on one mesh loads on any other
(dp=2 -> dp=1, pp=2 -> pp=1, ...). Tensors keep their dtypes: P1's mixed-dtype state (FP32 moments of FP32-kept
parameters beside bf16 ones, Muon's momentum) comes back bit-exact.

Atomicity (as harness/train/checkpoint.py): every rank writes into `.tmp-step_XXXXXX/` (a name all ranks agree on);
after a barrier rank 0 writes meta.json, fsyncs, renames the directory into place with `os.replace` and
replaces `latest` atomically. A run killed at any moment leaves the previous `latest` complete; a temp
directory is ignored and cleaned at the next save.
"""
from __future__ import annotations

import json
import os
import shutil

import torch
import torch.distributed as dist
from torch import nn

from dsv4.harness.train.checkpoint import CheckpointError, _fsync_dir, _write_json, find_step_dir, publish


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _dist() else 0


def _barrier() -> None:
    if _dist():
        dist.barrier()


class RankModule(nn.Module):
    """The modules one rank trains, registered under the whole model's names (so state-dict keys are model
    names): a pipeline rank's chunks merged (`layers.{i}` of every chunk, embed / norm / head / mtp where held)."""

    def __init__(self, parts: list):
        super().__init__()
        if len(parts) == 1 and not hasattr(parts[0], "layer_ids"):
            self.whole = parts[0]
            return
        self.layers = nn.ModuleDict()
        for c in parts:
            for k, m in c.layers.items():
                self.layers[k] = m
            for name in ("embed", "norm", "head", "mtp"):
                if hasattr(c, name) and not hasattr(self, name):
                    setattr(self, name, getattr(c, name))
            for name in ("hc_head_fn", "hc_head_base", "hc_head_scale"):
                if hasattr(c, name) and name not in self._parameters:
                    self.register_parameter(name, getattr(c, name))

    def target(self) -> nn.Module:
        return getattr(self, "whole", self)


def _optimizers(opt) -> list:
    return list(opt.optimizers) if hasattr(opt, "optimizers") else [opt]


def _options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    return StateDictOptions(flatten_optimizer_state_dict=True)


def state_of(parts: list, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict
    mod = RankModule(parts).target()
    msd, osd = get_state_dict(mod, _optimizers(opt), options=_options())
    return {"model": msd, "optim": osd}


def save(ckpt_dir: str, step: int, parts: list, opt, meta: dict) -> str:
    """Write checkpoint `step` (collective over the world); returns its final directory."""
    import torch.distributed.checkpoint as dcp
    name = f"step_{step:06d}"
    tmp = os.path.join(ckpt_dir, f".tmp-{name}")
    final = os.path.join(ckpt_dir, name)
    if _rank() == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
        for n in os.listdir(ckpt_dir):                                      # leftovers of killed writers
            if n.startswith(".tmp-"):
                shutil.rmtree(os.path.join(ckpt_dir, n), ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    dcp.save(state_of(parts, opt), checkpoint_id=tmp)
    _barrier()
    if _rank() == 0:
        _write_json(os.path.join(tmp, "meta.json"), {**meta, "step": step, "format": "dcp"})
        for f in os.listdir(tmp):
            fd = os.open(os.path.join(tmp, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        publish(ckpt_dir, tmp, name)
    _barrier()
    return final


def resolve(path: str) -> str:
    """A run dir, its checkpoints dir or a step dir -> a complete DCP step directory."""
    d = find_step_dir(path)
    if d is None:
        raise CheckpointError(f"resume: no complete DCP checkpoint under {path!r}")
    if not os.path.isfile(os.path.join(d, ".metadata")):
        raise CheckpointError(f"resume: {d!r} is a one-device (safetensors) checkpoint, not DCP; "
                              f"resume it without --dp/--pp/--cp/--ep")
    return d


def load(path: str, parts: list, opt) -> dict:
    """Load a DCP checkpoint saved on any mesh into this rank's modules and optimiser; returns its meta."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict
    d = resolve(path)
    with open(os.path.join(d, "meta.json")) as f:
        meta = json.load(f)
    state = state_of(parts, opt)                                            # the target shapes / shardings
    try:
        dcp.load(state, checkpoint_id=d)
    except Exception as e:  # noqa: BLE001 - one line for the user
        raise CheckpointError(f"resume: cannot load {d!r}: {str(e).splitlines()[0][:300]}") from None
    set_state_dict(RankModule(parts).target(), _optimizers(opt), model_state_dict=state["model"],
                   optim_state_dict=state["optim"], options=_options())
    return meta


@torch.no_grad()
def full_state(parts: list, opt) -> dict:
    """{key: full tensor} of the model and optimiser state (DTensors gathered): for exactness checks."""
    from torch.distributed.tensor import DTensor
    st = state_of(parts, opt)
    out = {}
    for top in ("model", "optim"):
        for k, v in st[top].items():
            if isinstance(v, DTensor):
                v = v.full_tensor()
            if isinstance(v, torch.Tensor):
                out[f"{top}.{k}"] = v.detach().clone()
    return out
