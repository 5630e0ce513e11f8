"""config.json as Hugging Face's `DeepseekV4Config` fields, plus our full config under "dsv4_config".

Both the HF and the DeepSeek-official (hub) checkpoints carry this config.json, so hf.py and official.py both
use it. YaRN's `attention_factor` (HF multiplies the compress table's cos/sin by it) maps to
rope_scaling["attention_factor"].
"""
from __future__ import annotations

import math

from dsv4.model.config import ConfigError, DSv4Config

HF_TYPES = {"window": "sliding_attention", "csa": "compressed_sparse_attention",
            "hca": "heavily_compressed_attention"}

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
