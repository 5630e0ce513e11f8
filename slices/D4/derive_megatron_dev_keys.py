"""Writes slices/D4/megatron_dev_keys.json: the state_dict() keys, shapes and dtypes that Megatron-LM dev's
HybridModel (DSv4 path) holds, for configs of ours (`python slices/D4/derive_megatron_dev_keys.py`).

Derived by reading dev's module constructors (names only, no Megatron code copied; see PROVENANCE below),
not by running them: dev's modules allocate on torch.cuda.current_device() and its DSv4 layer specs need
Transformer Engine, neither of which this CPU host has. Each rule below names the file it was read from.
It does not import our model or convert.py, so a wrong name in `ours_to_megatron` cannot leak into it;
the test compares `ours_to_megatron` against the JSON exactly.

Input is a Megatron-side config written with dev's field names (mcfg below); `to_mcfg` maps our config to it
by the documented field correspondence only (no module names).
"""
from __future__ import annotations

import json
import os

REPO, COMMIT = "NVIDIA/Megatron-LM", "d48bd6be0a85cc0d6d3cc71e8750cf357cc6bdb1"   # branch dev, 2026-08-21
PROVENANCE = {
    "repo": REPO, "branch": "dev", "commit": COMMIT, "commit_date": "2026-08-21",
    "files_read": [
        "megatron/core/models/hybrid/hybrid_model.py (embedding, decoder, mtp, output_layer)",
        "megatron/core/models/hybrid/hybrid_block.py (HybridStack: layers.{j}, HyperConnectionHybridLayer "
        "hyper_connection + inner_layer per sub-layer, final_norm, hc_head_fn/base/scale; none of those two "
        "in the MTP stack)",
        "megatron/core/models/hybrid/hybrid_layer_specs.py (hybrid_dsv4_stack_spec: attention layers "
        "input_layernorm + self_attention; MLPLayer with TELayerNormColumnParallelLinear fc1; "
        "MoETransformerLayer pre_mlp_layernorm + mlp, TE grouped-gemm MoE)",
        "megatron/core/models/hybrid/hybrid_layer_allocation.py (symbols W C H D E - | /)",
        "megatron/core/models/gpt/experimental_attention_variant_module_specs.py "
        "(get_dsv4_hybrid_module_spec_for_backend)",
        "megatron/core/transformer/experimental_attention_variant/deepseek_v4_hybrid_attention.py "
        "(linear_q_down_proj, linear_q_up_proj, linear_kv_proj, q_layernorm, kv_layernorm, "
        "linear_o_group_proj, linear_proj, core_attention)",
        "megatron/core/transformer/experimental_attention_variant/csa.py (CompressedSparseAttention attn_sink, "
        "compressor if ratio > 1, indexer if ratio == 4; Compressor linear_wkv, linear_wgate, ape, norm with "
        "coff = 2 iff ratio == 4; CSAIndexer linear_wq_b, linear_weights_proj, compressor)",
        "megatron/core/transformer/hyper_connection.py (HyperConnectionModule mapping_proj (no bias), "
        "alpha_pre, alpha_post, alpha_res [1], bias [n*n + 2n])",
        "megatron/core/transformer/moe/router.py (weight; tid2eid int32 buffer iff layer_number <= "
        "moe_n_hash_layers and not MTP; expert_bias fp32 buffer only on non-hash layers)",
        "megatron/core/transformer/moe/experts.py (TEGroupedMLP linear_fc1.weight{e} [2f, d], "
        "linear_fc2.weight{e} [d, f])",
        "megatron/core/transformer/moe/shared_experts.py, megatron/core/transformer/mlp.py (linear_fc1 "
        "[2f, d] gated, linear_fc2; no gate_weight without moe_shared_expert_gate)",
        "megatron/core/transformer/multi_token_prediction.py (mtp.layers.{k}: enorm, hnorm, e_proj, h_proj "
        "(mHC mode), mtp_model_layer = HybridStack, final_layernorm, hc_head_fn/base/scale)",
    ],
    "how": "hand-derived from the constructors listed (this script); the whole HybridModel was not built (its "
           "DSv4 spec needs Transformer Engine: TESpecProvider, TELinear). Transformer Engine `_extra_state` "
           "entries (fp8 metadata, no tensor data) and non-persistent buffers (local_tokens_per_expert, cos/sin "
           "caches) are left out.",
    "built_check": "HyperConnectionModule and TopKRouter were built on CPU from the dev tree (PYTHONPATH, "
                   "torch.cuda.current_device patched to 'cpu', gloo world size 1, MLATransformerConfig with the "
                   "debug sizes): keys, shapes and dtypes equal the derived ones (mapping_proj.weight [24, 256], "
                   "bias [24], alpha_pre/post/res [1]; router at layer_number 2 with moe_n_hash_layers 2: weight "
                   "[8, 64] + tid2eid int32 [256, 2], no expert_bias; layer_number 3, 4 and MTP: weight + "
                   "expert_bias fp32 [8]). DSv4HybridSelfAttention from dev's get_dsv4_hybrid_module_spec_for_backend, "
                   "with one-`weight` stand-ins for the Transformer Engine leaf linears / norms, gives exactly the "
                   "derived self_attention keys and shapes at ratios 0 and 4, and at 128 the same names (ape "
                   "[128, 32] there, [16, 32] for debug's ratio 16). dev's HybridStack for layer types WECEHE (its "
                   "HyperConnectionHybridLayer, TransformerLayer, MoETransformerLayer, MoELayer, TopKRouter, "
                   "shared experts; leaf linears / norms stubbed or local, experts SequentialMLP) gives exactly the "
                   "derived `decoder.*` keys and shapes except the routed experts (TEGroupedMLP names are from "
                   "reading) and that ape, plus `_extra_state` entries (None) of the local linears. The MTP block "
                   "and the TE leaf names (weight, layer_norm_weight, weight{e}) are from reading only.",
    "notes": [
        "Each of our layers is two HybridModel sub-layers: attention at j = 2i, FFN at j = 2i + 1.",
        "Dev's 'C' / 'H' symbols fix the ratio at 4 / 128, and TransformerConfig asserts csa_compress_ratios in "
        "{0, 4, 128}: debug's HCA ratio 16 has no dev counterpart. For it the names are dev's HCA names (no indexer, "
        "coff 1) and the compressor's ape [ratio, c] follows our ratio; the pattern writes it as 'D'.",
        "Hash layers: dev hashes a MoE sub-layer iff its 1-based sub-layer number <= moe_n_hash_layers, so our "
        "num_hash_layers = n is dev's moe_n_hash_layers = 2n (the first n FFN sub-layers are numbers 2, 4, ..).",
        "dtypes assume params_dtype fp32 (our checkpoints); tid2eid is int32, expert_bias fp32 in any case.",
    ],
}


