"""What every naming shares: the one checkpoint error, the checkpoint directory (config.json + safetensors) read
and write, the config-field type check, and the checked copy of a state dict into a model.

A checkpoint directory holds `config.json` and safetensors files; pickles are never unpickled. Wrong, missing or
unexpected tensors are refused with one line naming the key and both shapes.
"""
from __future__ import annotations

import dataclasses
import json
import os

import torch

from dsv4.model.config import ConfigError, DSv4Config


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model (one line naming the key and both shapes)."""


# JSON types of config fields: DSv4Config's own annotations, plus the HF-only fields config_from_hf reads
_JSON_TYPES = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,), "list[int]": (list,),
               "list": (list,), "dict": (dict,), "dict | None": (dict, type(None)), "str | None": (str, type(None))}
_HF_ONLY_TYPES = {"partial_rotary_factor": "float", "num_key_value_heads": "int", "layer_types": "list",
                  "mlp_layer_types": "list", "compress_rates": "dict", "rope_parameters": "dict | None",
                  "num_hash_layers": "int", "dsv4_config": "dict | None"}


def check_field_types(d: dict, where: str) -> None:
    """Refuse, naming the field, a config JSON value of the wrong type (a string "64" for an int, ...)."""
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: must be a JSON object, got {type(d).__name__}")
    types = {f.name: f.type for f in dataclasses.fields(DSv4Config)} | _HF_ONLY_TYPES
    for k, v in d.items():
        t = types.get(k)
        if t is None:
            continue
        ok = _JSON_TYPES[t]
        bad = not isinstance(v, ok) or (isinstance(v, bool) and bool not in ok)
        if not bad and t == "list[int]":
            bad = not all(isinstance(x, int) and not isinstance(x, bool) for x in v)
        if bad:
            raise ConfigError(f"{where}: field {k!r} must be {t}, got {type(v).__name__} {json.dumps(v)[:40]}")

# ---------------------------------------------------------------------------------------------------------
# files
# ---------------------------------------------------------------------------------------------------------

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")


def read_safetensors(path: str) -> dict[str, torch.Tensor]:
    """One safetensors file -> tensors; a pickle / torch.save file or a truncated, tampered file is refused in one
    line naming it. Pickle is never unpickled (that can run code), not even with torch.load(weights_only=True)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    try:
        return load_file(path)
    except (SafetensorError, OSError) as e:
        why = str(e).splitlines()[0]
    try:
        with open(path, "rb") as fh:
            head = fh.read(2)
    except OSError:
        head = b""
    if head == b"PK" or (len(head) == 2 and head[0] == 0x80 and 2 <= head[1] <= 5):   # torch.save zip / pickle
        raise CheckpointError(f"{path}: a pickle (torch.save) file, not safetensors: not loaded, since unpickling "
                              f"can run code; convert it to safetensors first")
    raise CheckpointError(f"{path}: not a readable safetensors file ({why})")


def _read_dir(directory: str) -> tuple[dict, dict[str, torch.Tensor], str]:
    """-> (config.json dict, tensors, where: the file, or the files, the tensors came from)."""
    cfg_path = os.path.join(directory, "config.json")
    if not os.path.isfile(cfg_path):
        raise CheckpointError(f"{directory}: no config.json")
    names = sorted(os.listdir(directory))
    files = [f for f in names if f.endswith(".safetensors")]
    if not files:
        pick = [f for f in names if f.endswith(PICKLE_SUFFIXES)]
        if pick:
            raise CheckpointError(f"{os.path.join(directory, pick[0])}: a pickle checkpoint: not loaded, since "
                                  f"unpickling can run code; only safetensors are read")
        raise CheckpointError(f"{directory}: no .safetensors files (only safetensors checkpoints are read)")
    try:
        with open(cfg_path) as fh:
            d = json.load(fh)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{cfg_path}: not valid JSON ({e})") from None
    check_field_types(d, cfg_path)
    check_field_types(d.get("dsv4_config") or {}, f"{cfg_path}: dsv4_config")
    sd, seen = {}, {}
    for f in files:
        for k, v in read_safetensors(os.path.join(directory, f)).items():
            if k in seen:
                raise CheckpointError(f"{directory}: tensor {k} is in both {seen[k]} and {f}")
            sd[k], seen[k] = v, f
    where = os.path.join(directory, files[0]) if len(files) == 1 else os.path.join(directory, "*.safetensors")
    from dsv4.model.interop.released import dequantize_released     # DeepSeek's FP8 / MXFP4 release formats
    qc = d.get("quantization_config")
    if qc is not None and not isinstance(qc, dict):
        raise CheckpointError(f"{cfg_path}: field 'quantization_config' must be an object, got {type(qc).__name__}")
    return d, dequantize_released(sd, qc, where), where


def _write_dir(directory: str, config: dict, sd: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as fh:
        json.dump(config, fh, indent=2)
    save_file({k: v.detach().contiguous().cpu() for k, v in sd.items()}, os.path.join(directory, "model.safetensors"),
              metadata={"format": "pt"})


def load_checked(model, sd: dict[str, torch.Tensor], where: str = "checkpoint") -> None:
    """Copy `sd` into `model` (our names); refuse missing / unexpected / wrongly shaped tensors in one line
    naming `where` (the file) and the tensor."""
    want = model.state_dict()
    for k, v in want.items():
        if k not in sd:
            raise CheckpointError(f"{where}: missing tensor {k}: model expects shape {list(v.shape)}, "
                                  f"checkpoint has none")
        if tuple(sd[k].shape) != tuple(v.shape):
            raise CheckpointError(f"{where}: tensor {k}: checkpoint shape {list(sd[k].shape)}, "
                                  f"model expects {list(v.shape)}")
    extra = sorted(set(sd) - set(want))
    if extra:
        raise CheckpointError(f"{where}: unexpected tensor {extra[0]}: checkpoint shape "
                              f"{list(sd[extra[0]].shape)}, model has none")
    with torch.no_grad():
        for k, v in want.items():
            v.copy_(sd[k])


def _build(cfg):
    from dsv4.model.model import DSv4Model
    return DSv4Model(cfg)
