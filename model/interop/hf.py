"""Hugging Face naming: transformers 5.23 `DeepseekV4ForCausalLM` (`model.layers.{i}.self_attn.q_a_proj.weight`,
..., stacked `mlp.experts.gate_up_proj` / `down_proj`; HF has no MTP and drops `mtp.*`, which we keep in official
names).

HF clamps the shared expert at swiglu_limit (shared_expert_clamp=True); DeepSeek's code does not. `to_hf` refuses
an unclamped model (HF would run a different function) unless `clamp_shared_expert=True`, and then records
shared_expert_clamp=True, the function HF runs. `from_hf` loads HF's clamped function and refuses a "dsv4_config"
saying shared_expert_clamp=false (an older export) unless the caller passes the flag.
The config.json mapping (config_to_hf / config_from_hf) is in hf_config.py, shared with the official naming.
"""
from __future__ import annotations

import re

import torch

from dsv4.model.interop.common import CheckpointError, _build, _read_dir, _write_dir, load_checked
from dsv4.model.interop.hf_config import config_from_hf, config_to_hf
from dsv4.model.interop.official import official_to_ours, ours_to_official

# (ours, HF) substitutions applied to the part after `layers.{i}.`; order matters (longest first)
_LAYER_RULES = [
    ("hc_attn_fn", "attn_hc.fn"), ("hc_attn_base", "attn_hc.base"), ("hc_attn_scale", "attn_hc.scale"),
    ("hc_ffn_fn", "ffn_hc.fn"), ("hc_ffn_base", "ffn_hc.base"), ("hc_ffn_scale", "ffn_hc.scale"),
    ("attn_norm.weight", "input_layernorm.weight"), ("ffn_norm.weight", "post_attention_layernorm.weight"),
    ("attn.attn_sink", "self_attn.sinks"),
    ("attn.indexer.compressor.ape", "self_attn.compressor.indexer.position_bias"),
    ("attn.indexer.compressor.wkv.weight", "self_attn.compressor.indexer.kv_proj.weight"),
    ("attn.indexer.compressor.wgate.weight", "self_attn.compressor.indexer.gate_proj.weight"),
    ("attn.indexer.compressor.norm.weight", "self_attn.compressor.indexer.kv_norm.weight"),
    ("attn.indexer.wq_b.weight", "self_attn.compressor.indexer.q_b_proj.weight"),
    ("attn.indexer.weights_proj.weight", "self_attn.compressor.indexer.scorer.weights_proj.weight"),
    ("attn.compressor.ape", "self_attn.compressor.position_bias"),
    ("attn.compressor.wkv.weight", "self_attn.compressor.kv_proj.weight"),
    ("attn.compressor.wgate.weight", "self_attn.compressor.gate_proj.weight"),
    ("attn.compressor.norm.weight", "self_attn.compressor.kv_norm.weight"),
    ("attn.wq_a.weight", "self_attn.q_a_proj.weight"), ("attn.q_norm.weight", "self_attn.q_a_norm.weight"),
    ("attn.wq_b.weight", "self_attn.q_b_proj.weight"), ("attn.wkv.weight", "self_attn.kv_proj.weight"),
    ("attn.kv_norm.weight", "self_attn.kv_norm.weight"), ("attn.wo_a.weight", "self_attn.o_a_proj.weight"),
    ("attn.wo_b.weight", "self_attn.o_b_proj.weight"),
    ("ffn.gate.weight", "mlp.gate.weight"), ("ffn.gate.bias", "mlp.gate.e_score_correction_bias"),
    ("ffn.gate.tid2eid", "mlp.gate.tid2eid"),
    ("ffn.experts.w13", "mlp.experts.gate_up_proj"), ("ffn.experts.w2", "mlp.experts.down_proj"),
    ("ffn.shared_experts.w1.weight", "mlp.shared_experts.gate_proj.weight"),
    ("ffn.shared_experts.w3.weight", "mlp.shared_experts.up_proj.weight"),
    ("ffn.shared_experts.w2.weight", "mlp.shared_experts.down_proj.weight"),
]
_TOP_RULES = [("embed.weight", "model.embed_tokens.weight"), ("head.weight", "lm_head.weight"),
              ("norm.weight", "model.norm.weight"), ("hc_head_fn", "model.hc_head.hc_fn"),
              ("hc_head_base", "model.hc_head.hc_base"), ("hc_head_scale", "model.hc_head.hc_scale")]
