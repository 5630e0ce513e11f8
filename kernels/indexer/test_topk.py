"""The Triton backend's top-k (kernels/indexer/topk.py: `row_topk`, the row on registers, for rows of <= ROW_MAX_N
entries; the radix select `radix_topk` for longer rows) == `naive.indexer_topk` (a stable descending sort) EXACTLY (torch.equal on the indices): ties -> lower index first, -1 for -inf picks,
-0.0 == +0.0, NaN above +inf (torch.sort's order). CPU: Triton's interpreter with tiles of 32 entries (its CPU
config), so rows of 37..300 entries span several tiles and end in a partial one; GPU: DSv4 shapes."""
from dsv4.kernels._testing import CUDA, use_interpreter

use_interpreter()

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
from dsv4.kernels.indexer import naive  # noqa: E402
from dsv4.kernels.indexer import topk  # noqa: E402
from dsv4.kernels.indexer.topk import radix_topk, row_topk  # noqa: E402

DEV = "cuda" if CUDA else "cpu"
INF = float("inf")
# the two routes of topk.indexer_topk: radix select (per chunk of rows), and the row on registers (all rows at once)
ROUTES = {"radix": lambda I, k, **kw: topk.indexer_topk(I, k, **kw),
          "row": lambda I, k, **kw: topk.indexer_topk(I, k, row_max_n=topk.ROW_MAX_N, **kw)}


