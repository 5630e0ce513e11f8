"""Prototype, not used by the model: the window part of the sparse-attention backward without dKV atomics, for
H <= 16 heads (`proxy`). Issue 14 asks for "a key-centric deterministic pass" for the window keys. In the kernel as
it is (`_sparse_attn_bwd`, one query's 16 heads a program, M = 16 tiles), every (query, key tile) adds a [BN, c] fp32
tile of dKV by atomics: 16K queries x 128 keys x 512 channels x 4 B = 4.3 GB of atomic traffic per layer at 16K, for
a backward of 2.06 ms (H100, e6d359e). Here the work is split in two passes with no atomics:
    dq pass   (`_win_dq`, QB queries a program, M = QB x HB rows sharing the key tiles):
              s = q Kᵀ, p, dp = dO Kᵀ, ds, dq = ds K
    dKV pass  (`_win_dkv`, BKV keys x DC channels a program, M = BKV keys): for the QB-query tiles that see the
              block (t in [s0, s0 + BKV + window - 2]):  sT = K qᵀ, pT, dpT = K dOᵀ, dsT,
              dKV[:, chunk] += dsT q[:, chunk] + pT dO[:, chunk]   (K = V), stored once
The dKV pass recomputes s and dp (c / DC times, once per channel chunk): about 1.4x (DC = c) to 1.8x (DC = c / 2)
the MMA work of the fused kernel, on M = 32-64 tiles instead of M = 16, and no atomics. lse / delta as the kernel
stores them (log2 domain; delta = rowsum(dO o O)). Same math as `naive.sparse_attn`'s window part; the sink's
gradient is the kernel's (from delta), untouched.

  TRITON_INTERPRET=1 python harness/device/window_bwd_split.py check   # CPU, fp32: vs naive autograd, and the kernel
  python harness/device/window_bwd_split.py ab                         # GPU: A/B vs the kernel as it is
`ab` (16K tokens of one document, H 16, c 512, window 128: the proxy's window layers) times the window-only backward
as it is (MODE = none) against dq pass + dKV pass for every config below, checks the gradients against it, and
writes $OUT/window_bwd_split.json after every row. Shim on PYTHONPATH (harness/device/shim.sh)."""
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
def _win_dq(Q, KV, DO, LSE, DELTA, DQ, SEG, POS, sq_s, sq_h, skv_s, so_s, so_h, sl_s, TQ, H, window, qk_scale, scale,
            C: tl.constexpr, PREC: tl.constexpr, BD: tl.constexpr, HB: tl.constexpr, QB: tl.constexpr,
            BN: tl.constexpr):
    t0 = tl.program_id(0).to(tl.int64) * QB                             # queries t0 .. t0 + QB - 1 (= key rows, q_off 0)
    r = tl.arange(0, QB * HB)                                           # rows: query t0 + r // HB, head r % HB
    t = t0 + r // HB
    h = r % HB
    rm = (h < H) & (t < TQ)
    d = tl.arange(0, BD)
    qd = rm[:, None] & (d < C)[None, :]
    q = tl.load(Q + t[:, None] * sq_s + h[:, None] * sq_h + d[None, :], mask=qd, other=0.0)        # [R, BD]
    do = tl.load(DO + t[:, None] * so_s + h[:, None] * so_h + d[None, :], mask=qd, other=0.0)
    lse = tl.load(LSE + t * sl_s + h, mask=rm, other=0.0)                                          # [R]
    delta = tl.load(DELTA + t * sl_s + h, mask=rm, other=0.0)
    seg_u = tl.load(SEG + t, mask=rm, other=-3)
    pos_u = tl.load(POS + t, mask=rm, other=0)
    dq = tl.zeros([QB * HB, BD], tl.float32)
    u_hi = tl.minimum(t0 + QB, TQ) - 1
    for start in range(tl.maximum(t0 - window + 1, 0), u_hi + 1, BN):   # the window keys of every query
        n = start + tl.arange(0, BN)
        valid = tri._window_valid_rows(SEG, POS, n, u_hi, t, seg_u, pos_u, window) & rm[:, None]     # [R, BN]
        k = tl.load(KV + n[:, None] * skv_s + d[None, :], mask=(n <= u_hi)[:, None] & (d < C)[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale                                  # [R, BN]
        p = tl.where(valid, tl.exp2(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(k), input_precision=PREC)
        ds = p * (dp - delta[:, None]) * scale
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PREC)                                        # [R, BD]
    tl.store(DQ + t[:, None] * sq_s + h[:, None] * sq_h + d[None, :], dq.to(DQ.dtype.element_ty), mask=qd)


@triton.jit
def _win_dkv(Q, KV, DO, LSE, DELTA, DKV, SEG, POS, sq_s, sq_h, skv_s, so_s, so_h, sl_s, TQ, H, window, qk_scale,
             scale, C: tl.constexpr, PREC: tl.constexpr, BD: tl.constexpr, HB: tl.constexpr, BKV: tl.constexpr,
             QB: tl.constexpr, DC: tl.constexpr):
    s0 = tl.program_id(0).to(tl.int64) * BKV
    c0 = tl.program_id(1) * DC
    sk = s0 + tl.arange(0, BKV)                                         # [BKV] the block's key rows
    km = sk < TQ
    seg_s = tl.load(SEG + sk, mask=km, other=-2)
    pos_s = tl.load(POS + sk, mask=km, other=0)
    d = tl.arange(0, BD)
    k = tl.load(KV + sk[:, None] * skv_s + d[None, :], mask=km[:, None] & (d < C)[None, :], other=0.0)   # [BKV, BD]
    dc = c0 + tl.arange(0, DC)
    dcm = dc < C
    r = tl.arange(0, QB * HB)                                           # rows: query t0 + r // HB, head r % HB
    hh = r % HB
    acc = tl.zeros([BKV, DC], tl.float32)
    t_hi = tl.minimum(s0 + BKV - 1 + window - 1, TQ - 1)                # the last query that sees a key of the block
    for t0 in range(s0, t_hi + 1, QB):
        tq = t0 + r // HB
        rm = (hh < H) & (tq <= t_hi)
        qd = rm[:, None] & (d < C)[None, :]
        q = tl.load(Q + tq[:, None] * sq_s + hh[:, None] * sq_h + d[None, :], mask=qd, other=0.0)     # [R, BD]
        do = tl.load(DO + tq[:, None] * so_s + hh[:, None] * so_h + d[None, :], mask=qd, other=0.0)
        lse = tl.load(LSE + tq * sl_s + hh, mask=rm, other=0.0)                                        # [R]
        delta = tl.load(DELTA + tq * sl_s + hh, mask=rm, other=0.0)
        seg_t = tl.load(SEG + tq, mask=rm, other=-3)
        pos_t = tl.load(POS + tq, mask=rm, other=0)
        valid = (km & (seg_s >= 0))[:, None] & rm[None, :] & (sk[:, None] <= tq[None, :]) & \
            (seg_s[:, None] == seg_t[None, :]) & (pos_s[:, None] <= pos_t[None, :]) & \
            (pos_s[:, None] > pos_t[None, :] - window)                                                  # [BKV, R]
        sT = tl.dot(k, tl.trans(q), input_precision=PREC) * qk_scale                                   # [BKV, R]
        pT = tl.where(valid, tl.exp2(sT - lse[None, :]), 0.0)
        dpT = tl.dot(k, tl.trans(do), input_precision=PREC)
        dsT = pT * (dpT - delta[None, :]) * scale
        cd = rm[:, None] & dcm[None, :]
        qc = tl.load(Q + tq[:, None] * sq_s + hh[:, None] * sq_h + dc[None, :], mask=cd, other=0.0)   # [R, DC]
        doc = tl.load(DO + tq[:, None] * so_s + hh[:, None] * so_h + dc[None, :], mask=cd, other=0.0)
        acc += tl.dot(dsT.to(qc.dtype), qc, input_precision=PREC)
        acc += tl.dot(pT.to(doc.dtype), doc, input_precision=PREC)
    tl.store(DKV + sk[:, None] * skv_s + dc[None, :], acc.to(DKV.dtype.element_ty), mask=km[:, None] & dcm[None, :])


# dKV pass configs: BKV keys x QB queries (R = QB x 16 rows) x DC channels a program
CONFIGS = ([dict(BKV=bkv, QB=qb, DC=dc, num_warps=w, num_stages=st)
            for bkv in (32, 64) for qb in (2, 4) for dc in (128, 256) for w in (4, 8) for st in (1, 2)])
# dq pass configs: QB queries (R = QB x 16 rows: M = 16 as the kernel's tuned choice, or 32 / 64 sharing key tiles)
DQ_CONFIGS = ([dict(QB=1, BN=bn, num_warps=4, num_stages=st) for bn in (16, 32, 64) for st in (1, 2)]
              + [dict(QB=qb, BN=bn, num_warps=w, num_stages=2) for qb in (2, 4) for bn in (32, 64) for w in (4, 8)])
CPU_CONFIG = dict(BKV=16, QB=2, DC=16, num_warps=4, num_stages=1)
CPU_DQS = [dict(QB=1, BN=16, num_warps=4, num_stages=1), dict(QB=2, BN=16, num_warps=4, num_stages=1)]


def backward(q, kv, sink, o, lse, do, seg, pos, window, scale, cfg=None, dq_cfg=None):
    """(dq, dkv) in the inputs' dtypes: the window-only backward as it is (`op._sparse_attn_bwd`, MODE none; cfg
    None), or `_win_dq` (dq_cfg) + `_win_dkv` (cfg)."""
    if cfg is None:
        return O._sparse_attn_bwd(do, q, kv, None, None, sink, seg, pos, None, None, o, lse, window, 1, scale, 0)[:2]
    Tq, H, C = q.shape
    assert kv.shape[0] == Tq and q.stride(2) == 1 and kv.stride(1) == 1 and do.stride(2) == 1
    delta = (o.float() * do.float()).sum(-1).contiguous()                # [Tq, H] rowsum(dO o O), as the kernel's
    lse = lse.contiguous()
    dq, dkv = torch.empty_like(q), torch.empty_like(kv)
    common = dict(C=C, PREC=tri._prec(q), BD=pow2(C), HB=max(16, pow2(H)))
    _win_dq[(triton.cdiv(Tq, dq_cfg["QB"]),)](q, kv, do, lse, delta, dq, seg, pos, q.stride(0), q.stride(1),
                                               kv.stride(0), do.stride(0), do.stride(1), lse.stride(0), Tq, H, window,
                                               scale * tri.LOG2E, scale, **common, **dq_cfg)
    grid = (triton.cdiv(Tq, cfg["BKV"]), triton.cdiv(C, cfg["DC"]))
    _win_dkv[grid](q, kv, do, lse, delta, dkv, seg, pos, q.stride(0), q.stride(1), kv.stride(0), do.stride(0),
                   do.stride(1), lse.stride(0), Tq, H, window, scale * tri.LOG2E, scale, **common, **cfg)
    return dq, dkv


def check():
    """CPU (interpreter), fp32: packed documents with padding, H 3 and 16, odd c, a window longer than a document:
    dq / dkv of the two passes against naive autograd and against the kernel as it is."""
    from dsv4.kernels._testing import assert_close, packed_meta
    from dsv4.kernels.sparse_attn import sparse_attn
    for H, c, lens, pads, window in ((3, 24, [13, 9], [2, 1], 5), (16, 40, [21, 4], None, 7), (2, 8, [6], None, 9)):
        g = torch.Generator().manual_seed(H)
        seg, pos = packed_meta(lens, pads)
        T = seg.numel()
        q, kv, sink = torch.randn(T, H, c, generator=g), torch.randn(T, c, generator=g), torch.randn(H, generator=g)
        scale = c ** -0.5
        o, lse, _ = O._sparse_attn_fwd(q, kv, None, None, sink, seg, pos, None, None, window, 1, scale, 0)
        do = torch.randn(o.shape, generator=g)
        qa, kva = (x.clone().requires_grad_() for x in (q, kv))
        ref = sparse_attn(qa, kva, None, None, sink, window, 1, scale, seg, pos, None, None, backend="naive")
        want = torch.autograd.grad(ref, (qa, kva), do)
        assert_close("o", o, ref, 2e-5, 1e-5)
        base = backward(q, kv, sink, o, lse, do, seg, pos, window, scale)
        for dq_cfg in CPU_DQS:                                          # one query a program, and two
            got = backward(q, kv, sink, o, lse, do, seg, pos, window, scale, CPU_CONFIG, dq_cfg)
            for name, a, b, w in zip(("dq", "dkv"), got, base, want):
                assert_close(f"{name} H={H} QB={dq_cfg['QB']} vs naive", a, w, 5e-5, 1e-4)
                assert_close(f"{name} H={H} QB={dq_cfg['QB']} vs the kernel as it is", a, b, 5e-5, 1e-4)
        print(f"check H={H} c={c} window={window}: dq / dkv match naive and the kernel as it is", flush=True)


def ab():
    """DEV=cpu SEQ=64 (with TRITON_INTERPRET=1): a dry run on the interpreter (fp32, CPU configs only): it catches
    a broken script before a device call; its numbers mean nothing."""
    from dsv4.harness.bench import _timer
    dev = os.environ.get("DEV", "cuda")
    do_bench = _timer(dev)
    cuda = dev == "cuda"
    dt, configs, dq_configs = (torch.bfloat16, CONFIGS, DQ_CONFIGS) if cuda else (torch.float32, [CPU_CONFIG], CPU_DQS)
    S, H, c = int(os.environ.get("SEQ", "16384")), int(os.environ.get("HEADS", "16")), 512 if cuda else 32
    window = 128 if cuda else 8
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(S, H, c, device=dev, generator=g, dtype=dt)
    kv = torch.randn(S, c, device=dev, generator=g, dtype=dt)
    sink = torch.randn(H, device=dev, generator=g)
    seg, pos = torch.zeros(S, dtype=torch.long, device=dev), torch.arange(S, device=dev)
    scale = c ** -0.5
    o, lse, _ = O._sparse_attn_fwd(q, kv, None, None, sink, seg, pos, None, None, window, 1, scale, 0)
    do = torch.randn_like(o)
    args = (q, kv, sink, o, lse, do, seg, pos, window, scale)
    res = {"S": S, "H": H, "c": c, "window": window, "rows": [], "dq_rows": []}
    out = os.path.join(os.environ.get("OUT", "."), "window_bwd_split.json")
    ref = backward(*args)
    res["as_is_ms"] = do_bench(lambda: backward(*args), 200)
    res["as_is_config"] = str(tri._sparse_attn_bwd.best_config)
    print(json.dumps({k: res[k] for k in ("as_is_ms", "as_is_config")}), flush=True)
    bound = {"dq": 1e-2, "dkv": 2e-2}                                   # test_sparse_attn.py's bf16 bounds vs naive
    best = (float("inf"), dq_configs[0])
    for dq_cfg in dq_configs:                                           # the dq pass alone; its best goes below
        row = {"dq_config": dq_cfg}
        try:
            dq = _dq_only(args, dq_cfg)
            row["dq_rel_err_vs_as_is"] = float((dq.float() - ref[0].float()).norm() / ref[0].float().norm())
            row["ms"] = do_bench(lambda: _dq_only(args, dq_cfg), 100)
            best = min(best, (row["ms"], dq_cfg), key=lambda b: b[0])
        except Exception as e:  # noqa: BLE001
            row["error"] = repr(e)[:300]
        print(json.dumps(row), flush=True)
        res["dq_rows"].append(row)
    best_dq = best[1]
    for cfg in configs:
        row = {"config": cfg, "dq_config": best_dq}
        try:
            got = backward(*args, cfg, best_dq)
            row["rel_err_vs_as_is"] = {n: float((a.float() - b.float()).norm() / b.float().norm())
                                       for n, a, b in zip(("dq", "dkv"), got, ref)}
            row["within_bounds"] = all(row["rel_err_vs_as_is"][n] <= b for n, b in bound.items())
            row["ms"] = do_bench(lambda: backward(*args, cfg, best_dq), 100)
            row["speedup"] = res["as_is_ms"] / row["ms"]
        except Exception as e:  # noqa: BLE001
            row["error"] = repr(e)[:300]
        print(json.dumps(row), flush=True)
        res["rows"].append(row)
        with open(out, "w") as fh:
            json.dump(res, fh, indent=1)                                # after every row: a cut run keeps its rows


def _dq_only(args, dq_cfg):
    q, kv, sink, o, lse, do, seg, pos, window, scale = args
    Tq, H, C = q.shape
    delta = (o.float() * do.float()).sum(-1)
    dq = torch.empty_like(q)
    _win_dq[(triton.cdiv(Tq, dq_cfg["QB"]),)](q, kv, do, lse, delta, dq, seg, pos, q.stride(0), q.stride(1),
                                               kv.stride(0), do.stride(0), do.stride(1), lse.stride(0), Tq, H, window,
                                               scale * tri.LOG2E, scale, C=C, PREC=tri._prec(q), BD=pow2(C),
                                               HB=max(16, pow2(H)), **dq_cfg)
    return dq


if __name__ == "__main__":
    {"check": check, "ab": ab}[sys.argv[1]]()
