"""X5: the SFT recipe -- chat JSONL -> ids with an assistant-only loss mask, packed THD rows (P7 scheduler).

* the mask: the trained targets are exactly the assistant contents, their end markers and the final EOD;
* masked tokens contribute nothing: d loss / d logits (LM and MTP heads) is exactly 0 at every ignored
  position, the LM loss equals a hand-written CE over the assistant targets only, and changing the tokens of a
  trailing user turn (inputs never followed by a target) leaves the loss and every gradient bit-identical
  (dense FFNs; see the test);
* packing equals per-conversation runs: one packed row of 3 conversations (cu_seqlens + padding) gives the
  per-conversation logits and the gradients of the token-weighted LM + MTP loss (fp32, 1e-5 / 1e-5 rel);
* `dsv4 train --recipe sft-debug` runs from a user JSONL, a tokenizer file, and --init (an HF directory),
  and resumes exactly.
"""
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dsv4.harness.train.data import ByteTokenizer
from dsv4.harness.train.sft import END, IGNORE, SFTSource, encode_chat, labels_for, read_chat_jsonl, synthetic_chats
from dsv4.model.config import get_config
from dsv4.model.model import DSv4Model

TOK = ByteTokenizer()
CONVS = [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"},
     {"role": "assistant", "content": "5."}, {"role": "user", "content": "And 4 + 4?"},
     {"role": "assistant", "content": "8, twice four."}],
    [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Teal."}],
    [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "hi there, friend"},
     {"role": "user", "content": "trailing question with no answer"}],
]


def _model(seed=0):
    torch.manual_seed(seed)
    return DSv4Model(get_config("debug", seq_aux_loss_coeff=0.0, indexer_loss_coeff=0.0))


def _row(conv):
    ids, tr = encode_chat(conv, TOK)
    return torch.from_numpy(ids)[None], torch.from_numpy(labels_for(ids, tr))[None]


def test_mask_is_the_assistant_turns():
    for conv in CONVS:
        ids, lab = _row(conv)
        tgt = lab[lab != IGNORE]
        want = "".join(m["content"] + END for m in conv if m["role"] == "assistant")
        assert TOK.decode(tgt.tolist()) == want                      # EOD (0) is dropped by decode
        assert (tgt == 0).sum() == (1 if conv[-1]["role"] == "assistant" else 0)
        assert torch.equal(lab[0, :-1] != IGNORE, torch.from_numpy(encode_chat(conv, TOK)[1][1:]))


def test_masked_tokens_contribute_nothing():
    # dense FFNs ('-'): the MoE groups tokens by expert, so perturbed tokens routed elsewhere would change the
    # row sets of the experts' GEMMs for the real tokens too (gradients then move by float rounding, ~1e-7
    # relative) -- with dense FFNs every shape is unchanged and the check is bit-exact
    torch.manual_seed(0)
    model = DSv4Model(get_config("debug", seq_aux_loss_coeff=0.0, indexer_loss_coeff=0.0, moe_layer_pattern="----"))
    ids, lab = _row(CONVS[2])
    out = model(ids, lab)
    out.logits.retain_grad()
    out.mtp_logits.retain_grad()
    out.loss.backward()
    ign = (lab == IGNORE)[0]
    assert bool((out.logits.grad[0, ign] == 0).all()) and bool((out.logits.grad[0, ~ign] != 0).any(-1).all())
    mtp_ign = torch.cat([ign[1:], ign.new_ones(1)])                  # MTP target of t = label of t+1
    assert bool((out.mtp_logits.grad[0, mtp_ign] == 0).all())
    manual = F.cross_entropy(out.logits[0, ~ign].float(), lab[0, ~ign])
    assert abs(out.losses["lm loss"].item() - manual.item()) <= 1e-6
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    # perturb the masked trailing user turn's tokens (the inputs after the last target)
    last = int((~ign).nonzero().max()) + 1                            # the token of the last target
    ids2 = ids.clone()
    g = torch.Generator().manual_seed(3)
    ids2[0, last + 1:] = torch.randint(1, 256, (ids.shape[1] - last - 1,), generator=g)
    assert not torch.equal(ids, ids2)
    model.zero_grad(set_to_none=True)
    out2 = model(ids2, lab)
    out2.loss.backward()
    assert out2.loss.item() == out.loss.item()
    for n, p in model.named_parameters():
        if n in grads:
            assert torch.equal(p.grad, grads[n]), n


