"""Megatron-LM dev oracle cases for whole layers: dev's MoELayer (hash and score routers, clamped GLU experts) and
dev's MultiTokenPredictionLayer with hyper-connection streams, built on CPU from dev's own specs.

Registered into harness/megatron_cases.CASES (imported at its end); same MCase contract (inputs / ours / dev /
function / mapping / tol). Built without Transformer Engine: the local backend (megatron_cases._dev_world:
TELinear -> y = x W^T stand-in, norms WrappedTorchNorm = torch RMSNorm), routed experts SequentialMLP (dev's
local-backend experts; TE's TEGroupedMLP holds the same matrices as `linear_fc{1,2}.weight{e}`), the allgather
token dispatcher (alltoall allocates a CUDA stream in __init__). Weights: our module's state dict renamed by
model/interop/megatron.ours_to_megatron (hybrid layout), experts renamed to SequentialMLP's
`local_experts.{e}.linear_fc{1,2}.weight`, loaded strictly (only `_extra_state` entries may be missing).
"""
from __future__ import annotations

import re

import torch
import torch.nn.functional as F

from dsv4.harness.megatron_cases import _ATTN_RATIOS, _dev_config, _dev_world, _grads, _leaf, mcase

_S = 37           # tokens (one document), as the D1 layer cases
_NE = 4           # d_w13 [E, 2f, d] stored for experts 0..3 only (a golden output holds <= 16384 values)


def _cfg(**over):
    """debug with dev-buildable ratios [0, 4, 128, 0] (dev asserts ratios in {0, 4, 128}), swiglu_limit 1 (the
    clamps fire on O(1) activations) and the shared expert clamped as dev clamps it (P5 differences)."""
    from dsv4.model.config import get_config
    kw = dict(compress_ratios=_ATTN_RATIOS, hca_ratio=128, swiglu_limit=1.0, shared_expert_clamp=True)
    kw.update(over)
    return get_config("debug", **kw)


def _seed_params(mod, seed=1):
    """O(1) outputs: matrices ~ N / sqrt(fan_in), 1-D parameters and ape ~ 0.3 N (+1 for norm weights), the
    expert bias buffer ~ 0.05 N (selection only: it must not enter the routing weights)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in mod.named_parameters():
            if p.dim() == 1 or n.endswith("ape"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (1.0 if "norm" in n else 0.0))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
        for n, b in mod.named_buffers():
            if n.endswith("gate.bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.05)
    return mod.eval()


def _to_dev_names(sd: dict, prefix: str, strip: str) -> dict:
    """Our tensors (keys under `prefix`) -> dev names via ours_to_megatron, `strip` removed, TEGroupedMLP expert
    names -> SequentialMLP's."""
    from dsv4.model.interop.megatron import ours_to_megatron
    meg = ours_to_megatron({prefix + k: v for k, v in sd.items()})
    out = {}
    for k, v in meg.items():
        assert k.startswith(strip), k
        k = re.sub(r"experts\.linear_fc([12])\.weight(\d+)$", r"experts.local_experts.\2.linear_fc\1.weight",
                   k[len(strip):])
        out[k] = v
    return out


def _load_strict(mod, sd):
    missing, unexpected = mod.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise RuntimeError(f"dev {type(mod).__name__}: missing {missing}, unexpected {unexpected}")


