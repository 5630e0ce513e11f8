"""FP4 QK path of the lightning indexer with BF16 index scores (slice X1; seed 004, spec §7.3).

As DeepSeek's inference code does it: after RoPE, the indexer queries qI and compressed keys kI go through a
normalised Walsh-Hadamard transform over the head dim (`rotate_activation`, H_n / sqrt(n), n = c_I = 128 in
the real model) and are fake-quantised to MXFP4 (e2m1 elements, blocks of 32 along the head dim, ue8m0
power-of-two scales 2^ceil(log2(amax/6)), so nothing saturates). The scores are then formed exactly as the
bf16/fp32 indexer forms them (kernels/indexer `indexer_scores`, fp32 accumulation) and rounded to BF16 (the
"BF16 index-score path" of the top-k selector); -inf marks non-causal entries as before.

H is symmetric and orthogonal (H H^T = I) and applied to both sides, so without quantisation the scores are
unchanged up to fp32 rounding; the rotation spreads outlier channels over the block so the 32-element FP4
scale is not set by one large coordinate.

CPU emulation (dequantised fp32 values): on the GPU the same function runs as tensor ops (no FP4 tensor-core
kernel here; Hopper has none).

One precision setting of the indexer's QK scoring, `QK_PRECISIONS` (model/indexer.py `Indexer.qk_precision`,
set by the precision recipe's `indexer_qk_precision`), shared with the FP8 indexer of issue 14:
    "bf16"  the high-precision path, unchanged (kernels/indexer `indexer_scores`; fp32 in fp32 runs)
    "fp8"   rotated qI, kI fake-quantised to e4m3 with one ue8m0 scale per row (per token and head: 1 x c_I;
            DeepSeek-V3.2's FP8 indexer rotates and act_quant's both sides the same way), BF16 index scores
    "fp4"   rotated qI, kI in MXFP4 (above), BF16 index scores
Simulated (quantise-dequantise, exact on the CPU) with a straight-through gradient for the indexer's KL loss;
only the QK scoring is low precision: the indexer's weights and projections stay high precision.

Re-ranking (`rerank_topk`, Indexer.qk_rerank = margin m > 0, recipe `indexer_qk_rerank`): the low-precision scores
pick a wider list of k' = ceil(k (1 + m)) entries (capped at N), the high-precision listed scores of those k'
(`indexer_scores_listed` on the unquantised features, O(Tq k' n_I c_I)) pick the k, ordered as `indexer_topk`
orders the high-precision scores (descending, ties -> lower entry index). The selection then equals the
high-precision top-k whenever the wide list holds it, so the FP8 / FP4 scoring only pre-filters: recall vs bf16
is the share of the bf16 top-k inside the wide list (e4m3's 3-bit mantissa alone gives 0.96-0.98 at k' = k).
"""
from __future__ import annotations

import functools
import math

import torch

from dsv4.kernels.indexer import indexer_scores, indexer_scores_listed, indexer_topk
from dsv4.kernels.quant.naive import quantize, ste_fake_quantize

QK_PRECISIONS = ("bf16", "fp8", "fp4")


