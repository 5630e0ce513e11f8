"""D1: attention-level parity with Hugging Face transformers 5.23.0 `DeepseekV4Attention` (fp32, CPU).

The weights of our layer are copied into HF's by the official -> HF name rules of spec §11.4 (written here, not
imported). Odd lengths (37, 13, 3). Top-k ties: the output parity runs with index_topk >= the number of entries
(no top-k boundary); a second test with k < T compares HF's raw indexer scores and the selected sets modulo
exact ties.
"""
import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import DeepseekV4Config  # noqa: E402
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (  # noqa: E402
    DeepseekV4Attention, DeepseekV4RotaryEmbedding)

from dsv4.model.attention import DSv4Attention
from dsv4.model.layout import Layout
from dsv4.model.losses import AuxLosses  # noqa: E402
from dsv4.model.config import get_config  # noqa: E402

# max abs, fp32, outputs O(1): README's HF parity limit (1e-5); measured worst 9.5e-7 (MKL_CBWR=COMPATIBLE) over the
# 11 simulated hosts of harness/numerics.py, x10
TOL = 1e-5
HF_KIND = {"window": "sliding_attention", "csa": "compressed_sparse_attention", "hca": "heavily_compressed_attention"}
RULES = [           # spec §11.4, applied in order to the names inside `layers.{i}.attn.`
    ("indexer.compressor.", "compressor.indexer."), ("indexer.wq_b.", "compressor.indexer.q_b_proj."),
    ("indexer.weights_proj.", "compressor.indexer.scorer.weights_proj."), ("attn_sink", "sinks"),
    ("wq_a.", "q_a_proj."), ("q_norm.", "q_a_norm."), ("wq_b.", "q_b_proj."), ("wkv.", "kv_proj."),
    ("wgate.", "gate_proj."), ("wo_a.", "o_a_proj."), ("wo_b.", "o_b_proj."), (".ape", ".position_bias"),
    ("compressor.norm.", "compressor.kv_norm."), ("indexer.norm.", "indexer.kv_norm."),
]


def hf_name(n):
    for a, b in RULES:
        n = n.replace(a, b)
    return n


def hf_config(cfg):
    rs = cfg.rope_scaling
    return DeepseekV4Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=3,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=1, head_dim=cfg.head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim, q_lora_rank=cfg.q_lora_rank, o_groups=cfg.o_groups,
        o_lora_rank=cfg.o_lora_rank, index_n_heads=cfg.index_n_heads, index_head_dim=cfg.index_head_dim,
        index_topk=cfg.index_topk, sliding_window=cfg.sliding_window,
        layer_types=[HF_KIND[cfg.layer_kind(i)] for i in range(3)],
        compress_rates={"compressed_sparse_attention": cfg.csa_ratio, "heavily_compressed_attention": cfg.hca_ratio},
        rope_theta=cfg.rope_theta, compress_rope_theta=cfg.compress_rope_theta,
        rope_parameters={"rope_type": "yarn", "factor": rs["factor"],
                         "original_max_position_embeddings": rs["original_max_position_embeddings"],
                         "beta_fast": rs["beta_fast"], "beta_slow": rs["beta_slow"]},
        max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
        n_routed_experts=cfg.n_routed_experts, num_experts_per_tok=cfg.num_experts_per_tok,
        moe_intermediate_size=cfg.moe_intermediate_size)


def pair(layer, seed, **over):
    cfg = get_config("debug", **over)
    torch.manual_seed(seed)
    ours = DSv4Attention(cfg, layer).eval()
    with torch.no_grad():
        for n, p in ours.named_parameters():
            if p.dim() == 1 or n.endswith("ape"):
                p.copy_(torch.randn_like(p) * 0.3 + (1.0 if "norm" in n else 0.0))
            else:
                p.normal_(0.0, p.shape[1] ** -0.5)
    hcfg = hf_config(cfg)
    hcfg._attn_implementation = "eager"
    hf = DeepseekV4Attention(hcfg, layer).eval()
    hf.load_state_dict({hf_name(k): v for k, v in ours.state_dict().items()}, strict=True)
    return cfg, hcfg, ours, hf


