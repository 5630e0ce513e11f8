"""D9 FLOP / parameter accounting: published sizes, independent parameter counts, 6 N, Megatron formulas, CLI."""
import json

import pytest
import torch
from click.testing import CliRunner
from torch.utils.flop_counter import FlopCounterMode

from dsv4.harness.train.flops import COMPONENTS, PARAM_COMPONENTS, _attn_core_macs, count_params, flops_cmd, flops_per_token
from dsv4.model.config import get_config
from dsv4.model.hybrid import parse_pattern


def test_published_sizes():
    f = flops_per_token(get_config("flash"), 4096)
    assert 13.0e9 < f["active_params"] < 14.0e9                        # "13B activated" (13.80B incl. embedding)
    assert abs(f["params"]["active_params_excl_embedding"] - 13.27e9) < 0.01e9   # spec §2.1: 13.3B
    assert abs(f["total_params"] - 284.33e9) < 0.01e9                   # spec §2.1: 284.33B without MTP
    p = flops_per_token(get_config("pro"), 4096)
    assert abs(p["active_params"] - 49.78e9) < 0.01e9 and abs(p["total_params"] - 1573.0e9) < 0.5e9


@pytest.mark.parametrize("name", ["flash", "pro", "proxy", "tiny", "debug"])
def test_counts_against_meta_modules(name):
    """Independent oracle for every named size: the parameters of the real DSv4Model built on the meta device."""
    from dsv4.model.model import build_model
    cfg = get_config(name)
    m = build_model(cfg, device="meta")
    pc = count_params(cfg)
    main = [p for n, p in m.named_parameters() if not n.startswith("mtp.")]
    assert sum(p.numel() for p in main) == pc["total_params"]
    assert sum(p.numel() for p in m.parameters()) == pc["total_params"] + pc["mtp_total_params"]
    K, E = cfg.num_experts_per_tok, cfg.n_routed_experts
    routed = sum(p.numel() for n, p in m.named_parameters() if ".experts." in n and not n.startswith("mtp."))
    assert pc["active_params"] == pc["total_params"] - routed + routed * K // E


class _SplitCounter(FlopCounterMode):
    """FlopCounterMode that also splits the counted FLOPs into matmuls with a parameter operand (weights; a view
    of a parameter shares its storage) and matmuls between activations (attention core, indexer scores)."""

    def __init__(self, model):
        super().__init__(display=False)
        self.weight_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.weight = self.activation = 0
        self.bmms = []                           # (module parents, contraction size, FLOPs) of every aten bmm

    def _count_flops(self, func_packet, out, args, kwargs):
        if func_packet in self.flop_registry:
            n = self.flop_registry[func_packet](*args, **kwargs, out_val=out)
            if "bmm" in str(func_packet):
                self.bmms.append((set(self.mod_tracker.parents), args[0].shape[-1], n))
            if any(isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() in self.weight_storages for a in args):
                self.weight += n
            else:
                self.activation += n
        return super()._count_flops(func_packet, out, args, kwargs)


def _forward_counted(cfg, S):
    from dsv4.model.model import DSv4Model
    torch.manual_seed(0)
    m = DSv4Model(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, S), generator=torch.Generator().manual_seed(1))
    counter = _SplitCounter(m)
    with torch.no_grad(), counter:
        m(ids)
    return m, counter


MATMUL_CASES = {"debug": lambda: get_config("debug"), "tiny": lambda: get_config("tiny"),
                "dense_WEC-/WE": lambda: parse_pattern("WEC-/WE", "debug").cfg}


@pytest.mark.parametrize("name", list(MATMUL_CASES))
def test_weight_matmul_flops_equal_a_real_forward(name):
    """Every matmul with a weight that a real forward executes (torch.utils.flop_counter, aten mm/bmm), per token,
    equals flops.py's parameter FLOPs of the main model plus the MTP block's matmuls. Exact: both are integer
    counts of the same products (routing sends each token to exactly K experts); measured difference 0. Before the
    MTP h_proj fix the formula was short by 2 (n_hc - 1) d^2 per token (h_proj runs on every stream)."""
    cfg, S = MATMUL_CASES[name](), 64
    _, counter = _forward_counted(cfg, S)
    f = flops_per_token(cfg, S)
    mtp_core = sum(2 * v for v in _attn_core_macs(cfg, cfg.num_hidden_layers, S).values())
    formula = sum(f["forward"][k] for k in PARAM_COMPONENTS) + f["forward"]["mtp"] - mtp_core
    assert counter.weight / S == formula
    assert f["param_flops_per_token"] == 3 * sum(f["forward"][k] for k in PARAM_COMPONENTS)


