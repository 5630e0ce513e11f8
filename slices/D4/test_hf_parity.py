"""D4: full-model logits parity with Hugging Face transformers 5.23 DeepseekV4 (spec §11, §12) and checkpoint
round trips (ours -> HF dir -> ours bit-exact; ours -> official -> ours; ours -> HF dir -> HF model).

Random tiny HF models mixing window / CSA / HCA layers, hash layers, YaRN or plain RoPE, active SwiGLU clamps,
with HF's zero-initialised tensors (sinks, position_bias, mHC base, router bias) randomised; sequence lengths
37 and 45 (not multiples of the ratios). fp32, max |logit diff| <= 1e-5.

Indexer top-k ties: ReLU scoring gives exact 0.0 scores, and torch.topk orders ties by an unspecified,
shape-dependent rule (spec §12) while our contract picks the LOWER entry index first. A hook on HF's indexer
(harness/testing.tie_aware) checks that HF's picks equal the lower-index-first picks modulo ties (same multiset of scores per query) and
then hands HF the lower-index-first indices, so the logits comparison is exact on the same selection.
"""
import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import DeepseekV4ForCausalLM  # noqa: E402

from dsv4.harness.testing import tie_aware, tie_aware_all, tiny_hf_model  # noqa: E402
from dsv4.model.interop import (CheckpointError, from_hf, load_official, save_official,  # noqa: E402
                                to_hf)

LOGIT_ATOL = 1e-5

CASES = {
    # name: (layer types, n_hash, hca rate, yarn, index_topk, swiglu_limit)
    "WCH_hash1_yarn": ("WCH", 1, 16, True, 64, 10.0),
    "CCHW_hash2_plain_clamped": ("CCHW", 2, 8, False, 64, 0.5),
    "HC_hash0_yarn_topk3": ("HC", 0, 16, True, 3, 10.0),
}