def to_mcfg(ours: dict, pattern: str) -> dict:
    """Our config dict + our HybridModel pattern -> the Megatron-side fields this derivation reads."""
    main, _, mtp = pattern.partition("/")
    main = main.replace("|", "")
    L = ours["num_hidden_layers"]
    ratios = []
    for i in range(L + ours["num_nextn_predict_layers"]):
        ratios += [ours["compress_ratios"][i], 0]          # per sub-layer; FFN sub-layers carry none
    dense = ours["dense_intermediate_size"] or 2 * ours["moe_intermediate_size"]

    def sym(p):                         # dev's C / H fix ratio 4 / 128; other ratios are 'D' + csa_compress_ratios
        p = p.replace("C", "C" if ours["csa_ratio"] == 4 else "D")
        return p.replace("H", "H" if ours["hca_ratio"] == 128 else "D")
    return {
        "hybrid_layer_pattern": sym(main) + ("/" + sym(mtp) if mtp else ""),
        "vocab_size": ours["vocab_size"], "hidden_size": ours["hidden_size"],
        "num_attention_heads": ours["num_attention_heads"], "v_head_dim": ours["head_dim"],
        "q_lora_rank": ours["q_lora_rank"], "o_groups": ours["o_groups"], "o_lora_rank": ours["o_lora_rank"],
        "csa_compress_ratios": ratios, "dsa_indexer_n_heads": ours["index_n_heads"],
        "dsa_indexer_head_dim": ours["index_head_dim"], "num_moe_experts": ours["n_routed_experts"],
        "moe_ffn_hidden_size": ours["moe_intermediate_size"],
        "moe_shared_expert_intermediate_size": ours["moe_intermediate_size"] * ours["n_shared_experts"],
        "ffn_hidden_size": dense, "num_residual_streams": ours["hc_mult"],
        "moe_n_hash_layers": 2 * ours["num_hash_layers"], "moe_router_topk": ours["num_experts_per_tok"],
    }


