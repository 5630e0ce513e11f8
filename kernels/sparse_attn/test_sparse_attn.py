"""Triton sparse attention vs the naive reference (spec §5.2-5.3) on packed streams: window-only, CSA (gathered
top-k entries, with -1, not-yet-complete and other-document picks) and HCA (every visible entry); one document,
several documents with padding, and a left halo (q_offset, the CP layout); output and gradients of q, kv, comp,
sink. CPU: Triton interpreter, tiny odd shapes, fp32. GPU: DSv4 shapes (H=64, c=512, window 128), bf16."""
from dsv4.kernels._testing import CUDA, assert_close, assert_rel, packed_meta, use_interpreter

use_interpreter()

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
from dsv4.kernels.compressor.naive import entry_slots  # noqa: E402
from dsv4.kernels.sparse_attn import sparse_attn  # noqa: E402

DEV = "cuda" if CUDA else "cpu"
LAYOUTS = {"one_doc": ([13], None, 0), "packed": ([5, 11, 2, 9], [2, 0, 3, 1], 0), "halo": ([7, 12, 6], [0, 1, 0], 4)}
# H below the kernel's rows per program (16 on the interpreter, 32 / 64 on the GPU) packs several queries into a
# program (H=3: 4 queries of 4 head rows, one empty); H=16 on the interpreter is one query per program, the DSv4
# H=64 path on the GPU; `proxy` (H=16) runs 4 queries per forward program and 2 per backward one on the GPU.
TINY = dict(H=3, c=24, window=5, dtype=torch.float32)
TINY16 = dict(H=16, c=24, window=5, dtype=torch.float32)
REAL = dict(H=64, c=512, window=128, dtype=torch.bfloat16)
REAL16 = dict(H=16, c=512, window=128, dtype=torch.bfloat16)
SHAPES = {"tiny": TINY, "tiny_h16": TINY16, "real": REAL, "real_h16": REAL16}


def _case(mode, lens, pads, q_off, H, c, window, dtype, ratio, k, seed=0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen, device=DEV)
    seg, pos = packed_meta(lens, pads, DEV)
    Tk = seg.numel()
    Tq = Tk - q_off
    q, kv, sink = rnd(Tq, H, c).to(dtype), rnd(Tk, c).to(dtype), rnd(H)
    comp = idx = eseg = ej = None
    if mode != "window":
        ends, valid, ej = entry_slots(seg, pos, ratio, q_off)
        eseg = torch.where(valid, seg[ends], torch.full_like(ends, -1))
        comp = rnd(ends.numel(), c).to(dtype)
    if mode == "csa":                              # unique picks per row, some -1, some not visible
        N = comp.shape[0]
        scores = torch.rand(Tq, N, generator=gen, device=DEV)
        idx = scores.topk(min(k, N), dim=-1).indices
        drop = torch.rand(idx.shape, generator=gen, device=DEV) < 0.2
        idx = torch.where(drop, torch.full_like(idx, -1), idx)
    ins = [x.requires_grad_() if x is not None else None for x in (q, kv, comp)]
    return ins + [idx, sink.requires_grad_()], dict(seg=seg, pos=pos, entry_seg=eseg, entry_j=ej, q_offset=q_off)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("mode,ratio,k", [("window", 4, 0), ("csa", 3, 4), ("hca", 4, 0)])
