"""Checkpoint interop (spec §11.3, §11.4; Megatron-Bridge names in megatron_dsv4.md §5.2), one file per naming:

  hf.py         Hugging Face transformers 5.23 DeepseekV4ForCausalLM names (from_hf / to_hf)
  official.py   DeepSeek's official hub names (load_official / save_official)
  megatron.py   Megatron-LM dev's HybridModel names, GPT / Bridge alias (save_megatron / load_megatron)
  hf_config.py  config.json as HF DeepseekV4Config fields (carried by HF and official checkpoints)
  megatron_config.py  our config fields <-> dev's MLATransformerConfig, in one table
  common.py     CheckpointError, directory read / write, field-type checks, load_checked

Ours = DeepSeek's official names with stacked routed experts (`layers.{i}.ffn.experts.w13` [E, 2f, d],
`...experts.w2` [E, d, f]). `convert` below dispatches between the namings.
"""
from __future__ import annotations

from dsv4.model.interop.common import CheckpointError, load_checked, read_safetensors
from dsv4.model.interop.hf import from_hf, to_hf
from dsv4.model.interop.megatron import load_megatron, save_megatron
from dsv4.model.interop.official import load_official, save_official

__all__ = ["CheckpointError", "convert", "from_hf", "to_hf", "load_official", "save_official", "load_megatron",
           "save_megatron", "load_checked", "read_safetensors"]


def convert(src: str, dst: str, src_format: str, dst_format: str, clamp_shared_expert: bool = False,
            model=None) -> dict:
    """Convert a checkpoint directory between "hf", "official" and "megatron" (dev's HybridModel names and
    config fields), or save `model`, loaded by the caller from `src` (e.g. a `dsv4 train` checkpoint); returns a
    small summary dict. `clamp_shared_expert`: see `to_hf` (an unclamped model goes to HF only as HF's clamped
    model)."""
    loaders = {"hf": from_hf, "official": load_official, "megatron": load_megatron}
    savers = {"hf": to_hf, "official": save_official, "megatron": save_megatron}
    if model is None and src_format not in loaders:
        raise CheckpointError(f"--from: unknown format {src_format!r} (auto | hf | official | megatron | train)")
    if dst_format not in savers:
        raise CheckpointError(f"--to: unknown format {dst_format!r} (hf | official | megatron)")
    model = model if model is not None else loaders[src_format](src)
    if dst_format == "hf":
        to_hf(model, dst, clamp_shared_expert=clamp_shared_expert)
    else:
        savers[dst_format](model, dst)
    n = sum(v.numel() for v in model.state_dict().values())
    return {"src": src, "dst": dst, "from": src_format, "to": dst_format, "tensors": len(model.state_dict()),
            "elements": n, "layers": model.cfg.num_hidden_layers, "mtp": model.cfg.num_nextn_predict_layers}
