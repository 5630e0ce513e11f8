"""The FlashMLA peer's input mapping (harness/flashmla_peer.py): one kv tensor of window rows + compressed entries
and one index list per query, attended the way FlashMLA's sparse prefill defines it (scaled logits, a sink logit
merged into the log-sum-exp, V = the same rows), == our naive sparse attention on the same inputs (fp64, odd
sizes: window-only, CSA with -1 and not-yet-complete picks, HCA). FlashMLA itself runs on the H200 only."""
import pytest
import torch

from dsv4.harness import flashmla_peer as FM
from dsv4.kernels.sparse_attn import naive


@pytest.mark.parametrize("mode", ["window", "csa", "hca"])
@pytest.mark.parametrize("S,window,ratio,k", [(37, 5, 4, 3), (64, 16, 4, 7), (29, 1, 2, 4)])
def test_mapping_equals_naive_sparse_attn(mode, S, window, ratio, k):
    g = torch.Generator().manual_seed(S * 10 + window)
    H, c = 3, 8
    q = torch.randn(S, H, c, generator=g, dtype=torch.float64)
    kv = torch.randn(S, c, generator=g, dtype=torch.float64)
    sink = torch.randn(H, generator=g, dtype=torch.float64)
    N = 0 if mode == "window" else S // ratio
    comp = None if mode == "window" else torch.randn(N, c, generator=g, dtype=torch.float64)
    idx = None
    if mode == "csa":
        idx = torch.stack([torch.randperm(N, generator=g)[:k] for _ in range(S)])
        idx[torch.rand(S, k, generator=g) < 0.25] = -1                  # -1, visible and not-yet-complete picks
    seg, pos = torch.zeros(S, dtype=torch.long), torch.arange(S)
    ej = torch.arange(N)
    ref = naive.sparse_attn(q, kv, comp, idx, sink, window, ratio if N else 0, c ** -0.5, seg, pos,
                            torch.zeros(N, dtype=torch.long) if N else None, ej if N else None)
    ix = FM.indices(S, window, ratio, idx, N, "cpu")
    kva = FM.kv_all(kv, comp)
    assert ix.dtype == torch.int32 and ix.shape == (S, 1, window + (0 if N == 0 else (k if mode == "csa" else N)))
    assert int(ix.max()) < kva.shape[0] and int(ix.min()) >= -1
    got = FM.gathered_attention(q, kva, ix, sink, c ** -0.5)
    torch.testing.assert_close(got, ref, atol=1e-12, rtol=1e-12)
    if mode == "csa":                                        # the picks that are not complete yet are dropped
        late = (idx >= 0) & (idx >= ((pos + 1) // ratio)[:, None])
        assert late.any() and (ix[:, 0, window:][late] == -1).all()


def test_unavailable_is_one_line_with_the_build_script():
    fn, why = FM.load()
    if fn is not None:
        pytest.skip("flash_mla is importable here")
    assert "\n" not in why and "flashmla_h200.sh" in why


def test_bench_row_times_and_compares_a_stand_in(monkeypatch):
    """`dsv4 bench kernels`' FlashMLA columns on the CPU: a stand-in with FlashMLA's signature and return (the
    gathered attention of the mapping) gives a time, TFLOP/s, and an output difference at fp32 rounding; no
    flash_mla gives the reason, nothing else."""
    from dsv4.harness import bench
    monkeypatch.setattr(bench, "_ms", lambda fn, rep=60: (fn(), 2.0)[1])
    g = torch.Generator().manual_seed(3)
    S, H, c, N, k = 40, 4, 16, 10, 5
    q, kv = torch.randn(S, H, c, generator=g), torch.randn(S, c, generator=g)
    comp, sink = torch.randn(N, c, generator=g), torch.randn(H, generator=g)
    idx = torch.stack([torch.randperm(N, generator=g)[:k] for _ in range(S)])
    stand_in = lambda q, kv, ix, scale, dv, sink: (FM.gathered_attention(q, kv, ix, sink, scale), None, None)
    meta = (torch.zeros(S, dtype=torch.long), torch.arange(S), torch.zeros(N, dtype=torch.long), torch.arange(N))
    r = bench._flashmla_row(stand_in, None, q, kv, comp, idx, sink, 6, 4, c, 1000, {"fwd_ms": 4.0}, meta,
                            backend="naive")
    assert r["flashmla_fwd_ms"] == 2.0 and r["ours_fwd_over_flashmla"] == 0.5
    assert r["flashmla_fwd_tflops"] == pytest.approx(4.0 * H * c * 1000 / 2.0 * 1e-9)
    assert r["flashmla_index_slots"] == 6 + k and r["flashmla_max_abs_diff"] < 1e-5 < r["out_max_abs"]
    assert bench._flashmla_row(None, "why", q, kv, comp, idx, sink, 6, 4, c, 1, {}, meta) == \
        {"flashmla": {"skipped": "why"}}
