"""Prototype, not used by the model: the CSA picks' part of the sparse-attention backward with the KEYS as the
tensor cores' M dimension, for H <= 16 heads (`proxy`). kernels/PERF_NOTES.md (session 18) splits the H = 16 CSA
backward: its dQ path (logits and dP recomputed, dQ) is 54%, run as M = 16 (one query's heads) x BN = 16 key tiles.
Here one program is one query and its BN picks are the rows of every product:
    sT  = K qT * scale_log2          [BN, HB]    (M = BN keys, N = HB heads, K = c)
    pT  = exp2(sT - lse)             [BN, HB]    (masked: invisible picks, heads >= H)
    dpT = K dOT                      [BN, HB]
    dsT = pT (dpT - delta) scale     [BN, HB]
    dq  += dsTT K                    [HB, c]     (M = HB, K = BN: the one product left at M = 16)
    dK  = dsT q + pT dO              [BN, c]     (M = BN, K = HB), in DC-channel chunks, fp32 atomic adds
The window keys stay with the kernel as it is (`_sparse_attn_bwd` with MODE = none, the full lse / delta: its
gradients are the window part exactly); this kernel then adds the picks' dq into the same dq. Same math as
`naive.sparse_attn`'s backward; only the tiling differs.

  TRITON_INTERPRET=1 python harness/device/sparse_bwd_keymajor.py check   # CPU, fp32: vs naive (autograd)
  python harness/device/sparse_bwd_keymajor.py ab                         # GPU: A/B vs the kernel as it is
`ab` (16K tokens, H 16, c 512, window 128, CSA ratio 4, top-k 512: the bench's inputs) times the backward as it is
(MODE = picks) against MODE = none + this kernel for every config below, checks the gradients against it, and
writes $OUT/sparse_bwd_keymajor.json. Shim on PYTHONPATH (harness/device/shim.sh)."""
import json
import os
import sys

import torch
import triton
import triton.language as tl

from dsv4.kernels._triton_util import pow2
from dsv4.kernels.sparse_attn import op as O
from dsv4.kernels.sparse_attn import triton as tri


@triton.jit
def _picks_bwd_km(Q, COMP, IDX, DO, LSE, DELTA, DQ, DCOMP, SEG, POS, ESEG, EJ,
                  sq_s, sq_h, sc_s, si_s, so_s, so_h, sl_s, H, NSEL, ratio, qk_scale, scale, q_off,
                  C: tl.constexpr, PREC: tl.constexpr, BD: tl.constexpr, HB: tl.constexpr, BN: tl.constexpr,
                  DC: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, HB)
    hm = h < H
    d = tl.arange(0, BD)
    dm = d < C
    q = tl.load(Q + t * sq_s + h[:, None] * sq_h + d[None, :], mask=hm[:, None] & dm[None, :], other=0.0)   # [HB, BD]
    do = tl.load(DO + t * so_s + h[:, None] * so_h + d[None, :], mask=hm[:, None] & dm[None, :], other=0.0)
    lse = tl.load(LSE + t * sl_s + h, mask=hm, other=0.0)                                                    # [HB]
    delta = tl.load(DELTA + t * sl_s + h, mask=hm, other=0.0)
    u = t + q_off
    seg_u = tl.load(SEG + u)
    pos_u = tl.load(POS + u)
    dq = tl.zeros([HB, BD], tl.float32)
    for s0 in range(0, NSEL, BN):
        n = s0 + tl.arange(0, BN)
        idx = tl.load(IDX + t * si_s + n, mask=n < NSEL, other=-1)                                          # [BN]
        valid = tri._entry_valid(ESEG, EJ, idx, idx >= 0, seg_u, pos_u, ratio)
        k = tl.load(COMP + idx[:, None] * sc_s + d[None, :], mask=(idx >= 0)[:, None] & dm[None, :], other=0.0)
        sT = tl.dot(k, tl.trans(q), input_precision=PREC) * qk_scale                                       # [BN, HB]
        pT = tl.where(valid[:, None] & hm[None, :], tl.exp2(sT - lse[None, :]), 0.0)
        dpT = tl.dot(k, tl.trans(do), input_precision=PREC)                                                # [BN, HB]
        dsT = pT * (dpT - delta[None, :]) * scale
        dq = dq + tl.dot(tl.trans(dsT.to(k.dtype)), k, input_precision=PREC)                               # [HB, BD]
        for c0 in range(0, BD, DC):                                                                     # dK [BN, DC]
            dc = c0 + tl.arange(0, DC)
            cm = hm[:, None] & (dc < C)[None, :]
            qc = tl.load(Q + t * sq_s + h[:, None] * sq_h + dc[None, :], mask=cm, other=0.0)                # [HB, DC]
            doc = tl.load(DO + t * so_s + h[:, None] * so_h + dc[None, :], mask=cm, other=0.0)
            dk = tl.dot(dsT.to(qc.dtype), qc, input_precision=PREC) + tl.dot(pT.to(doc.dtype), doc, input_precision=PREC)
            tl.atomic_add(DCOMP + idx[:, None] * sc_s + dc[None, :], dk, mask=valid[:, None] & (dc < C)[None, :],
                          sem="relaxed")
    dq_ptr = DQ + t * sq_s + h[:, None] * sq_h + d[None, :]                                                 # [HB, BD]
    qm = hm[:, None] & dm[None, :]
    old = tl.load(dq_ptr, mask=qm, other=0.0).to(tl.float32)
    tl.store(dq_ptr, (old + dq).to(DQ.dtype.element_ty), mask=qm)


