"""Triton compressor pooling vs the naive reference (spec §6.2/6.3) on packed streams: overlapping (CSA) and
non-overlapping (HCA) windows, documents of odd lengths with padding (trailing tokens, entry 0's empty previous
slots in every document), a left halo, several channel blocks and slot counts that do not fill the last program;
forward, entry metadata and gradients of kv, gate, ape; the zero pass stores exactly the elements no slot owns.
The kernels have no tl.dot, so bf16 also runs in the interpreter (one small case); the DSv4-size cases (REAL)
run on the GPU only."""
from dsv4.kernels._testing import CUDA, assert_close, assert_rel, packed_meta, use_interpreter

use_interpreter()

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
from dsv4.kernels.compressor import compress_pool  # noqa: E402

DEV = "cuda" if CUDA else "cpu"
CASES = [([37], None, 0, 5, 4, True), ([37], None, 0, 7, 8, False), ([13], None, 0, 6, 3, True),
         ([3], None, 0, 4, 4, True), ([9, 14, 2, 11], [1, 0, 3, 2], 0, 5, 4, True),
         ([9, 20, 17], [0, 3, 0], 0, 7, 8, False), ([6, 13, 9], [0, 1, 0], 5, 5, 3, True),
         ([29, 40], [3, 0], 0, 37, 4, True), ([50, 7, 33], [0, 2, 1], 0, 20, 8, False),
         ([13, 30], [0, 0], 7, 18, 3, True)]
REAL = [([4096], None, 0, 512, 4, True), ([1500, 2596], None, 0, 128, 4, True), ([4096], None, 0, 512, 128, False)]


@pytest.mark.parametrize("lens,pads,first,D,m,overlap", CASES + (REAL if CUDA else []))
def test_triton_matches_naive(lens, pads, first, D, m, overlap):
    gen = torch.Generator(device=DEV).manual_seed(0)
    seg, pos = packed_meta(lens, pads, DEV)
    T = seg.numel()
    if first:                                      # a halo: the first rows are context (their doc starts before)
        pos = torch.where(seg == 0, pos + 2 * m, pos)
    dt = torch.bfloat16 if T > 1000 or D == 18 else torch.float32          # D == 18: the CPU bf16 case
    W = 2 * D if overlap else D
    kv = torch.randn(T, W, generator=gen, device=DEV).to(dt).requires_grad_()
    gate = (2 * torch.randn(T, W, generator=gen, device=DEV)).to(dt).requires_grad_()
    ape = torch.randn(m, W, generator=gen, device=DEV).requires_grad_()
    y, s, j, e = compress_pool(kv, gate, ape, m, overlap, seg, pos, first, backend="triton")
    ref, s0, j0, e0 = compress_pool(kv, gate, ape, m, overlap, seg, pos, first, backend="naive")
    assert y.shape == ref.shape and y.dtype == ref.dtype
    assert torch.equal(s, s0) and torch.equal(j, j0) and torch.equal(e, e0)
    if y.numel() == 0:
        return
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, (kv, gate, ape), dy)
    want = torch.autograd.grad(ref, (kv, gate, ape), dy)
    for n, a, b in zip(("dkv", "dgate", "dape"), got, want):
        if dt == torch.float32:                    # measured <= 1/26 of atol + rtol*|ref| (11 simulated hosts)
            assert_close(n, a, b, 1e-5, 1e-5)
        else:
            assert_rel(n, a, b, 1e-2)
    if dt == torch.float32:                        # measured 2.4e-7, <= 1/90 of the bound (11 hosts)
        assert_close("out", y, ref, 1e-5, 1e-5)
    else:                                          # bf16: 1.3 bf16 eps, unmeasured
        assert_rel("out", y, ref, 1e-2)


@pytest.mark.parametrize("lens,pads,first,D,m,overlap", CASES)
def test_zero_pass_owns_the_complement_of_the_slots(lens, pads, first, D, m, overlap):
    """`_zero_free` on NaN-filled gradients: NaN must stay exactly where a slot's rows are (naive.pool_rows), zero
    everywhere else (a wrong ownership rule either leaves garbage or erases a real gradient)."""
    from dsv4.kernels.compressor import naive
    from dsv4.kernels.compressor import triton as tri
    seg, pos = packed_meta(lens, pads, DEV)
    if first:
        pos = torch.where(seg == 0, pos + 2 * m, pos)
    T, W = seg.numel(), (2 * D if overlap else D)
    ends, eseg, j, r0, hp = tri.slot_meta(seg, pos, m, overlap, first)
    cur, prev, has_prev = naive.pool_rows(seg, pos, ends, eseg >= 0, j, m, overlap)
    owned = torch.zeros(T, W, dtype=torch.bool, device=DEV)
    for s_ in range(ends.numel()):
        if eseg[s_] >= 0:
            owned[cur[s_], (D if overlap else 0):] = True
            if overlap and has_prev[s_]:
                owned[prev[s_], :D] = True
    dkv, dgate = (torch.full((T, W), float("nan"), device=DEV) for _ in range(2))
    tri._zero_free[(triton_cdiv(T, 8), triton_cdiv(W, 16))](pos, r0, hp, dkv, dgate, T, ends.numel(), m, D, W, first,
                                                            OVERLAP=overlap, BT=8, BW=16)
    for g in (dkv, dgate):
        assert torch.equal(torch.isnan(g), owned)
        assert torch.equal(g[~owned], torch.zeros_like(g[~owned]))


