"""X2: our cached greedy generation == Hugging Face transformers 5.23.0's cached generation
(`DeepseekV4ForCausalLM.generate`, its DeepseekV4 HCA / CSA cache layers) on a converted checkpoint.

The HF models are built as in slices/D4/test_hf_parity.py (window / CSA / HCA layers, hash layers, YaRN,
randomised sinks / position_bias / mHC / router bias, a filled tid2eid) and converted with model/interop
(`from_hf` of the saved directory). HF's indexer top-k breaks exact score ties by torch.topk's unspecified
order; our contract is lower-index-first (spec §12). A hook checks HF's picks equal ours modulo ties, at the
real query positions of every prefill and decode call, then hands HF the lower-index-first picks.
Compared: every new token, and the logits each was chosen from (fp32, <= 1e-5; measured in the test output).
"""
import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM  # noqa: E402

from dsv4.model.interop import from_hf  # noqa: E402
from dsv4.model.generate import generate  # noqa: E402

TOL = 1e-5
TYPES = {"W": "sliding_attention", "C": "compressed_sparse_attention", "H": "heavily_compressed_attention"}
CASES = {   # name: (layer types, n_hash, hca rate, index_topk)
    "WCH_topk3": ("WCH", 1, 16, 3),
    "CHC_hca8_topk64": ("CHC", 2, 8, 64),
}


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _hf_model(types, n_hash, hca, topk, seed=0):
    torch.manual_seed(seed)
    E, K, V = 8, 2, 256
    cfg = DeepseekV4Config(
        vocab_size=V, hidden_size=64, num_hidden_layers=len(types), num_attention_heads=4, num_key_value_heads=1,
        head_dim=32, qk_rope_head_dim=8, q_lora_rank=32, o_groups=2, o_lora_rank=16, moe_intermediate_size=32,
        n_routed_experts=E, n_shared_experts=1, num_experts_per_tok=K, index_n_heads=2, index_head_dim=16,
        index_topk=topk, sliding_window=8, hc_mult=4, hc_sinkhorn_iters=20, swiglu_limit=10.0,
        layer_types=[TYPES[t] for t in types],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": hca},
        mlp_layer_types=["hash_moe"] * n_hash + ["moe"] * (len(types) - n_hash),
        rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 64,
                         "beta_fast": 32, "beta_slow": 1},
        max_position_embeddings=1024, routed_scaling_factor=1.5, eos_token_id=None, bos_token_id=None,
        pad_token_id=0)
    hf = DeepseekV4ForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if p.dim() >= 2 and "hc" not in n and "embed" not in n:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
            if any(s in n for s in ("sinks", "position_bias", ".base", "hc_base")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            if any(s in n for s in (".scale", "hc_scale")):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            if n.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
        for n, b in hf.named_buffers():
            if "e_score_correction_bias" in n:
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
            if n.endswith("tid2eid"):
                b.copy_(torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(V)]))
    ties = {"n": 0, "calls": 0}
    for layer in hf.model.layers:
        comp = getattr(layer.self_attn, "compressor", None)
        if comp is not None and hasattr(comp, "indexer"):
            _tie_aware(comp.indexer, ties)
    return hf, ties


def _tie_aware(indexer, stats):
    seen = {}
    orig = indexer.scorer.forward
    indexer.scorer.forward = lambda *a: seen.__setitem__("s", orig(*a)) or seen["s"]

    def hook(mod, args, out):
        stats["calls"] += 1
        if out.numel() == 0:
            return out
        scores, position_ids = seen["s"], args[2]                           # [B, S, T], [B, S]
        T = scores.shape[-1]
        thr = (position_ids + 1) // mod.compress_rate                       # [B, S]
        masked = scores.masked_fill(torch.arange(T)[None, None] >= thr[..., None], float("-inf"))
        k = out.shape[-1]
        ours = torch.sort(masked, dim=-1, descending=True, stable=True).indices[..., :k]
        ours = torch.where(ours >= thr[..., None], torch.full_like(ours, -1), ours)

        def picked(idx):
            vals = masked.gather(-1, idx.clamp(min=0))
            return torch.where(idx < 0, torch.full_like(vals, float("-inf")), vals).sort(-1).values
        assert torch.equal(picked(out), picked(ours)), "HF and lower-index-first top-k differ beyond ties"
        stats["n"] += int((torch.sort(out, -1).values != torch.sort(ours, -1).values).any(-1).sum())
        return ours

    indexer.register_forward_hook(hook)


@pytest.mark.parametrize("name", list(CASES))
def test_generation_equals_hf_cached_generation(name, tmp_path):
    hf, ties = _hf_model(*CASES[name])
    hf.save_pretrained(str(tmp_path))
    ours = from_hf(str(tmp_path)).eval()
    prompt = torch.randint(1, 256, (2, 13), generator=torch.Generator().manual_seed(4))
    new = 40                                                  # 13 + 40: crosses 16 / 32 / 48 and every m = 4
    with torch.no_grad():
        ref = hf.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False, use_cache=True,
                          return_dict_in_generate=True, output_logits=True, pad_token_id=0)
    got = generate(ours, prompt, max_new_tokens=new, output_logits=True)
    assert torch.equal(ref.sequences, got.sequences), "generated tokens differ from HF's"
    worst = max((a.float() - b).abs().max().item() for a, b in zip(ref.logits, got.logits))
    print(f"{name}: {new} tokens equal; max |dlogits| vs HF cached generation {worst:.2e}; "
          f"indexer calls {ties['calls']}, tie-broken queries {ties['n']}")
    assert worst <= TOL
    assert ties["calls"] >= new                                  # prefill + every decode call, per CSA layer