_O2H = dict(_LAYER_RULES)
_H2O = {h: o for o, h in _LAYER_RULES}
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def ours_to_hf_name(name: str) -> str | None:
    """Our tensor name -> HF name (None for `mtp.*`, which HF does not hold)."""
    top = dict(_TOP_RULES)
    if name in top:
        return top[name]
    m = _LAYER.match(name)
    if m and m.group(2) in _O2H:
        return f"model.layers.{m.group(1)}.{_O2H[m.group(2)]}"
    if name.startswith("mtp."):
        return None
    raise CheckpointError(f"no HF name for tensor {name}")


def hf_to_ours_name(name: str) -> str:
    top = {h: o for o, h in _TOP_RULES}
    if name in top:
        return top[name]
    m = _HF_LAYER.match(name)
    if m and m.group(2) in _H2O:
        return f"layers.{m.group(1)}.{_H2O[m.group(2)]}"
    raise CheckpointError(f"unexpected tensor {name}: no DSv4 counterpart")

def normalise_hf_names(hf_sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Any HF-side naming -> ours. Accepts HF module names (spec §11.3, stacked experts), the names
    `save_pretrained` writes (official names under `model.`, per-expert tensors, `attn.norm` for the attention
    kv_norm, `head.weight`), and plain official hub names (incl. `mtp.*`)."""
    top = {h: o for o, h in _TOP_RULES}
    official = {}
    out = {}
    for k, v in hf_sd.items():
        if k in top:
            out[top[k]] = v
            continue
        m = _HF_LAYER.match(k)
        if m and m.group(2) in _H2O:
            out[f"layers.{m.group(1)}.{_H2O[m.group(2)]}"] = v
            continue
        o = k[len("model."):] if k.startswith("model.") else k
        o = {"embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight", "hc_head.hc_fn": "hc_head_fn",
             "hc_head.hc_base": "hc_head_base", "hc_head.hc_scale": "hc_head_scale"}.get(o, o)
        o = re.sub(r"\.attn\.norm\.weight$", ".attn.kv_norm.weight", o)      # save_pretrained's reverse rename
        official[o] = v
    for k, v in official_to_ours(official).items():
        if k in out:
            raise CheckpointError(f"tensor {k} given twice (two namings in one checkpoint)")
        out[k] = v
    return out


def from_hf(directory: str, **overrides):
    """A Hugging Face DeepseekV4 checkpoint directory -> DSv4Model (fp32; HF's clamped shared expert).

    `mtp.*` tensors (official names) are loaded when present; otherwise the MTP block keeps its fresh init.
    """
    d, hf_sd, where = _read_dir(directory)
    if (d.get("dsv4_config") or {}).get("shared_expert_clamp") is False and "shared_expert_clamp" not in overrides:
        raise CheckpointError(f"{directory}: dsv4_config.shared_expert_clamp=false but HF runs this checkpoint with "
                              "the shared expert clamped (older to_hf export); pass shared_expert_clamp explicitly")
    overrides.setdefault("shared_expert_clamp", True)
    cfg = config_from_hf(d, **overrides)
    model = _build(cfg)
    sd = normalise_hf_names(hf_sd)
    if not any(k.startswith("mtp.") for k in sd):
        sd.update({k: v for k, v in model.state_dict().items() if k.startswith("mtp.")})
    load_checked(model, sd, where)
    return model


def to_hf(model, directory: str, clamp_shared_expert: bool = False) -> None:
    """DSv4Model -> HF DeepseekV4 directory (config.json + model.safetensors); `mtp.*` in official names.

    HF clamps the shared expert; a model with shared_expert_clamp=False (DeepSeek's code) is refused unless
    `clamp_shared_expert=True`, which exports it as the clamped model HF runs (recorded in "dsv4_config")."""
    cfg = model.cfg
    if not cfg.shared_expert_clamp:
        if not clamp_shared_expert:
            raise CheckpointError("to_hf: model has shared_expert_clamp=False but HF DeepseekV4 clamps the shared "
                                  f"expert at swiglu_limit={cfg.swiglu_limit}, a different function; save_official "
                                  "keeps it, or pass clamp_shared_expert=True (--hf-clamp-shared-expert) to export "
                                  "the clamped model")
        cfg = cfg.replace(shared_expert_clamp=True)
    sd = model.state_dict()
    out = {}
    for k, v in sd.items():
        if not k.startswith("mtp."):
            out[ours_to_hf_name(k)] = v
    out.update(ours_to_official({k: v for k, v in sd.items() if k.startswith("mtp.")}))
    _write_dir(directory, config_to_hf(cfg), out)