def _rows(kind: str, R: int, N: int, seed: int) -> torch.Tensor:
    """[R, N] fp32 scores of one kind, rows 0 / 1 / 2 overwritten: all -inf / 3 visible / visible prefix only."""
    g = torch.Generator().manual_seed(seed)
    if kind == "ties":                                  # integers 0..3: ties straddle the k-th position
        I = torch.randint(0, 4, (R, N), generator=g).float()
    elif kind == "signed":                              # both signs, +-0.0 (equal for the sort)
        I = torch.randint(-2, 3, (R, N), generator=g).float() * torch.randn(R, N, generator=g).sign()
        I[torch.rand(R, N, generator=g) < 0.2] = -0.0
    elif kind == "magnitudes":                          # huge / tiny / subnormal / +-inf, both signs
        pool = torch.tensor([3e38, -3e38, 1e-38, -1e-38, 1e-45, -1e-45, 1.0, -1.0, INF, 0.0, -0.0, 7e-39])
        I = pool[torch.randint(0, len(pool), (R, N), generator=g)]
        I = I * (1 + 1e-6 * torch.randint(0, 3, (R, N), generator=g))
    else:                                               # continuous
        I = torch.randn(R, N, generator=g) * 10 ** torch.randint(-3, 4, (R, 1), generator=g).float()
    I[0] = -INF
    if R > 1:
        I[1, 3:] = -INF                                 # fewer visible than k
    if R > 2:
        I[2, N // 3:] = -INF                            # a causal row: -inf tail
    return I.to(DEV)


@pytest.mark.parametrize("kind", ["ties", "signed", "magnitudes", "randn"])
@pytest.mark.parametrize("R,N,k", [(6, 37, 5), (5, 100, 40), (4, 64, 64), (3, 29, 50), (4, 300, 33), (2, 1, 1)])
def test_radix_topk_equals_naive(kind, R, N, k):
    I = _rows(kind, R, N, seed=R * N + k)
    assert torch.equal(topk.indexer_topk(I, k), naive.indexer_topk(I, k))


@pytest.mark.parametrize("kind", ["ties", "signed", "magnitudes", "randn"])
@pytest.mark.parametrize("R,N,k", [(6, 37, 5), (5, 100, 40), (4, 64, 64), (3, 29, 50), (4, 300, 33), (2, 1, 1),
                                   (3, 513, 512)])
def test_row_topk_equals_naive(kind, R, N, k):
    """The row on registers: one tile of next_pow2(N) entries (padding past N), k picks sorted in a [next_pow2(k)]
    vector (padding below every pick)."""
    I = _rows(kind, R, N, seed=R * N + k + 1)
    assert torch.equal(row_topk(I, k), naive.indexer_topk(I, k))


@pytest.mark.parametrize("bits,block", [(5, 32), (8, 64), (11, 128), (8, 512)])
def test_digit_widths_and_tiles(bits, block):
    """Other digit widths (7 / 4 / 3 select passes, a last narrower digit) and tiles (one tile > N included)."""
    I = torch.cat([_rows("ties", 4, 201, 1), _rows("magnitudes", 4, 201, 2), _rows("randn", 4, 201, 3)])
    for k in (1, 17, 201):
        assert torch.equal(radix_topk(I, k, dict(BLOCK=block, BITS=bits, num_warps=1)), naive.indexer_topk(I, k))


@pytest.mark.parametrize("route", list(ROUTES))
def test_exact_ties_at_the_kth_position(route):
    """Hand-made: the k-th score is shared by entries before and after the cut; only the lowest indices enter."""
    top = ROUTES[route]
    row = torch.tensor([1.0, 5, 3, 3, 5, 3, -0.0, 3, 0.0, 3, 5, -INF, 3])
    I = torch.stack([row, row.flip(0), row.neg()]).to(DEV)
    for k in range(1, 14):
        assert torch.equal(top(I, k), naive.indexer_topk(I, k)), k
    assert top(I, 5)[0].tolist() == [1, 4, 10, 2, 3]


@pytest.mark.parametrize("route", list(ROUTES))
def test_nan_ranks_above_inf_in_index_order(route):
    """NaN (either sign) ranks above +inf, NaNs in index order: torch.sort's descending order on the CPU, which
    naive keeps there. The oracle is naive on the CPU on every device: CUDA's sort does not rank a NaN with the sign
    bit set (-row's NaNs) above +inf (H200, torch 2.11: row 2 of k = 1 -> index 3, not 1), so on NaN input naive
    itself differs between devices and the radix select keeps the CPU order on both."""
    top = ROUTES[route]
    row = torch.tensor([1.0, float("nan"), INF, -float("nan"), -INF, 2.0, float("nan"), -0.0] * 5)
    I = torch.stack([row, row.roll(3), -row]).to(DEV)
    for k in (1, 3, 4, 8, 40):
        assert torch.equal(top(I, k).cpu(), naive.indexer_topk(I.cpu(), k)), k
    assert top(I, 4)[0].tolist() == [1, 3, 6, 9]
    assert top(I, 1)[:, 0].tolist() == [1, 1, 1]                # row 2: -nan at 1 first


@pytest.mark.parametrize("route", list(ROUTES))
def test_dtypes_shapes_and_args(route):
    """bf16 / fp16 scores (widened exactly) and fp64 (naive's sort), leading dims, empty rows, k < 1."""
    top = ROUTES[route]
    I = _rows("ties", 5, 70, 4)
    b = (I * 0.37).bfloat16()
    assert torch.equal(top(b, 9), naive.indexer_topk(b, 9))
    assert torch.equal(top(b.half(), 9), naive.indexer_topk(b.half(), 9))
    assert torch.equal(top(I.double(), 9), naive.indexer_topk(I.double(), 9))
    assert torch.equal(top(I.view(5, 1, 70), 9), naive.indexer_topk(I, 9).view(5, 1, 9))
    assert top(I[:0], 9).shape == (0, 9)
    assert torch.equal(top(I[:, ::2], 9), naive.indexer_topk(I[:, ::2], 9))     # strided rows
    assert torch.equal(top(I, 4, chunk=2), naive.indexer_topk(I, 4))            # 3 chunks (radix)
    assert torch.equal(top(I, 4, chunk=2, sort_max_n=70), naive.indexer_topk(I, 4))  # sorted chunks (radix)
    with pytest.raises(ValueError, match="k must be >= 1"):
        top(I, 0)
    with pytest.raises(ValueError, match="at most"):
        row_topk(torch.zeros(2, topk.ROW_MAX_N + 1, device=DEV), 4)


def test_backend_op_routes_rows_to_registers_or_radix_select(monkeypatch):
    """get_op("indexer_topk", "triton") is op.indexer_topk: eager calls run its body, traced calls the custom op
    dsv4::indexer_topk (fake shapes: [..., min(k, N)] long); rows of at most ROW_MAX_N entries go to `row_topk`
    (one launch), longer ones to the radix select (per chunk); all == naive."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from dsv4 import kernels as K
    from dsv4.kernels.indexer import op
    assert K.get_op("indexer_topk", "triton", torch.device(DEV)) is op.indexer_topk
    calls = []
    radix, row = topk.radix_topk, topk.row_topk
    monkeypatch.setattr(topk, "radix_topk", lambda I, k: calls.append("radix") or radix(I, k))
    monkeypatch.setattr(topk, "row_topk", lambda I, k: calls.append("row") or row(I, k))
    I = _rows("ties", 6, 45, 5)
    for n_max, want_calls in ((100, ["row"] * 2), (44, ["radix"] * 2)):
        monkeypatch.setattr(topk, "ROW_MAX_N", n_max)
        calls.clear()
        assert torch.equal(op.indexer_topk(I, 7), naive.indexer_topk(I, 7))
        assert torch.equal(torch.ops.dsv4.indexer_topk(I, 50), naive.indexer_topk(I, 50))
        assert calls == want_calls, n_max
    with FakeTensorMode() as mode:
        f = op.indexer_topk(mode.from_tensor(I), 7)
    assert f.shape == (6, 7) and f.dtype == torch.long
    with pytest.raises(ValueError, match="k must be >= 1"):
        op.indexer_topk(I, 0)


@pytest.mark.skipif(not CUDA, reason="DSv4 shapes: GPU only")
@pytest.mark.parametrize("N", [16384, 32768])
def test_dsv4_shapes_equal_naive_on_gpu(N):
    """4096 query rows x N entries, k = 512: causal -inf tails, bf16-rounded scores (many exact ties), rows with
    fewer than k visible entries, all -inf rows; one tuned launch vs naive's sort, bit-equal."""
    g = torch.Generator(device="cuda").manual_seed(N)
    R = 4096
    I = torch.randn(R, N, generator=g, device="cuda").bfloat16().float()
    vis = torch.linspace(0, N, R, device="cuda").long()                 # visible prefix per row: 0 .. N
    I = I.masked_fill(torch.arange(N, device="cuda")[None, :] >= vis[:, None], -INF)
    I[::97] = I[::97].round()                                           # integer scores: long ties
    for k in (512, 2048):
        assert torch.equal(topk.indexer_topk(I, k), naive.indexer_topk(I, k)), k


@pytest.mark.skipif(not CUDA, reason="DSv4 shapes: GPU only")
@pytest.mark.parametrize("N", [4096, 16384])
def test_row_topk_dsv4_shapes_every_config_on_gpu(N):
    """`row_topk` at the indexer's rows of 16K / 64K tokens (N = S / 4), every tuner config, k = 512 / 2048:
    causal -inf tails, bf16-rounded scores with integer rows (long ties), rows with fewer than k visible, all -inf
    rows; bit-equal to naive's sort."""
    g = torch.Generator(device="cuda").manual_seed(N + 1)
    R = 4096
    I = torch.randn(R, N, generator=g, device="cuda").bfloat16().float()
    vis = torch.linspace(0, N, R, device="cuda").long()
    I = I.masked_fill(torch.arange(N, device="cuda")[None, :] >= vis[:, None], -INF)
    I[::97] = I[::97].round()
    for k in (512, 2048):
        want = naive.indexer_topk(I, k)
        for w in (4, 8, 16):                                            # the GPU configs
            assert torch.equal(row_topk(I, k, dict(num_warps=w)), want), (k, w)
        assert torch.equal(topk.indexer_topk(I, k, row_max_n=topk.ROW_MAX_N), want), k
