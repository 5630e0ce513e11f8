"""X2 (stretch): the MTP head with its own cache == the full forward's MTP logits, and MTP self-speculative
greedy decoding gives exactly the greedy tokens (accepted drafts and rolled-back rejections both exercised)."""
import torch

from dsv4.model.generate import DSv4Cache, forward_step, generate, mtp_step, speculative_generate

from ._models import debug_model

TOL = 1e-5


def test_cached_mtp_logits_equal_full_forward():
    torch.set_num_threads(1)
    model = debug_model(seed=5)
    ids = torch.randint(1, 256, (2, 37), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(ids).mtp_logits                                   # position t: inputs X_L[t], ids[t+1]
        cache = DSv4Cache(model, 2)
        got, a = [], 0
        for n in (5, 1, 1, 9, 3, 1, 16):                               # 36 positions have a next token
            lg, X = forward_step(model, cache, ids[:, a:a + n], return_streams=True)
            got.append(mtp_step(model, cache, X, ids[:, a + 1:a + n + 1]))
            a += n
    diff = (full[:, :36] - torch.cat(got, 1)).abs().max().item()
    assert diff <= TOL, diff


def test_speculative_equals_greedy():
    """Random models: their MTP head drafts badly, every draft is rejected (the rollback path); seed 3 with
    both final norms zeroed predicts token 0 everywhere, so every draft is accepted (the two-token path)."""
    torch.set_num_threads(1)
    seen = {"accepted": 0, "rejected": 0}
    for seed in range(4):
        model = debug_model(seed=seed)
        if seed == 3:
            with torch.no_grad():
                model.norm.weight.zero_()
                model.mtp[0].norm.weight.zero_()
        p = torch.randint(1, 256, (1, 11), generator=torch.Generator().manual_seed(seed))
        ref = generate(model, p, max_new_tokens=30).new_tokens
        got, st = speculative_generate(model, p, max_new_tokens=30)
        assert torch.equal(ref, got), seed
        for k in seen:
            seen[k] += st[k]
    assert seen["rejected"] > 0 and seen["accepted"] > 0
    print("speculative stats", seen)