@pytest.mark.parametrize("shape", ["tiny", "tiny_h16"] + (["real", "real_h16"] if CUDA else []))
def test_triton_matches_naive(shape, mode, ratio, k, layout):
    sh = SHAPES[shape]
    lens, pads, q_off = LAYOUTS[layout]
    if shape.startswith("real"):
        ratio, k = {"window": (4, 0), "csa": (4, 512), "hca": (128, 0)}[mode]
        lens = [L * 97 for L in lens]
    (q, kv, comp, idx, sink), meta = _case(mode, lens, pads, q_off, **sh, ratio=ratio, k=k)
    scale = sh["c"] ** -0.5
    o = sparse_attn(q, kv, comp, idx, sink, sh["window"], ratio, scale, **meta, backend="triton")
    ref = sparse_attn(q, kv, comp, idx, sink, sh["window"], ratio, scale, **meta, backend="naive")
    do = torch.randn_like(o)
    ins = [x for x in (q, kv, comp, sink) if x is not None]
    names = [n for n, x in zip(("dq", "dkv", "dcomp", "dsink"), (q, kv, comp, sink)) if x is not None]
    got = torch.autograd.grad(o, ins, do)
    want = torch.autograd.grad(ref, ins, do)
    # fp32 (measured over the 11 simulated hosts of harness/numerics.py): o 4.8e-7 (1/70 of its bound), grads
    # 1.2e-6 (1/81); bf16 (GPU only): 1.3 / 2.5 bf16 eps, not measured here
    if shape.startswith("tiny"):                   # fp32 everywhere: summation order only
        assert_close("o", o, ref, 2e-5, 1e-5)
        for n, a, b in zip(names, got, want):
            assert_close(n, a, b, 5e-5, 1e-4)
    else:                                          # bf16 operands / P in bf16 for the PV product
        # measured on the H200 (triton 3.6, 2026-12-01, scratch relerr run): o 2.2e-3, dq 2.7e-3, dkv 1.6e-2, HCA
        # dcomp 3.4e-3, CSA dcomp 3.8e-2 (one_doc; 2.7e-2 packed) -- the CSA entries collect dS Q + P dO from
        # every query that lists them, each term rounded to bf16; the same kernel in fp32 matches naive to 5e-7
        # (window path, GPU) and the tiny fp32 cases above check every branch. Bounds: 1e-2 / 2e-2, CSA dcomp 5e-2
        assert_rel("o", o, ref, 1e-2)
        for n, a, b in zip(names, got, want):
            assert_rel(n, a, b, 5e-2 if (n == "dcomp" and mode == "csa") else 2e-2)


