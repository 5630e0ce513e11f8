"""D4: HybridModel pattern parsing (W C H E - | /), parameter counts (Flash ~284B/13B, Pro ~1.6T/49B) checked
against meta-device modules, and a pattern-built model with dense `-` layers that runs."""
import json
import os

import pytest
import torch

from dsv4.model.config import ConfigError, get_config
from dsv4.model.hybrid import config_from_ratios, count_params, parse_pattern, to_pattern
from dsv4.model.model import build_model


def test_megatron_functional_pattern():
    lay = parse_pattern("WEC-|H-C-/W-", "debug")
    c = lay.cfg
    assert lay.stages == [[0, 1], [2, 3]]
    assert c.num_hidden_layers == 4 and c.num_nextn_predict_layers == 1
    assert c.compress_ratios == [0, c.csa_ratio, c.hca_ratio, c.csa_ratio, 0]
    assert c.moe_layer_pattern == "E----"
    assert [c.layer_kind(i) for i in range(5)] == ["window", "csa", "hca", "csa", "window"]
    assert [c.is_moe(i) for i in range(5)] == [True, False, False, False, False]
    assert to_pattern(c, lay.stages) == "WEC-|H-C-/W-"


def test_flash_schedule_as_pattern():
    flash = get_config("flash")
    pat = to_pattern(flash)
    assert pat == "WEWE" + "CEHE" * 20 + "CE" + "/WE"
    c = parse_pattern(pat, "flash").cfg
    assert c.compress_ratios == flash.compress_ratios and c.moe_layer_pattern is None
    assert c.num_hash_layers == 3
    r = config_from_ratios([0, 4, 16, 0], "debug")
    assert r.num_hidden_layers == 3 and r.compress_ratios == [0, 4, 16, 0]


@pytest.mark.parametrize("pattern,pos", [
    ("WEX-", 2), ("WC-", 1), ("EW-", 0), ("WE||C-", 3), ("|WE", 0), ("WE/", 3), ("WE/W-|C-", 5),
    ("WE/W-W-", 5), ("W", 1), ("WE|", 2), ("WE//W-", 3),
])
def test_bad_patterns_name_the_position(pattern, pos):
    with pytest.raises(ConfigError) as e:
        parse_pattern(pattern, "debug")
    msg = str(e.value)
    assert "\n" not in msg and f"position {pos}" in msg, msg


def test_empty_pattern_refused():
    with pytest.raises(ConfigError):
        parse_pattern("", "debug")


def _meta_counts(cfg):
    m = build_model(cfg, device="meta")
    total = sum(p.numel() for p in m.parameters())
    mtp = sum(p.numel() for n, p in m.named_parameters() if n.startswith("mtp."))
    routed = sum(p.numel() for n, p in m.named_parameters() if ".experts." in n and not n.startswith("mtp."))
    return total, mtp, routed


@pytest.mark.parametrize("name", ["debug", "flash", "pro"])
def test_count_params_vs_meta_module(name):
    cfg = get_config(name)
    c = count_params(cfg)
    total, mtp, routed = _meta_counts(cfg)
    assert c["total"] == total and c["mtp"] == mtp
    E, K = cfg.n_routed_experts, cfg.num_experts_per_tok
    assert c["active"] == c["total_main"] - routed + routed * K // E
    print(f"{name}: total {c['total'] / 1e9:.3f}B (main {c['total_main'] / 1e9:.3f}B), active {c['active'] / 1e9:.3f}B")


def test_published_sizes():
    f, p = count_params(get_config("flash")), count_params(get_config("pro"))
    assert abs(f["total_main"] / 1e9 - 284) < 1.0 and abs(f["active"] / 1e9 - 13.8) < 0.1      # 284B / 13B
    assert abs(p["total"] / 1e12 - 1.6) < 0.01 and abs(p["active"] / 1e9 - 49.8) < 0.1         # 1.6T / 49B
    assert abs(f["active_no_embed"] / 1e9 - 13.3) < 0.1 and abs(p["active_no_embed"] / 1e9 - 48.9) < 0.1


def test_pattern_model_with_dense_layers_runs_and_counts():
    cfg = parse_pattern("WEC-|H-/W-", "debug").cfg
    torch.manual_seed(0)
    m = build_model(cfg)
    assert sum(p.numel() for p in m.parameters()) == count_params(cfg)["total"]
    assert not hasattr(m.layers[1].ffn, "gate") and m.layers[0].ffn.gate.hash
    ids = torch.randint(0, cfg.vocab_size, (1, 23))
    out = m(ids, labels=ids)
    assert out.logits.shape == (1, 23, cfg.vocab_size) and torch.isfinite(out.loss)


def test_hub_style_config_json_gives_flash():
    """A DeepSeek-V4-Flash hub-style config.json (legacy compress_ratios incl. the MTP entry, flat rope_scaling,
    num_hash_layers) maps to exactly our `flash` config; HF-style config_to_hf -> config_from_hf is identity."""
    from dsv4.model.interop.hf_config import config_from_hf, config_to_hf
    hub = dict(vocab_size=129280, hidden_size=4096, num_hidden_layers=43, num_attention_heads=64, head_dim=512,
               qk_rope_head_dim=64, q_lora_rank=1024, o_groups=8, o_lora_rank=1024, sliding_window=128,
               compress_ratios=[0, 0] + [4, 128] * 20 + [4] + [0], index_n_heads=64, index_head_dim=128,
               index_topk=512, n_routed_experts=256, num_experts_per_tok=6, moe_intermediate_size=2048,
               num_hash_layers=3, compress_rope_theta=160000, num_nextn_predict_layers=1,
               rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                             "beta_fast": 32, "beta_slow": 1})
    assert config_from_hf(hub) == get_config("flash")
    for name in ("debug", "pro"):
        cfg = get_config(name)
        d = config_to_hf(cfg)
        d.pop("dsv4_config")
        assert config_from_hf(d, hash_seed=cfg.hash_seed) == cfg, name


