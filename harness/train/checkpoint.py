"""Atomic training checkpoints: safetensors for tensors, JSON for everything else; no pickle anywhere.

Layout of `<out>/checkpoints/`:
    step_000012/model.safetensors      model state_dict (parameters and buffers: MoE expert biases, hash table)
    step_000012/optim.safetensors      every tensor of the optimiser state (FP32 moments, Muon momentum, steps)
    step_000012/rng.safetensors        torch CPU (and CUDA) RNG states as uint8 tensors
    step_000012/meta.json              step, data position, optimiser non-tensor state, metrics so far, recipe,
                                       model_config (DSv4Config: `dsv4 convert` rebuilds the model from it)
    latest                             text: the name of the newest complete step directory

Atomicity: a checkpoint is written into `.tmp-step_XXXXXX-<pid>/` (each file fsync'ed), the directory is
renamed into place with `os.replace`, then `latest` is replaced atomically (write `latest.tmp`, fsync,
`os.replace`). A process killed at any moment leaves either the previous `latest` (still complete) or the new
one; a half-written temp directory is ignored and cleaned on the next save. A write that fails (a full disk)
removes its temp directory and raises CheckpointError (one line naming the checkpoint, exit 2 in the CLI).
Reading refuses, in one line naming the file and tensor or field, a truncated or tampered safetensors file,
a pickle file (never unpickled), missing / extra optimiser tensors and meta.json fields of the wrong type.
"""
from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from dsv4.harness.errors import one_line
from dsv4.model.interop.common import CheckpointError, read_safetensors   # one error class for every checkpoint

