"""Our config fields <-> Megatron-Core's (Megatron-LM dev d48bd6be0a `MLATransformerConfig`), in ONE table.

Used by `to_megatron_config` / `from_megatron_config`, by `model/interop/megatron.py`'s saver and by
`dsv4 convert --to megatron`. Every Megatron name here is a field of dev's `MLATransformerConfig` (checked by
harness/tests/test_megatron_config.py against goldens/megatron-dev/D4/transformer_config_fields.json, the field
list of dev's real dataclass written by `dsv4 goldens import-megatron`).

Conversions that are not a rename:
- `num_hash_layers` -> `moe_n_hash_layers`: dev hashes a router when `layer_number <= moe_n_hash_layers`
  (router.py), with 1-based layer numbers. On the GPT path a decoder layer is one number: N. On dev's
  HybridModel path every pattern symbol (attention AND FFN sub-layer) is one layer number
  (hybrid_block.py: `layer_number = i + 1`), our layer i's FFN is sub-layer 2i+1 -> number 2i+2, so hashing our
  first N layers needs moe_n_hash_layers = 2N (N would hash only the first ceil(N/2) FFNs).
- `compress_ratios` -> `csa_compress_ratios`: the same per-layer list (0 = window `W`, csa_ratio `C`, hca_ratio
  `H`), main layers then MTP layers; dev turns on overlapping compression iff the ratio is 4 (Compressor), ours
  iff the ratio equals `csa_ratio`, so a csa_ratio other than 4 has no Megatron equivalent (refused).
- `indexer_loss_mode` -> `dsa_indexer_use_sparse_loss` (sparse True / dense False) and `dsa_indexer_loss_coeff`
  (0 for "off").
- `rope_scaling` (YaRN, compress table only) -> `rope_type="yarn"`, `rotary_scaling_factor`,
  `original_max_position_embeddings`, `beta_fast`, `beta_slow`; main table `rotary_base`, compress table
  `csa_compress_rotary_base` (dev's default is 40000; ours 160000: always written explicitly).
"""
from __future__ import annotations

from dsv4.model.config import ConfigError, DSv4Config

# (our field, Megatron field, note). Plain renames first; the special ones are handled in code below.
FIELD_MAP: list[tuple[str, str, str]] = [
    ("hidden_size", "hidden_size", ""),
    ("num_hidden_layers", "num_layers", ""),
    ("num_attention_heads", "num_attention_heads", ""),
    ("head_dim", "kv_channels", "K = V single head; also v_head_dim"),
    ("head_dim", "v_head_dim", ""),
    ("qk_rope_head_dim", "qk_pos_emb_head_dim", "last r dims of a head"),
    ("q_lora_rank", "q_lora_rank", ""),
    ("o_groups", "o_groups", ""),
    ("o_lora_rank", "o_lora_rank", ""),
    ("sliding_window", "csa_window_size", ""),
    ("compress_ratios", "csa_compress_ratios", "main + MTP layers; overlap iff 4 in dev"),
    ("index_n_heads", "dsa_indexer_n_heads", ""),
    ("index_head_dim", "dsa_indexer_head_dim", ""),
    ("index_topk", "dsa_indexer_topk", ""),
    ("rope_theta", "rotary_base", "main table"),
    ("compress_rope_theta", "csa_compress_rotary_base", "compress table (dev default 40000)"),
    ("hc_mult", "num_residual_streams", ""),
    ("hc_sinkhorn_iters", "mhc_sinkhorn_iterations", ""),
    ("n_routed_experts", "num_moe_experts", ""),
    ("num_experts_per_tok", "moe_router_topk", ""),
    ("moe_intermediate_size", "moe_ffn_hidden_size", ""),
    ("routed_scaling_factor", "moe_router_topk_scaling_factor", ""),
    ("num_hash_layers", "moe_n_hash_layers", "x2 on the hybrid path (sub-layer numbering)"),
    ("swiglu_limit", "activation_func_clamp_value", ""),
    ("expert_bias_update_rate", "moe_router_bias_update_rate", ""),
    ("seq_aux_loss_coeff", "moe_aux_loss_coeff", "seq_aux_loss"),
    ("num_nextn_predict_layers", "mtp_num_layers", ""),
    ("mtp_loss_scaling_factor", "mtp_loss_scaling_factor", ""),
    ("indexer_loss_coeff", "dsa_indexer_loss_coeff", "0 when indexer_loss_mode is off"),
    ("indexer_loss_mode", "dsa_indexer_use_sparse_loss", "sparse -> True, dense -> False"),
    ("rms_norm_eps", "layernorm_epsilon", ""),
    ("initializer_range", "init_method_std", ""),
    ("vocab_size", "actual_vocab_size", "hash table rows"),
    ("rope_scaling", "rotary_scaling_factor", "YaRN factor (+ original_max_position_embeddings, beta_fast/slow)"),
]
# fixed Megatron settings of a DSv4 model (not fields of ours)
FIXED = {"multi_latent_attention": True, "experimental_attention_variant": "dsv4_hybrid",
         "enable_hyper_connections": True, "moe_router_score_function": "sqrtsoftplus",
         "moe_router_enable_expert_bias": True, "moe_router_load_balancing_type": "seq_aux_loss",
         "normalization": "RMSNorm", "gated_linear_unit": True, "activation_func": "silu"}