def derive(m: dict) -> dict[str, list]:
    """{key: [shape, dtype]} of dev's HybridModel state_dict for Megatron-side config m."""
    d, n, f32 = m["hidden_size"], m["num_residual_streams"], "float32"
    out = {}

    def put(k, shape, dt=f32):
        out[k] = [list(shape), dt]

    def hyper(p):                                                     # hyper_connection.py
        put(p + "hyper_connection.mapping_proj.weight", (n * n + 2 * n, n * d))
        for a in ("alpha_pre", "alpha_post", "alpha_res"):
            put(p + f"hyper_connection.{a}", (1,))
        put(p + "hyper_connection.bias", (n * n + 2 * n,))

    def compressor(p, ratio, head_dim):                              # csa.py Compressor
        coff = 2 if ratio == 4 else 1
        put(p + "linear_wkv.weight", (coff * head_dim, d))
        put(p + "linear_wgate.weight", (coff * head_dim, d))
        put(p + "ape", (ratio, coff * head_dim))
        put(p + "norm.weight", (head_dim,))

    def attention(p, ratio):                                         # deepseek_v4_hybrid_attention.py
        H, c, g, r, q = m["num_attention_heads"], m["v_head_dim"], m["o_groups"], m["o_lora_rank"], m["q_lora_rank"]
        put(p + "input_layernorm.weight", (d,))
        s = p + "self_attention."
        put(s + "linear_q_down_proj.weight", (q, d))
        put(s + "linear_q_up_proj.weight", (H * c, q))
        put(s + "linear_kv_proj.weight", (c, d))
        put(s + "kv_layernorm.weight", (c,))
        put(s + "q_layernorm.weight", (q,))
        put(s + "linear_o_group_proj", (g * r, H * c // g))
        put(s + "linear_proj.weight", (d, g * r))
        put(s + "core_attention.attn_sink", (H,))
        if ratio > 1:
            compressor(s + "core_attention.compressor.", ratio, c)
        if ratio == 4:
            ip = s + "core_attention.indexer."
            put(ip + "linear_wq_b.weight", (m["dsa_indexer_n_heads"] * m["dsa_indexer_head_dim"], q))
            put(ip + "linear_weights_proj.weight", (m["dsa_indexer_n_heads"], d))
            compressor(ip + "compressor.", ratio, m["dsa_indexer_head_dim"])

    def moe(p, hashed):                                              # router.py, experts.py, shared_experts.py
        E, f, fs = m["num_moe_experts"], m["moe_ffn_hidden_size"], m["moe_shared_expert_intermediate_size"]
        put(p + "pre_mlp_layernorm.weight", (d,))
        put(p + "mlp.router.weight", (E, d))
        if hashed:
            put(p + "mlp.router.tid2eid", (m["vocab_size"], m["moe_router_topk"]), "int32")
        else:
            put(p + "mlp.router.expert_bias", (E,))
        for e in range(E):
            put(p + f"mlp.experts.linear_fc1.weight{e}", (2 * f, d))
            put(p + f"mlp.experts.linear_fc2.weight{e}", (d, f))
        put(p + "mlp.shared_experts.linear_fc1.weight", (2 * fs, d))
        put(p + "mlp.shared_experts.linear_fc2.weight", (d, fs))

    def dense(p):                                                    # MLPLayer, TELayerNormColumnParallelLinear
        put(p + "mlp.linear_fc1.layer_norm_weight", (d,))
        put(p + "mlp.linear_fc1.weight", (2 * m["ffn_hidden_size"], d))
        put(p + "mlp.linear_fc2.weight", (d, m["ffn_hidden_size"]))

    def stack(prefix, symbols, first_ratio_index, mtp):
        for j, sym in enumerate(symbols):
            p = f"{prefix}layers.{j}."
            hyper(p)
            inner = p + "inner_layer."
            if sym in "WCHD":
                ratio = {"W": 0, "C": 4, "H": 128}.get(sym, m["csa_compress_ratios"][first_ratio_index + j])
                attention(inner, ratio)
            elif sym == "E":
                moe(inner, hashed=not mtp and first_ratio_index + j + 1 <= m["moe_n_hash_layers"])
            elif sym == "-":
                dense(inner)

    main, _, mtp = m["hybrid_layer_pattern"].partition("/")
    put("embedding.word_embeddings.weight", (m["vocab_size"], d))
    stack("decoder.", main, 0, mtp=False)
    put("decoder.final_norm.weight", (d,))
    put("decoder.hc_head_fn", (n, n * d))
    put("decoder.hc_head_base", (n,))
    put("decoder.hc_head_scale", (1,))
    for k, pat in enumerate([x for x in mtp.split("/") if x]):
        p = f"mtp.layers.{k}."
        for name in ("enorm.weight", "hnorm.weight", "final_layernorm.weight"):
            put(p + name, (d,))
        put(p + "e_proj.weight", (d, d))
        put(p + "h_proj.weight", (d, d))
        put(p + "hc_head_fn", (n, n * d))
        put(p + "hc_head_base", (n,))
        put(p + "hc_head_scale", (1,))
        stack(p + "mtp_model_layer.", pat, len(main) + k * len(pat), mtp=True)
    put("output_layer.weight", (m["vocab_size"], d))
    return out


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    from dsv4.model.config import get_config            # our config values only (no module names)
    from dsv4.model.hybrid import parse_pattern, to_pattern
    cases = {"debug": get_config("debug"), "debug_dense_WEC-/WE": parse_pattern("WEC-/WE", "debug").cfg}
    doc = {"provenance": PROVENANCE, "configs": {}}
    for name, cfg in cases.items():
        mcfg = to_mcfg(cfg.to_dict(), to_pattern(cfg))
        keys = derive(mcfg)
        doc["configs"][name] = {"megatron_config": mcfg, "keys": keys}
    path = os.path.join(here, "megatron_dev_keys.json")
    with open(path, "w") as fh:
        json.dump(doc, fh, indent=1)
        fh.write("\n")
    print(f"wrote {path}: " + ", ".join(f"{k} {len(v['keys'])} keys" for k, v in doc["configs"].items()))


if __name__ == "__main__":
    main()