def test_packing_equals_per_conversation():
    model = _model(1).eval()                      # eval: no router statistics; gradients still flow
    rows = [_row(c) for c in CONVS]
    lens = [r[0].shape[1] for r in rows]
    padded = [lens[0], lens[1] + 5, lens[2] + 3]
    T = sum(padded)
    ids = torch.zeros(1, T, dtype=torch.long)
    lab = torch.full((1, T), IGNORE, dtype=torch.long)
    o = 0
    for (x, y), p in zip(rows, padded):
        ids[0, o:o + x.shape[1]], lab[0, o:o + x.shape[1]] = x[0], y[0]
        o += p
    cu = torch.tensor([0] + list(np.cumsum(lens)))
    cup = torch.tensor([0] + list(np.cumsum(padded)))
    out = model(ids, lab, cu_seqlens=cu, cu_seqlens_padded=cup)
    out.loss.backward()
    packed_g = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    n_lm = sum(int((y != IGNORE).sum()) for _, y in rows)
    n_mtp = sum(int((y[:, 1:] != IGNORE).sum()) for _, y in rows)
    total, o = 0.0, 0
    w = model.cfg.mtp_loss_scaling_factor
    for (x, y), p in zip(rows, padded):
        r = model(x, y)
        assert (r.logits[0] - out.logits[0, o:o + x.shape[1]]).abs().max() <= 1e-5
        lm = F.cross_entropy(r.logits[0].float(), y[0], ignore_index=IGNORE, reduction="sum")
        ym = torch.cat([y[0, 1:], y.new_full((1,), IGNORE)])
        mt = F.cross_entropy(r.mtp_logits[0].float(), ym, ignore_index=IGNORE, reduction="sum")
        (lm / n_lm + w * mt / n_mtp).backward()
        total += (lm / n_lm + w * mt / n_mtp).item()
        o += p
    assert abs(total - out.loss.item()) <= 1e-5
    for n, p in model.named_parameters():
        if n in packed_g:
            err = (p.grad - packed_g[n]).abs().max().item()
            assert err <= 1e-5 * max(1.0, packed_g[n].abs().max().item()), (n, err)


def test_sft_source_rows_and_chunks():
    convs = synthetic_chats(40, 0)
    src = SFTSource(convs, TOK, 96, seed=5)
    b = src.batch(0)
    cu, cup = b["cu_seqlens"], b["cu_seqlens_padded"]
    assert cup[-1] == 96 and len(cu) >= 2
    for i in range(len(cu) - 1):                                      # every doc: labels = its own targets
        o, n = int(cup[i]), int(cu[i + 1] - cu[i])
        assert b["labels"][o + n - 1] == IGNORE
    assert np.array_equal(src.batch(3)["tokens"], SFTSource(convs, TOK, 96, seed=5).batch(3)["tokens"])


def test_train_sft_from_jsonl_tokenizer_and_init(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from dsv4.harness.train.loop import RECIPES, train
    from dsv4.model.interop import to_hf
    from dataclasses import replace
    p = tmp_path / "chats.jsonl"
    p.write_text("\n".join(json.dumps({"messages": c}) for c in CONVS * 4) + "\n")
    assert len(read_chat_jsonl(str(p))) == 12
    # a user tokenizer file: a word-level vocabulary of the chats (< 256 ids, fits the debug model)
    words = sorted({w for c in CONVS for m in c for w in (m["content"] + " " + END + f" <|{m['role']}|>").split()})
    vocab = {"[UNK]": 0, "</s>": 1, **{w: i + 2 for i, w in enumerate(words)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.save(str(tmp_path / "tok.json"))
    init = _model(2)
    to_hf(init, str(tmp_path / "hf"), clamp_shared_expert=True)   # HF clamps the shared expert (issue 11 item 5)
    r = replace(RECIPES["sft-debug"], steps=3, sft_data=str(p), tokenizer=str(tmp_path / "tok.json"),
                init=str(tmp_path / "hf"), save_interval=2)
    res = train(r, str(tmp_path / "run"), seed=1, progress=False)
    assert res["steps"] == 3 and all(np.isfinite(res["lm loss"]))
    # resume from step 2 replays step 3 exactly
    res2 = train(r, str(tmp_path / "run2"), seed=1, resume=str(tmp_path / "run" / "checkpoints" / "step_000002"),
                 progress=False)
    assert res2["lm loss"][-1] == res["lm loss"][-1]
    # the --init weights were used: step 1's loss equals the initial model's loss on step 1's batch
    from dsv4.harness.train.tokenizer import load_tokenizer
    b = SFTSource(read_chat_jsonl(str(p)), load_tokenizer(str(tmp_path / "tok.json")), 128, 1).batch(0)
    x, y = torch.from_numpy(b["tokens"])[None], torch.from_numpy(b["labels"])[None]
    ref = init.train()(x, y, cu_seqlens=torch.from_numpy(b["cu_seqlens"]),
                       cu_seqlens_padded=torch.from_numpy(b["cu_seqlens_padded"]))
    assert abs(ref.losses["lm loss"].item() - res["lm loss"][0]) <= 1e-5
