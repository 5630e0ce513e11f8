"""Megatron-Core naming: Megatron-LM dev's HybridModel (DSv4's path), with the GPTModel / Megatron-Bridge names
(megatron_dsv4.md §5.2) as the alias layout="gpt". slices/D4/megatron_dev_keys.json holds dev's real keys; the
config fields are megatron_config.py's one table.
"""
from __future__ import annotations

import re

import torch

from dsv4.model.config import DSv4Config
from dsv4.model.interop.common import CheckpointError, _build, _read_dir, _write_dir, load_checked
from dsv4.model.interop.megatron_config import dev_behaves_differently, dev_rejects, from_megatron_config, to_megatron_config

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


def save_megatron(model, directory: str, layout: str = "hybrid") -> None:
    """DSv4Model -> a Megatron-Core directory: config.json = {"megatron": dev's config fields (megatron_config.py's
    one table), "megatron_layout", "dsv4_config"}, model.safetensors in dev's names (`ours_to_megatron`)."""
    meg = to_megatron_config(model.cfg, layout)
    cfg = {"megatron": meg, "megatron_layout": layout, "megatron_dev_would_reject": dev_rejects(meg),
           "megatron_dev_differs": dev_behaves_differently(model.cfg), "dsv4_config": model.cfg.to_dict()}
    _write_dir(directory, cfg, ours_to_megatron(model.state_dict(), layout))


def load_megatron(directory: str, **overrides):
    """Inverse of `save_megatron` (the layout is read from config.json)."""
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