# our fields with no Megatron counterpart (kept only in "dsv4_config")
NOT_MAPPED = {"csa_ratio": "implied: dev's CSA ratio is 4 (overlap iff 4)", "hca_ratio": "implied by csa_compress_ratios",
              "hc_eps": "dev hard-codes 1e-6 (_MHC_SINKHORN_EPS, _MHC_COMPUTE_H_EPS)",
              "n_shared_experts": "moe_shared_expert_intermediate_size = n_shared * moe_intermediate_size",
              "dense_intermediate_size": "ffn_hidden_size of `-` layers",
              "shared_expert_clamp": "dev clamps every GLU through activation_func_clamp_value (see manifest)",
              "moe_layer_pattern": "the hybrid pattern's E/- symbols", "hash_seed": "the tid2eid table is stored",
              "indexer_teacher": "dev: joint teacher (csa_teacher_lse)", "max_position_embeddings": "",
              "tie_word_embeddings": "untied", }
LAYOUTS = ("hybrid", "gpt")


def megatron_fields() -> list[str]:
    """Every Megatron field name this module writes."""
    names = [m for _, m, _ in FIELD_MAP] + list(FIXED) + ["moe_shared_expert_intermediate_size", "rope_type",
                                                           "original_max_position_embeddings", "beta_fast", "beta_slow"]
    return sorted(set(names))


def to_megatron_config(cfg: DSv4Config, layout: str = "hybrid") -> dict:
    """DSv4Config -> Megatron-Core config fields (dev names)."""
    if layout not in LAYOUTS:
        raise ConfigError(f"megatron layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    if cfg.csa_ratio != 4:
        raise ConfigError(f"DSv4Config.csa_ratio: Megatron overlaps the compressor iff the ratio is 4, got {cfg.csa_ratio}")
    out = dict(FIXED)
    for ours, meg, _ in FIELD_MAP:
        v = getattr(cfg, ours)
        if ours == "compress_ratios":
            v = list(v[: cfg.num_hidden_layers + cfg.num_nextn_predict_layers])
        elif ours == "num_hash_layers":
            v = min(v, cfg.num_hidden_layers) * (2 if layout == "hybrid" else 1)
        elif ours == "indexer_loss_mode":
            v = v == "sparse"
        elif ours == "indexer_loss_coeff":
            v = 0.0 if cfg.indexer_loss_mode == "off" else v
        elif ours == "rope_scaling":
            rs = cfg.rope_scaling
            if rs:
                out.update(rope_type="yarn", original_max_position_embeddings=rs["original_max_position_embeddings"],
                           beta_fast=rs["beta_fast"], beta_slow=rs["beta_slow"])
                v = rs["factor"]
            else:
                out["rope_type"] = "rope"
                v = 1.0
        out[meg] = v
    out["moe_shared_expert_intermediate_size"] = cfg.n_shared_experts * cfg.moe_intermediate_size
    return out


def dev_rejects(d: dict) -> list[str]:
    """What dev's TransformerConfig.__post_init__ (d48bd6be0a, transformer_config.py:1745-1762) would assert on
    for these fields: ratios outside {0, 4, 128}, too short a ratio list. Toy configs (debug's HCA ratio 16)
    are still written -- names and shapes stay meaningful -- and save_megatron records these lines."""
    out = []
    bad = sorted({r for r in d["csa_compress_ratios"] if r not in (0, 4, 128)})
    if bad:
        out.append(f"csa_compress_ratios must be 0, 4, or 128 (has {bad})")
    if len(d["csa_compress_ratios"]) < d["num_layers"] + d["mtp_num_layers"]:
        out.append("csa_compress_ratios shorter than num_layers + mtp_num_layers")
    return out


def dev_behaves_differently(cfg: DSv4Config) -> list[str]:
    """Where dev, run with these fields, computes something else than our model does (recorded on export)."""
    out = []
    if cfg.swiglu_limit and not cfg.shared_expert_clamp:
        out.append("shared expert: dev clamps it (SharedExpertMLP is an MLP with the same config, so "
                   "activation_func_clamp_value applies, as in HF); ours / DeepSeek's official code leave it "
                   "unclamped (shared_expert_clamp=false)")
    return out


def from_megatron_config(d: dict, layout: str = "hybrid", base: DSv4Config | None = None) -> DSv4Config:
    """Megatron config fields -> DSv4Config (fields we do not map come from `base`, default: our defaults)."""
    if layout not in LAYOUTS:
        raise ConfigError(f"megatron layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    kw = base.to_dict() if base is not None else {}
    for ours, meg, _ in FIELD_MAP:
        if meg not in d or ours in ("indexer_loss_coeff", "rope_scaling"):
            continue
        v = d[meg]
        if ours == "num_hash_layers":
            v = v // 2 if layout == "hybrid" else v
        elif ours == "indexer_loss_mode":
            v = "sparse" if v else "dense"
        kw[ours] = v
    if "dsa_indexer_loss_coeff" in d:
        if d["dsa_indexer_loss_coeff"] == 0:
            kw["indexer_loss_mode"] = "off"
        kw["indexer_loss_coeff"] = d["dsa_indexer_loss_coeff"]
    if d.get("rope_type") == "yarn":
        kw["rope_scaling"] = {"type": "yarn", "factor": d["rotary_scaling_factor"],
                              "original_max_position_embeddings": d["original_max_position_embeddings"],
                              "beta_fast": d["beta_fast"], "beta_slow": d["beta_slow"]}
    elif d.get("rope_type") == "rope":
        kw["rope_scaling"] = None
    if "moe_shared_expert_intermediate_size" in d and "moe_ffn_hidden_size" in d:
        kw["n_shared_experts"] = d["moe_shared_expert_intermediate_size"] // d["moe_ffn_hidden_size"]
    ratios = [r for r in kw.get("compress_ratios", []) if r]
    if ratios:
        kw["csa_ratio"] = 4
        kw["hca_ratio"] = next((r for r in ratios if r != 4), kw.get("hca_ratio", 128))
    return DSv4Config(**kw)
