"""Load a DSv4Model from a path for generation / fine-tuning (`--init PATH`):

  * a Hugging Face DeepseekV4 directory (config.json + safetensors with `model.` names)  -> model/interop.from_hf
  * an official-naming directory (config.json + safetensors, `layers.{i}.attn.*` names) -> load_official
  * a `dsv4 train` run / checkpoints / step directory (meta.json; harness/train/checkpoint.py) -> its recipe's config
    (or the `config` dict the SFT recipe stores) with the saved state dict.
"""
from __future__ import annotations

import json
import os

from dsv4.harness.train import checkpoint as ckpt


class InitError(ValueError):
    """A path that holds no loadable DSv4 model (one line)."""


def _is_hf_dir(d: str) -> bool:
    from safetensors import safe_open
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(d, f), "pt") as sf:
                return any(k.startswith("model.") or k == "lm_head.weight" for k in sf.keys())
    raise InitError(f"init: no .safetensors file in {d!r}")


def load_model(path: str):
    """-> (DSv4Model (fp32, eval mode off), description)."""
    from dsv4.model.config import DSv4Config, get_config
    from dsv4.model.model import DSv4Model
    if not os.path.exists(path):
        raise InitError(f"init: no such path {path!r}")
    if os.path.isfile(os.path.join(path, "config.json")):
        from dsv4.model.interop import from_hf, load_official
        if _is_hf_dir(path):
            return from_hf(path), "hf"
        return load_official(path), "official"
    try:
        d = ckpt.latest_checkpoint(path)
    except ckpt.CheckpointError:
        raise InitError(f"init: {path!r} is neither a checkpoint directory (config.json + safetensors) nor a "
                        f"dsv4 training run") from None
    with open(os.path.join(d, "meta.json")) as f:
        meta = json.load(f)
    if "model_config" in meta or "config" in meta:               # the built config (dsv4 train writes model_config)
        cfg = DSv4Config.from_dict(meta.get("model_config") or meta["config"])
    else:
        cfg = get_config(meta["recipe"]["config"])
    from safetensors.torch import load_file
    model = DSv4Model(cfg)
    model.load_state_dict(load_file(os.path.join(d, "model.safetensors")), strict=True)
    return model, f"dsv4:{os.path.basename(d)}"
