"""X2: cached decoding == the full forward over the grown sequence, token by token (fp32, <= 1e-5).

debug config (window 8, CSA m = 4 with top-k 4, HCA m' = 16, hash + score MoE, mHC), random O(1)-scale weights
(slices/X2/_models.py). Prompts of odd lengths, decode far enough that every step crosses CSA group
boundaries, the HCA boundaries at 16 / 32 / 48 and the window; chunked prefill; the dense indexer mode; left /
right padded batches == each row alone; sampling (seeded, top-p); the cache's memory per token.

Tolerance source: the brief's 1e-5 (fp32). Measured on this host: worst 8.6e-6 over these cases with logits
|max| ~ 5; the full forward's own noise floor (the same positions run at other shapes: [2, n] vs [2, n + 1] vs
[1, n]) is 4.3e-6 -- the cached step differs from the full forward only in matmul shapes (M = new tokens vs
M = S). The margin is < 2x: a host with another BLAS path may need a wider bound; the exactness is checked
through the identical greedy tokens and the bit-level structure tests below.
"""
import pytest
import torch

from dsv4.model.generate import DSv4Cache, cache_elements_per_token, forward_step, generate

from ._models import debug_model

TOL = 1e-5


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)                     # tiny ops: 2 threads on a shared 2-core host are 50x slower
    yield
    torch.set_num_threads(n)


def _ids(B, S, seed):
    return torch.randint(1, 256, (B, S), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("S,new,chunk,over", [
    (5, 44, None, {}),                            # decode crosses 8 / 16 / 32 / 48
    (17, 20, 3, {}),                              # prefill in chunks of 3 slots (partial groups carried)
    (33, 8, 7, {"indexer_loss_mode": "dense"}),   # CSA without top-k
])
def test_greedy_logits_equal_full_forward(S, new, chunk, over):
    model = debug_model(**over)
    prompt = _ids(2, S, S)
    out = generate(model, prompt, max_new_tokens=new, prefill_chunk=chunk, output_logits=True)
    seq = out.sequences
    worst = 0.0
    with torch.no_grad():
        for i, lg in enumerate(out.logits):      # step i's logits came from the sequence seq[:, :S + i]
            full = model(seq[:, :S + i]).logits[:, -1].float()
            worst = max(worst, (full - lg).abs().max().item())
            assert torch.equal(full.argmax(-1), seq[:, S + i]), f"step {i}: greedy token differs"
    print(f"S={S} new={new} chunk={chunk} {over}: max |dlogits| {worst:.2e}")
    assert worst <= TOL


def test_every_position_of_a_chunked_run_equals_full():
    """All slots of every step (prefill chunks and decode), not only the last one of each step."""
    model = debug_model(seed=3)
    ids = _ids(1, 50, 7)
    cache = DSv4Cache(model, 1)
    with torch.no_grad():
        full = model(ids).logits
        parts, a = [], 0
        for n in (3, 1, 5, 4, 9, 1, 1, 16, 2, 8):   # 50 tokens in steps that straddle every boundary
            parts.append(forward_step(model, cache, ids[:, a:a + n]))
            a += n
    diff = (full - torch.cat(parts, 1)).abs().max().item()
    assert diff <= TOL, diff
    lc = cache.layers[1]                       # CSA layer: 12 entries, and its indexer's 12 keys
    assert lc.comp[0].entries.n == 12 and lc.index[0].entries.n == 12
    assert cache.layers[2].comp[0].entries.n == 3          # HCA m' = 16
    assert cache.layers[1].comp[0].kv.shape[0] == 4 + 2    # previous group + the 2 tokens of the open one
    assert cache.layers[2].comp[0].kv.shape[0] == 2


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_equals_rows_alone(side):
    model = debug_model(seed=1)
    lens = [7, 18, 12]
    S = max(lens)
    ids = torch.zeros(len(lens), S, dtype=torch.long)
    mask = torch.zeros(len(lens), S, dtype=torch.long)
    rows = [_ids(1, n, 20 + n)[0] for n in lens]
    for b, r in enumerate(rows):
        sl = slice(S - len(r), S) if side == "left" else slice(0, len(r))
        ids[b, sl], mask[b, sl] = r, 1
    out = generate(model, ids, attention_mask=mask, max_new_tokens=12, output_logits=True)
    for b, r in enumerate(rows):
        alone = generate(model, r[None], max_new_tokens=12, output_logits=True)
        assert torch.equal(alone.new_tokens[0], out.new_tokens[b]), (side, b)
        d = max((x[0] - y[b]).abs().max().item() for x, y in zip(alone.logits, out.logits))
        assert d <= TOL, (side, b, d)


def test_sampling_seeded_and_top_p():
    model = debug_model(seed=2)
    p = _ids(2, 9, 5)
    def run(seed, **kw):
        g = torch.Generator().manual_seed(seed)
        return generate(model, p, max_new_tokens=10, do_sample=True, generator=g, **kw).new_tokens
    assert torch.equal(run(1, temperature=1.0), run(1, temperature=1.0))
    assert not torch.equal(run(1, temperature=1.5), run(2, temperature=1.5))
    greedy = generate(model, p, max_new_tokens=10).new_tokens
    assert torch.equal(run(3, top_p=1e-6), greedy)                  # nucleus of one token = argmax
    assert torch.equal(run(4, temperature=0.0), greedy)


def test_eos_stops_rows_and_pads():
    model = debug_model(seed=2)
    p = _ids(2, 9, 5)
    greedy = generate(model, p, max_new_tokens=10).new_tokens
    eos = int(greedy[0, 3])
    out = generate(model, p, max_new_tokens=10, eos_token_id=eos, pad_token_id=0).new_tokens
    first = int((greedy[0] == eos).nonzero()[0])
    assert torch.equal(out[0, :first + 1], greedy[0, :first + 1]) and bool((out[0, first + 1:] == 0).all())


def test_cache_memory_per_token():
    """Growth of the cache between two lengths that are multiples of m' (the partial states are then equal)
    == (L2 - L1) * cache_elements_per_token * bytes; the ring buffers are constant."""
    model = debug_model()
    cfg = model.cfg
    ids = _ids(1, 48, 9)
    cache = DSv4Cache(model, 1)
    forward_step(model, cache, ids[:, :16])
    n16 = cache.nbytes()
    forward_step(model, cache, ids[:, 16:48])
    grow = cache.nbytes() - n16
    assert grow == 32 * cache_elements_per_token(cfg) * 4
    # debug: 1 CSA layer (c 32, c_I 16, m 4) + 1 HCA layer (c 32, m' 16) + streams 4 x 64
    assert cache_elements_per_token(cfg) == (32 + 16) / 4 + 32 / 16 + 4 * 64