def _moe_spec(cfg):
    """Dev's MoE spec on the local backend: SequentialMLP experts (ColumnParallelLinear / RowParallelLinear)."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
    return get_moe_module_spec_for_backend(LocalSpecProvider(), num_experts=cfg.num_moe_experts, moe_grouped_gemm=False)


_DEV_MOE_FIELDS = dict(activation_func=F.silu, moe_router_load_balancing_type="seq_aux_loss",
                       moe_token_dispatcher_type="allgather", moe_grouped_gemm=False, hidden_dropout=0.0,
                       attention_dropout=0.0)


# =========================================================================================== P4: the MoE layer
def _moe_inputs(li):
    """Our MoE of layer li (0: hash-routed, 1: score-routed with a non-zero expert bias) of _cfg(), parameters
    seeded (seed 1), hidden x [S=37, B=2, 64] ~ N and token ids [2, 37] (seed 3)."""
    g = torch.Generator().manual_seed(3)
    return {"li": li, "x": torch.randn(_S, 2, 64, generator=g), "ids": torch.randint(0, 256, (2, _S), generator=g)}


def _our_moe(li):
    from dsv4.model.moe import MoE
    torch.manual_seed(0)
    return _seed_params(MoE(_cfg(), li))


def _moe_ours(inp):
    moe = _our_moe(inp["li"])
    P = dict(moe.named_parameters())
    L = {"x": _leaf(inp["x"]), "gate_w": P["gate.weight"], "w13": P["experts.w13"], "w2": P["experts.w2"],
         "shared_w1": P["shared_experts.w1.weight"]}
    y = moe(L["x"].transpose(0, 1), inp["ids"])                            # [B, S, d]
    res = _grads({"y": y.transpose(0, 1)}, L)                              # [S, B, d]
    res["d_w13"] = res["d_w13"][:_NE]
    return res


def _moe_dev(inp, M):
    from megatron.core.process_groups_config import ProcessGroupCollection
    ours = _our_moe(inp["li"])
    _dev_world(M)
    cfg = _dev_config(M, _cfg(), **_DEV_MOE_FIELDS)
    pg = ProcessGroupCollection.use_mpu_process_groups()
    dev = _moe_spec(cfg)(config=cfg, layer_number=2 * inp["li"] + 2, pg_collection=pg).eval()
    assert dev.router.is_hash_layer == ours.gate.hash
    sd = {("ffn." + k): v for k, v in ours.state_dict().items() if not k.endswith("tokens_per_expert")}
    i = 2 * inp["li"] + 1
    _load_strict(dev, _to_dev_names(sd, f"layers.{inp['li']}.", f"decoder.layers.{i}.inner_layer.mlp."))
    P = dict(dev.named_parameters())
    E = cfg.num_moe_experts
    # the stacked leaves of ours, as dev's per-expert tensors: d_w13[e] = d local_experts.e.linear_fc1.weight
    L = {"x": _leaf(inp["x"]), "gate_w": P["router.weight"], "shared_w1": P["shared_experts.linear_fc1.weight"]}
    fc1 = [P[f"experts.local_experts.{e}.linear_fc1.weight"] for e in range(E)]
    fc2 = [P[f"experts.local_experts.{e}.linear_fc2.weight"] for e in range(E)]
    y, _ = dev(L["x"], input_ids=inp["ids"])
    res = _grads({"y": y}, dict(L, **{f"fc1_{e}": fc1[e] for e in range(E)}, **{f"fc2_{e}": fc2[e] for e in range(E)}))
    res["d_w13"] = torch.stack([res.pop(f"d_fc1_{e}") for e in range(E)])[:_NE]
    res["d_w2"] = torch.stack([res.pop(f"d_fc2_{e}") for e in range(E)])
    f = cfg.moe_shared_expert_intermediate_size
    res["d_shared_w1"] = res["d_shared_w1"][:f]                      # fc1 = cat(w1, w3): our w1 rows
    return res


_MOE_MAP = ("our MoE(layer li) of debug(compress_ratios [0,4,128,0], swiglu_limit 1, shared_expert_clamp true) -> "
            "model/interop/megatron.ours_to_megatron (hybrid: decoder.layers.{2li+1}.inner_layer.mlp.*; router.weight, "
            "router.tid2eid int32 | router.expert_bias, shared_experts.linear_fc1 = cat(w1, w3), linear_fc2), routed "
            "experts linear_fc{1,2}.weight{e} -> SequentialMLP local_experts.{e}.linear_fc{1,2}.weight; dev MoELayer "
            "from get_moe_module_spec_for_backend(LocalSpecProvider, moe_grouped_gemm False) at layer_number 2li+2 "
            "with to_megatron_config(cfg) fields + activation_func silu, allgather dispatcher, eval; x [S, B, d], "
            "input_ids [B, S]; gradients of our stacked w13 (experts 0-3) / w2 = dev's per-expert fc1 / fc2 stacked")
# measured ours vs dev (this host, fp32; |grad| up to 16): y <= 3.6e-7, d_x <= 8.3e-7, d_w2 7.2e-7, d_gate_w 1.4e-6,
# d_w13 <= 3.8e-6, d_shared_w1 3.8e-6 -> x10: y 4e-6, d_x 1e-5, the weight gradients 4e-5 abs
_MOE_TOL = {"y": (4e-6, 1e-5), "d_x": (1e-5, 1e-5)}
_MOE_TOL.update({k: (4e-5, 1e-5) for k in ("d_gate_w", "d_w13", "d_w2", "d_shared_w1")})
for _li, _kind in ((0, "hash"), (1, "score")):
    mcase(f"moe_layer_{_kind}", "P4", "megatron.core.transformer.moe.moe_layer.MoELayer.forward (TopKRouter "
          f"{'_hash_routing (tid2eid)' if _li == 0 else 'sqrtsoftplus top-k with expert_bias'}, "
          "MoEAllGatherTokenDispatcher, SequentialMLP experts and SharedExpertMLP with the clamped GLU of "
          "activation_func_clamp_value)", _MOE_MAP, _MOE_TOL,
          (lambda li=_li: _moe_inputs(li)))((_moe_ours, _moe_dev))


# =========================================================================================== P2: MTP with mHC streams
def _mtp_inputs():
    """Our MTP depth 1 (MTPBlock at layer index 3 of _cfg(): window attention + score-routed MoE, own mHC and
    head), seeded (seed 1); embedding table [256, 64] ~ N, ids [1, 37], main streams X [1, 37, 4, 64] ~ N
    (seed 4)."""
    g = torch.Generator().manual_seed(4)
    return {"emb": torch.randn(256, 64, generator=g), "ids": torch.randint(0, 256, (1, _S), generator=g),
            "X": torch.randn(1, _S, 4, 64, generator=g)}


def _our_mtp():
    from dsv4.model.mtp import MTPBlock
    cfg = _cfg()
    torch.manual_seed(0)
    return _seed_params(MTPBlock(cfg, cfg.num_hidden_layers))


_MTP_PARAMS = {"e_proj": "e_proj.weight", "h_proj": "h_proj.weight", "hc_head_fn": "hc_head_fn",
               "attn_wq_a": "attn.wq_a.weight", "hc_attn_fn": "hc_attn_fn", "w13": "ffn.experts.w13"}      # d_w13: experts 0.._NE-1


def _mtp_ours(inp):
    from dsv4.model.layout import Layout
    mtp = _our_mtp()
    P = dict(mtp.named_parameters())
    L = {"X": _leaf(inp["X"]), "emb": _leaf(inp["emb"])}
    L.update({k: P[v] for k, v in _MTP_PARAMS.items()})
    layout = Layout.batch(1, _S)
    ids_next = layout.roll_next(inp["ids"], 0)                              # token t+1, 0 past the end (dev too)
    y = mtp(L["X"], F.embedding(ids_next, L["emb"]), ids_next, layout)      # [1, S, d]
    res = _grads({"y": y.transpose(0, 1)}, L)                               # [S, 1, d]
    res["d_w13"] = res["d_w13"][:_NE]
    return res


def _dev_mtp_layer(M, cfg):
    import dataclasses

    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_dsv4_hybrid_module_spec_for_backend)
    from megatron.core.models.hybrid.hybrid_block import HybridStackSubmodules
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.multi_token_prediction import (MultiTokenPredictionLayer,
                                                                  MultiTokenPredictionLayerSubmodules)
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_layer import (MoETransformerLayer, TransformerLayer,
                                                             TransformerLayerSubmodules)
    backend = _dev_world(M)
    attn = get_dsv4_hybrid_module_spec_for_backend(cfg, backend)
    # hybrid_layer_specs.hybrid_dsv4_stack_spec's 'W' layer and hybrid_stack_spec's moe_layer, norms TENorm ->
    # WrappedTorchNorm (RMSNorm), MoE on the local backend
    window = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=WrappedTorchNorm, self_attention=dataclasses.replace(
            attn, params={**attn.params, "compress_ratio": 0}), self_attn_bda=get_bias_dropout_add))
    moe = ModuleSpec(module=MoETransformerLayer, submodules=TransformerLayerSubmodules(
        pre_mlp_layernorm=WrappedTorchNorm, mlp=_moe_spec(cfg), mlp_bda=get_bias_dropout_add))
    # e_proj / h_proj: the y = x W^T stand-in (hybrid_layer_specs uses TEColumnParallelLinear, = x W^T at TP 1).
    # Not the local ColumnParallelLinear: its backward (megatron/core/utils.py prepare_input_tensors_for_wgrad_compute
    # flattens 3-D inputs only) fails on h_proj's 4-D per-stream input [s, b, n, h] (P2 differences)
    sub = MultiTokenPredictionLayerSubmodules(enorm=WrappedTorchNorm, hnorm=WrappedTorchNorm,
                                              layer_norm=WrappedTorchNorm, e_proj=backend.linear(),
                                              h_proj=backend.linear())
    return MultiTokenPredictionLayer(cfg, sub, layer_number=1, pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
                                     mtp_layer_pattern="WE",
                                     hybrid_submodules=HybridStackSubmodules(window_layer=window, moe_layer=moe)).eval()


def _mtp_dev(inp, M):
    ours = _our_mtp()
    cfg = _dev_config(M, _cfg(), **_DEV_MOE_FIELDS)
    dev = _dev_mtp_layer(M, cfg)
    sd = {k: v for k, v in ours.state_dict().items() if not k.endswith("tokens_per_expert")}
    _load_strict(dev, _to_dev_names(sd, "mtp.0.", "mtp.layers.0."))
    P = dict(dev.named_parameters())
    dev_names = {"e_proj": "e_proj.weight", "h_proj": "h_proj.weight", "hc_head_fn": "hc_head_fn",
                 "attn_wq_a": "mtp_model_layer.layers.0.inner_layer.self_attention.linear_q_down_proj.weight",
                 "hc_attn_fn": "mtp_model_layer.layers.0.hyper_connection.mapping_proj.weight"}
    L = {"X": _leaf(inp["X"]), "emb": _leaf(inp["emb"])}
    L.update({k: P[v] for k, v in dev_names.items()})
    E = cfg.num_moe_experts
    fc1 = {f"fc1_{e}": P[f"mtp_model_layer.layers.1.inner_layer.mlp.experts.local_experts.{e}.linear_fc1.weight"]
           for e in range(E)}

    class Embedding(torch.nn.Module):                        # dev's LanguageModelEmbedding contract: -> [s, b, h]
        def forward(self, input_ids, position_ids):
            return F.embedding(input_ids, L["emb"]).transpose(0, 1).contiguous()
    S, B, n, d = _S, 1, 4, 64
    streams = L["X"].transpose(0, 1).reshape(S, B, n * d)                    # [s, b, n*h] stream-major
    hidden, *_ = dev(input_ids=inp["ids"], position_ids=torch.arange(S)[None], hidden_states=streams,
                     attention_mask=None, embedding=Embedding())
    y = dev._postprocess(hidden)                                             # hc head + final_layernorm [s, b, h]
    res = _grads({"y": y}, dict(L, **fc1))
    res["d_w13"] = torch.stack([res.pop(f"d_fc1_{e}") for e in range(E)])[:_NE]
    return res


_MTP_MAP = ("our MTPBlock (layer 3 of debug(compress_ratios [0,4,128,0], swiglu_limit 1, shared_expert_clamp true): "
            "window attention + score-routed MoE) -> ours_to_megatron 'mtp.layers.0.*' (enorm, hnorm, e_proj, h_proj, "
            "final_layernorm <- norm, hc_head_*; mtp_model_layer.layers.{0,1}.{hyper_connection,inner_layer}.*), "
            "experts -> SequentialMLP names; dev MultiTokenPredictionLayer(mtp_layer_pattern 'WE', hybrid_submodules: "
            "hybrid_dsv4_stack_spec's window layer + the MoE layer on the local backend, norms WrappedTorchNorm, "
            "e_proj/h_proj the y = x W^T stand-in of TEColumnParallelLinear), eval; forward(input_ids, position_ids, hidden_states = our "
            "streams [s, b, n*h], embedding = F.embedding with our table, [s, b, h]) then _postprocess "
            "(learned_output_contract + final_layernorm); ours: MTPBlock(X, Embed(roll_next(ids, 0)), ...); "
            "gradients w.r.t. the streams, the table and six parameters (w13: experts 0-3 of dev's per-expert fc1 stacked)")
# measured ours vs dev (this host, fp32; each ~3.5e-7 of the output's magnitude, mostly the mHC mapping norm of the
# ext_4531 differences): y 1.4e-6 (|y| 4.1), d_X 6.6e-7, d_emb 3.3e-6, d_e_proj 1.1e-5 (|g| 32), d_h_proj 6.4e-6,
# d_attn_wq_a 7.3e-6, d_hc_attn_fn 5.7e-7, d_hc_head_fn 3.9e-6, d_w13 4.8e-6 -> each x10 (rounded up)
_MTP_TOL = {"y": (1.5e-5, 1e-5), "d_X": (7e-6, 1e-5), "d_emb": (4e-5, 1e-5), "d_e_proj": (1.2e-4, 1e-5),
            "d_h_proj": (7e-5, 1e-5), "d_attn_wq_a": (8e-5, 1e-5), "d_hc_attn_fn": (6e-6, 1e-5),
            "d_hc_head_fn": (4e-5, 1e-5), "d_w13": (5e-5, 1e-5)}
mcase("mtp_layer_mhc", "P2", "megatron.core.transformer.multi_token_prediction.MultiTokenPredictionLayer.forward "
      "(mHC mode: _get_embeddings roll, _concat_embeddings e_proj + per-stream h_proj, nested HybridStack 'WE' with "
      "HyperConnectionHybridLayer per sub-layer) + _postprocess", _MTP_MAP, _MTP_TOL, _mtp_inputs)((_mtp_ours, _mtp_dev))