# meta.json fields and their JSON types (checked on load when present; `dsv4 train --resume` needs them all)
META_TYPES = {"step": int, "seed": int, "config_hash": str, "recipe": dict, "history": list,
              "consumed_samples": int, "model_config": dict, "optim_tree": dict}


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def flatten_state(obj, prefix: str, tensors: dict) -> object:
    """Replace every tensor inside a nested dict/list by a reference {"__tensor__": key}; tensors go to `tensors`."""
    if isinstance(obj, torch.Tensor):
        key = prefix
        tensors[key] = obj.detach().cpu().contiguous().clone()
        return {"__tensor__": key}
    if isinstance(obj, dict):
        return {"__dict__": [[_key(k), flatten_state(v, f"{prefix}.{k}", tensors)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return {"__list__": [flatten_state(v, f"{prefix}.{i}", tensors) for i, v in enumerate(obj)],
                "tuple": isinstance(obj, tuple)}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise CheckpointError(f"checkpoint: cannot store object of type {type(obj).__name__} at {prefix}")


def _key(k):
    if isinstance(k, (int, str)):
        return k
    raise CheckpointError(f"checkpoint: unsupported dict key type {type(k).__name__}")


def unflatten_state(obj, tensors: dict):
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        if "__dict__" in obj:
            return {k: unflatten_state(v, tensors) for k, v in obj["__dict__"]}
        if "__list__" in obj:
            seq = [unflatten_state(v, tensors) for v in obj["__list__"]]
            return tuple(seq) if obj.get("tuple") else seq
    return obj


def _write_json(path: str, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def rng_state() -> dict:
    st = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            st[f"torch_cuda_{i}"] = s
    return st


def set_rng_state(st: dict) -> None:
    torch.set_rng_state(st["torch_cpu"])
    cuda = [st[k] for k in sorted(st) if k.startswith("torch_cuda_")]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)


def save_checkpoint(ckpt_dir: str, step: int, model: torch.nn.Module, optim_state: dict, meta: dict) -> str:
    """Write checkpoint `step` atomically under `ckpt_dir`; returns the final directory."""
    os.makedirs(ckpt_dir, exist_ok=True)
    for name in os.listdir(ckpt_dir):                                      # leftovers of killed writers
        if name.startswith(".tmp-"):
            shutil.rmtree(os.path.join(ckpt_dir, name), ignore_errors=True)
    name = f"step_{step:06d}"
    tmp = os.path.join(ckpt_dir, f".tmp-{name}-{os.getpid()}")
    try:
        return _save(ckpt_dir, name, tmp, step, model, optim_state, meta)
    except (OSError, SafetensorError) as e:                                # full disk, read-only fs, ...
        shutil.rmtree(tmp, ignore_errors=True)                             # nothing half-written stays
        why = getattr(e, "strerror", None) or one_line(e)
        raise CheckpointError(f"checkpoint {os.path.join(ckpt_dir, name)}: cannot write ({why}); "
                              f"the previous checkpoint is intact") from None


def _save(ckpt_dir, name, tmp, step, model, optim_state, meta) -> str:
    os.makedirs(tmp)
    model_t = {k: v.detach().cpu().contiguous().clone() for k, v in model.state_dict().items()}
    save_file(model_t, os.path.join(tmp, "model.safetensors"))
    opt_t: dict = {}
    opt_tree = flatten_state(optim_state, "optim", opt_t)
    save_file(opt_t, os.path.join(tmp, "optim.safetensors"))
    save_file(rng_state(), os.path.join(tmp, "rng.safetensors"))
    _write_json(os.path.join(tmp, "meta.json"), {**meta, "step": step, "optim_tree": opt_tree})
    for f in os.listdir(tmp):
        _fsync_file(os.path.join(tmp, f))
    return publish(ckpt_dir, tmp, name)


def publish(ckpt_dir: str, tmp: str, name: str) -> str:
    """Make the fully written (and fsynced) temp dir `tmp` the step dir `name`, then point `latest` at it: each
    step an atomic rename, so a kill at any point leaves the previous checkpoint loadable. Returns the step dir.
    Shared by the single-process and the DCP (harness/train/dcp_checkpoint.py) checkpoints."""
    _fsync_dir(tmp)
    final = os.path.join(ckpt_dir, name)
    if os.path.exists(final):                                              # re-saving the same step
        trash = os.path.join(ckpt_dir, f".tmp-old-{name}-{os.getpid()}")
        os.replace(final, trash)
        shutil.rmtree(trash, ignore_errors=True)
    os.replace(tmp, final)
    _fsync_dir(ckpt_dir)
    latest_tmp = os.path.join(ckpt_dir, "latest.tmp")
    with open(latest_tmp, "w") as f:
        f.write(name)
        f.flush()
        os.fsync(f.fileno())
    os.replace(latest_tmp, os.path.join(ckpt_dir, "latest"))
    _fsync_dir(ckpt_dir)
    return final


def find_step_dir(path: str) -> str | None:
    """The complete step directory (one holding meta.json, written last by `publish`) that `path` names: the step
    dir itself, or the `latest` pointer of a run dir or its checkpoints/ dir; None if there is none. Shared by the
    one-device and the DCP checkpoints (harness/train/dcp_checkpoint.resolve)."""
    for base in (path, os.path.join(path, "checkpoints")):
        if os.path.isfile(os.path.join(base, "meta.json")):
            return base
        lf = os.path.join(base, "latest")
        if os.path.isfile(lf):
            with open(lf) as f:
                d = os.path.join(base, f.read().strip())
            if os.path.isfile(os.path.join(d, "meta.json")):
                return d
    return None


def latest_checkpoint(path: str) -> str:
    """Resolve `path` (a run dir, its checkpoints dir, or a step dir) to a complete step directory."""
    if os.path.isfile(path):
        read_safetensors(path)                           # a pickle / torch.save file: refused, never unpickled
        raise CheckpointError(f"resume: {path!r} is a file; give a run dir, its checkpoints/ dir or a step dir")
    d = find_step_dir(path)
    if d is None:
        raise CheckpointError(f"resume: no complete checkpoint under {path!r}")
    return d


def read_meta(d: str) -> dict:
    """meta.json of step directory `d`, its known fields type-checked (one line naming the file and field)."""
    mp = os.path.join(d, "meta.json")
    try:
        with open(mp) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{mp}: unreadable ({one_line(e)})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{mp}: must be a JSON object, got {type(meta).__name__}")
    for k, t in META_TYPES.items():
        if k in meta and (not isinstance(meta[k], t) or (t is int and isinstance(meta[k], bool))):
            raise CheckpointError(f"{mp}: field {k!r} must be {t.__name__}, got {type(meta[k]).__name__}")
    meta["dir"] = d
    return meta


def load_checkpoint(path: str) -> tuple[dict, dict, dict, dict]:
    """-> (model_state, optim_state, rng_state, meta) from a step directory (safetensors + JSON only)."""
    d = latest_checkpoint(path)
    meta = read_meta(d)
    model_state = read_safetensors(os.path.join(d, "model.safetensors"))
    opt_t = read_safetensors(os.path.join(d, "optim.safetensors"))
    rng = read_safetensors(os.path.join(d, "rng.safetensors"))
    tree = meta.pop("optim_tree", {})
    refs, op = _tree_refs(tree), os.path.join(d, "optim.safetensors")
    missing, extra = sorted(refs - set(opt_t)), sorted(set(opt_t) - refs)
    if missing:
        raise CheckpointError(f"{op}: missing tensor {missing[0]} (meta.json's optimiser state refers to it)")
    if extra:
        raise CheckpointError(f"{op}: unexpected tensor {extra[0]} (meta.json's optimiser state does not refer to it)")
    return model_state, unflatten_state(tree, opt_t), rng, meta


def _tree_refs(obj) -> set:
    """Tensor keys a flattened state tree (flatten_state) refers to."""
    if isinstance(obj, dict):
        return {obj["__tensor__"]} if "__tensor__" in obj else set().union(set(), *map(_tree_refs, obj.values()))
    if isinstance(obj, list):
        return set().union(set(), *map(_tree_refs, obj))
    return set()
