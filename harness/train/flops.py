"""FLOP and parameter accounting for DSv4 (slice D9): `dsv4 flops --config NAME|FILE --seq S [--json]`.

Everything is per token of a training sequence of length S (BSHD, one document per sequence).

Conventions (sources):
  * Parameter (matmul) FLOPs: forward 2 * N per token for the N weights used in a matmul, backward 4 * N
    (input and weight gradients) -- Megatron's "x 3 (fwd + 2 bwd GEMMs) x 2 (FMA)"
    (`megatron/training/training.py`, dev, `num_floating_point_operations`; megatron_dsv4.md §2.4).
  * Attention core FLOPs follow Megatron dev `_dsv4_hybrid_self_attention_flops` (megatron_dsv4.md §2.4),
    counted as multiply-adds then x 2; backward = 2 x forward as in Megatron:
      window keys (every layer, also the window branch of CSA/HCA and the MTP layer): H * n_win * c * 2 MACs
        (QK^T and PV; K = V; Megatron assumes full windows);
      CSA selected keys: H * avg_comp * c * 2 MACs with avg_comp = k (1 - 4k / (2S)), k = min(topk, S/4);
      HCA compressed keys: H * c * S / m' MACs (causal average S/(2m') entries, x 2 for QK and PV);
      indexer scoring: n_I * c_I * S / 4 MACs (the dense [S, S/4] score matrix, as Megatron counts it;
        kernels_perf.md §2.6 counts only the causal half, 2 n_I c_I S/8 FLOPs -- we keep Megatron's number).
    kernels_perf.md §2.6 gives cuDNN's sparse-attention convention (fwd 2 s H K (d_qk + d_v), bwd
    2 s H K (3 d_qk + 2 d_v)); with d_qk = d_v = c our forward equals it; its backward is 2.5x forward (it
    recomputes QK^T) where Megatron's is 2x -- reported as `attention_backward_cudnn` for reference.
  * Not counted (as Megatron): RMSNorms, softmaxes, the compressor's softmax pooling, the mHC Sinkhorn
    iterations and elementwise collapse/expand, hash routing. The mHC `fn` projections ARE matmuls and are
    counted as parameter FLOPs (Megatron omits them; they are 0.1% of Flash). The MTP block's h_proj is applied
    to each of the n_hc residual streams (ours and dev's mHC MTP), so its FLOPs are n_hc x 2 d^2 per token
    (found by slices/D9/test_flops.py's FlopCounterMode count; the parameter count is d^2 once).
  * Active parameters: all parameters except the E - K routed experts a token does not use; the frozen hash
    table `tid2eid` is a buffer, not a parameter. `active_params` includes the input embedding and the head and
    excludes MTP (as the published 13B / 49B); MTP is reported on its own.
"""
from __future__ import annotations

import json
import os

import click

from dsv4.harness.errors import report_bad_input

from dsv4.model.config import ConfigError, DSv4Config, get_config


