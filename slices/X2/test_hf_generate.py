"""X2: our cached greedy generation == Hugging Face transformers 5.23.0's cached generation
(`DeepseekV4ForCausalLM.generate`, its DeepseekV4 HCA / CSA cache layers) on a converted checkpoint.

The HF models are D4's (harness/testing.tiny_hf_model: window / CSA / HCA layers, hash layers, YaRN,
randomised sinks / position_bias / mHC / router bias, a filled tid2eid), converted with model/interop
(`from_hf` of the saved directory). HF's indexer top-k breaks exact score ties by torch.topk's unspecified
order; our contract is lower-index-first (spec §12). A hook (harness/testing.tie_aware) checks HF's picks
equal ours modulo ties, at the real query positions of every prefill and decode call, then hands HF the
lower-index-first picks.
Compared: every new token, and the logits each was chosen from (fp32, <= 1e-5; measured in the test output).
"""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from dsv4.harness.testing import hf_tie_stats, tiny_hf_model  # noqa: E402
from dsv4.model.interop import from_hf  # noqa: E402
from dsv4.model.generate import generate  # noqa: E402

TOL = 1e-5
CASES = {   # name: (layer types, n_hash, hca rate, index_topk)
    "WCH_topk3": ("WCH", 1, 16, 3),
    "CHC_hca8_topk64": ("CHC", 2, 8, 64),
}


def _hf_model(types, n_hash, hca, topk, seed=0):
    return tiny_hf_model(types, n_hash, hca, topk, seed=seed, eos_token_id=None, bos_token_id=None, pad_token_id=0)


@pytest.mark.parametrize("name", list(CASES))
def test_generation_equals_hf_cached_generation(name, tmp_path):
    hf = _hf_model(*CASES[name])
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
    ties = hf_tie_stats(hf)                                      # over the CSA layers' indexers
    print(f"{name}: {new} tokens equal; max |dlogits| vs HF cached generation {worst:.2e}; "
          f"indexer calls {ties['calls']}, tie-broken queries {ties['ties']}")
    assert worst <= TOL
    assert ties["calls"] >= new                                  # prefill + every decode call, per CSA layer
