"""The one config-field table (model/megatron_config.py) against Megatron-LM dev's real MLATransformerConfig
field list (slices/D4/megatron_dev_config_fields.json, written by `dsv4 goldens import-megatron`), and
`dsv4 convert --to megatron` / `--from megatron` through it."""
import json

import pytest
import torch
from click.testing import CliRunner

from dsv4.harness import megatron_import as MI
from dsv4.harness.registry import REPO
from dsv4.model.interop import megatron_config as MCF
from dsv4.model.config import ConfigError, get_config


def _dev_fields():
    doc = json.loads((REPO / MI.CONFIG_FIELDS).read_text())
    assert doc["megatron_commit"] == MI.PINNED_COMMIT
    return set(doc["fields"])


def test_every_megatron_name_is_a_dev_field():
    fields = _dev_fields()
    missing = [m for m in MCF.megatron_fields() if m not in fields]
    assert not missing, f"not fields of dev's MLATransformerConfig: {missing}"


def test_issue_fields_are_in_the_table():
    megs = {m for _, m, _ in MCF.FIELD_MAP}
    for m in ("csa_compress_ratios", "csa_window_size", "num_residual_streams", "mhc_sinkhorn_iterations",
              "activation_func_clamp_value", "moe_n_hash_layers", "dsa_indexer_n_heads", "dsa_indexer_head_dim",
              "dsa_indexer_topk", "dsa_indexer_loss_coeff"):
        assert m in megs


@pytest.mark.parametrize("name", ["debug", "tiny", "flash"])
@pytest.mark.parametrize("layout", ["hybrid", "gpt"])
def test_round_trip(name, layout):
    cfg = get_config(name)
    d = MCF.to_megatron_config(cfg, layout)
    assert d["csa_window_size"] == cfg.sliding_window and d["num_residual_streams"] == cfg.hc_mult
    back = MCF.from_megatron_config(d, layout, base=get_config(name))
    assert back.to_dict() == cfg.to_dict()
    # without a base, every mapped field still comes back
    fresh = MCF.from_megatron_config(d, layout)
    for ours, _, _ in MCF.FIELD_MAP:
        assert getattr(fresh, ours) == getattr(cfg, ours), ours


def test_hash_layers_follow_devs_layer_number_rule():
    """dev hashes a router iff layer_number <= moe_n_hash_layers; on the hybrid path our layer i's FFN is
    sub-layer number 2i+2, on the GPT path decoder number i+1: the same layers as ours (i < num_hash_layers)."""
    cfg = get_config("flash")
    for layout, number in (("hybrid", lambda i: 2 * i + 2), ("gpt", lambda i: i + 1)):
        n = MCF.to_megatron_config(cfg, layout)["moe_n_hash_layers"]
        dev = [number(i) <= n for i in range(cfg.num_hidden_layers)]
        assert dev == [cfg.is_hash(i) for i in range(cfg.num_hidden_layers)], layout
    assert MCF.to_megatron_config(cfg, "hybrid")["moe_n_hash_layers"] == 2 * cfg.num_hash_layers


def test_dev_config_constraints_reported():
    assert MCF.dev_rejects(MCF.to_megatron_config(get_config("flash"))) == []
    assert MCF.dev_rejects(MCF.to_megatron_config(get_config("debug"))) == ["csa_compress_ratios must be 0, 4, or 128 (has [16])"]


def test_refuses_a_csa_ratio_megatron_cannot_express():
    with pytest.raises(ConfigError, match="iff the ratio is 4"):
        MCF.to_megatron_config(get_config("debug", csa_ratio=8, compress_ratios=[0, 8, 16, 0]))


def test_convert_cli_to_and_from_megatron(tmp_path):
    from dsv4.harness.cli import main
    from dsv4.model.interop.common import _build
    from dsv4.model.interop.official import save_official
    torch.manual_seed(0)
    model = _build(get_config("debug"))
    save_official(model, str(tmp_path / "off"))
    r = CliRunner().invoke(main, ["convert", str(tmp_path / "off"), str(tmp_path / "meg"), "--from", "official",
                                  "--to", "megatron", "--json"])
    assert r.exit_code == 0, r.output
    conf = json.loads((tmp_path / "meg" / "config.json").read_text())
    assert conf["megatron"]["moe_n_hash_layers"] == 2 and conf["megatron_layout"] == "hybrid"
    assert conf["megatron_dev_would_reject"] == ["csa_compress_ratios must be 0, 4, or 128 (has [16])"]
    assert conf["megatron_dev_differs"][0].startswith("shared expert: dev clamps it")
    from safetensors.torch import load_file
    keys = set(load_file(str(tmp_path / "meg" / "model.safetensors")))
    assert "decoder.final_norm.weight" in keys and "decoder.layers.0.hyper_connection.bias" in keys
    r = CliRunner().invoke(main, ["convert", str(tmp_path / "meg"), str(tmp_path / "off2"), "--from", "megatron",
                                  "--to", "official"])
    assert r.exit_code == 0, r.output
    a, b = load_file(str(tmp_path / "off" / "model.safetensors")), load_file(str(tmp_path / "off2" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
