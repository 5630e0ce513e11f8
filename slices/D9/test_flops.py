"""D9 FLOP / parameter accounting: published sizes, independent parameter counts, 6 N, Megatron formulas, CLI."""
import json

import pytest
import torch
from click.testing import CliRunner

from dsv4.harness.flops import COMPONENTS, count_params, flops_cmd, flops_per_token
from dsv4.model.config import get_config


def test_published_sizes():
    f = flops_per_token(get_config("flash"), 4096)
    assert 13.0e9 < f["active_params"] < 14.0e9                        # "13B activated" (13.80B incl. embedding)
    assert abs(f["params"]["active_params_excl_embedding"] - 13.27e9) < 0.01e9   # spec §2.1: 13.3B
    assert abs(f["total_params"] - 284.33e9) < 0.01e9                   # spec §2.1: 284.33B without MTP
    p = flops_per_token(get_config("pro"), 4096)
    assert abs(p["active_params"] - 49.78e9) < 0.01e9 and abs(p["total_params"] - 1573.0e9) < 0.5e9


@pytest.mark.parametrize("name", ["flash", "pro", "proxy", "tiny", "debug"])
def test_counts_agree_with_model_helper(name):
    from dsv4.model.hybrid import count_params as model_count          # written by the model helper
    cfg = get_config(name)
    ours, theirs = count_params(cfg), model_count(cfg)
    assert ours["total_params"] == theirs["total_main"]
    assert ours["active_params"] == theirs["active"]
    assert ours["total_params"] + ours["mtp_total_params"] == theirs["total"]


@pytest.mark.parametrize("name", ["debug", "tiny"])
def test_counts_and_6n_against_real_modules(name):
    """Independent oracle: the parameters of the instantiated DSv4Model and of HF's DeepseekV4 (meta device)."""
    from dsv4.model.model import DSv4Model
    cfg = get_config(name)
    m = DSv4Model(cfg)
    main = {n: p for n, p in m.named_parameters() if not n.startswith("mtp.")}
    pc = count_params(cfg)
    assert sum(p.numel() for p in main.values()) == pc["total_params"]
    assert sum(p.numel() for p in m.parameters()) == pc["total_params"] + pc["mtp_total_params"]
    # N_active(matmul): weights used in a matmul by one token; routed experts scaled by K / E
    K, E = cfg.num_experts_per_tok, cfg.n_routed_experts
    n_act = 0
    for n, p in main.items():
        if p.ndim < 2 or n == "embed.weight" or n.endswith(".ape"):
            continue                                                   # lookups, vectors, positional offsets
        n_act += p.numel() * K // E if ".experts." in n else p.numel()
    f = flops_per_token(cfg, 256)
    assert abs(f["param_flops_per_token"] / (6 * n_act) - 1) < 0.01
    assert f["param_flops_per_token"] == 6 * n_act                     # in fact exact


def test_counts_against_hf_meta_model():
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
    from dsv4.model.convert import config_to_hf
    # Flash widths (d 4096, 64 x 512 heads, 256 experts) with 5 layers (SWA, SWA, CSA, HCA, CSA)
    for cfg in (get_config("flash", num_hidden_layers=5), get_config("tiny")):
        d = {k: v for k, v in config_to_hf(cfg).items() if k not in ("dsv4_config", "architectures", "model_type")}
        with torch.device("meta"):
            hf = DeepseekV4ForCausalLM(DeepseekV4Config(**d))
        assert sum(p.numel() for p in hf.parameters()) == count_params(cfg)["total_params"]


def test_attention_terms_follow_megatron_formulas():
    cfg, S = get_config("flash"), 4096
    f = flops_per_token(cfg, S)["forward"]
    H, c, w = 64, 512, 128
    n_csa, n_hca = 21, 20
    k = min(512, S / 4)
    avg = k * (1 - 4 * k / (2 * S))                                    # 384
    assert f["window_attention"] == 2 * (43 * H * w * c * 2)           # every layer has the window branch
    assert f["csa_selected_keys"] == 2 * n_csa * H * avg * c * 2
    assert f["hca_compressed_keys"] == 2 * n_hca * H * c * S / 128
    assert f["indexer_scoring"] == 2 * n_csa * 64 * 128 * S / 4
    assert f["compressors"] == 2 * (n_csa * 4096 * 2 * c * 2 + n_hca * 4096 * c * 2)
    t = flops_per_token(cfg, S)
    assert t["total_training_flops_per_token"] == pytest.approx(3 * sum(f.values()))
    assert set(f) == set(COMPONENTS)


def test_cli_json_and_errors(tmp_path):
    r = CliRunner().invoke(flops_cmd, ["--config", "flash", "--seq", "4096", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)                                         # exactly one JSON document
    for key in ("active_params", "total_params", "total_training_flops_per_token", "forward", "backward", "moe"):
        assert key in doc
    stats = tmp_path / "routing.json"
    E = 8
    stats.write_text(json.dumps({"layers": {"1": [10, 0, 3, 3, 0, 0, 0, 0], "2": [2] * E}}))
    r = CliRunner().invoke(flops_cmd, ["--config", "debug", "--seq", "64", "--routing-stats", str(stats), "--json"])
    doc = json.loads(r.stdout)
    assert doc["moe"]["layers"]["1"]["max_over_mean"] == 10 / 2 and doc["moe"]["layers"]["2"]["max_over_mean"] == 1
    assert doc["moe"]["layers"]["1"]["tokens"] == 16 / 2               # top-2 routing: 16 assignments = 8 tokens
    cfg_file = tmp_path / "c.json"
    cfg_file.write_text(json.dumps(get_config("debug").to_dict()))
    r = CliRunner().invoke(flops_cmd, ["--config", str(cfg_file), "--seq", "64", "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["total_params"] == count_params(get_config("debug"))["total_params"]
    for args in (["--config", "nope"], ["--config", "debug", "--seq", "0"],
                 ["--config", "debug", "--routing-stats", str(cfg_file)]):
        r = CliRunner().invoke(flops_cmd, args)
        assert r.exit_code == 2 and r.stderr.count("\n") == 1 and r.stderr.startswith("dsv4: error:"), (args, r.output)