def _hf_model(name, seed=0, **rope_extra):
    types, n_hash, hca, yarn, topk, limit = CASES[name]
    return tiny_hf_model(types, n_hash, hca, topk, seed=seed, yarn=yarn, swiglu_limit=limit, rope_extra=rope_extra)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    out = {}
    for name in CASES:
        hf = _hf_model(name)
        d = str(tmp_path_factory.mktemp(name))
        hf.save_pretrained(d)
        out[name] = (hf, from_hf(d).eval(), d)
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_hf(converted, name):
    hf, ours, _ = converted[name]
    for B, S, seed in ((2, 37, 3), (2, 45, 4), (1, 5, 8)):     # S=5: at most one CSA entry, no HCA entry
        ids = torch.randint(0, 256, (B, S), generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            ref = hf(input_ids=ids, use_cache=False).logits
            got = ours(ids).logits
        diff = (ref - got).abs().max().item()
        print(f"{name} S={S}: max|dlogits| = {diff:.3e} (|logits| max {ref.abs().max().item():.2f})")
        assert diff <= LOGIT_ATOL, f"{name} S={S}: max |logit diff| {diff:.3e} > {LOGIT_ATOL}"


def test_clamp_case_really_clamps(converted):
    """The small-limit case must exercise the clamps, else its parity says nothing about them."""
    _, ours, _ = converted["CCHW_hash2_plain_clamped"]
    ids = torch.randint(0, 256, (1, 37), generator=torch.Generator().manual_seed(5))
    unclamped = ours.cfg.replace(swiglu_limit=1e9, shared_expert_clamp=False)
    from dsv4.model.model import DSv4Model
    other = DSv4Model(unclamped).eval()
    other.load_state_dict(ours.state_dict())
    with torch.no_grad():
        assert (ours(ids).logits - other(ids).logits).abs().max() > 1e-3


def _same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


def test_round_trips_bit_exact(converted, tmp_path):
    _, ours, _ = converted["WCH_hash1_yarn"]
    to_hf(ours, str(tmp_path / "hf"))
    _same_state(ours, from_hf(str(tmp_path / "hf")))
    save_official(ours, str(tmp_path / "off"))
    back = load_official(str(tmp_path / "off"), shared_expert_clamp=True)
    _same_state(ours, back)
    from safetensors.torch import load_file
    off = load_file(str(tmp_path / "off" / "model.safetensors"))
    assert "layers.0.ffn.experts.7.w3.weight" in off and off["layers.0.ffn.gate.tid2eid"].dtype == torch.int32
    assert "mtp.0.ffn.experts.0.w1.weight" in off and "mtp.0.hc_head_fn" in off


def test_our_hf_dir_loads_in_transformers(converted, tmp_path):
    _, ours, _ = converted["CCHW_hash2_plain_clamped"]
    to_hf(ours, str(tmp_path))
    hf = DeepseekV4ForCausalLM.from_pretrained(str(tmp_path)).eval()
    ids = torch.randint(0, 256, (2, 45), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        diff = (hf(input_ids=ids, use_cache=False).logits - ours(ids).logits).abs().max().item()
    assert diff <= LOGIT_ATOL


def test_bad_checkpoints_refused_in_one_line(converted, tmp_path):
    _, ours, _ = converted["WCH_hash1_yarn"]
    from safetensors.torch import load_file, save_file
    d = tmp_path / "bad"
    to_hf(ours, str(d))
    sd = load_file(str(d / "model.safetensors"))
    k = "model.layers.1.self_attn.q_a_proj.weight"
    sd[k] = sd[k][:, :-1].contiguous()
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError) as e:
        from_hf(str(d))
    msg = str(e.value)
    assert "\n" not in msg and "layers.1.attn.wq_a.weight" in msg and "[32, 63]" in msg and "[32, 64]" in msg
    del sd[k]
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing tensor layers\.1\.attn\.wq_a\.weight.*\[32, 64\]"):
        from_hf(str(d))


def test_convert_cli(converted, tmp_path):
    from click.testing import CliRunner

    from dsv4.harness.convert_cli import convert_cmd
    _, ours, src = converted["HC_hash0_yarn_topk3"]
    r = CliRunner().invoke(convert_cmd, [src, str(tmp_path / "off"), "--from", "hf", "--to", "official", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output.strip().splitlines()[-1])["to"] == "official"
    assert os.path.isfile(tmp_path / "off" / "model.safetensors")
    r = CliRunner().invoke(convert_cmd, [str(tmp_path / "nowhere"), str(tmp_path / "x"), "--from", "hf"])
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1
    r = CliRunner().invoke(convert_cmd, [src, str(tmp_path / "y"), "--from", "gguf"])
    assert r.exit_code == 2 and "gguf" in r.output
    hub = json.loads((tmp_path / "off" / "config.json").read_text())
    del hub["dsv4_config"]                                   # like a hub checkpoint: DeepSeek's unclamped expert
    (tmp_path / "off" / "config.json").write_text(json.dumps(hub))
    r = CliRunner().invoke(convert_cmd, [str(tmp_path / "off"), str(tmp_path / "hf"), "--from", "official", "--to", "hf"])
    assert r.exit_code == 2 and "shared_expert_clamp=False" in r.output, r.output
    r = CliRunner().invoke(convert_cmd, [str(tmp_path / "off"), str(tmp_path / "hf"), "--from", "official", "--to", "hf",
                                         "--hf-clamp-shared-expert"])
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dsv4_config"]["shared_expert_clamp"] is True


def test_topk3_case_exercises_ties(converted):
    """The k=3 case must really hit top-k ties (else the tie-aware path above is untested)."""
    hf, _, _ = converted["HC_hash0_yarn_topk3"]
    stats = hf.model.layers[1].self_attn.compressor.indexer.tie_stats
    stats["ties"] = 0
    ids = torch.randint(0, 256, (2, 37), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        hf(input_ids=ids, use_cache=False)
    assert stats["ties"] > 0


GRAD_RTOL_OF_MAX = 1e-4     # per tensor: max |g_hf - g_ours| <= 1e-4 * max |g_hf| (fp32 accumulation order)


@pytest.mark.parametrize("name", list(CASES))
def test_grads_match_hf(converted, name):
    """d(sum(logits * R))/d(every parameter) equals HF's (names mapped; stacked experts identical)."""
    from dsv4.model.interop.hf import hf_to_ours_name
    hf, ours, _ = converted[name]
    hf.zero_grad(set_to_none=True)
    ours.zero_grad(set_to_none=True)
    ids = torch.randint(0, 256, (2, 37), generator=torch.Generator().manual_seed(3))
    R = torch.randn(2, 37, 256, generator=torch.Generator().manual_seed(7))
    (hf(input_ids=ids, use_cache=False).logits * R).sum().backward()
    (ours(ids).logits * R).sum().backward()
    mine = dict(ours.named_parameters())
    checked = 0
    for n, p in hf.named_parameters():
        q = mine[hf_to_ours_name(n)]
        if p.grad is None or p.grad.abs().max() == 0:
            assert q.grad is None or q.grad.abs().max() == 0, n
            continue
        err = (p.grad - q.grad).abs().max().item()
        assert err <= GRAD_RTOL_OF_MAX * p.grad.abs().max().item(), f"{n}: {err:.3e}"
        checked += 1
    assert checked > 40
    hf.zero_grad(set_to_none=True)
    ours.zero_grad(set_to_none=True)


def _max_diff(a, b, ids):
    with torch.no_grad():
        ra = a(input_ids=ids, use_cache=False).logits if isinstance(a, DeepseekV4ForCausalLM) else a(ids).logits
        rb = b(input_ids=ids, use_cache=False).logits if isinstance(b, DeepseekV4ForCausalLM) else b(ids).logits
    d = (ra - rb).abs().max().item()
    print(f"max|dlogits| {d:.3e}")
    return d


def test_yarn_attention_factor_matches_hf(tmp_path):
    """HF multiplies the compress table's cos/sin by YaRN's attention_factor; from_hf keeps it (it used to drop it:
    max |dlogits| 2.48 at 1.3), to_hf writes it back, and the factor really moves the logits."""
    hf = _hf_model("WCH_hash1_yarn", attention_factor=1.3)
    assert hf.model.rotary_emb.compress_attention_scaling == 1.3
    hf.save_pretrained(str(tmp_path / "a"))
    ours = from_hf(str(tmp_path / "a")).eval()
    assert ours.cfg.rope_scaling["attention_factor"] == 1.3
    ids = torch.randint(0, 256, (2, 37), generator=torch.Generator().manual_seed(3))
    assert _max_diff(hf, ours, ids) <= LOGIT_ATOL
    plain = ours.cfg.replace(rope_scaling={k: v for k, v in ours.cfg.rope_scaling.items() if k != "attention_factor"})
    from dsv4.model.model import DSv4Model
    other = DSv4Model(plain).eval()
    other.load_state_dict(ours.state_dict())
    assert _max_diff(other, ours, ids) > 1e-1                   # measured 2.25 (issue: 2.48 on its case): not a no-op
    to_hf(ours, str(tmp_path / "b"))
    back = DeepseekV4ForCausalLM.from_pretrained(str(tmp_path / "b")).eval()
    tie_aware(back.model.layers[1].self_attn.compressor.indexer)
    assert back.model.rotary_emb.compress_attention_scaling == 1.3 and _max_diff(back, ours, ids) <= LOGIT_ATOL


def test_yarn_attention_factor_derived_like_hf():
    """A nested compress dict without the key (or an explicit null) gets HF's derived 0.1 ln(factor) + 1."""
    from dsv4.model.interop.hf_config import config_from_hf, config_to_hf
    from dsv4.model.config import get_config
    d = config_to_hf(get_config("debug"))
    d.pop("dsv4_config")
    yarn = {**d["rope_parameters"], "rope_theta": d["compress_rope_theta"]}
    d["rope_parameters"] = {"main": {"rope_type": "default", "rope_theta": d["rope_theta"]}, "compress": yarn}
    import math
    assert config_from_hf(d).rope_scaling["attention_factor"] == 0.1 * math.log(16.0) + 1.0
    d["rope_parameters"]["main"]["rope_type"] = "yarn"
    from dsv4.model.config import ConfigError
    with pytest.raises(ConfigError, match="rope_parameters.main.rope_type"):
        config_from_hf(d)


def test_unclamped_model_is_not_exported_as_a_different_function(tmp_path):
    """Ours with shared_expert_clamp=False (DeepSeek's code): HF would clamp the shared expert, so to_hf refuses;
    with clamp_shared_expert=True it exports the clamped model, and HF, from_hf and our clamped model agree."""
    from dsv4.model.config import get_config
    from dsv4.model.model import DSv4Model
    torch.manual_seed(0)
    ours = DSv4Model(get_config("debug", swiglu_limit=0.5)).eval()
    assert not ours.cfg.shared_expert_clamp
    with torch.no_grad():                                     # O(1) activations so that the 0.5 clamp binds
        for n, p in ours.named_parameters():
            if p.dim() >= 2 and "hc" not in n and "embed" not in n:
                p.mul_(p.shape[-1] ** -0.5 / p.std().clamp(min=1e-6))
    with pytest.raises(CheckpointError, match="shared_expert_clamp=False") as e:
        to_hf(ours, str(tmp_path / "x"))
    assert "\n" not in str(e.value)
    to_hf(ours, str(tmp_path / "hf"), clamp_shared_expert=True)
    clamped = DSv4Model(ours.cfg.replace(shared_expert_clamp=True)).eval()
    clamped.load_state_dict(ours.state_dict())
    ids = torch.randint(0, ours.cfg.vocab_size, (2, 37), generator=torch.Generator().manual_seed(6))
    assert _max_diff(ours, clamped, ids) > 1e-1               # measured 4.93: the clamp binds here
    back = from_hf(str(tmp_path / "hf")).eval()
    assert back.cfg == clamped.cfg and _max_diff(back, clamped, ids) == 0.0
    hf = DeepseekV4ForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    tie_aware_all(hf)
    assert _max_diff(hf, clamped, ids) <= LOGIT_ATOL
    cfgj = json.loads((tmp_path / "hf" / "config.json").read_text())        # an older export said false
    cfgj["dsv4_config"]["shared_expert_clamp"] = False
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfgj))
    with pytest.raises(CheckpointError, match="shared_expert_clamp=false"):
        from_hf(str(tmp_path / "hf"))
    assert _max_diff(from_hf(str(tmp_path / "hf"), shared_expert_clamp=False).eval(), ours, ids) == 0.0
