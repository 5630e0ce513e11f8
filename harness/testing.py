"""Helpers shared by the tests (harness/tests, slices/*/test_*.py); nothing here runs a check by itself.

- `fake_slice`: a one-off Slice (optionally with a cases.py) for the registry / goldens / verify / graph tests.
- `tiny_hf_model`: a tiny random Hugging Face transformers 5.23.0 DeepseekV4ForCausalLM, the independent oracle of
  D4's logits parity and X2's cached generation: window / CSA / HCA layers, hash layers, YaRN or plain RoPE,
  HF's zero- or one-initialised tensors (sinks, position_bias, mHC base / scale, norms, router bias) randomised
  and the hash table tid2eid filled (HF initialises it to zeros; reference §11.2).
- `tie_aware`: HF's indexer top-k breaks exact score ties (ReLU scores give exact zeros) by torch.topk's
  unspecified, shape-dependent order, our contract is lower-index-first (spec §12): a forward hook on HF's
  indexer checks that HF's picks equal the lower-index-first ones modulo ties (same multiset of scores per
  query, at the real query positions of every prefill and decode call) and then hands HF the lower-index-first
  picks, so a comparison is exact on the same selection.
"""
from __future__ import annotations

from pathlib import Path

import torch

from dsv4.harness.registry import Slice

HF_LAYER_TYPES = {"W": "sliding_attention", "C": "compressed_sparse_attention", "H": "heavily_compressed_attention"}


def fake_slice(sid: str, folder: Path, *, title: str = "fake", depends_on=(), golden_cases=(),
               cases: str | None = None) -> Slice:
    """Slice `sid` in `folder` (created with `cases` as its cases.py when given), implemented on cpu only."""
    if cases is not None:
        folder.mkdir(parents=True)
        (folder / "cases.py").write_text(cases)
    return Slice(id=sid, title=title, kind="dsv4", delivers="x", provenance=[], depends_on=list(depends_on),
                 files=[], tests=[], golden_cases=list(golden_cases),
                 status={"cpu": "implemented", "h200": "planned", "h100": "planned", "gb200": "planned"},
                 folder=folder)


def tiny_hf_model(types: str, n_hash: int, hca: int, topk: int, *, seed: int = 0, yarn: bool = True,
                  swiglu_limit: float = 10.0, rope_extra: dict | None = None, **config_extra):
    """types: one letter per layer (W / C / H); the first `n_hash` layers hash-routed; HCA rate m' = `hca`;
    index_topk = `topk`. Every CSA indexer is made `tie_aware` (its stats: hf_tie_stats(model))."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
    torch.manual_seed(seed)
    E, K, V = 8, 2, 256
    rope = ({"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 64, "beta_fast": 32,
             "beta_slow": 1, **(rope_extra or {})} if yarn else None)
    cfg = DeepseekV4Config(
        vocab_size=V, hidden_size=64, num_hidden_layers=len(types), num_attention_heads=4, num_key_value_heads=1,
        head_dim=32, qk_rope_head_dim=8, q_lora_rank=32, o_groups=2, o_lora_rank=16, moe_intermediate_size=32,
        n_routed_experts=E, n_shared_experts=1, num_experts_per_tok=K, index_n_heads=2, index_head_dim=16,
        index_topk=topk, sliding_window=8, hc_mult=4, hc_sinkhorn_iters=20, swiglu_limit=swiglu_limit,
        layer_types=[HF_LAYER_TYPES[t] for t in types],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": hca},
        mlp_layer_types=["hash_moe"] * n_hash + ["moe"] * (len(types) - n_hash),
        rope_parameters=rope, max_position_embeddings=1024, routed_scaling_factor=1.5, **config_extra)
    hf = DeepseekV4ForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if p.dim() >= 2 and "hc" not in n and "embed" not in n:   # O(1) sublayer outputs (HF: std 0.02)
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
        for n, p in hf.named_parameters():            # HF initialises these to 0 / 1: randomise
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
    tie_aware_all(hf)
    return hf


def tie_aware_all(hf) -> None:
    """`tie_aware` on every CSA indexer of an HF DeepseekV4 model."""
    for layer in hf.model.layers:
        comp = getattr(layer.self_attn, "compressor", None)
        if comp is not None and hasattr(comp, "indexer"):
            tie_aware(comp.indexer)


def tie_aware(indexer) -> dict:
    """Hook HF's indexer (see the module docstring); returns its stats, also `indexer.tie_stats`:
    calls (forward calls), ties (queries whose picks were tie-broken)."""
    stats = {"calls": 0, "ties": 0}
    seen = {}
    orig = indexer.scorer.forward
    indexer.scorer.forward = lambda *a: seen.__setitem__("s", orig(*a)) or seen["s"]   # HF's module, observed

    def hook(mod, args, out):
        stats["calls"] += 1
        if out.numel() == 0:
            return out
        scores, position_ids = seen["s"], args[2]                           # [B, S, T], [B, S]
        T = scores.shape[-1]
        thr = (position_ids + 1) // mod.compress_rate                       # [B, S] visible entries
        masked = scores.masked_fill(torch.arange(T)[None, None] >= thr[..., None], float("-inf"))
        k = out.shape[-1]
        ours = torch.sort(masked, dim=-1, descending=True, stable=True).indices[..., :k]
        ours = torch.where(ours >= thr[..., None], torch.full_like(ours, -1), ours)

        def picked(idx):
            vals = masked.gather(-1, idx.clamp(min=0))
            return torch.where(idx < 0, torch.full_like(vals, float("-inf")), vals).sort(-1).values
        assert torch.equal(picked(out), picked(ours)), "HF and lower-index-first top-k differ beyond ties"
        stats["ties"] += int((torch.sort(out, -1).values != torch.sort(ours, -1).values).any(-1).sum())
        return ours

    indexer.register_forward_hook(hook)
    indexer.tie_stats = stats
    return stats


def hf_tie_stats(hf) -> dict:
    """The tie stats summed over an HF model's tie-aware indexers."""
    tot = {"calls": 0, "ties": 0}
    for m in hf.modules():
        for k, v in getattr(m, "tie_stats", {}).items():
            tot[k] += v
    return tot