# Kept where the offline sm_90 compile (triton 3.6, ptxas; the launch's 16-divisible strides) spills <= 40 bytes a
# thread at 8 warps (4 warps spill 100-850 bytes); BN 128 needs 288 KB of shared memory (> 227). BN 64 runs sT / dpT /
# dK as wgmma, BN 32 as mma.sync (M = 32).
CONFIGS = ([dict(BN=32, DC=dc, num_warps=8, num_stages=st) for dc in (64, 128, 256) for st in (2, 3)]
           + [dict(BN=64, DC=dc, num_warps=8, num_stages=3) for dc in (64, 128, 256)]
           + [dict(BN=64, DC=256, num_warps=8, num_stages=2)])
CPU_CONFIG = dict(BN=16, DC=16, num_warps=4, num_stages=1)


def backward(q, kv, comp, idx, sink, o, lse, do, meta, window, ratio, scale, km=None):
    """(dq, dkv, dcomp) in the inputs' dtypes: the backward as it is (`op._sparse_attn_bwd`, km None), or its window
    part alone (comp None: MODE none) + `_picks_bwd_km` with the config km (a dict of CONFIGS); meta = (seg, pos,
    entry_seg, entry_j)."""
    seg, pos, eseg, ej = meta
    if km is None:
        return O._sparse_attn_bwd(do, q, kv, comp, idx, sink, seg, pos, eseg, ej, o, lse, window, ratio, scale, 0)[:3]
    dq, dkv, _, _ = O._sparse_attn_bwd(do, q, kv, None, None, sink, seg, pos, None, None, o, lse, window, ratio,
                                       scale, 0)
    _, nsel, ratio, comp_t, idx_t, seg, pos, eseg, ej, _, _ = tri.prepare(q, kv, comp, idx, ratio, seg, pos, eseg,
                                                                          ej, 0)
    Tq, H, C = q.shape
    delta = (o.float() * do.float()).sum(-1)                 # rowsum(dO o O), as the kernel stores it
    dcomp = torch.zeros(comp_t.shape, device=q.device, dtype=torch.float32)
    _picks_bwd_km[(Tq,)](
        q, comp_t, idx_t, do, lse, delta, dq, dcomp, seg, pos, eseg, ej,
        q.stride(0), q.stride(1), comp_t.stride(0), idx_t.stride(0), do.stride(0), do.stride(1), lse.stride(0),
        H, nsel, ratio, scale * tri.LOG2E, scale, 0,
        C=C, PREC=tri._prec(q), BD=pow2(C), HB=max(16, pow2(H)), **km)
    return dq, dkv, dcomp.to(comp.dtype)


def check():
    """CPU (interpreter), fp32: packed documents, -1 / invisible picks, H 3 and 16, odd c: dq / dkv / dcomp of
    MODE = none + the prototype against naive autograd, and against the kernel as it is."""
    from dsv4.kernels._testing import assert_close, packed_meta
    from dsv4.kernels.compressor.naive import entry_slots
    from dsv4.kernels.sparse_attn import sparse_attn
    for H, c, lens, pads in ((3, 24, [13, 9], [2, 1]), (16, 40, [21], None)):
        g = torch.Generator().manual_seed(H)
        seg, pos = packed_meta(lens, pads)
        T, window, ratio, k = seg.numel(), 5, 3, 4
        ends, ok, ej = entry_slots(seg, pos, ratio, 0)
        eseg = torch.where(ok, seg[ends], torch.full_like(ends, -1))
        q, kv, sink = torch.randn(T, H, c, generator=g), torch.randn(T, c, generator=g), torch.randn(H, generator=g)
        comp = torch.randn(ends.numel(), c, generator=g)
        idx = torch.rand(T, comp.shape[0], generator=g).topk(min(k, comp.shape[0]), dim=-1).indices
        idx = torch.where(torch.rand(idx.shape, generator=g) < 0.2, torch.full_like(idx, -1), idx)
        scale = c ** -0.5
        meta = (seg, pos, eseg, ej)
        o, lse, _ = O._sparse_attn_fwd(q, kv, comp, idx, sink, *meta, window, ratio, scale, 0)
        do = torch.randn(o.shape, generator=g)
        qa, kva, ca = (x.clone().requires_grad_() for x in (q, kv, comp))
        ref = sparse_attn(qa, kva, ca, idx, sink, window, ratio, scale, seg, pos, eseg, ej, backend="naive")
        want = torch.autograd.grad(ref, (qa, kva, ca), do)
        assert_close("o", o, ref, 2e-5, 1e-5)
        args = (q, kv, comp, idx, sink, o, lse, do, meta, window, ratio, scale)
        base, got = backward(*args), backward(*args, km=CPU_CONFIG)
        for name, a, b, w in zip(("dq", "dkv", "dcomp"), got, base, want):
            assert_close(f"{name} H={H} vs naive", a, w, 5e-5, 1e-4)
            assert_close(f"{name} H={H} vs the kernel as it is", a, b, 5e-5, 1e-4)
        print(f"check H={H} c={c}: dq / dkv / dcomp match naive and the kernel as it is")