def run_hf(hcfg, hf, h, window):
    B, S, _ = h.shape
    pos = torch.arange(S)[None].expand(B, S)
    rot = DeepseekV4RotaryEmbedding(hcfg)
    pe = {k: rot(h, pos, layer_type=k) for k in ("main", "compress")}
    t = torch.arange(S)
    band = (t[None, :] <= t[:, None]) & (t[None, :] > t[:, None] - window)
    mask = torch.zeros(S, S).masked_fill(~band, float("-inf"))[None, None].expand(B, 1, S, S)
    return hf(h, pe, pos, mask)[0]


@pytest.mark.parametrize("kind,layer", [("window", 0), ("csa", 1), ("hca", 2)])
@pytest.mark.parametrize("S", [37, 13, 3])
def test_attention_matches_hf(kind, layer, S):
    cfg, hcfg, ours, hf = pair(layer, seed=S + layer, index_topk=16)      # k >= T = S // 4: no top-k boundary
    h = torch.randn(2, S, cfg.hidden_size, generator=torch.Generator().manual_seed(S))
    with torch.no_grad():
        y_hf = run_hf(hcfg, hf, h, cfg.sliding_window)
        y = ours(h)
    err = (y - y_hf).abs().max().item()
    print(f"HF parity {kind} S={S}: max|diff| = {err:.3g} (max|y| = {y_hf.abs().max().item():.3g})")
    assert y_hf.abs().max().item() > 0.1
    assert err <= TOL, f"{kind} S={S}: max |ours - HF| = {err:.3g}"


def test_indexer_scores_and_topk_match_hf_modulo_ties():
    cfg, hcfg, ours, hf = pair(1, seed=7)                                   # index_topk = 4 < T = 9
    S = 37
    h = torch.randn(2, S, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    got = {}
    hf.compressor.indexer.scorer.register_forward_hook(lambda m, a, out: got.__setitem__("I", out))
    hf.compressor.indexer.register_forward_hook(lambda m, a, out: got.__setitem__("idx", out))
    aux = AuxLosses()
    with torch.no_grad():
        run_hf(hcfg, hf, h, cfg.sliding_window)
        ours(h, aux=aux)
    lay = Layout.batch(2, S)                                               # 2 documents of S tokens
    x = h.reshape(2 * S, -1)
    with torch.no_grad():
        cq = ours.q_norm(ours.wq_a(x))
        I, sel, es, ej = ours.indexer(x, cq, (lay.seg, lay.pos, lay.rope_pos, 0), lay)   # [2S, N], [2S, k]
    I = torch.stack([I[b * S:(b + 1) * S][:, es == b] for b in range(2)])   # [B, S, T]: document b's entries
    causal = torch.isfinite(I)
    err = (I[causal] - got["I"][causal]).abs().max().item()
    # the HF parity limit; measured 8.3e-7 (ATEN default + MKL_CBWR=COMPATIBLE + DNNL SSE41; 11 hosts), x12
    assert err <= 1e-5, f"indexer scores max |ours - HF| = {err:.3g}"
    assert torch.equal(sel, aux.selections[None][0])
    picks = aux.picks(None, (2, S))                                           # entry index j inside the document
    hf_idx = got["idx"]
    for b in range(2):
        for t in range(S):
            a = sorted(j for j in picks[b, t].tolist() if j >= 0)
            c = sorted(j for j in hf_idx[b, t].tolist() if j >= 0)
            # same selected score multiset (a set may differ only among entries with exactly equal scores); the
            # HF parity limit 1e-5, measured 0 on all 11 hosts
            sa, sc = sorted(I[b, t, a].tolist()), sorted(I[b, t, c].tolist())
            assert len(a) == len(c) and max([abs(u - v) for u, v in zip(sa, sc)], default=0.0) <= 1e-5, (b, t, a, c)