# ----------------------------------------------------------------------------------------------- parameters
def _layer_params(cfg: DSv4Config, i: int) -> dict:
    """Parameter counts of block i (i == L is the MTP block), split into categories."""
    d, H, c, dc = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank
    g, dg, n = cfg.o_groups, cfg.o_lora_rank, cfg.hc_mult
    kind = cfg.layer_kind(i)
    p = {}
    p["attn_proj"] = d * dc + dc * H * c + d * c + (g * dg) * (H * c // g) + d * g * dg   # wq_a wq_b wkv wo_a wo_b
    p["attn_vec"] = dc + c + H                                                               # q_norm kv_norm sink
    p["compressor"], p["compressor_vec"] = 0, 0
    p["indexer_proj"], p["indexer_vec"] = 0, 0
    if kind != "window":
        m = cfg.csa_ratio if kind == "csa" else cfg.hca_ratio
        coff = 2 if kind == "csa" else 1
        p["compressor"] = 2 * coff * c * d                                                   # wkv, wgate
        p["compressor_vec"] = m * coff * c + c                                               # ape, norm
    if kind == "csa":
        nI, cI = cfg.index_n_heads, cfg.index_head_dim
        p["indexer_proj"] = nI * cI * dc + nI * d + 2 * (2 * cI) * d                          # wq_b, weights_proj, compressor
        p["indexer_vec"] = cfg.csa_ratio * 2 * cI + cI                                         # its ape, norm
    p["mhc_fn"] = 2 * ((2 + n) * n) * (n * d)                                                # hc_attn_fn, hc_ffn_fn
    p["mhc_vec"] = 2 * ((2 + n) * n + 3)                                                     # base, scale
    p["norm_vec"] = 2 * d                                                                    # attn_norm, ffn_norm
    if cfg.is_moe(i):
        E, K, f = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
        p["router"] = E * d
        p["router_vec"] = 0            # e_score_correction_bias [E] is a buffer (HF and ours), not a parameter
        p["routed_expert_each"] = 3 * d * f
        p["routed_experts_total"] = E * 3 * d * f
        p["routed_experts_active"] = K * 3 * d * f
        p["shared_expert"] = cfg.n_shared_experts * 3 * d * f
        p["dense_mlp"] = 0
    else:
        p["router"] = p["router_vec"] = p["routed_expert_each"] = 0
        p["routed_experts_total"] = p["routed_experts_active"] = p["shared_expert"] = 0
        p["dense_mlp"] = 3 * d * cfg.dense_ffn_size
    return p


_MATMUL = ("attn_proj", "compressor", "indexer_proj", "mhc_fn", "router", "shared_expert", "dense_mlp")
_VECTOR = ("attn_vec", "compressor_vec", "indexer_vec", "mhc_vec", "norm_vec", "router_vec")


def count_params(cfg: DSv4Config) -> dict:
    """Total and active parameter counts (spec §2.1, §11.3 shapes): the totals are model/hybrid.count_params (the
    one parameter count); the FLOP view adds the active MATMUL parameters (6N accounting) from `_layer_params`."""
    from dsv4.model.hybrid import count_params as model_count_params
    pc = model_count_params(cfg)
    d, V, n, L = cfg.hidden_size, cfg.vocab_size, cfg.hc_mult, cfg.num_hidden_layers
    out = {"embedding": pc["embedding"], "head": pc["head"], "total_params": pc["total_main"],
           "active_params": pc["active"], "active_params_excl_embedding": pc["active_no_embed"]}
    mm_layers = 0
    for i in range(L):
        p = _layer_params(cfg, i)
        mm_layers += sum(p[k] for k in _MATMUL) + p["routed_experts_active"]
    out["active_matmul_params"] = mm_layers + V * d + n * (n * d)    # layers + head + hc_head_fn
    mtp_inactive = mtp_mm = 0
    for j in range(cfg.num_nextn_predict_layers):
        p = _layer_params(cfg, L + j)
        mtp_inactive += p["routed_experts_total"] - p["routed_experts_active"]
        mtp_mm += sum(p[k] for k in _MATMUL) + p["routed_experts_active"] + 2 * d * d + n * n * d + V * d  # + shared head
    out["mtp_total_params"], out["mtp_active_params"] = pc["mtp"], pc["mtp"] - mtp_inactive
    out["mtp_active_matmul_params"] = mtp_mm
    return out


# ----------------------------------------------------------------------------------------------- FLOPs
COMPONENTS = ("attention_projections", "window_attention", "csa_selected_keys", "hca_compressed_keys",
              "compressors", "indexer_projections", "indexer_scoring", "router", "routed_experts",
              "shared_expert", "dense_mlp", "mhc", "head", "mtp")
PARAM_COMPONENTS = ("attention_projections", "compressors", "indexer_projections", "router", "routed_experts",
                    "shared_expert", "dense_mlp", "mhc", "head")           # matmuls with weights (main model)


def _attn_core_macs(cfg: DSv4Config, i: int, S: int) -> dict:
    """Attention-core multiply-adds per token of layer i (Megatron `_dsv4_hybrid_self_attention_flops`)."""
    H, c, win = cfg.num_attention_heads, cfg.head_dim, cfg.sliding_window
    kind = cfg.layer_kind(i)
    out = {"window_attention": H * win * c * 2, "csa_selected_keys": 0, "hca_compressed_keys": 0,
           "indexer_scoring": 0}
    if kind == "csa":
        k = min(cfg.index_topk, S / cfg.csa_ratio)
        avg_comp = k * (1 - cfg.csa_ratio * k / (2 * S))
        out["csa_selected_keys"] = H * avg_comp * c * 2
        out["indexer_scoring"] = cfg.index_n_heads * cfg.index_head_dim * S / cfg.csa_ratio
    elif kind == "hca":
        out["hca_compressed_keys"] = H * c * S / cfg.hca_ratio
    return out


def flops_per_token(cfg: DSv4Config, seq: int, routing_stats: dict | None = None) -> dict:
    """Per-token forward / backward FLOPs by component, parameter counts, MoE load accounting."""
    if seq < 1:
        raise ConfigError(f"flops.seq: must be >= 1, got {seq}")
    d, V, n, L = cfg.hidden_size, cfg.vocab_size, cfg.hc_mult, cfg.num_hidden_layers
    fwd = {k: 0.0 for k in COMPONENTS}
    for i in range(L):
        p = _layer_params(cfg, i)
        fwd["attention_projections"] += 2 * p["attn_proj"]
        fwd["compressors"] += 2 * p["compressor"]
        fwd["indexer_projections"] += 2 * p["indexer_proj"]
        fwd["router"] += 2 * p["router"]
        fwd["routed_experts"] += 2 * p["routed_experts_active"]
        fwd["shared_expert"] += 2 * p["shared_expert"]
        fwd["dense_mlp"] += 2 * p["dense_mlp"]
        fwd["mhc"] += 2 * p["mhc_fn"]
        for k, v in _attn_core_macs(cfg, i, seq).items():
            fwd[k] += 2 * v
    fwd["mhc"] += 2 * n * (n * d)                                    # hc_head_fn of the final HyperHead
    fwd["head"] = 2 * V * d
    pc = count_params(cfg)
    mtp_core = sum(2 * v for j in range(cfg.num_nextn_predict_layers)
                   for v in _attn_core_macs(cfg, L + j, seq).values())
    h_proj_streams = 2 * (n - 1) * d * d * cfg.num_nextn_predict_layers    # MTP h_proj runs on each of n streams
    fwd["mtp"] = 2 * pc["mtp_active_matmul_params"] + h_proj_streams + mtp_core
    bwd = {k: 2 * v for k, v in fwd.items()}
    tot = {k: fwd[k] + bwd[k] for k in COMPONENTS}
    core = ("window_attention", "csa_selected_keys", "hca_compressed_keys")
    param_fwd = sum(fwd[k] for k in PARAM_COMPONENTS)
    res = {
        "seq": seq,
        "forward": fwd, "backward": bwd, "total": tot,
        "forward_flops_per_token": sum(fwd.values()),
        "backward_flops_per_token": sum(bwd.values()),
        "total_training_flops_per_token": sum(tot.values()),
        "param_flops_per_token": 3 * param_fwd,                       # main model matmuls, fwd + bwd
        "attention_backward_cudnn": {k: 2.5 * fwd[k] for k in core},
        "params": pc,
        "active_params": pc["active_params"], "total_params": pc["total_params"],
        "moe": moe_load(cfg, routing_stats),
    }
    return res


def moe_load(cfg: DSv4Config, stats: dict | None) -> dict:
    """Tokens per expert and imbalance per MoE layer.

    `stats` = {"layers": {"<layer>": [tokens routed to expert e, ...]}}. Without it, uniform routing is assumed
    (T K / E tokens per expert). `max_over_mean` is the slowdown of the busiest expert over a balanced layer;
    `routed_flops_critical_path_per_token` scales the routed-expert FLOPs by it.
    """
    E, K = cfg.n_routed_experts, cfg.num_experts_per_tok
    moe_layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe(i)]
    out = {"experts": E, "topk": K, "moe_layers": len(moe_layers),
           "hash_layers": sum(cfg.is_hash(i) for i in moe_layers), "source": "uniform"}
    if not stats:
        out["max_over_mean"] = 1.0
        return out
    layers = stats.get("layers")
    if not isinstance(layers, dict) or not layers:
        raise ConfigError("routing-stats.layers: must be a non-empty object layer -> [tokens per expert]")
    per = {}
    for k, counts in layers.items():
        if not isinstance(counts, list) or len(counts) != E or any((not isinstance(x, (int, float))) or x < 0
                                                                   for x in counts):
            raise ConfigError(f"routing-stats.layers.{k}: need {E} non-negative counts")
        mean = sum(counts) / E
        per[k] = {"tokens_per_expert": counts, "tokens": sum(counts) / K, "max": max(counts), "min": min(counts),
                  "max_over_mean": max(counts) / mean if mean else 1.0}
    out.update(source="routing-stats", layers=per,
               max_over_mean=max(v["max_over_mean"] for v in per.values()),
               mean_max_over_mean=sum(v["max_over_mean"] for v in per.values()) / len(per))
    return out


