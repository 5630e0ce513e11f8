"""Checkpoint interop (spec §11.3, §11.4; Megatron-Bridge names in megatron_dsv4.md §5.2).

Three namings of the same tensors:
  * ours      = DeepSeek's official names, except that routed experts are stacked:
                `layers.{i}.ffn.experts.w13` [E, 2f, d] (cat(w1, w3) rows per expert), `...experts.w2` [E, d, f];
  * official  = the hub checkpoint names (`layers.{i}.ffn.experts.{e}.w1.weight`, ..., `mtp.0.*`,
                `ffn.gate.tid2eid` int32);
  * HF        = transformers 5.23 `DeepseekV4ForCausalLM` (`model.layers.{i}.self_attn.q_a_proj.weight`, ...,
                stacked `mlp.experts.gate_up_proj` / `down_proj`; HF has no MTP and drops `mtp.*`).

A checkpoint directory holds `config.json` (HF `DeepseekV4Config` fields, plus our full config under
"dsv4_config") and safetensors files. HF clamps the shared expert at swiglu_limit (shared_expert_clamp=True);
DeepSeek's code does not. `to_hf` refuses an unclamped model (HF would run a different function) unless
`clamp_shared_expert=True`, and then records shared_expert_clamp=True, the function HF runs. `from_hf` loads HF's
clamped function and refuses a "dsv4_config" saying shared_expert_clamp=false (an older export) unless the caller
passes the flag; `load_official` is unclamped unless "dsv4_config" says so.
YaRN's `attention_factor` (HF multiplies the compress table's cos/sin by it) maps to rope_scaling["attention_factor"].
Wrong, missing or unexpected tensors are refused with one line naming the key and both shapes.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re

import torch

from dsv4.model.config import ConfigError, DSv4Config

HF_TYPES = {"window": "sliding_attention", "csa": "compressed_sparse_attention",
            "hca": "heavily_compressed_attention"}


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model (one line naming the key and both shapes)."""


# ---------------------------------------------------------------------------------------------------------
# names
# ---------------------------------------------------------------------------------------------------------

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


_EXPERT = re.compile(r"^(.*ffn\.experts)\.(\d+)\.(w[123])\.weight$")
_MTP_SHARED = re.compile(r"^mtp\.\d+\.(emb(\..*)?|head\.weight)$")


