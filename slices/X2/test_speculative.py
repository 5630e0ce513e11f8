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


def test_batched_speculative_equals_greedy_per_row():
    """B = 3 rows of different lengths (left and right padding): per-row acceptance. The MTP norm zeroed makes
    every draft token 0; head row 0 scaled up makes the main model choose 0 at about half the positions, so
    rows accept and reject independently, in the same steps. Each row's tokens == greedy on that row alone."""
    torch.set_num_threads(1)
    model = debug_model(seed=1)
    with torch.no_grad():
        model.mtp[0].norm.weight.zero_()
        model.head.weight[0] *= 8.0
    g = torch.Generator().manual_seed(7)
    lens = [11, 6, 9]
    rows = [torch.randint(1, 256, (n,), generator=g) for n in lens]
    S = max(lens)
    seen = {"accepted": 0, "rejected": 0, "mixed_rows": 0}
    for side in ("left", "right"):
        ids = torch.zeros(len(rows), S, dtype=torch.long)
        mask = torch.zeros(len(rows), S, dtype=torch.long)
        for b, r in enumerate(rows):
            sl = slice(S - len(r), S) if side == "left" else slice(0, len(r))
            ids[b, sl], mask[b, sl] = r, 1
        got, st = speculative_generate(model, ids, max_new_tokens=24, attention_mask=mask)
        for b, r in enumerate(rows):
            ref = generate(model, r[None], max_new_tokens=24).new_tokens[0]
            assert torch.equal(got[b], ref), (side, b, got[b].tolist(), ref.tolist())
        seen["accepted"] += st["accepted"]
        seen["rejected"] += st["rejected"]
        seen["mixed_rows"] += sum(a > 0 and r > 0 for a, r in zip(st["accepted_per_row"], st["rejected_per_row"]))
    assert seen["accepted"] > 0 and seen["rejected"] > 0 and seen["mixed_rows"] > 0, seen
    print("batched speculative stats", seen)


def test_batched_speculative_eos_pads_rows():
    """A row that emits eos stops (later slots are pad_token_id) while the others go on; == greedy with eos."""
    torch.set_num_threads(1)
    model = debug_model(seed=2)
    p = torch.randint(1, 256, (2, 8), generator=torch.Generator().manual_seed(3))
    ref = [generate(model, p[b:b + 1], max_new_tokens=12).new_tokens[0] for b in range(2)]
    eos = int(ref[0][3])                                          # row 0 ends at its 4th token
    got, _ = speculative_generate(model, p, max_new_tokens=12, eos_token_id=eos, pad_token_id=0)
    for b in range(2):
        r = generate(model, p[b:b + 1], max_new_tokens=12, eos_token_id=eos).new_tokens[0].tolist()
        if eos in r:
            r = r[:r.index(eos) + 1]
        assert got[b, :len(r)].tolist() == r and (got[b, len(r):] == 0).all(), (b, got[b].tolist(), r)