def _tables(Tq, r, scale, gen, dtype=torch.float32):
    """cos / sin [Tq, r/2] of random angles times `scale` (HF's YaRN attention factor when != 1: the rotation is
    then not orthogonal, so the backward's delta from the rotated O and dO is right only as the adjoint)."""
    ang = torch.rand(Tq, r // 2, generator=gen, device=DEV, dtype=dtype) * 6.3
    return ang.cos() * scale, ang.sin() * scale


@pytest.mark.parametrize("layout", ["packed", "halo"])
@pytest.mark.parametrize("mode,ratio,k", [("window", 4, 0), ("csa", 3, 4), ("hca", 4, 0)])
@pytest.mark.parametrize("shape", ["tiny", "tiny_h16"] + (["real", "real_h16"] if CUDA else []))
def test_fused_output_rope_matches_attention_then_rope(shape, mode, ratio, k, layout):
    """out_rope (cos, sin): the Triton kernels rotate o's last r dims back inside the forward and keep only that
    rotated output, whose backward's first pass takes delta from the rotated O and dO and rotates dO back for the
    kernel (`_out_rope_bwd_prep`). Oracle: naive
    attention, then kernels/rope's naive inverse rotation, autograd through both; c 24 / r 8 (BD 32 > c: padded
    pairs), a table scale of 0.7. Also what autograd keeps: one [Tq, H, c] tensor for o, not two."""
    from dsv4.kernels.rope import rope_rows
    sh = SHAPES[shape]
    lens, pads, q_off = LAYOUTS[layout]
    r = 8 if shape.startswith("tiny") else 64
    if shape.startswith("real"):
        ratio, k = {"window": (4, 0), "csa": (4, 512), "hca": (128, 0)}[mode]
        lens = [L * 97 for L in lens]
    (q, kv, comp, idx, sink), meta = _case(mode, lens, pads, q_off, **sh, ratio=ratio, k=k)
    cos, sin = _tables(q.shape[0], r, 0.7, torch.Generator(device=DEV).manual_seed(9))
    scale = sh["c"] ** -0.5
    saved = []

    def pack(t):
        saved.append(t)
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        o = sparse_attn(q, kv, comp, idx, sink, sh["window"], ratio, scale, **meta, out_rope=(cos, sin),
                        backend="triton")
    big = {t.untyped_storage().data_ptr() for t in saved if t.shape == q.shape and t is not q}
    assert len(big) == 1 and o.untyped_storage().data_ptr() in big          # the rotated output, once
    ref = rope_rows(sparse_attn(q, kv, comp, idx, sink, sh["window"], ratio, scale, **meta, backend="naive"),
                    cos, sin, True, backend="naive")
    do = torch.randn_like(o)
    ins = [x for x in (q, kv, comp, sink) if x is not None]
    names = [n for n, x in zip(("dq", "dkv", "dcomp", "dsink"), (q, kv, comp, sink)) if x is not None]
    got = torch.autograd.grad(o, ins, do)
    want = torch.autograd.grad(ref, ins, do)
    if shape.startswith("tiny"):                   # fp32: summation order only (bounds of test_triton_matches_naive)
        assert_close("o", o, ref, 2e-5, 1e-5)
        for n, a, b in zip(names, got, want):
            assert_close(n, a, b, 5e-5, 1e-4)
    else:                                          # bf16: test_triton_matches_naive's bounds
        assert_rel("o", o, ref, 1e-2)
        for n, a, b in zip(names, got, want):
            assert_rel(n, a, b, 5e-2 if (n == "dcomp" and mode == "csa") else 2e-2)


def test_fused_output_rope_with_odd_c_minus_r_falls_back():
    """c - r odd (c 25, r 8): the kernels pair channels (2i, 2i+1) of the whole row, so `sparse_attn` rotates after
    the Triton attention instead (the same result as naive + rope), and the op refuses such tables itself."""
    from dsv4.kernels.rope import rope_rows
    from dsv4.kernels.sparse_attn import op as O
    (q, kv, comp, idx, sink), meta = _case("csa", [5, 11, 2, 9], [2, 0, 3, 1], 0, H=3, c=25, window=5,
                                           dtype=torch.float32, ratio=3, k=4)
    cos, sin = _tables(q.shape[0], 8, 0.7, torch.Generator(device=DEV).manual_seed(9))
    o = sparse_attn(q, kv, comp, idx, sink, 5, 3, 0.2, **meta, out_rope=(cos, sin), backend="triton")
    ref = rope_rows(sparse_attn(q, kv, comp, idx, sink, 5, 3, 0.2, **meta, backend="naive"), cos, sin, True)
    assert_close("o", o, ref, 2e-5, 1e-5)
    with pytest.raises(ValueError, match="c - r even"):
        O.sparse_attn(q, kv, comp, idx, sink, 5, 3, 0.2, **meta, out_rope=(cos, sin))


def test_fused_output_rope_backward_needs_the_unrotated_do():
    """The backward's un-rotation of dO is load-bearing: the same fused forward whose backward is given tables
    of angle 0 (no un-rotation) gives a dq off the oracle's by far more than the bound above."""
    from dsv4.kernels.sparse_attn import op as O
    (q, kv, comp, idx, sink), meta = _case("csa", [5, 11, 2, 9], [2, 0, 3, 1], 0, **TINY, ratio=3, k=4)
    cos, sin = _tables(q.shape[0], 8, 1.0, torch.Generator(device=DEV).manual_seed(9))
    m = (meta["seg"], meta["pos"], meta["entry_seg"], meta["entry_j"])
    args = (q.detach(), kv.detach(), comp.detach(), idx, sink.detach(), *m, TINY["window"], 3, 24 ** -0.5, 0)
    o, lse, _ = O._sparse_attn_fwd(*args, cos, sin)
    do = torch.randn_like(o)
    bwd = lambda c, s: O._sparse_attn_bwd(do, *args[:9], o, lse, TINY["window"], 3, 24 ** -0.5, 0, c, s)
    right, wrong = bwd(cos, sin)[0], bwd(torch.ones_like(cos), torch.zeros_like(sin))[0]
    assert (right - wrong).abs().max() > 100 * 5e-5


def test_forward_probs_stay_off_past_their_memory_cap(monkeypatch):
    """`return_probs` stores [Tq, k, H] fp32 logits; past triton._STORE_S_BYTES the forward stores nothing and
    returns None, so the caller falls back to `entry_probs` (o and lse unchanged)."""
    from dsv4.kernels.sparse_attn import triton as T
    (q, kv, comp, idx, sink), meta = _case("csa", [5, 11, 2, 9], [2, 0, 3, 1], 0, **TINY, ratio=3, k=4)
    args = (q, kv, comp, idx, sink, TINY["window"], 3, 24 ** -0.5)
    o, lse, p = sparse_attn(*args, **meta, return_lse=True, return_probs=True, backend="triton")
    assert p is not None and p.shape == idx.shape
    monkeypatch.setattr(T, "_STORE_S_BYTES", p.numel() * q.shape[1] * 4 - 1)
    o2, lse2, p2 = sparse_attn(*args, **meta, return_lse=True, return_probs=True, backend="triton")
    assert p2 is None and torch.equal(o2, o) and torch.equal(lse2, lse)
    from dsv4.kernels.sparse_attn import op as O                # the fake (torch.compile's shapes) agrees
    m = (meta["seg"], meta["pos"], meta["entry_seg"], meta["entry_j"])
    torch.library.opcheck(O.sparse_attn_fwd, (q.detach(), kv.detach(), comp.detach(), idx, sink.detach(), *m,
                                              TINY["window"], 3, 24 ** -0.5, 0, None, None, True),
                          test_utils=("test_faketensor",))


# Layouts where queries of different documents that both see entries share a program (4 queries a program at H 3 on
# the interpreter): "mixed"; and "hole": one_doc with an empty entry slot inside the document's range (as a context-
# parallel rank's gathered entries can have when its chunk is not a multiple of the ratio), so that an entry's index
# in the stream and in its document differ by more than the range start
PROB_LAYOUTS = {**LAYOUTS, "mixed": ([5, 8, 9], None, 0), "hole": ([13], None, 0)}


@pytest.mark.parametrize("layout", list(PROB_LAYOUTS))
@pytest.mark.parametrize("shape", ["tiny", "tiny_h16"] + (["real_h16"] if CUDA else []))
def test_forward_probs_of_every_visible_entry_follow_the_listing(shape, layout):
    """Every visible entry attended (comp_idx None, MODE_ALL) with `probs_idx`, a listing of those entries (each
    query's visible ones in a random order, -1 padding; what the indexer's top-k gives when it lists them all): the
    forward stores each visible entry's logits at slot entry_j (its index in the document) and returns the mass of
    each listed entry == naive `entry_probs` of that listing against the naive lse. H 3 runs 4 queries a program on
    the interpreter, H 16 one. Also: o and lse equal the call without probs (the store changes nothing else), and
    the fake (torch.compile's shapes) agrees."""
    from dsv4.kernels.sparse_attn import entry_probs
    from dsv4.kernels.sparse_attn import op as O
    sh = SHAPES[shape]
    lens, pads, q_off = PROB_LAYOUTS[layout]
    ratio = 3 if shape.startswith("tiny") else 4
    if shape == "real_h16":
        lens = [L * 97 for L in lens]
    (q, kv, comp, _, sink), meta = _case("hca", lens, pads, q_off, **sh, ratio=ratio, k=0)
    if layout == "hole":                           # an empty slot (entry_seg -1) between the document's entries 1 and 2
        comp = torch.cat([comp[:2], torch.randn_like(comp[:1]), comp[2:]]).detach().requires_grad_()
        for f, v in (("entry_seg", -1), ("entry_j", 0)):
            meta[f] = torch.cat([meta[f][:2], meta[f].new_tensor([v]), meta[f][2:]])
    seg, pos = meta["seg"][q_off:], meta["pos"][q_off:]
    vis = (meta["entry_seg"][None, :] == seg[:, None]) & (meta["entry_seg"][None, :] >= 0) & \
        (meta["entry_j"][None, :] < ((pos + 1) // ratio)[:, None])                   # [Tq, N]
    k = min(int(vis.sum(1).max()) + 1, vis.shape[1])                                 # -1 padding where it fits
    gen = torch.Generator(device=DEV).manual_seed(1)
    key = torch.rand(vis.shape, generator=gen, device=DEV).masked_fill(~vis, -1.0)
    v, listing = key.topk(k, dim=-1)
    listing = torch.where(v < 0, torch.full_like(listing, -1), listing)
    scale = sh["c"] ** -0.5
    args = (q, kv, comp, None, sink, sh["window"], ratio, scale)
    o_n, lse_n = sparse_attn(*args, **meta, return_lse=True, backend="naive")
    em = dict(seg=meta["seg"], pos=meta["pos"], entry_seg=meta["entry_seg"], entry_j=meta["entry_j"], q_offset=q_off)
    want = entry_probs(q, comp, listing, lse_n, ratio, scale, **em, backend="naive")
    o, lse, got = sparse_attn(*args, **meta, return_lse=True, return_probs=True, probs_idx=listing, backend="triton")
    o0, lse0, none = sparse_attn(*args, **meta, return_lse=True, return_probs=True, backend="triton")
    assert none is None and torch.equal(o, o0) and torch.equal(lse, lse0)
    assert got is not None and got.shape == listing.shape and (got[listing < 0] == 0).all()
    if shape.startswith("tiny"):                   # fp32: summation order only (bounds of test_entry_probs_...)
        assert_close("forward's probs of every visible entry", got, want, 2e-5, 1e-5)
    else:                                          # bf16 QK products on the GPU, as test_entry_probs_...
        assert_rel("forward's probs of every visible entry", got, want, 2e-2)
    m = (meta["seg"], meta["pos"], meta["entry_seg"], meta["entry_j"])
    torch.library.opcheck(O.sparse_attn_fwd, (q.detach(), kv.detach(), comp.detach(), None, sink.detach(), *m,
                                              sh["window"], ratio, scale, q_off, None, None, True, listing),
                          test_utils=("test_faketensor",))


def test_no_key_but_sink_is_defined():
    """Query 0 of an HCA layer sees one window key and no entry; the sink alone must not give NaN; padding
    queries see only the sink (output 0)."""
    (q, kv, comp, idx, sink), meta = _case("hca", [3], [2], 0, H=2, c=16, window=1, dtype=torch.float32, ratio=4, k=0)
    o = sparse_attn(q, kv, comp, idx, sink, 1, 4, 0.25, **meta, backend="triton")
    assert torch.isfinite(o).all() and o[3:].abs().max() == 0
    # measured 2.4e-7 (11 hosts), 1/150 of the bound
    assert_close("o", o, sparse_attn(q, kv, comp, idx, sink, 1, 4, 0.25, **meta, backend="naive"), 2e-5, 1e-5)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("shape", ["tiny"] + (["real"] if CUDA else []))
def test_entry_probs_triton_matches_naive(shape, layout):
    """The attention's mass on its listed entries (the indexer's joint teacher, from the forward's lse): Triton
    == naive, and the naive one == exp(l - lse) summed over heads, formed directly from the attention's logits.
    The Triton forward's own P (`return_probs`: the picks' logits it stored, summed against its final lse) == the
    same; the other backends return None (the caller runs `entry_probs`)."""
    sh = TINY if shape == "tiny" else REAL
    lens, pads, q_off = LAYOUTS[layout]
    ratio, k = (3, 4) if shape == "tiny" else (4, 512)
    if shape == "real":
        lens = [L * 97 for L in lens]
    (q, kv, comp, idx, sink), meta = _case("csa", lens, pads, q_off, **sh, ratio=ratio, k=k)
    scale = sh["c"] ** -0.5
    from dsv4.kernels.sparse_attn import entry_probs
    o, lse = sparse_attn(q, kv, comp, idx, sink, sh["window"], ratio, scale, **meta, return_lse=True, backend="naive")
    o_t, lse_t = sparse_attn(q, kv, comp, idx, sink, sh["window"], ratio, scale, **meta, return_lse=True,
                             backend="triton")
    em = dict(seg=meta["seg"], pos=meta["pos"], entry_seg=meta["entry_seg"], entry_j=meta["entry_j"],
              q_offset=q_off)
    want = entry_probs(q, comp, idx, lse, ratio, scale, **em, backend="naive")
    got = entry_probs(q, comp, idx, lse_t, ratio, scale, **em, backend="triton")
    o_f, lse_f, fwd = sparse_attn(q, kv, comp, idx, sink, sh["window"], ratio, scale, **meta, return_lse=True,
                                  return_probs=True, backend="triton")
    assert torch.equal(o_f, o_t) and torch.equal(lse_f, lse_t)        # storing the logits changes nothing else
    assert sparse_attn(q, kv, comp, idx, sink, sh["window"], ratio, scale, **meta, return_lse=True,
                       return_probs=True, backend="naive")[2] is None
    # an independent oracle: the probabilities of one softmax over (window logits, listed logits, sink)
    if shape == "tiny":
        Tq, H, _ = q.shape
        from dsv4.kernels.sparse_attn.naive import listed_entries, window_keys
        sq, pq = meta["seg"][q_off:], meta["pos"][q_off:]
        cidx, cval = listed_entries(idx, sq, pq, meta["entry_seg"], meta["entry_j"], ratio)
        wr, wv = window_keys(meta["seg"], meta["pos"], Tq, sh["window"], q_off)
        lw = torch.einsum("thc,twc->thw", q, kv[wr]).mul(scale).masked_fill(~wv[:, None], float("-inf"))
        lc = torch.einsum("thc,tkc->thk", q, comp[cidx]).mul(scale).masked_fill(~cval[:, None], float("-inf"))
        p = torch.softmax(torch.cat([lw, lc, sink.view(1, H, 1).expand(Tq, H, 1)], -1), -1)
        oracle = p[:, :, lw.shape[-1]:-1].sum(1)
        assert_close("entry_probs naive vs softmax", want, oracle, 1e-5, 1e-6)    # fp32 rounding; values <= H
        assert (want[idx < 0] == 0).all() and (got[idx < 0] == 0).all()
        assert_close("lse", lse_t, lse, 2e-5, 1e-5)           # same bounds as o (summation order only)
        assert_close("entry_probs", got, want, 2e-5, 1e-5)
        assert (fwd[idx < 0] == 0).all()
        assert_close("forward's entry probs", fwd, want, 2e-5, 1e-5)  # same bounds (summation order only)
    else:                                          # bf16 QK products on the GPU
        assert_rel("entry_probs", got, want, 2e-2)
        assert_rel("forward's entry probs", fwd, want, 2e-2)


@pytest.mark.parametrize("shape", ["tiny", "tiny_h16"] + (["real_h16"] if CUDA else []))
def test_listings_are_read_up_to_their_last_entry(shape):
    """A top-k lists a query's visible picks first, -1 after (a query that sees fewer than k entries): the kernels
    read each query's listing up to its last entry (`listed_width`) and skip the rest. Listings with -1 tails of
    every length (none, all -1; the picks kept before them have holes), then _case's listing (holes anywhere): o,
    lse, the gradients and the forward's probs (whose unread tail slots must read 0) == naive. A width that
    stopped at the first -1 or counted the entries drops the entries after a hole."""
    from dsv4.kernels.sparse_attn import entry_probs
    from dsv4.kernels.sparse_attn.triton import listed_width
    sh = SHAPES[shape]
    ratio, k, lens = (3, 6, [31, 17]) if shape.startswith("tiny") else (4, 512, [31 * 97, 17 * 97])
    (q, kv, comp, idx, sink), meta = _case("csa", lens, None, 0, **sh, ratio=ratio, k=k, seed=3)
    Tq, kk = idx.shape
    gen = torch.Generator(device=DEV).manual_seed(5)
    keep = torch.randint(0, kk + 1, (Tq,), generator=gen, device=DEV)                 # slots kept per query
    keep[:3] = torch.tensor([0, kk, 1], device=DEV)
    slot = torch.arange(kk, device=DEV)
    tails = torch.where(slot[None, :] < keep[:, None], idx, -1)
    assert torch.equal(listed_width(tails).long(), torch.where(tails >= 0, slot + 1, 0).amax(-1))
    assert (tails[:, 0] < 0).any() and (listed_width(tails) == kk).any() and (tails == -1).any(-1).any()
    scale = sh["c"] ** -0.5
    em = dict(seg=meta["seg"], pos=meta["pos"], entry_seg=meta["entry_seg"], entry_j=meta["entry_j"], q_offset=0)
    ins = [q, kv, comp, sink]
    for listing in (tails, idx):                   # idx: _case's picks with holes (-1 anywhere)
        o, lse, p = sparse_attn(q, kv, comp, listing, sink, sh["window"], ratio, scale, **meta, return_lse=True,
                                return_probs=True, backend="triton")
        ref, lse_n = sparse_attn(q, kv, comp, listing, sink, sh["window"], ratio, scale, **meta, return_lse=True,
                                 backend="naive")
        want_p = entry_probs(q, comp, listing, lse_n, ratio, scale, **em, backend="naive")
        do = torch.randn_like(o)
        got = torch.autograd.grad(o, ins, do)
        want = torch.autograd.grad(ref, ins, do)
        if shape.startswith("tiny"):               # fp32: summation order only (bounds of test_triton_matches_naive)
            assert_close("o", o, ref, 2e-5, 1e-5)
            assert_close("lse", lse, lse_n, 2e-5, 1e-5)
            assert_close("probs", p, want_p, 2e-5, 1e-5)
            for n, a, b in zip(("dq", "dkv", "dcomp", "dsink"), got, want):
                assert_close(n, a, b, 5e-5, 1e-4)
        else:                                      # bf16 (bounds of test_triton_matches_naive / entry_probs)
            assert_rel("o", o, ref, 1e-2)
            assert_rel("probs", p, want_p, 2e-2)
            for n, a, b in zip(("dq", "dkv", "dcomp", "dsink"), got, want):
                assert_rel(n, a, b, 5e-2 if n == "dcomp" else 2e-2)
        assert (p[listing < 0] == 0).all()