MEGATRON_KEYS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "megatron_dev_keys.json")


def _meg_cases():
    return {"debug": get_config("debug"), "debug_dense_WEC-/WE": parse_pattern("WEC-/WE", "debug").cfg}


@pytest.mark.parametrize("name", list(_meg_cases()))
def test_megatron_keys_are_devs(name):
    """`ours_to_megatron` gives exactly the state_dict keys, shapes and dtypes of Megatron-LM dev's HybridModel
    (megatron_dev_keys.json: provenance inside; derived from dev's constructors, not from our names)."""
    from dsv4.model.interop.megatron import ours_to_megatron
    with open(MEGATRON_KEYS) as fh:
        doc = json.load(fh)
    assert doc["provenance"]["commit"].startswith("d48bd6be0a")
    want = {k: (tuple(s), dt) for k, (s, dt) in doc["configs"][name]["keys"].items()}
    torch.manual_seed(0)
    meg = ours_to_megatron(build_model(_meg_cases()[name]).state_dict())
    got = {k: (tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in meg.items()}
    assert sorted(set(want) - set(got)) == [], "missing dev keys"
    assert sorted(set(got) - set(want)) == [], "keys dev does not have"
    assert {k: got[k] for k in want if got[k] != want[k]} == {}, "shape / dtype differs from dev"


def test_megatron_keys_fixture_is_what_the_derivation_gives():
    """The stored key list is the output of derive_megatron_dev_keys.py for today's configs (no drift)."""
    from dsv4.model.hybrid import to_pattern
    from dsv4.slices.D4.derive_megatron_dev_keys import derive, to_mcfg
    with open(MEGATRON_KEYS) as fh:
        doc = json.load(fh)
    for name, cfg in _meg_cases().items():
        mcfg = to_mcfg(cfg.to_dict(), to_pattern(cfg))
        assert mcfg == doc["configs"][name]["megatron_config"] and derive(mcfg) == doc["configs"][name]["keys"], name


@pytest.mark.parametrize("layout", ["hybrid", "gpt"])
def test_megatron_values_and_round_trip(layout):
    """Values land where dev reads them (fc1 = cat(w1, w3), mHC base -> bias, scale -> alphas, tid2eid int32) and
    megatron_to_ours inverts ours_to_megatron bit-exactly, dtypes included; 'gpt' is the GPTModel / Bridge alias."""
    from dsv4.model.interop.megatron import megatron_to_ours, ours_to_megatron
    cfg = parse_pattern("WEC-/WE", "debug").cfg
    torch.manual_seed(0)
    sd = build_model(cfg).state_dict()
    meg = ours_to_megatron(sd, layout)
    f = cfg.moe_intermediate_size
    if layout == "hybrid":
        hc0, hc1, inner1, fin = ("decoder.layers.0.hyper_connection.", "decoder.layers.1.hyper_connection.",
                                 "decoder.layers.1.inner_layer.", "decoder.final_norm.weight")
        mtp_attn = "mtp.layers.0.mtp_model_layer.layers.0.inner_layer."
    else:
        hc0, hc1, inner1, fin = ("decoder.layers.0.self_attention_hyper_connection.",
                                 "decoder.layers.0.mlp_hyper_connection.", "decoder.layers.0.", "decoder.final_layernorm.weight")
        mtp_attn = "mtp.layers.0.mtp_model_layer."
    assert torch.equal(meg[hc0 + "bias"], sd["layers.0.hc_attn_base"])
    assert torch.equal(meg[hc0 + "mapping_proj.weight"], sd["layers.0.hc_attn_fn"])
    assert torch.equal(meg[hc1 + "alpha_post"], sd["layers.0.hc_ffn_scale"][1:2])
    assert torch.equal(meg[inner1 + "mlp.shared_experts.linear_fc1.weight"][:f], sd["layers.0.ffn.shared_experts.w1.weight"])
    assert torch.equal(meg[inner1 + "mlp.shared_experts.linear_fc1.weight"][f:], sd["layers.0.ffn.shared_experts.w3.weight"])
    assert torch.equal(meg[inner1 + "mlp.experts.linear_fc1.weight7"], sd["layers.0.ffn.experts.w13"][7])
    t = meg[inner1 + "mlp.router.tid2eid"]
    assert t.dtype == torch.int32 and torch.equal(t.long(), sd["layers.0.ffn.gate.tid2eid"])
    assert torch.equal(meg[fin], sd["norm.weight"])
    assert torch.equal(meg[mtp_attn + "self_attention.linear_q_down_proj.weight"], sd["mtp.0.attn.wq_a.weight"])
    back = megatron_to_ours(meg, layout)
    assert back.keys() == sd.keys()
    bad = [k for k in sd if back[k].dtype != sd[k].dtype or not torch.equal(back[k], sd[k])]
    assert bad == []


def test_megatron_bad_names_refused():
    from dsv4.model.interop.megatron import CheckpointError, megatron_to_ours, ours_to_megatron
    torch.manual_seed(0)
    meg = ours_to_megatron(build_model(get_config("debug")).state_dict())
    meg["decoder.layers.0.hyper_connection.mapping_proj.bias"] = meg.pop("decoder.layers.0.hyper_connection.bias")
    with pytest.raises(CheckpointError, match=r"mapping_proj\.bias"):
        megatron_to_ours(meg)
    with pytest.raises(CheckpointError, match="layout"):
        ours_to_megatron({}, "bridge")