def triton_cdiv(a, b):
    return -(-a // b)


@pytest.mark.parametrize("lens,pads,first,D,m,overlap", CASES[:3] + CASES[4:7])
@pytest.mark.parametrize("loop", [False, True])
def test_both_forward_forms_match_naive(lens, pads, first, D, m, overlap, loop):
    """The forward's two forms, launched directly (the autotuner picks between them on the GPU; the CPU config is
    LOOP): the [BE, MP, BD] tile with its softmax over the middle axis, and the slot loop with an online softmax."""
    from dsv4.kernels.compressor import naive
    from dsv4.kernels.compressor import triton as tri
    gen = torch.Generator(device=DEV).manual_seed(1)
    seg, pos = packed_meta(lens, pads, DEV)
    if first:
        pos = torch.where(seg == 0, pos + 2 * m, pos)
    T, W = seg.numel(), (2 * D if overlap else D)
    kv, gate = torch.randn(T, W, generator=gen, device=DEV), 2 * torch.randn(T, W, generator=gen, device=DEV)
    ape = torch.randn(m, W, generator=gen, device=DEV)
    ends, eseg, j, r0, hp = tri.slot_meta(seg, pos, m, overlap, first)
    N = r0.numel()
    out = torch.full((N, D), float("nan"), device=DEV)
    BE, BD, NIT = 2, 16, 2
    tri._pool_fwd.fn[(triton_cdiv(N, BE * NIT), triton_cdiv(D, BD))](
        kv, gate, ape, r0, hp, out, N, m, D, W, N.bit_length(), OVERLAP=overlap, MP=tri._mp(m, overlap),
        BE=BE, BD=BD, NIT=NIT, LOOP=loop)
    ref, *_ = naive.compress_pool(kv, gate, ape, m, overlap, seg, pos, first)
    assert_close("out", out, ref, 1e-5, 1e-5)       # fp32: the tests above' bound (measured 2.4e-7)


@pytest.mark.parametrize("case", [CASES[4], CASES[5], CASES[9]])
def test_precomputed_slots_equal_and_give_the_same_pool(case):
    """compress_slots: the Triton `_slot_meta` == the naive reference on every field (odd packed documents,
    padding, a halo); compress_pool with the slots precomputed (by either backend) == computing them inside, bit
    for bit, forward and gradients; slots of another (ratio, overlap, first) are refused (one line)."""
    from dsv4.kernels.compressor import compress_slots, naive
    lens, pads, first, D, m, overlap = case
    gen = torch.Generator(device=DEV).manual_seed(4)
    seg, pos = packed_meta(lens, pads, DEV)
    if first:
        pos = torch.where(seg == 0, pos + 2 * m, pos)
    T, W = seg.numel(), (2 * D if overlap else D)
    sl = {be: compress_slots(seg, pos, m, overlap, first, backend=be) for be in ("naive", "triton")}
    for a, b in zip(sl["naive"], sl["triton"]):
        assert (torch.equal(a, b) and a.dtype == b.dtype) if isinstance(a, torch.Tensor) else a == b
    kv = torch.randn(T, W, generator=gen, device=DEV).requires_grad_()
    gate = torch.randn(T, W, generator=gen, device=DEV).requires_grad_()
    ape = torch.randn(m, W, generator=gen, device=DEV).requires_grad_()
    for be in ("naive", "triton"):
        ref = compress_pool(kv, gate, ape, m, overlap, seg, pos, first, backend=be)
        dy = torch.randn(ref[0].shape, generator=gen, device=DEV)
        gref = torch.autograd.grad(ref[0], (kv, gate, ape), dy)
        for src in ("naive", "triton"):
            got = compress_pool(kv, gate, ape, m, overlap, seg, pos, first, backend=be, slots=sl[src])
            assert all(torch.equal(a, b) for a, b in zip(got, ref)), (be, src)
            assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(got[0], (kv, gate, ape), dy), gref))
        other = compress_slots(seg, pos, m, not overlap, first)
        with pytest.raises(naive.LayoutError, match="slots were computed for"):
            compress_pool(kv, gate, ape, m, overlap, seg, pos, first, backend=be, slots=other)