def ours_to_official(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Split stacked experts into `ffn.experts.{e}.w1|w2|w3.weight`; `tid2eid` as int32."""
    out = {}
    for k, v in sd.items():
        if k.endswith("ffn.experts.w13"):
            pre, f = k[: -len(".w13")], v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{pre}.{e}.w1.weight"] = v[e, :f].contiguous()
                out[f"{pre}.{e}.w3.weight"] = v[e, f:].contiguous()
        elif k.endswith("ffn.experts.w2"):
            pre = k[: -len(".w2")]
            for e in range(v.shape[0]):
                out[f"{pre}.{e}.w2.weight"] = v[e].contiguous()
        elif k.endswith("tid2eid"):
            out[k] = v.to(torch.int32)
        else:
            out[k] = v
    return out


def official_to_ours(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Stack `ffn.experts.{e}.w*` into w13 / w2 (experts must be 0..E-1, all three present)."""
    out, experts = {}, {}
    for k, v in sd.items():
        if _MTP_SHARED.match(k):            # hub duplicates of the shared embedding / head under mtp.*: skipped
            continue
        if k.endswith(".scale") and not re.search(r"hc_(attn|ffn|head)_scale$", k):
            raise CheckpointError(f"quantised tensor {k}: dequantise the checkpoint to bf16/fp32 first")
        m = _EXPERT.match(k)
        if m:
            experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = v
        else:
            out[k] = v
    for pre, per in experts.items():
        E = len(per)
        for e in range(E):
            for w in ("w1", "w2", "w3"):
                if w not in per.get(e, {}):
                    raise CheckpointError(f"missing tensor {pre}.{e}.{w}.weight (experts 0..{E - 1} expected)")
        out[f"{pre}.w13"] = torch.stack([torch.cat([per[e]["w1"], per[e]["w3"]], 0) for e in range(E)])
        out[f"{pre}.w2"] = torch.stack([per[e]["w2"] for e in range(E)])
    return out


# ---------------------------------------------------------------------------------------------------------
# config
# ---------------------------------------------------------------------------------------------------------

def config_to_hf(cfg: DSv4Config) -> dict:
    """DSv4Config -> HF DeepseekV4Config kwargs (config.json), plus "dsv4_config" for an exact round trip."""
    L = cfg.num_hidden_layers
    if cfg.moe_layer_pattern is not None and "-" in cfg.moe_layer_pattern[:L]:
        raise ConfigError("DSv4Config.moe_layer_pattern: HF DeepseekV4 has no dense MLP layers ('-')")
    rope = {"rope_type": "default"}
    if cfg.rope_scaling:
        rs = cfg.rope_scaling
        rope = {"rope_type": rs.get("type", rs.get("rope_type", "yarn")), "factor": rs["factor"],
                "original_max_position_embeddings": rs["original_max_position_embeddings"],
                "beta_fast": rs["beta_fast"], "beta_slow": rs["beta_slow"]}
        if "attention_factor" in rs:
            rope["attention_factor"] = rs["attention_factor"]
    return {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_hidden_layers": L,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": 1, "head_dim": cfg.head_dim,
        "partial_rotary_factor": cfg.qk_rope_head_dim / cfg.head_dim, "q_lora_rank": cfg.q_lora_rank,
        "o_groups": cfg.o_groups, "o_lora_rank": cfg.o_lora_rank, "sliding_window": cfg.sliding_window,
        "layer_types": [HF_TYPES[cfg.layer_kind(i)] for i in range(L)],
        "compress_rates": {"compressed_sparse_attention": cfg.csa_ratio,
                           "heavily_compressed_attention": cfg.hca_ratio},
        "index_n_heads": cfg.index_n_heads, "index_head_dim": cfg.index_head_dim, "index_topk": cfg.index_topk,
        "rope_theta": cfg.rope_theta, "compress_rope_theta": cfg.compress_rope_theta, "rope_parameters": rope,
        "hc_mult": cfg.hc_mult, "hc_sinkhorn_iters": cfg.hc_sinkhorn_iters, "hc_eps": cfg.hc_eps,
        "n_routed_experts": cfg.n_routed_experts, "n_shared_experts": cfg.n_shared_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok, "moe_intermediate_size": cfg.moe_intermediate_size,
        "routed_scaling_factor": cfg.routed_scaling_factor, "scoring_func": "sqrtsoftplus",
        "norm_topk_prob": True, "swiglu_limit": cfg.swiglu_limit,
        "mlp_layer_types": ["hash_moe" if cfg.is_hash(i) else "moe" for i in range(L)],
        "num_nextn_predict_layers": cfg.num_nextn_predict_layers, "rms_norm_eps": cfg.rms_norm_eps,
        "initializer_range": cfg.initializer_range, "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings, "hidden_act": "silu",
        "bos_token_id": 0, "eos_token_id": 1,
        "dsv4_config": cfg.to_dict(),
    }


def _hf_yarn_attention_factor(rp: dict, nested: bool) -> float:
    """The factor HF 5.23 puts on the compress table's cos/sin: DeepseekV4Config sets 1.0 on a flat YaRN dict
    without the key; an explicit None, or a nested dict without it, is derived from mscale as in
    `_compute_yarn_parameters` (0.1 * mscale * ln(factor) + 1, a ratio when mscale and mscale_all_dim are set)."""
    af = rp.get("attention_factor", None if nested else 1.0)
    if af is not None:
        return float(af)
    def get(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
    f, m, m_all = rp["factor"], rp.get("mscale"), rp.get("mscale_all_dim")
    return float(get(f, m) / get(f, m_all)) if m and m_all else float(get(f))


def config_from_hf(d: dict, **overrides) -> DSv4Config:
    """HF config.json dict -> DSv4Config (HF fields win; the rest from "dsv4_config" when present)."""
    def need(key):
        if key not in d:
            raise ConfigError(f"config.json: missing field {key!r}")
        return d[key]

    extra = dict(d.get("dsv4_config") or {})
    L = need("num_hidden_layers")
    c = need("head_dim")
    r = d.get("qk_rope_head_dim") or int(round(c * d.get("partial_rotary_factor", 64 / 512)))
    rates = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128, **(d.get("compress_rates") or {})}
    csa, hca = rates["compressed_sparse_attention"], rates["heavily_compressed_attention"]
    if d.get("layer_types"):
        kinds = {v: k for k, v in HF_TYPES.items()}
        to_ratio = {"window": 0, "csa": csa, "hca": hca}
        try:
            ratios = [to_ratio[kinds[t]] for t in d["layer_types"][:L]]
        except KeyError as e:
            raise ConfigError(f"config.json: layer_types has unknown entry {e.args[0]!r}") from None
    elif d.get("compress_ratios"):
        ratios = [{0: 0, 4: csa, 128: hca}[x] for x in d["compress_ratios"][:L]]
    else:
        raise ConfigError("config.json: needs layer_types or compress_ratios (HF's default matches no model)")
    n_mtp = d.get("num_nextn_predict_layers", 1)
    if extra.get("compress_ratios"):
        mtp_ratios = extra["compress_ratios"][L:L + n_mtp]
    else:                                   # hub config.json: compress_ratios has L + n_mtp type labels
        mtp_ratios = [{0: 0, 4: csa, 128: hca}[x] for x in (d.get("compress_ratios") or [])[L:L + n_mtp]]
    ratios = ratios + list(mtp_ratios) + [0] * (n_mtp - len(mtp_ratios))
    mlp = d.get("mlp_layer_types")
    n_hash = d.get("num_hash_layers", 3)
    if mlp:
        n_hash = next((i for i, t in enumerate(mlp) if t != "hash_moe"), len(mlp))
        if "hash_moe" in mlp[n_hash:]:
            raise ConfigError("config.json: mlp_layer_types has 'hash_moe' after a 'moe' layer (prefix only)")
    rp = d.get("rope_parameters") or d.get("rope_scaling") or {}
    rope_theta, comp_theta = d.get("rope_theta", 10000.0), d.get("compress_rope_theta", 160000.0)
    nested = isinstance(rp.get("compress"), dict)
    if nested:
        main = rp.get("main") or {}
        if main.get("rope_type", main.get("type", "default")) != "default":
            raise ConfigError("config.json: rope_parameters.main.rope_type must be 'default' (DSv4 scales only the "
                              f"compress table), got {main.get('rope_type', main.get('type'))!r}")
        rope_theta = main.get("rope_theta", rope_theta)
        rp = rp["compress"]
        comp_theta = rp.get("rope_theta", comp_theta)
    rtype = rp.get("rope_type", rp.get("type", "default"))
    scaling = None
    if rtype == "yarn":
        scaling = {"type": "yarn", "factor": rp["factor"],
                   "original_max_position_embeddings": rp["original_max_position_embeddings"],
                   "beta_fast": rp.get("beta_fast", 32.0), "beta_slow": rp.get("beta_slow", 1.0)}
        af = _hf_yarn_attention_factor(rp, nested)
        if af != 1.0:
            scaling["attention_factor"] = af
    elif rtype != "default":
        raise ConfigError(f"config.json: rope type {rtype!r} not supported (default | yarn)")
    hf = dict(
        vocab_size=need("vocab_size"), hidden_size=need("hidden_size"), num_hidden_layers=L,
        num_attention_heads=need("num_attention_heads"), head_dim=c, qk_rope_head_dim=r,
        q_lora_rank=need("q_lora_rank"), o_groups=need("o_groups"), o_lora_rank=need("o_lora_rank"),
        sliding_window=need("sliding_window"), compress_ratios=ratios, csa_ratio=csa, hca_ratio=hca,
        index_n_heads=need("index_n_heads"), index_head_dim=need("index_head_dim"), index_topk=need("index_topk"),
        rope_theta=float(rope_theta), compress_rope_theta=float(comp_theta), rope_scaling=scaling,
        hc_mult=d.get("hc_mult", 4), hc_sinkhorn_iters=d.get("hc_sinkhorn_iters", 20), hc_eps=d.get("hc_eps", 1e-6),
        n_routed_experts=need("n_routed_experts"), n_shared_experts=d.get("n_shared_experts", 1),
        num_experts_per_tok=need("num_experts_per_tok"), moe_intermediate_size=need("moe_intermediate_size"),
        routed_scaling_factor=d.get("routed_scaling_factor", 1.5), num_hash_layers=n_hash,
        swiglu_limit=d.get("swiglu_limit", 10.0), num_nextn_predict_layers=n_mtp,
        rms_norm_eps=d.get("rms_norm_eps", 1e-6), initializer_range=d.get("initializer_range", 0.02),
        max_position_embeddings=d.get("max_position_embeddings", 1048576),
        tie_word_embeddings=d.get("tie_word_embeddings", False),
    )
    if d.get("scoring_func", "sqrtsoftplus") != "sqrtsoftplus":
        raise ConfigError(f"config.json: scoring_func {d['scoring_func']!r} not supported (sqrtsoftplus)")
    if hf["tie_word_embeddings"]:
        raise ConfigError("config.json: tie_word_embeddings=true not supported (DSv4 head is untied)")
    for k in sorted(set(extra) & set(hf)):
        if extra[k] != hf[k]:
            raise ConfigError(f"config.json: dsv4_config.{k} = {extra[k]!r} contradicts the HF fields, which give "
                              f"{k} = {hf[k]!r}")
    merged = {**extra, **hf, **overrides}
    return DSv4Config.from_dict(merged)


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
    return d, sd, where


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


def load_official(directory: str, **overrides):
    """An official-naming checkpoint directory (config.json + safetensors) -> DSv4Model (unclamped shared expert)."""
    d, off, where = _read_dir(directory)
    cfg = config_from_hf(d, **overrides)
    model = _build(cfg)
    load_checked(model, official_to_ours(off), where)
    return model


def save_official(model, directory: str) -> None:
    _write_dir(directory, config_to_hf(model.cfg), ours_to_official(model.state_dict()))


def save_megatron(model, directory: str, layout: str = "hybrid") -> None:
    """DSv4Model -> a Megatron-Core directory: config.json = {"megatron": dev's config fields (model/megatron_config's
    one table), "megatron_layout", "dsv4_config"}, model.safetensors in dev's names (`ours_to_megatron`)."""
    from .megatron_config import dev_behaves_differently, dev_rejects, to_megatron_config
    meg = to_megatron_config(model.cfg, layout)
    cfg = {"megatron": meg, "megatron_layout": layout, "megatron_dev_would_reject": dev_rejects(meg),
           "megatron_dev_differs": dev_behaves_differently(model.cfg), "dsv4_config": model.cfg.to_dict()}
    _write_dir(directory, cfg, ours_to_megatron(model.state_dict(), layout))


def load_megatron(directory: str, **overrides):
    """Inverse of `save_megatron` (the layout is read from config.json)."""
    from .megatron_config import from_megatron_config
    d, sd, where = _read_dir(directory)
    if "megatron" not in d:
        raise CheckpointError(f"{directory}/config.json: no 'megatron' config (not written by save_megatron)")
    layout = d.get("megatron_layout", "hybrid")
    base = DSv4Config(**d["dsv4_config"]) if d.get("dsv4_config") else None
    cfg = from_megatron_config(d["megatron"], layout, base)
    if overrides:
        cfg = cfg.replace(**overrides)
    model = _build(cfg)
    load_checked(model, megatron_to_ours(sd, layout), where)
    return model


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


# ---------------------------------------------------------------------------------------------------------
# Megatron-Core names: Megatron-LM dev's HybridModel (DSv4's path), with the GPTModel / Megatron-Bridge names
# (megatron_dsv4.md §5.2) as the alias layout="gpt". slices/D4/megatron_dev_keys.json holds dev's real keys.
#   hybrid: each of our layers i is two sub-layers, `decoder.layers.{2i}` (attention) and `{2i+1}` (FFN), each
#           `hyper_connection.*` + `inner_layer.*`; MTP depth k is `mtp.layers.{k}.mtp_model_layer.layers.{0,1}.*`
#           plus its own `mtp.layers.{k}.{enorm,hnorm,e_proj,h_proj,final_layernorm,hc_head_*}`;
#           final norm `decoder.final_norm`.
#   gpt:    `decoder.layers.{i}.{self_attention,mlp}_hyper_connection.*` and the inner names directly under the
#           layer; MTP `mtp.layers.{k}.mtp_model_layer.*`; final norm `decoder.final_layernorm`.
# mHC: fn -> mapping_proj.weight, base -> bias (not mapping_proj.bias: mapping_proj has no bias), scale [3] ->
# alpha_pre / alpha_post / alpha_res [1]. fc1 = cat(w1, w3) rows; routed experts as TEGroupedMLP
# `linear_fc1.weight{e}`; a dense `-` FFN fuses its norm into fc1 (`mlp.linear_fc1.layer_norm_weight`);
# `tid2eid` int32 (dev's buffer dtype; int64 on our side).
# ---------------------------------------------------------------------------------------------------------

_MEG_LAYOUTS = ("hybrid", "gpt")
_MEG_TOP = [("embed.weight", "embedding.word_embeddings.weight"), ("head.weight", "output_layer.weight"),
            ("hc_head_fn", "decoder.hc_head_fn"), ("hc_head_base", "decoder.hc_head_base"),
            ("hc_head_scale", "decoder.hc_head_scale")]
_MEG_FINAL_NORM = {"hybrid": "decoder.final_norm.weight", "gpt": "decoder.final_layernorm.weight"}
_MEG_ATTN = [  # (ours after `layers.{i}.` / `mtp.{k}.`, Megatron inside the attention (sub-)layer)
    ("attn_norm.weight", "input_layernorm.weight"),
    ("attn.wq_a.weight", "self_attention.linear_q_down_proj.weight"),
    ("attn.q_norm.weight", "self_attention.q_layernorm.weight"),
    ("attn.wq_b.weight", "self_attention.linear_q_up_proj.weight"),
    ("attn.wkv.weight", "self_attention.linear_kv_proj.weight"),
    ("attn.kv_norm.weight", "self_attention.kv_layernorm.weight"),
    ("attn.wo_a.weight", "self_attention.linear_o_group_proj"),
    ("attn.wo_b.weight", "self_attention.linear_proj.weight"),
    ("attn.attn_sink", "self_attention.core_attention.attn_sink"),
    ("attn.compressor.wkv.weight", "self_attention.core_attention.compressor.linear_wkv.weight"),
    ("attn.compressor.wgate.weight", "self_attention.core_attention.compressor.linear_wgate.weight"),
    ("attn.compressor.norm.weight", "self_attention.core_attention.compressor.norm.weight"),
    ("attn.compressor.ape", "self_attention.core_attention.compressor.ape"),
    ("attn.indexer.wq_b.weight", "self_attention.core_attention.indexer.linear_wq_b.weight"),
    ("attn.indexer.weights_proj.weight", "self_attention.core_attention.indexer.linear_weights_proj.weight"),
    ("attn.indexer.compressor.wkv.weight", "self_attention.core_attention.indexer.compressor.linear_wkv.weight"),
    ("attn.indexer.compressor.wgate.weight",
     "self_attention.core_attention.indexer.compressor.linear_wgate.weight"),
    ("attn.indexer.compressor.norm.weight", "self_attention.core_attention.indexer.compressor.norm.weight"),
    ("attn.indexer.compressor.ape", "self_attention.core_attention.indexer.compressor.ape"),
]
_MEG_FFN = [  # (ours, Megatron inside the FFN (sub-)layer); fc1 / experts / dense norm handled in code
    ("ffn_norm.weight", "pre_mlp_layernorm.weight"),
    ("ffn.gate.weight", "mlp.router.weight"), ("ffn.gate.bias", "mlp.router.expert_bias"),
    ("ffn.gate.tid2eid", "mlp.router.tid2eid"),
    ("ffn.shared_experts.w2.weight", "mlp.shared_experts.linear_fc2.weight"),
    ("ffn.w2.weight", "mlp.linear_fc2.weight"),
]
_MEG_DENSE_NORM = "mlp.linear_fc1.layer_norm_weight"
_MEG_HC = {"fn": "mapping_proj.weight", "base": "bias"}
_MTP_OWN = [("enorm.weight", "enorm.weight"), ("hnorm.weight", "hnorm.weight"), ("norm.weight", "final_layernorm.weight"),
            ("e_proj.weight", "e_proj.weight"), ("h_proj.weight", "h_proj.weight"), ("hc_head_fn", "hc_head_fn"),
            ("hc_head_base", "hc_head_base"), ("hc_head_scale", "hc_head_scale")]
_ALPHAS = ("alpha_pre", "alpha_post", "alpha_res")


def _meg_check_layout(layout):
    if layout not in _MEG_LAYOUTS:
        raise CheckpointError(f"megatron layout must be one of {', '.join(_MEG_LAYOUTS)}, got {layout!r}")


def _meg_prefixes(kind: str, i: int, layout: str) -> dict[str, str]:
    """Prefixes of our layer (kind 'layers') or MTP depth (kind 'mtp') i: attention / FFN inner names, their
    two hyper-connections, and the MTP block's own tensors."""
    if layout == "hybrid":
        stack, j = ("decoder.", 2 * i) if kind == "layers" else (f"mtp.layers.{i}.mtp_model_layer.", 0)
        a, f = f"{stack}layers.{j}.", f"{stack}layers.{j + 1}."
        return {"attn": a + "inner_layer.", "ffn": f + "inner_layer.", "hc_attn": a + "hyper_connection.",
                "hc_ffn": f + "hyper_connection.", "own": f"mtp.layers.{i}."}
    p = f"decoder.layers.{i}." if kind == "layers" else f"mtp.layers.{i}.mtp_model_layer."
    return {"attn": p, "ffn": p, "hc_attn": p + "self_attention_hyper_connection.",
            "hc_ffn": p + "mlp_hyper_connection.", "own": f"mtp.layers.{i}."}


def ours_to_megatron(sd: dict[str, torch.Tensor], layout: str = "hybrid") -> dict[str, torch.Tensor]:
    """Our state dict -> Megatron-Core names (layout 'hybrid': dev's HybridModel; 'gpt': GPTModel / Bridge)."""
    _meg_check_layout(layout)
    top, attn, ffn, own = dict(_MEG_TOP), dict(_MEG_ATTN), dict(_MEG_FFN), dict(_MTP_OWN)
    top["norm.weight"] = _MEG_FINAL_NORM[layout]
    out = {}
    for k, v in sd.items():
        if k in top:
            out[top[k]] = v
            continue
        m = re.match(r"^(layers|mtp)\.(\d+)\.(.+)$", k)
        if not m:
            raise CheckpointError(f"no Megatron name for tensor {k}")
        kind, i, rest = m.group(1), int(m.group(2)), m.group(3)
        p = _meg_prefixes(kind, i, layout)
        h = re.match(r"^hc_(attn|ffn)_(fn|base|scale)$", rest)
        dense = (k[: -len(rest)] + "ffn.w1.weight") in sd
        if kind == "mtp" and rest in own:
            out[p["own"] + own[rest]] = v
        elif h and h.group(2) == "scale":
            for j, a in enumerate(_ALPHAS):
                out[p["hc_" + h.group(1)] + a] = v[j:j + 1].clone()
        elif h:
            out[p["hc_" + h.group(1)] + _MEG_HC[h.group(2)]] = v
        elif rest in attn:
            out[p["attn"] + attn[rest]] = v
        elif rest == "ffn_norm.weight" and dense:
            out[p["ffn"] + _MEG_DENSE_NORM] = v
        elif rest == "ffn.gate.tid2eid":
            out[p["ffn"] + ffn[rest]] = v.to(torch.int32)
        elif rest in ffn:
            out[p["ffn"] + ffn[rest]] = v
        elif rest in ("ffn.experts.w13", "ffn.experts.w2"):
            fc = "1" if rest.endswith("w13") else "2"
            for e in range(v.shape[0]):
                out[f"{p['ffn']}mlp.experts.linear_fc{fc}.weight{e}"] = v[e].clone()
        elif rest in ("ffn.shared_experts.w1.weight", "ffn.w1.weight"):
            w3 = sd[k[: -len("w1.weight")] + "w3.weight"]
            name = "mlp.shared_experts.linear_fc1.weight" if "shared" in rest else "mlp.linear_fc1.weight"
            out[p["ffn"] + name] = torch.cat([v, w3], 0)
        elif rest not in ("ffn.shared_experts.w3.weight", "ffn.w3.weight"):
            raise CheckpointError(f"no Megatron name for tensor {k}")
    return out


def megatron_to_ours(sd: dict[str, torch.Tensor], layout: str = "hybrid") -> dict[str, torch.Tensor]:
    """Inverse of `ours_to_megatron` (same layout)."""
    _meg_check_layout(layout)
    top = {m: o for o, m in _MEG_TOP}
    top[_MEG_FINAL_NORM[layout]] = "norm.weight"
    inner = {m: o for o, m in _MEG_ATTN + _MEG_FFN}
    inner[_MEG_DENSE_NORM] = "ffn_norm.weight"
    own = {m: o for o, m in _MTP_OWN}
    hc_names = {m: o for o, m in _MEG_HC.items()}
    if layout == "hybrid":
        layer_re = [(r"^decoder\.layers\.(\d+)\.(hyper_connection|inner_layer)\.(.+)$", "layers"),
                    (r"^mtp\.layers\.(\d+)\.mtp_model_layer\.layers\.([01])\.(hyper_connection|inner_layer)\.(.+)$",
                     "mtp")]
    else:
        layer_re = [(r"^decoder\.layers\.(\d+)\.(.+)$", "layers"), (r"^mtp\.layers\.(\d+)\.mtp_model_layer\.(.+)$", "mtp")]
    out, experts, alphas = {}, {}, {}
    for k, v in sd.items():
        if k in top:
            out[top[k]] = v
            continue
        mo = re.match(r"^mtp\.layers\.(\d+)\.(.+)$", k)
        if mo and mo.group(2) in own:
            out[f"mtp.{mo.group(1)}.{own[mo.group(2)]}"] = v
            continue
        for rx, kind in layer_re:
            m = re.match(rx, k)
            if m:
                break
        else:
            raise CheckpointError(f"unexpected Megatron tensor {k}: no DSv4 counterpart")
        g = m.groups()
        if layout == "hybrid":
            i, j = (int(g[0]) // 2, int(g[0]) % 2) if kind == "layers" else (int(g[0]), int(g[1]))
            part, rest = g[-2], g[-1]
            hc = "attn" if j == 0 else "ffn"
            if part == "hyper_connection":
                rest = ("self_attention" if j == 0 else "mlp") + "_hyper_connection." + rest
        else:
            i, rest = int(g[0]), g[1]
        pre = f"layers.{i}." if kind == "layers" else f"mtp.{i}."
        a = re.match(r"^(self_attention|mlp)_hyper_connection\.(.+)$", rest)
        e = re.match(r"^mlp\.experts\.linear_fc([12])\.weight(\d+)$", rest)
        if a:
            hc = "attn" if a.group(1) == "self_attention" else "ffn"
            if a.group(2) in _ALPHAS:
                alphas.setdefault(f"{pre}hc_{hc}_scale", {})[_ALPHAS.index(a.group(2))] = v
            elif a.group(2) in hc_names:
                out[f"{pre}hc_{hc}_{hc_names[a.group(2)]}"] = v
            else:
                raise CheckpointError(f"unexpected Megatron tensor {k}: no DSv4 counterpart")
        elif e:
            experts.setdefault((pre, e.group(1)), {})[int(e.group(2))] = v
        elif rest in ("mlp.shared_experts.linear_fc1.weight", "mlp.linear_fc1.weight"):
            base = "ffn.shared_experts." if "shared" in rest else "ffn."
            w1, w3 = v.chunk(2, 0)
            out[pre + base + "w1.weight"], out[pre + base + "w3.weight"] = w1.clone(), w3.clone()
        elif rest in inner:
            out[pre + inner[rest]] = v.to(torch.int64) if rest.endswith("tid2eid") else v
        else:
            raise CheckpointError(f"unexpected Megatron tensor {k}: no DSv4 counterpart")
    for name, parts in alphas.items():
        if sorted(parts) != [0, 1, 2]:
            raise CheckpointError(f"missing tensor for {name}: needs alpha_pre, alpha_post and alpha_res")
        out[name] = torch.cat([parts[0], parts[1], parts[2]])
    for (pre, fc), per in experts.items():
        if sorted(per) != list(range(len(per))):
            raise CheckpointError(f"missing expert in {pre}mlp.experts.linear_fc{fc}.weight*: experts 0..{len(per) - 1} expected")
        out[pre + ("ffn.experts.w13" if fc == "1" else "ffn.experts.w2")] = torch.stack([per[j] for j in range(len(per))])
    return out