def test_indexer_scoring_flops_equal_the_dense_score_matmul():
    """Megatron's convention counts the dense [S, S/4] indexer score matrix; the naive indexer (packed, one
    document) computes exactly that matmul -- qI [T, nI, cI] against the N = S/4 entry slots, contracted over
    c_I -- so those activation matmuls inside the CSA layers' indexers equal the formula (exact, measured 0).
    Its only other matmul is the weighted sum over the n_I heads (contracted over n_I, 2 n_I N FLOPs per
    token, a 1 / c_I fraction); Megatron's convention leaves it out, as it leaves out the softmaxes."""
    cfg, S = get_config("debug"), 64
    _, counter = _forward_counted(cfg, S)
    nI, cI, N = cfg.index_n_heads, cfg.index_head_dim, S // cfg.csa_ratio
    assert nI != cI                                                    # the contraction size tells them apart
    csa = {f"DSv4Model.layers.{i}.attn.indexer" for i in range(cfg.num_hidden_layers) if cfg.layer_kind(i) == "csa"}
    inside = [(k, n) for par, k, n in counter.bmms if par & csa]
    assert {k for k, _ in inside} == {cI, nI}, inside
    assert sum(n for k, n in inside if k == cI) / S == flops_per_token(cfg, S)["forward"]["indexer_scoring"]
    assert sum(n for k, n in inside if k == nI) / S == len(csa) * 2 * nI * N


ATTN_REL_TOL = 0.02   # measured worst case at S=1024: HCA 1.39% (window 0.34%, CSA 0.10%), x 1.4 margin


def test_attention_core_flops_against_attended_pairs(monkeypatch):
    """The naive attention computes masked logits (window rows, k listed or all N entry slots), so its FLOPs say
    nothing; count instead the (query, key) pairs it really attends (finite window / compressed logits going into
    its one logsumexp, sink excluded) x c x 2 (QK^T and PV) x 2 (FMA).
    Megatron's convention (full windows, S / (2 m') compressed entries, k (1 - 4k / 2S) selected) over-counts by
    O(w / S) and O(m' / S): the formula must lie above the count and within ATTN_REL_TOL of it at S = 1024."""
    import sys
    cfg, S = get_config("debug"), 1024
    pairs = {"window": 0, "csa": 0, "hca": 0}
    logsumexp = torch.logsumexp

    def spy(x, dim=-1, *a, **k):
        f = sys._getframe(1)
        if f.f_code.co_filename.endswith("sparse_attn/naive.py"):         # the one softmax: logsumexp of
            loc = f.f_locals                                            # [window | compressed | sink] logits
            pairs["window"] += int(torch.isfinite(loc["lw"]).sum())
            if loc["lc"] is not None:
                pairs["csa" if loc["comp_idx"] is not None else "hca"] += int(torch.isfinite(loc["lc"]).sum())
        return logsumexp(x, dim, *a, **k)

    monkeypatch.setattr(torch, "logsumexp", spy)
    _forward_counted(cfg, S)
    assert all(pairs.values())
    fw, c = flops_per_token(cfg, S)["forward"], cfg.head_dim
    mtp_window = 2 * cfg.num_attention_heads * cfg.sliding_window * c * 2 * cfg.num_nextn_predict_layers
    formula = {"window": fw["window_attention"] + mtp_window, "csa": fw["csa_selected_keys"],
               "hca": fw["hca_compressed_keys"]}
    for k, n in pairs.items():
        measured = 2 * 2 * c * n / S
        print(f"{k}: formula {formula[k]:.0f} measured {measured:.0f} ({formula[k] / measured - 1:+.4f})")
        assert measured <= formula[k] <= measured * (1 + ATTN_REL_TOL), k


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
    from dsv4.model.interop.hf_config import config_to_hf
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