@functools.lru_cache(maxsize=8)
def _hadamard_cpu(n: int) -> torch.Tensor:
    if n < 1 or n & (n - 1):
        raise ValueError(f"hadamard: size must be a power of two, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)     # Sylvester construction
    return h / n ** 0.5


def hadamard(n: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """Normalised Walsh-Hadamard matrix H_n / sqrt(n) [n, n] (symmetric, orthogonal)."""
    return _hadamard_cpu(n).to(device=device, dtype=dtype)


def rotate_activation(x: torch.Tensor) -> torch.Tensor:
    """x [..., n] -> x H (n a power of two), in x's dtype (computed in fp32 at least)."""
    dt = torch.promote_types(x.dtype, torch.float32)
    return (x.to(dt) @ hadamard(x.shape[-1], x.device, dt)).to(x.dtype)


def fp4_fake_quant(x: torch.Tensor, block: int = 32, rule: str = "ue8m0") -> torch.Tensor:
    """MXFP4 fake quantisation along the last dim (e2m1, `block` elements per power-of-two scale)."""
    return quantize(x, "e2m1", (1, block), rule).dequantize(torch.promote_types(x.dtype, torch.float32))


def indexer_scores_fp4(qI: torch.Tensor, kI: torch.Tensor, w: torch.Tensor, ratio: int, seg_q: torch.Tensor,
                       pos_q: torch.Tensor, entry_seg: torch.Tensor, entry_j: torch.Tensor, rotate: bool = True,
                       quant: bool = True, score_dtype: torch.dtype | None = torch.bfloat16,
                       block: int = 32) -> torch.Tensor:
    """qI [Tq,nI,cI] (after RoPE), kI [N,cI], w [Tq,nI] + document metadata (seg_q, pos_q [Tq]; entry_seg,
    entry_j [N]; as kernels/indexer `indexer_scores`) -> I [Tq,N] in `score_dtype` (None: fp32), -inf where not
    visible. rotate / quant switch the Hadamard rotation and the FP4 quantisation (both on = DeepSeek's path);
    both act per token / per entry along c_I only, so the packing does not change them."""
    if rotate:
        qI, kI = rotate_activation(qI.float()), rotate_activation(kI.float())
    if quant:
        qI, kI = fp4_fake_quant(qI, block), fp4_fake_quant(kI, block)
    I = indexer_scores(qI, kI, w, ratio, seg_q, pos_q, entry_seg, entry_j)
    return I if score_dtype is None else I.to(score_dtype)


def qk_fake_quant(x: torch.Tensor, precision: str, block: int = 32) -> torch.Tensor:
    """x [..., c_I] (qI or kI after RoPE) -> rotated and fake-quantised fp32 (straight-through gradient):
    "fp4" MXFP4 (e2m1, `block` elements per ue8m0 scale), "fp8" e4m3 with one ue8m0 scale per row."""
    x = rotate_activation(x.float())
    if precision == "fp4":
        return ste_fake_quantize(x, "e2m1", (1, block), "ue8m0")
    if precision == "fp8":
        return ste_fake_quantize(x, "e4m3", (1, x.shape[-1]), "ue8m0")
    raise ValueError(f"indexer qk_precision: fp8|fp4 quantise, got {precision!r}")


def indexer_scores_qk(qI: torch.Tensor, kI: torch.Tensor, w: torch.Tensor, ratio: int, seg_q: torch.Tensor,
                      pos_q: torch.Tensor, entry_seg: torch.Tensor, entry_j: torch.Tensor, precision: str = "bf16",
                      backend: str = "naive") -> torch.Tensor:
    """The indexer's scores I [Tq, N] at QK precision `precision` (QK_PRECISIONS; arguments as kernels/indexer
    `indexer_scores`): "bf16" = indexer_scores itself; "fp8" / "fp4" = the scores of the rotated, fake-quantised
    qI and kI (fp32 accumulation) rounded to BF16; differentiable (straight through the quantisers)."""
    if precision not in QK_PRECISIONS:
        raise ValueError(f"indexer qk_precision: must be {'|'.join(QK_PRECISIONS)}, got {precision!r}")
    if precision == "bf16":
        return indexer_scores(qI, kI, w, ratio, seg_q, pos_q, entry_seg, entry_j, backend=backend)
    qq, kq = qk_fake_quant(qI, precision), qk_fake_quant(kI, precision)
    return quantised_scores(qq, kq, w, ratio, seg_q, pos_q, entry_seg, entry_j, backend, precision)


def quantised_scores(qq: torch.Tensor, kq: torch.Tensor, w: torch.Tensor, ratio: int, seg_q: torch.Tensor,
                     pos_q: torch.Tensor, entry_seg: torch.Tensor, entry_j: torch.Tensor,
                     backend: str = "naive", precision: str = "fp4") -> torch.Tensor:
    """The BF16 index scores [Tq, N] of already rotated and fake-quantised qq [Tq,nI,cI], kq [N,cI] (fp32
    accumulation, then rounded to BF16). precision: the features' ("fp8" | "fp4"); "fp8" lets backend
    "triton+cudnn" score them with cuDNN's FP8 E4M3 kernel (kernels/indexer/cudnn_fwd.py), the same values."""
    return indexer_scores(qq, kq, w.float(), ratio, seg_q, pos_q, entry_seg, entry_j, backend=backend,
                          precision="fp8" if precision == "fp8" else "bf16").to(torch.bfloat16)


def rerank_width(k: int, N: int, margin: float) -> int:
    """k' = min(N, ceil(k (1 + margin))): the wide list the low-precision scores pick for `rerank_topk`."""
    if margin < 0:
        raise ValueError(f"indexer qk_rerank: the margin must be >= 0, got {margin!r}")
    return min(N, math.ceil(k * (1.0 + margin) - 1e-9))


def rerank_topk(wide: torch.Tensor, qI: torch.Tensor, kI: torch.Tensor, w: torch.Tensor, k: int,
                backend: str = "naive") -> torch.Tensor:
    """wide [Tq,k'] (entries picked by low-precision scores, -1 = none) -> idx [Tq,min(k,k')] long: the k best
    of them by the high-precision listed scores of qI [Tq,nI,cI], kI [N,cI], w [Tq,nI] (`indexer_scores_listed`,
    no gradient), in `indexer_topk`'s order (descending, ties -> lower entry index), -1 where none is left."""
    with torch.no_grad():
        N = kI.shape[0]
        key = torch.where(wide < 0, torch.full_like(wide, N), wide)
        order = torch.sort(key, dim=-1, stable=True).values                # [Tq, k'] entry ascending, -1 last
        cand = torch.where(order >= N, torch.full_like(order, -1), order)
        s = indexer_scores_listed(qI, kI, w, cand, backend=backend)           # [Tq, k'] fp32, -inf at -1
        pick = indexer_topk(s, k, backend=backend)                             # [Tq, min(k, k')] positions
        return torch.where(pick < 0, pick, cand.gather(-1, pick.clamp_min(0)))


def quantised_listed_scores(qq: torch.Tensor, kq: torch.Tensor, w: torch.Tensor, idx: torch.Tensor,
                            backend: str = "naive") -> torch.Tensor:
    """`quantised_scores` at the listed entries idx [Tq,k] only -> [Tq,k] (BF16 values in fp32, -inf at -1):
    the sparse-mode loss's scores, re-formed from the quantised features (straight-through gradients), so no
    dense [Tq, N] graph is kept."""
    return indexer_scores_listed(qq, kq, w.float(), idx, backend=backend).to(torch.bfloat16).float()


def topk_recall(I_test: torch.Tensor, I_ref: torch.Tensor, k: int, min_visible: int = 1) -> float:
    """Mean over query rows (I [..., N]) with >= `min_visible` visible entries (>= 1; k = issue 14's "queries with
    at least k candidates") of |TopK(test) ∩ TopK(ref)| / |TopK(ref)| (-1s ignored)."""
    return picks_recall(indexer_topk(I_test.float(), k), I_ref, k, min_visible)


def picks_recall(picks: torch.Tensor, I_ref: torch.Tensor, k: int, min_visible: int = 1) -> float:
    """`topk_recall` of a selection already made: picks [..., k'] (entries, -1 = none; any k', e.g. the wide list
    of `rerank_topk` or its result) against TopK(I_ref) [..., N]."""
    a = picks.cpu()
    r = indexer_topk(I_ref.float().cpu(), k)
    T = I_ref.shape[-1]
    hit = torch.zeros(*r.shape[:-1], T + 1, dtype=torch.bool)
    hit.scatter_(-1, torch.where(a < 0, T, a), True)
    hit[..., T] = False
    valid = r >= 0
    found = hit.gather(-1, torch.where(valid, r, T)) & valid
    n = valid.sum(-1)
    rows = (n > 0) & (torch.isfinite(I_ref.float().cpu()).sum(-1) >= min_visible)
    return float((found.sum(-1)[rows].float() / n[rows].float()).mean())