def add_critical_path(res: dict, cfg: DSv4Config) -> None:
    imb = res["moe"].get("mean_max_over_mean", 1.0)
    res["moe"]["routed_flops_critical_path_per_token"] = res["total"]["routed_experts"] * imb


# ----------------------------------------------------------------------------------------------- CLI
def _load_config(spec: str) -> tuple[str, DSv4Config]:
    if os.path.isfile(spec):
        with open(spec) as f:
            try:
                d = json.load(f)
            except json.JSONDecodeError as e:
                raise ConfigError(f"config: {spec} is not JSON ({e.msg})") from None
        return os.path.basename(spec), DSv4Config.from_dict(d)
    return spec, get_config(spec)


def _fmt(x: float) -> str:
    for unit, s in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(x) >= unit:
            return f"{x / unit:.3f}{s}"
    return f"{x:.1f}"


@click.command("flops")
@click.option("--config", "config", required=True, help="debug|tiny|proxy|flash|pro or a JSON config file")
@click.option("--seq", type=int, default=4096, show_default=True, help="sequence length S")
@click.option("--routing-stats", type=click.Path(), default=None, help="JSON {layers: {i: [tokens per expert]}}")
@click.option("--json", "as_json", is_flag=True, help="print one JSON document on stdout")
def flops_cmd(config, seq, routing_stats, as_json):
    """Per-token training FLOPs by component, active/total parameters, MoE load."""
    try:
        name, cfg = _load_config(config)
        stats = None
        if routing_stats:
            if not os.path.isfile(routing_stats):
                raise ConfigError(f"routing-stats: no such file {routing_stats!r}")
            with open(routing_stats) as f:
                stats = json.load(f)
        res = flops_per_token(cfg, seq, stats)
        add_critical_path(res, cfg)
    except (ConfigError, ValueError, TypeError) as e:
        report_bad_input(e)
    res = {"config": name, **res}
    if as_json:
        click.echo(json.dumps(res, indent=1))
        return
    click.echo(f"config {name}  seq {seq}  active params {_fmt(res['active_params'])}  "
               f"total params {_fmt(res['total_params'])}")
    click.echo(f"{'component':24s} {'forward':>10s} {'backward':>10s} {'total':>10s}   (FLOPs per token)")
    for k in COMPONENTS:
        click.echo(f"{k:24s} {_fmt(res['forward'][k]):>10s} {_fmt(res['backward'][k]):>10s} "
                   f"{_fmt(res['total'][k]):>10s}")
    click.echo(f"{'TOTAL':24s} {_fmt(res['forward_flops_per_token']):>10s} "
               f"{_fmt(res['backward_flops_per_token']):>10s} {_fmt(res['total_training_flops_per_token']):>10s}")
    click.echo(f"6 * N_active(matmul) = {_fmt(6 * res['params']['active_matmul_params'])}; "
               f"parameter FLOPs = {_fmt(res['param_flops_per_token'])}")