def ab():
    """DEV=cpu SEQ=64 (with TRITON_INTERPRET=1): a dry run of this mode on the interpreter (fp32, a wall-clock
    timer, CPU_CONFIG only): it catches a broken script before a device call, its numbers mean nothing."""
    from dsv4.harness.bench import _csa_idx, _timer
    dev = os.environ.get("DEV", "cuda")
    do_bench = _timer(dev)                                   # do_bench median on CUDA; one timed call on CPU
    dt, configs = (torch.bfloat16, CONFIGS) if dev == "cuda" else (torch.float32, [CPU_CONFIG])
    S, H, c = int(os.environ.get("SEQ", "16384")), int(os.environ.get("HEADS", "16")), 512 if dev == "cuda" else 32
    window, ratio, k = (128, 4, 512) if dev == "cuda" else (8, 4, 8)
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(S, H, c, device=dev, generator=g, dtype=dt)
    kv = torch.randn(S, c, device=dev, generator=g, dtype=dt)
    sink = torch.randn(H, device=dev, generator=g)
    comp = torch.randn(S // ratio, c, device=dev, generator=g, dtype=dt)
    idx = _csa_idx(S, S // ratio, k, ratio, dev, g)[:, 0]
    N = comp.shape[0]
    seg, pos = torch.zeros(S, dtype=torch.long, device=dev), torch.arange(S, device=dev)
    eseg, ej = torch.zeros(N, dtype=torch.long, device=dev), torch.arange(N, device=dev)
    scale = c ** -0.5
    meta = (seg, pos, eseg, ej)
    o, lse, _ = O._sparse_attn_fwd(q, kv, comp, idx, sink, *meta, window, ratio, scale, 0)
    do = torch.randn_like(o)
    res = {"S": S, "H": H, "c": c, "window": window, "ratio": ratio, "topk": k, "rows": []}
    args = (q, kv, comp, idx, sink, o, lse, do, meta, window, ratio, scale)
    ref = backward(*args)
    res["as_is_ms"] = do_bench(lambda: backward(*args), 200)
    res["as_is_config"] = str(tri._sparse_attn_bwd.best_config)
    res["window_only_ms"] = do_bench(lambda: O._sparse_attn_bwd(do, q, kv, None, None, sink, seg, pos, None, None, o,
                                                                lse, window, ratio, scale, 0), 200)
    print(json.dumps({k: res[k] for k in ("as_is_ms", "window_only_ms", "as_is_config")}), flush=True)
    for cfg in configs:
        row = {"config": cfg}
        try:
            got = backward(*args, km=cfg)
            row["rel_err_vs_as_is"] = {n: float((a.float() - b.float()).norm() / b.float().norm())
                                       for n, a, b in zip(("dq", "dkv", "dcomp"), got, ref)}
            bound = {"dq": 1e-2, "dkv": 2e-2, "dcomp": 5e-2}      # test_sparse_attn.py's bf16 bounds vs naive
            row["within_bounds"] = all(row["rel_err_vs_as_is"][n] <= b for n, b in bound.items())
            row["ms"] = do_bench(lambda: backward(*args, km=cfg), 100)
            row["speedup"] = res["as_is_ms"] / row["ms"]
        except Exception as e:  # noqa: BLE001
            row["error"] = repr(e)[:300]
        print(json.dumps(row), flush=True)
        res["rows"].append(row)
        with open(os.path.join(os.environ.get("OUT", "."), "sparse_bwd_keymajor.json"), "w") as fh:
            json.dump(res, fh, indent=1)                   # after every row: a cut run keeps what it measured


if __name__ == "__main__":
    {"check": check, "ab": ab}[sys.argv[1]]()
