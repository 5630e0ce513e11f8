"""`dsv4 bench kernels`: Triton kernels vs their naive PyTorch path and peers, on one GPU (H200), as JSON.

Per op (shapes = DSv4-Flash where the op has them; B = 1):
  sparse_attn  H=64, c=512, window 128; CSA (ratio 4, top-k 512) and HCA (ratio 128) at S in --seqs, and
               window-only at the smallest S. TFLOP/s with cuDNN's convention over the keys each query
               really sees (fwd 2·H·ΣK_t·(c+c), bwd 2·H·ΣK_t·(3c+2c)); the nominal K=640 numbers too.
               Peer: dense causal `scaled_dot_product_attention` (flash/efficient/cuDNN backends, no math
               fallback), same H and c, at the same S; the naive path at the smallest S only (O(S²) memory);
               at H = 64: FlashMLA's sparse prefill forward on the same inputs when `flash_mla` is importable
               (harness/flashmla_peer.py; built by harness/device/flashmla_h200.sh), else the reason; and the
               `triton_flashmla_*` columns: backend "triton+flashmla" (FlashMLA's forward + our Triton backward,
               kernels/sparse_attn/flashmla.py) fwd / bwd / fwd+bwd on the same inputs, else why it falls back;
               the `flashmla_cudnn_*` columns: backend "triton+flashmla+cudnn" (the same forward + NVIDIA
               cudnn-frontend's SM90 DSA backward, kernels/sparse_attn/cudnn_bwd.py), same inputs, else why not.
  indexer      nI=64, cI=128, ratio 4: scoring fwd/bwd TFLOP/s over causal (t, j) pairs; top-k k=512; the
               `cudnn_*` columns: backend "triton+cudnn" (NVIDIA cudnn-frontend's SM90 indexer forward, bf16 and
               FP8 E4M3 on the indexer's FP8 features; kernels/indexer/cudnn_fwd.py) on the same inputs, else why
               not; and `topk_rows`: the radix-select top-k (kernels/indexer/topk.py) vs naive's sort on [4096, N]
               score chunks, N = 4K / 16K / 32K.
  compressor   CSA D=512 (overlap) / indexer D=128 (overlap) / HCA D=512 (ratio 128) at T in --tokens, bf16,
               packed API with the slot metadata precomputed (`compress_slots`, layout metadata like cu_seqlens:
               the model computes it once per layout and ratio, Layout.compress_slots): fwd / bwd time the
               pooling, TB/s over `COMPRESSOR_BYTES`; `slots_ms` the metadata alone, `fwd_total_ms` /
               `fwd_total_tbps` the call computing it inside (the pre-memo forward); the naive path as a peer.
  mhc          N in --tokens x n=4 x d=4096 bf16: hc_pre / hc_post fwd and bwd, TB/s over `MHC_BYTES` (the
               minimal bytes); the naive path as a peer in every row; the autotuned configs recorded.
  swiglu       [65536, 2048] bf16: TB/s.
  cross_entropy  the head's blocked loss (model.head_cross_entropy; `proxy` head: 16384 rows, d=2048, V=32768,
               bf16) fwd / bwd on each kernel backend (the fused rows' A/B, GEMMs included), and the row kernels
               alone on one [8192, 32768] bf16 block: TB/s over the block's bytes (lse reads it; dlogits reads it
               and writes it).
  moe_combine  the grouped expert path's combine (kernels.moe_combine; T tokens in --tokens, K=4, d=2048, bf16
               slots, fp32 weights) fwd / bwd on each backend: TB/s over the minimal bytes (fwd reads y, writes
               out; bwd reads g once per slot and y, writes dy).
Timing: `triton.testing.do_bench` (median, L2 flushed between runs); dense SDPA at S >= 32K: CUDA events,
1 warm-up + 2 runs (a run takes seconds). Results carry provenance: git sha, torch/triton versions, GPU.
`--smoke`: tiny sizes of compressor / mhc / swiglu, on CPU (Triton's interpreter) when no GPU is visible, one
timed call each: checks that this code runs end to end, the numbers mean nothing.
"""
from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import click

SLICE_OF = {"sparse_attn": "D3", "indexer": "D3", "compressor": "D3", "mhc": "P2", "swiglu": "P5",
            "cross_entropy": "D9", "moe_combine": "P4"}
OPS = ["sparse_attn", "indexer", "compressor", "mhc", "swiglu", "cross_entropy", "moe_combine"]


def _provenance():
    import torch
    import triton
    from dsv4.harness.goldens import code_hash, git_sha
    sha = git_sha()[0]            # DSV4_GIT_SHA first: the device copy's .git can be stale
    return {"git_sha": sha, "code_hash": code_hash(), "torch": torch.__version__,
            "triton": triton.__version__, "cuda": torch.version.cuda,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none (cpu, --smoke)",
            "python": platform.python_version(), "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "command": "dsv4 bench kernels " + " ".join(sys.argv[1:]),
            "timing": "triton.testing.do_bench median, L2 flushed (dense SDPA >= 32K: events, 1 warm-up + 2); "
                      "compressor / mHC also graph_*: CUDA-graph replay medians, L2 flushed (device time only)"}


def _ms(fn, rep=60):
    import triton
    return float(triton.testing.do_bench(fn, warmup=15, rep=rep, return_mode="median"))


def _ms_events(fn, n=2):
    import torch
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / n


def _fwd_bwd(f, inputs, rep=60, ms=None):
    """(fwd ms, bwd ms) of out = f(); grads of `inputs` with a fixed random dout; `ms` the timer (`_ms` default)."""
    import torch
    ms = ms or _ms
    fwd = ms(lambda: f(), rep)
    out = f()
    outs = out if isinstance(out, tuple) else (out,)
    douts = [torch.randn_like(o) for o in outs]
    bwd = ms(lambda: torch.autograd.grad(outs, inputs, douts, retain_graph=True), rep)
    return fwd, bwd


def _err(msg):
    return {"error": msg[:500]}


# ------------------------------------------------------------------------------------------ sparse attention
def sparse_case(S: int, H: int, mode: str, c: int = 512, window: int = 128, dev: str = "cuda", seed: int = 0):
    """The `dsv4 bench kernels` sparse-attention inputs of one document of S tokens (the device scripts' A/Bs and
    profiles): mode window | csa (ratio 4, top-k 512) | hca (ratio 128); bf16, leaves with requires_grad.
    -> (q [S,H,c], kv [S,c], comp [S/ratio,c] | None, idx [S,k] | None, sink [H], meta (seg, pos, eseg, ej), ratio)."""
    import torch
    g = torch.Generator(device=dev).manual_seed(seed)
    ratio, k = (4, 512) if mode == "csa" else (128, 0)
    q = torch.randn(S, H, c, device=dev, generator=g, dtype=torch.bfloat16).requires_grad_()
    kv = torch.randn(S, c, device=dev, generator=g, dtype=torch.bfloat16).requires_grad_()
    sink = torch.randn(H, device=dev, generator=g).requires_grad_()
    comp = idx = None
    if mode != "window":
        comp = torch.randn(S // ratio, c, device=dev, generator=g, dtype=torch.bfloat16).requires_grad_()
    if mode == "csa":
        idx = _csa_idx(S, S // ratio, k, ratio, dev, g)[:, 0]
    N = 0 if comp is None else comp.shape[0]
    meta = (torch.zeros(S, dtype=torch.long, device=dev), torch.arange(S, device=dev),
            torch.zeros(N, dtype=torch.long, device=dev), torch.arange(N, device=dev))
    return q, kv, comp, idx, sink, meta, ratio


def _csa_idx(S, T, k, ratio, dev, gen):
    """Random unique top-k entry ids per query among its complete entries (-1 beyond), sorted ascending."""
    import torch
    idx = torch.empty(S, 1, min(k, T), dtype=torch.long, device=dev)
    t = torch.arange(S, device=dev)
    for s0 in range(0, S, 4096):
        sc = torch.rand(min(4096, S - s0), T, generator=gen, device=dev)
        lim = (t[s0:s0 + 4096] + 1) // ratio
        sc = sc.masked_fill(torch.arange(T, device=dev)[None, :] >= lim[:, None], -1.0)
        v, i = sc.topk(min(k, T), dim=-1)
        i = torch.where(v < 0, torch.full_like(i, -1), i)
        idx[s0:s0 + 4096, 0] = i.sort(dim=-1).values
    return idx


def _flashmla_row(fn, why, q, kv, comp, idx, sink, window, ratio, c, nkeys, row, meta, backend="triton") -> dict:
    """FlashMLA's sparse prefill forward on this row's inputs (harness/flashmla_peer.py; `meta` the row's one-document
    metadata, which is what the mapping assumes), in the same process:
    its time, TFLOP/s over the same keys, our forward's speed relative to it, and its output vs ours (bf16: the
    max abs difference next to the output's max abs)."""
    import torch

    from dsv4.harness import flashmla_peer
    from dsv4.kernels.sparse_attn import sparse_attn
    if fn is None:
        return {"flashmla": {"skipped": why}}
    try:
        S, N = q.shape[0], 0 if comp is None else comp.shape[0]
        ix = flashmla_peer.indices(S, window, ratio, idx, N, q.device)
        kva = flashmla_peer.kv_all(kv.detach(), None if comp is None else comp.detach())
        qd, sk = q.detach(), sink.detach().float()
        f = lambda: fn(qd, kva, ix, c ** -0.5, c, sk)
        fm_ms = _ms(f)
        with torch.no_grad():
            ours = sparse_attn(qd, kv.detach(), None if comp is None else comp.detach(), idx, sink.detach(), window,
                               ratio, c ** -0.5, *meta, backend=backend).float()
        theirs = f()[0].float()
        out = {"flashmla_fwd_ms": fm_ms, "flashmla_fwd_tflops": 4.0 * q.shape[1] * c * nkeys / fm_ms * 1e-9,
               "flashmla_index_slots": ix.shape[-1], "flashmla_max_abs_diff": (theirs - ours).abs().max().item(),
               "out_max_abs": ours.abs().max().item()}
        if "fwd_ms" in row:
            out["ours_fwd_over_flashmla"] = fm_ms / row["fwd_ms"]               # < 1: ours slower
        return out
    except Exception as e:  # noqa: BLE001
        return {"flashmla": _err(repr(e))}


def _flashmla_backend_row(fn, q, kv, comp, idx, sink, window, ratio, c, nkeys, row, meta, ins, capability=None,
                          bwd_fn=None, cudnn=False) -> dict:
    """Backend "triton+flashmla" (kernels/sparse_attn/flashmla.py: FlashMLA's forward + our Triton backward), or with
    cudnn=True backend "triton+flashmla+cudnn" (the same forward + cuDNN's SM90 DSA backward,
    kernels/sparse_attn/cudnn_bwd.py), on this row's inputs: its fwd / bwd / fwd+bwd ms, TFLOP/s over the same keys,
    fwd+bwd relative to the pure Triton path (> 1: faster), and (triton+flashmla) the forward without topk_length
    (every padded index slot visited); else why it would fall back (then nothing is timed)."""
    import torch

    from dsv4.kernels.sparse_attn import cudnn_bwd as CB
    from dsv4.kernels.sparse_attn import flashmla as FM
    from dsv4.kernels.sparse_attn import op
    name = "flashmla_cudnn" if cudnn else "triton_flashmla"
    cap = FM.capability(q) if capability is None else capability
    if cudnn:
        bwd_fn = CB.load()[0] if bwd_fn is None else bwd_fn
        why = CB.unqualified(q, kv, comp, fn, bwd_fn, cap)
    else:
        why = FM.unqualified(q, kv, comp, fn, cap)
    if why is not None:
        return {name: {"skipped": why}}
    try:
        H, scale = q.shape[1], c ** -0.5
        if cudnn:
            call = lambda tl: op.sparse_attn_flashmla_cudnn(q, kv, comp, idx, sink, window, ratio, scale, *meta,
                                                            fwd_fn=fn, bwd_fn=bwd_fn, capability=capability)
        else:
            call = lambda tl: op.sparse_attn_flashmla(q, kv, comp, idx, sink, window, ratio, scale, *meta,
                                                      fwd_fn=fn, capability=capability, topk_length=tl)
        fwd, bwd = _fwd_bwd(lambda: call(True), ins)
        out = {f"{name}_fwd_ms": fwd, f"{name}_bwd_ms": bwd, f"{name}_fwd_bwd_ms": fwd + bwd,
               f"{name}_fwd_tflops": 4.0 * H * c * nkeys / fwd * 1e-9,
               f"{name}_bwd_tflops": 10.0 * H * c * nkeys / bwd * 1e-9}
        if not cudnn:
            with torch.no_grad():
                out[f"{name}_fwd_ms_no_topk_length"] = _ms(lambda: call(False))
        if "fwd_bwd_ms" in row:
            out[f"{name}_fwd_bwd_speedup_vs_triton"] = row["fwd_bwd_ms"] / (fwd + bwd)
        return out
    except Exception as e:  # noqa: BLE001
        return {name: _err(repr(e))}


def _tuned_ms(kernel) -> dict:
    """The autotuner's median ms of every config it timed for its last tuned key (an in-process A/B of the
    configs, e.g. several queries a program against one): {config: ms}."""
    t = getattr(kernel, "configs_timings", None) or {}
    return {str(c): float(v[0] if isinstance(v, (list, tuple)) else v) for c, v in t.items()}


def _bench_sparse_attn(seqs, dense_peer, log, heads=(64,)):
    """Rows for each head count (64: DSv4; 16: `proxy`, where the tuner chooses per mode between one query a
    program and several, kernels/sparse_attn/triton.py; each row keeps every config's time); the dense peer at the
    first."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from dsv4.kernels.sparse_attn import sparse_attn
    from dsv4.kernels.sparse_attn import triton as tri
    H, c, window, dev = heads[0], 512, 128, "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    from dsv4.harness import flashmla_peer
    fm_fn, fm_why = flashmla_peer.load()
    rows = []
    per_h = [("window", seqs[0])] + [(m, S) for S in seqs for m in ("csa", "hca")]
    cases = [(h, m, S) for h in heads for (m, S) in per_h]
    for H, mode, S in cases:
        ratio, k = (4, 512) if mode == "csa" else (128, 0)
        q = torch.randn(S, 1, H, c, device=dev, generator=gen, dtype=torch.bfloat16).requires_grad_()
        kv = torch.randn(S, 1, c, device=dev, generator=gen, dtype=torch.bfloat16).requires_grad_()
        sink = torch.randn(H, device=dev, generator=gen).requires_grad_()
        comp = idx = None
        t = torch.arange(S, device=dev)
        nkeys = torch.clamp(t + 1, max=window).sum().item()
        if mode != "window":
            comp = torch.randn(S // ratio, 1, c, device=dev, generator=gen, dtype=torch.bfloat16).requires_grad_()
        if mode == "csa":
            idx = _csa_idx(S, S // ratio, k, ratio, dev, gen)
            nkeys += (idx >= 0).sum().item()
        elif mode == "hca":
            nkeys += ((t + 1) // ratio).sum().item()
        ins = [x for x in (q, kv, comp, sink) if x is not None]
        N = 0 if comp is None else comp.shape[0]                     # one document: seg 0, pos 0..S-1
        meta = (torch.zeros(S, dtype=torch.long, device=dev), t, torch.zeros(N, dtype=torch.long, device=dev),
                torch.arange(N, device=dev))
        q1, kv1 = q[:, 0], kv[:, 0]
        comp1 = None if comp is None else comp[:, 0]
        idx1 = None if idx is None else idx[:, 0]
        row = {"mode": mode, "S": S, "B": 1, "H": H, "c": c, "window": window, "ratio": ratio if mode != "window" else 0,
               "topk": k, "avg_keys_per_query": nkeys / S}
        try:
            for kern in (tri._sparse_attn_fwd, tri._sparse_attn_bwd):   # tune this row's key now: its timings below
                kern.cache.clear()
            fwd, bwd = _fwd_bwd(lambda: sparse_attn(q1, kv1, comp1, idx1, sink, window, ratio, c ** -0.5, *meta,
                                                    backend="triton"), ins)
            ff, fb = 4.0 * H * c * nkeys, 10.0 * H * c * nkeys
            row.update(fwd_ms=fwd, bwd_ms=bwd, fwd_tflops=ff / fwd * 1e-9, bwd_tflops=fb / bwd * 1e-9,
                       fwd_bwd_ms=fwd + bwd,
                       fwd_config=str(tri._sparse_attn_fwd.best_config), bwd_config=str(tri._sparse_attn_bwd.best_config),
                       fwd_tuned_ms=_tuned_ms(tri._sparse_attn_fwd), bwd_tuned_ms=_tuned_ms(tri._sparse_attn_bwd))
            if mode == "csa":   # nominal K = 640 for every query (kernels_perf §2.6 convention)
                row.update(nominal_fwd_tflops=4.0 * H * c * 640 * S / fwd * 1e-9,
                           nominal_bwd_tflops=10.0 * H * c * 640 * S / bwd * 1e-9)
        except Exception as e:  # noqa: BLE001
            row["triton"] = _err(repr(e))
        if H in (64, 128):                       # FlashMLA's sparse prefill: h_q 64 / 128 on SM90
            row.update(_flashmla_row(fm_fn, fm_why, q1, kv1, comp1, idx1, sink, window, ratio, c, nkeys, row, meta))
            row.update(_flashmla_backend_row(fm_fn, q1, kv1, comp1, idx1, sink, window, ratio, c, nkeys, row, meta,
                                             ins))
            row.update(_flashmla_backend_row(fm_fn, q1, kv1, comp1, idx1, sink, window, ratio, c, nkeys, row, meta,
                                             ins, cudnn=True))
        if S == seqs[0] and H == heads[0]:
            try:
                nf, nb = _fwd_bwd(lambda: sparse_attn(q1, kv1, comp1, idx1, sink, window, ratio, c ** -0.5, *meta), ins,
                                  rep=30)
                row.update(naive_fwd_ms=nf, naive_bwd_ms=nb, speedup_vs_naive=(nf + nb) / (row.get("fwd_bwd_ms") or math.nan))
            except Exception as e:  # noqa: BLE001
                row["naive"] = _err(repr(e))
            torch.cuda.empty_cache()
        log(row)
        rows.append(row)
        del q, kv, comp, idx, sink, ins, q1, kv1, comp1, idx1
        torch.cuda.empty_cache()
    H = heads[0]
    peers = []
    if dense_peer:
        for S in seqs:
            try:
                qd, kd, vd = (torch.randn(1, H, S, c, device=dev, generator=gen, dtype=torch.bfloat16).requires_grad_()
                              for _ in range(3))
                f = lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True)
                with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                                  SDPBackend.CUDNN_ATTENTION]):
                    if S >= 32768:
                        fwd = _ms_events(f)
                        out = f()
                        do = torch.randn_like(out)
                        bwd = _ms_events(lambda: torch.autograd.grad(out, (qd, kd, vd), do, retain_graph=True))
                    else:
                        fwd, bwd = _fwd_bwd(f, [qd, kd, vd], rep=100)
                flops = 2.0 * S * S * H * c   # causal: 4·S²/2·H·c fwd
                p = {"peer": "sdpa_dense_causal", "S": S, "H": H, "c": c, "fwd_ms": fwd, "bwd_ms": bwd,
                     "fwd_bwd_ms": fwd + bwd, "fwd_tflops": flops / fwd * 1e-9, "bwd_tflops": 2.5 * flops / bwd * 1e-9}
                for r in rows:
                    if r["S"] == S and "fwd_bwd_ms" in r:
                        p[f"speedup_{r['mode']}_vs_dense"] = p["fwd_bwd_ms"] / r["fwd_bwd_ms"]
            except Exception as e:  # noqa: BLE001
                p = {"peer": "sdpa_dense_causal", "S": S, **_err(repr(e))}
            log(p)
            peers.append(p)
            qd = kd = vd = None
            torch.cuda.empty_cache()
    return {"rows": rows, "peers": peers,
            "targets": {"fwd_tflops": 350, "bwd_tflops": 200, "speedup_vs_dense_fwd_bwd_64k": 20,
                        "speedup_vs_dense_fwd_bwd_16k": 5}}


# ---------------------------------------------------------------------------------------------------- indexer
def _bench_indexer(seqs, log):
    import torch

    from dsv4.kernels.indexer import indexer_scores, indexer_topk
    from dsv4.kernels.indexer import triton as tri
    nI, cI, ratio, k, dev = 64, 128, 4, 512, "cuda"
    gen = torch.Generator(device=dev).manual_seed(1)
    rows = []
    for S in seqs:
        T = S // ratio
        q = torch.randn(S, 1, nI, cI, device=dev, generator=gen, dtype=torch.bfloat16).requires_grad_()
        kk = torch.randn(T, 1, cI, device=dev, generator=gen, dtype=torch.bfloat16).requires_grad_()
        w = torch.randn(S, 1, nI, device=dev, generator=gen, dtype=torch.bfloat16).requires_grad_()
        t = torch.arange(S, device=dev)
        pairs = ((t + 1) // ratio).clamp(max=T).sum().item()
        row = {"S": S, "nI": nI, "cI": cI, "ratio": ratio, "T": T, "causal_pairs": pairs}
        meta = (torch.zeros(S, dtype=torch.long, device=dev), t, torch.zeros(T, dtype=torch.long, device=dev),
                torch.arange(T, device=dev))                           # one document
        q, kk, w = q[:, 0], kk[:, 0], w[:, 0]
        try:
            fwd, bwd = _fwd_bwd(lambda: indexer_scores(q, kk, w, ratio, *meta, backend="triton"), [q, kk, w])
            fl = 2.0 * nI * cI * pairs
            row.update(fwd_ms=fwd, bwd_ms=bwd, fwd_tflops=fl / fwd * 1e-9, bwd_tflops_useful=2 * fl / bwd * 1e-9,
                       bwd_tflops_executed=4 * fl / bwd * 1e-9, fwd_config=str(tri._scores_fwd.best_config),
                       fwd_tuned_ms=_tuned_ms(tri._scores_fwd),
                       # the dense scoring backward's two kernels (the dense warm-up's KL path): the tuner's pick
                       # and its in-process timing of every config (ms, the A/B; from this S's tuning run unless
                       # an earlier S had the same tuning key)
                       bwd_dq_config=str(tri._scores_bwd_dq.best_config),
                       bwd_dk_config=str(tri._scores_bwd_dk.best_config),
                       bwd_dq_tuned_ms=_tuned_ms(tri._scores_bwd_dq), bwd_dk_tuned_ms=_tuned_ms(tri._scores_bwd_dk))
            with torch.no_grad():
                I = indexer_scores(q, kk, w, ratio, *meta, backend="triton")
                row["topk_ms"] = _ms(lambda: indexer_topk(I, k, backend="triton"))
                row["topk_naive_sort_ms"] = _ms(lambda: indexer_topk(I, k, backend="naive"))
                row["topk_read_tbps"] = I.numel() * 4 / row["topk_ms"] * 1e-9
                row["topk_equal_naive"] = bool(torch.equal(indexer_topk(I, k, backend="triton"),
                                                           indexer_topk(I, k, backend="naive")))
                del I
                row["select_chunked_ms"] = _ms(lambda: tri.indexer_select(q, kk, w, ratio, k, *meta), rep=30)
                row["select_tflops"] = fl / row["select_chunked_ms"] * 1e-9        # scoring + top-k (issue 14)
        except Exception as e:  # noqa: BLE001
            row["triton"] = _err(repr(e))
        row.update(_cudnn_indexer_cols(q, kk, w, ratio, meta, k, row))
        if S <= 4096:
            try:
                nf, nb = _fwd_bwd(lambda: indexer_scores(q, kk, w, ratio, *meta), [q, kk, w], rep=30)
                row.update(naive_fwd_ms=nf, naive_bwd_ms=nb)
            except Exception as e:  # noqa: BLE001
                row["naive"] = _err(repr(e))
        log(row)
        rows.append(row)
        del q, kk, w
        torch.cuda.empty_cache()
    return {"rows": rows, "topk_rows": _bench_topk(log),
            "targets": {"fwd_tflops_bf16": 400, "select_tflops_bf16": 450}}


RERANK_MARGINS = (0.1, 0.25)      # the FP8 indexer's re-rank margins timed (CPU, randn, k 512: recall 0.9965 / 0.99995)


def _cudnn_indexer_cols(q, kk, w, ratio, meta, k, row, fn=None, capability=None) -> dict:
    """Backend "triton+cudnn" (kernels/indexer/cudnn_fwd.py) beside ours on this row's inputs, per precision p in
    bf16 / fp8 (fp8: the indexer's FP8 features of the same inputs, kernels/indexer/fp4.py qk_fake_quant):
    `cudnn_{p}_fwd_ms` the whole backend call (offset, cuDNN, our mask; fp8 also the e4m3 split), `cudnn_{p}_kernel_ms`
    cuDNN's call alone on the prepared arguments, TFLOP/s of both over the causal pairs, the max |diff| vs the Triton
    scores of the same features, `cudnn_{p}_select_ms` (its scores + our top-k), `ours_fwd_over_cudnn_bf16` (> 1:
    ours slower); `cudnn_fp8_topk_recall_vs_bf16` (queries with >= k visible entries); per margin m of
    RERANK_MARGINS the FP8 pre-filter + bf16 re-rank (kernels/indexer/fp4.py `rerank_topk`: the FP8 top
    ceil(k (1 + m)), its k best by the bf16 listed scores): `cudnn_fp8_rerank{m}_select_ms` / `_tflops` (the causal
    pairs' FLOPs, as select_tflops) and `_topk_recall_vs_bf16`; else {"cudnn": reason}."""
    import torch

    from dsv4.kernels.indexer import cudnn_fwd as CF
    from dsv4.kernels.indexer import indexer_topk, naive, op
    from dsv4.kernels.indexer.fp4 import picks_recall, qk_fake_quant, rerank_topk, rerank_width, topk_recall
    fn = CF.load()[0] if fn is None else fn
    cap = CF.capability(q) if capability is None else capability
    why = CF.unqualified(q, kk, w, "bf16", fn, cap)
    if why is not None:
        return {"cudnn": {"skipped": why}}
    fl, out, picks = 2.0 * q.shape[1] * q.shape[2] * row["causal_pairs"], {}, {}
    try:
        with torch.no_grad():
            for p in ("bf16", "fp8"):
                qi, ki = (q, kk) if p == "bf16" else (qk_fake_quant(q, "fp8"), qk_fake_quant(kk, "fp8"))
                call = lambda: op.indexer_scores_cudnn(qi, ki, w, ratio, *meta, p, fwd_fn=fn, capability=cap)
                ms = _ms(call)
                mask = naive.causal_entry_mask(*meta, ratio)
                off, wf = CF.causal_offset(mask, ratio), w.float() * (q.shape[1] * q.shape[2]) ** -0.5
                if p == "bf16":
                    args = (qi[None], ki[None, :, None], wf[None].contiguous())
                    kw = dict(ratio=ratio, sm_scale=1.0, q_causal_offsets=off, precision="bf16")
                else:
                    (q8, qs), (k8, ks) = CF.fp8_split(qi), CF.fp8_split(ki)
                    args = (q8[None], k8[None, :, None], (wf * qs)[None].contiguous())
                    kw = dict(ratio=ratio, sm_scale=1.0, q_causal_offsets=off, precision="fp8",
                              q_scale=qs[None].contiguous(), k_scale=ks[None, :, None])
                kms = _ms(lambda: fn(*args, **kw))
                I, tri = call(), op.indexer_scores(qi, ki, w, ratio, *meta)
                fin = torch.isfinite(tri)
                out.update({f"cudnn_{p}_fwd_ms": ms, f"cudnn_{p}_fwd_tflops": fl / ms * 1e-9,
                            f"cudnn_{p}_kernel_ms": kms, f"cudnn_{p}_kernel_tflops": fl / kms * 1e-9,
                            f"cudnn_{p}_max_abs_diff_vs_triton": (I[fin] - tri[fin]).abs().max().item(),
                            f"cudnn_{p}_mask_equal": bool(torch.equal(torch.isfinite(I), fin)),
                            f"cudnn_{p}_select_ms": _ms(lambda: indexer_topk(call(), k, backend="triton"), rep=30)})
                picks[p] = I if p == "bf16" else I.bfloat16()
                if p == "fp8":
                    q8f, k8f = qi, ki                                   # the FP8 features, for the re-rank below
                del I, tri, mask
            if "fwd_ms" in row:
                out["ours_fwd_over_cudnn_bf16"] = row["fwd_ms"] / out["cudnn_bf16_fwd_ms"]
            out["cudnn_fp8_topk_recall_vs_bf16"] = topk_recall(picks["fp8"].cpu(), picks["bf16"].cpu(), k,
                                                               min_visible=k)
            for m in RERANK_MARGINS:            # fp8 pre-filter of k' = ceil(k (1 + m)), bf16 re-rank to k
                def rerank_select():
                    I8 = op.indexer_scores_cudnn(q8f, k8f, w, ratio, *meta, "fp8", fwd_fn=fn, capability=cap)
                    wide = indexer_topk(I8.bfloat16(), rerank_width(k, I8.shape[-1], m), backend="triton")
                    return rerank_topk(wide, q, kk, w, k, backend="triton")
                ms = _ms(rerank_select, rep=30)
                out[f"cudnn_fp8_rerank{m}_select_ms"] = ms
                out[f"cudnn_fp8_rerank{m}_select_tflops"] = fl / ms * 1e-9
                out[f"cudnn_fp8_rerank{m}_topk_recall_vs_bf16"] = picks_recall(rerank_select(), picks["bf16"], k,
                                                                               min_visible=k)
    except Exception as e:  # noqa: BLE001
        out["cudnn"] = _err(repr(e))
    return out


def _bench_topk(log, R=4096, k=512):
    """The row-on-registers top-k (kernels/indexer/topk.py `row_topk`, the Triton backend's for N <= ROW_MAX_N since
    2026-12-04) and the radix select (the backend's above) vs naive's full stable sort on one [R, N] fp32 chunk of scores, N entries = a 4N-token sequence: the chunk's
    rows at its end ("tail": all but the last <= 1K entries visible) and at its middle ("mid": the second half
    -inf), randn scores."""
    import torch

    from dsv4.kernels.indexer import naive
    from dsv4.kernels.indexer import topk as tk
    out = []
    for N in (4096, 16384, 32768):
        for where, t0 in (("tail", 4 * N - R), ("mid", 2 * N - R)):
            vis = (torch.arange(t0, t0 + R, device="cuda") + 1) // 4                 # [R] visible entries
            I = torch.randn(R, N, device="cuda").masked_fill(torch.arange(N, device="cuda")[None] >= vis[:, None],
                                                            float("-inf"))
            row = {"N": N, "rows": R, "k": k, "rows_at": where}
            try:
                row["radix_ms"] = _ms(lambda: tk.radix_topk(I, k))
                if N <= tk.ROW_MAX_N:
                    row["row_ms"] = _ms(lambda: tk.row_topk(I, k))
                    row["row_equal_naive"] = bool(torch.equal(tk.row_topk(I, k), naive.indexer_topk(I, k)))
                    row["row_config"] = str(tk._row_topk_tuned.best_config)
                    row["row_tuned_ms"] = _tuned_ms(tk._row_topk_tuned)       # every config (ROWS x warps): the A/B
                row["sort_ms"] = _ms(lambda: naive.indexer_topk(I, k))
                row["speedup_vs_sort"] = row["sort_ms"] / row["radix_ms"]
                if "row_ms" in row:
                    row["row_speedup_vs_sort"] = row["sort_ms"] / row["row_ms"]
                row["radix_read_tbps_5_passes"] = 5 * I.numel() * 4 / row["radix_ms"] * 1e-9
                row["equal_naive"] = bool(torch.equal(tk.radix_topk(I, k), naive.indexer_topk(I, k)))
                row["config"] = str(tk._radix_topk_tuned.best_config)
            except Exception as e:  # noqa: BLE001
                row.update(_err(repr(e)))
            log(row)
            out.append(row)
            del I
            torch.cuda.empty_cache()
    return out


# ------------------------------------------------------------------------------------------------- compressor
def _timer(dev):
    """Median ms of a callable: `do_bench` (L2 flushed) on CUDA; on CPU (--smoke) one warm-up + one timed call."""
    if dev == "cuda":
        return _ms

    def cpu_ms(fn, rep=None):
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    return cpu_ms


def _fwd_bwd_on(dev, f, inputs, rep=60):
    """`_fwd_bwd` with the device's timer."""
    return _fwd_bwd(f, inputs, rep, _timer(dev))


def _graph_ms(fn, rep=30):
    """Median ms of `fn` replayed as one captured CUDA graph, L2 flushed before each replay: the device time of
    its kernels with no host launch cost (the eager `_ms` of a small op measures the host: its launches, custom-op
    dispatch and autotuner lookups, when they take longer than the kernels)."""
    import torch
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):                          # warm-up on the capture stream (autograd's streams)
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    cache = torch.empty(256 * 2 ** 20 // 4, dtype=torch.int32, device="cuda")
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(rep)]
    for a, b in ev:
        cache.zero_()
        a.record()
        g.replay()
        b.record()
    torch.cuda.synchronize()
    ts = sorted(a.elapsed_time(b) for a, b in ev)
    del g
    return float(ts[len(ts) // 2])


def _kernel_split(fn, top=8):
    """{kernel name: [us, launches]} of one eager call of `fn` under torch.profiler (device time by kernel)."""
    from dsv4.harness.train.profile_step import profile_once, summarize
    prof, _ = profile_once(fn, "cuda")
    return [{k: r[k] for k in ("name", "ms", "count")} for r in summarize(prof, 0.0, top, 1)["top_kernels"]]


def _device_rows(dev, f, inputs):
    """Device-only timing of a small op (CUDA only; {} elsewhere): forward and forward+backward as CUDA graphs
    (bwd = the difference), and the kernels of one forward+backward with their device times."""
    if dev != "cuda":
        return {}
    import torch
    out = f()
    outs = out if isinstance(out, tuple) else (out,)
    douts = [torch.randn_like(o) for o in outs]
    del out, outs
    fb = lambda: torch.autograd.grad(f(), inputs, douts[0] if len(douts) == 1 else douts)
    try:
        gf = _graph_ms(lambda: f())
        gfb = _graph_ms(fb)
        return {"graph_fwd_ms": gf, "graph_bwd_ms": max(gfb - gf, 0.0), "graph_fwd_bwd_ms": gfb,
                "kernels_fwd_bwd": _kernel_split(fb)}
    except Exception as e:  # noqa: BLE001 - a capture failure must not lose the eager row
        return {"graph_error": repr(e)[:300]}


def _best(kernel):
    cfg = getattr(kernel, "best_config", None)
    return None if cfg is None else str(cfg)


COMPRESSOR_BYTES = ("T tokens, W = coff*D channels, N = T/m entries, bf16: fwd 2*T*W*2 (kv + gate, each element "
                    "read once) + N*D*2 (out); bwd 4*T*W*2 (kv + gate read, dkv + dgate written) + N*D*2 (dout)")


def _bench_compressor(tokens, dev, log, smoke=False):
    import torch

    from dsv4.kernels.compressor import compress_pool, compress_slots
    from dsv4.kernels.compressor import triton as tri
    gen = torch.Generator(device=dev).manual_seed(2)
    cases = [("csa_main", 512, 4, True), ("csa_indexer", 128, 4, True), ("hca_main", 512, 128, False)]
    if smoke:
        cases = [("csa_main", 16, 4, True), ("hca_main", 16, 8, False)]
    rows = []
    for S in tokens:
        for name, D, m, ov in cases:
            W = 2 * D if ov else D
            dt = torch.bfloat16
            kv = torch.randn(S, W, device=dev, generator=gen, dtype=dt).requires_grad_()
            g = torch.randn(S, W, device=dev, generator=gen, dtype=dt).requires_grad_()
            ape = torch.randn(m, W, device=dev, generator=gen).requires_grad_()
            row = {"case": name, "S": S, "D": D, "ratio": m, "overlap": ov}
            seg, pos = torch.zeros(S, dtype=torch.long, device=dev), torch.arange(S, device=dev)   # one document
            by_f = 2 * S * W * 2 + (S // m) * D * 2
            by_b = 4 * S * W * 2 + (S // m) * D * 2
            row["bytes_fwd"], row["bytes_bwd"] = by_f, by_b
            for backend in ("triton", "naive"):
                try:
                    meta = lambda: compress_slots(seg, pos, m, ov, 0, backend=backend)      # noqa: E731
                    slots = meta()                                  # layout metadata, precomputed once
                    pool = lambda: compress_pool(kv, g, ape, m, ov, seg, pos, backend=backend,   # noqa: E731
                                                 slots=slots)[0]
                    total = lambda: compress_pool(kv, g, ape, m, ov, seg, pos, backend=backend)[0]   # noqa: E731
                    f, b = _fwd_bwd_on(dev, pool, [kv, g, ape])
                    sm, ft = _timer(dev)(meta, 60), _timer(dev)(total, 60)
                    row[backend] = {"fwd_ms": f, "bwd_ms": b, "fwd_tbps": by_f / f * 1e-9, "bwd_tbps": by_b / b * 1e-9,
                                    "slots_ms": sm, "fwd_total_ms": ft, "fwd_total_tbps": by_f / ft * 1e-9}
                    if backend == "triton":
                        row[backend].update(fwd_config=_best(tri._pool_fwd), bwd_config=_best(tri._pool_bwd))
                        dv = _device_tbps(_device_rows(dev, pool, [kv, g, ape]), by_f, by_b)
                        if dev == "cuda" and "graph_fwd_ms" in dv:
                            try:
                                dv["graph_slots_ms"] = _graph_ms(meta)
                                dv["graph_fwd_total_ms"] = _graph_ms(total)
                                dv["graph_fwd_total_tbps"] = by_f / dv["graph_fwd_total_ms"] * 1e-9
                            except Exception as e:  # noqa: BLE001
                                dv["graph_slots_error"] = repr(e)[:300]
                        row[backend].update(dv)
                except Exception as e:  # noqa: BLE001
                    row[backend] = _err(repr(e))
            if "fwd_ms" in row["triton"] and "fwd_ms" in row["naive"]:
                row["speedup_vs_naive"] = {"fwd": row["naive"]["fwd_ms"] / row["triton"]["fwd_ms"],
                                           "bwd": row["naive"]["bwd_ms"] / row["triton"]["bwd_ms"]}
            log(row)
            rows.append(row)
            del kv, g, ape
            if dev == "cuda":
                torch.cuda.empty_cache()
    return {"rows": rows, "bytes": COMPRESSOR_BYTES, "targets_tbps": {"fwd": 2.5}}


# ------------------------------------------------------------------------------------------------------- mhc
MHC_BYTES = ("X = N*n*d*2 (the bf16 streams), U = N*d*2: hc_pre fwd 2X + U (x read by the split-K projection and "
             "by the aggregate, u written); hc_pre bwd 3X + 2U (x and du read by dpre, x and du read and dx written "
             "by dx/dfn); hc_post fwd 2X + U (x, out read, y written); hc_post bwd 3X + 2U (dy, x, out read, dx, "
             "dout written); the small per-token tensors (post, comb, mix, partials) are not counted")


def _device_tbps(dv, by_f, by_b):
    if "graph_fwd_ms" in dv:
        dv.update(graph_fwd_tbps=by_f / dv["graph_fwd_ms"] * 1e-9,
                  graph_bwd_tbps=by_b / max(dv["graph_bwd_ms"], 1e-6) * 1e-9)
    return dv


def _bench_mhc(tokens, dev, log, smoke=False):
    import torch

    from dsv4.kernels.mhc import hc_post, hc_pre
    from dsv4.kernels.mhc import triton as tri
    n, d = (4, 64) if smoke else (4, 4096)
    rows = []
    for N in tokens:
        gen = torch.Generator(device=dev).manual_seed(3)
        x = torch.randn(N, n, d, device=dev, generator=gen, dtype=torch.bfloat16).requires_grad_()
        fn = (torch.randn((2 + n) * n, n * d, device=dev, generator=gen) * 0.01).requires_grad_()
        base = torch.zeros((2 + n) * n, device=dev).requires_grad_()
        scale = torch.ones(3, device=dev).requires_grad_()
        out = torch.randn(N, d, device=dev, generator=gen, dtype=torch.bfloat16).requires_grad_()
        post = torch.rand(N, n, device=dev, generator=gen).requires_grad_()
        comb = torch.rand(N, n, n, device=dev, generator=gen).requires_grad_()
        X, U = N * n * d * 2, N * d * 2
        for backend in ("triton", "naive"):
            row = {"backend": backend, "N": N, "n": n, "d": d, "bytes": {"fwd": 2 * X + U, "bwd": 3 * X + 2 * U}}
            try:
                f, b = _fwd_bwd_on(dev, lambda: hc_pre(x, fn, base, scale, 20, 1e-6, 1e-6, backend=backend),
                                   [x, fn, base, scale])
                row["hc_pre"] = {"fwd_ms": f, "bwd_ms": b, "fwd_tbps": (2 * X + U) / f * 1e-9,
                                 "bwd_tbps": (3 * X + 2 * U) / b * 1e-9}
                if backend == "triton":   # breakdown: the split-K projection + small map alone (one read of x)
                    with torch.no_grad():
                        p = _timer(dev)(lambda: tri._project(x, fn.detach(), 1e-6))
                    row["hc_pre"].update(proj_only_ms=p, proj_only_tbps=X / p * 1e-9,
                                         configs={k: _best(getattr(tri, k)) for k in
                                                  ("_proj", "_pre_map", "_pre_agg", "_pre_bwd_dpre",
                                                   "_pre_bwd_map", "_pre_bwd_dx")})
                    row["hc_pre"].update(_device_tbps(_device_rows(
                        dev, lambda: hc_pre(x, fn, base, scale, 20, 1e-6, 1e-6, backend=backend),
                        [x, fn, base, scale]), 2 * X + U, 3 * X + 2 * U))
            except Exception as e:  # noqa: BLE001
                row["hc_pre"] = _err(repr(e))
            try:
                f, b = _fwd_bwd_on(dev, lambda: hc_post(x, out, post, comb, backend=backend), [x, out, post, comb])
                row["hc_post"] = {"fwd_ms": f, "bwd_ms": b, "fwd_tbps": (2 * X + U) / f * 1e-9,
                                  "bwd_tbps": (3 * X + 2 * U) / b * 1e-9}
                if backend == "triton":
                    row["hc_post"]["configs"] = {k: _best(getattr(tri, k)) for k in ("_post_fwd", "_post_bwd")}
                    row["hc_post"].update(_device_tbps(_device_rows(
                        dev, lambda: hc_post(x, out, post, comb, backend=backend), [x, out, post, comb]),
                        2 * X + U, 3 * X + 2 * U))
            except Exception as e:  # noqa: BLE001
                row["hc_post"] = _err(repr(e))
            log(row)
            rows.append(row)
        del x, fn, base, scale, out, post, comb
        if dev == "cuda":
            torch.cuda.empty_cache()
    return {"rows": rows, "bytes": MHC_BYTES,
            "targets_tbps": {"hc_pre_fwd": 3.0, "hc_pre_bwd": 2.5, "hc_post_bwd": 2.5}}


# ---------------------------------------------------------------------------------------------------- swiglu
def _bench_swiglu(log, dev="cuda", smoke=False):
    import torch

    from dsv4.kernels.swiglu import clamped_swiglu
    gen = torch.Generator(device=dev).manual_seed(4)
    shape = (64, 32) if smoke else (65536, 2048)
    g = torch.randn(shape, device=dev, generator=gen, dtype=torch.bfloat16).mul(4).requires_grad_()
    u = torch.randn(shape, device=dev, generator=gen, dtype=torch.bfloat16).mul(4).requires_grad_()
    E = g.numel() * 2
    rows = []
    for backend in ("triton", "naive"):
        f, b = _fwd_bwd_on(dev, lambda: clamped_swiglu(g, u, 10.0, backend=backend), [g, u])
        row = {"backend": backend, "shape": list(shape), "fwd_ms": f, "bwd_ms": b, "fwd_tbps": 3 * E / f * 1e-9,
               "bwd_tbps": 5 * E / b * 1e-9}
        log(row)
        rows.append(row)
    return {"rows": rows, "bytes": "fwd: read gate+up, write y; bwd: read gate+up+dy, write dgate+dup"}


# ------------------------------------------------------------------------------------------- cross entropy
def _bench_cross_entropy(log, dev="cuda", smoke=False):
    import torch

    from dsv4.kernels.cross_entropy import ce_dlogits, ce_lse
    from dsv4.model.model import head_cross_entropy
    N, d, V = (37, 16, 300) if smoke else (16384, 2048, 32768)
    C = min(N, 8192)                                                   # head_cross_entropy's row block
    gen = torch.Generator(device=dev).manual_seed(5)
    bf = torch.bfloat16
    y = torch.randn(N, d, device=dev, generator=gen).to(bf).requires_grad_()
    W = (torch.randn(V, d, device=dev, generator=gen) * 0.02).to(bf).requires_grad_()
    lab = torch.randint(0, V, (N,), device=dev, generator=gen)
    logits = (torch.randn(C, V, device=dev, generator=gen) * 3).to(bf)
    scale = torch.rand(C, device=dev, generator=gen)
    ms = _timer(dev)
    rows, nbytes = [], logits.numel() * logits.element_size()
    for backend in ("triton", "naive"):
        f, b = _fwd_bwd_on(dev, lambda: head_cross_entropy(y, W, lab, backend=backend), [y, W])
        lse = ce_lse(logits, lab[:C], backend=backend)[0]
        fl = ms(lambda: ce_lse(logits, lab[:C], backend=backend))
        fd = ms(lambda: ce_dlogits(logits, lse, lab[:C], scale, backend=backend))
        row = {"backend": backend, "rows": N, "d": d, "V": V, "head_fwd_ms": f, "head_bwd_ms": b,
               "block": [C, V], "lse_ms": fl, "dlogits_ms": fd, "lse_tbps": nbytes / fl * 1e-9,
               "dlogits_tbps": 2 * nbytes / fd * 1e-9}
        log(row)
        rows.append(row)
    t, n = rows
    return {"rows": rows, "speedup_vs_naive": {"head_fwd": n["head_fwd_ms"] / t["head_fwd_ms"],
                                                "head_bwd": n["head_bwd_ms"] / t["head_bwd_ms"]}}


# --------------------------------------------------------------------------------------------- MoE combine
def _bench_moe_combine(tokens, log, dev="cuda", smoke=False):
    import torch

    from dsv4.kernels.moe_combine import moe_combine
    K, d = 4, (16 if smoke else 2048)
    rows = []
    for T in tokens:
        gen = torch.Generator(device=dev).manual_seed(6)
        idx = torch.rand(T, 16, device=dev, generator=gen).argsort(1)[:, :K]            # [T, K] distinct experts
        order = torch.argsort(idx.reshape(-1), stable=True)
        tok = order // K
        y = torch.randn(T * K, d, device=dev, generator=gen).to(torch.bfloat16).requires_grad_()
        w = torch.rand(T * K, device=dev, generator=gen).requires_grad_()
        X = T * d * 2                                                                    # one [T, d] bf16 tensor
        for backend in ("triton", "naive"):
            f, b = _fwd_bwd_on(dev, lambda: moe_combine(y, w, tok, T, torch.bfloat16, backend=backend), [y, w])
            row = {"backend": backend, "tokens": T, "K": K, "d": d, "fwd_ms": f, "bwd_ms": b,
                   "fwd_tbps": (K + 1) * X / f * 1e-9, "bwd_tbps": (3 * K) * X / b * 1e-9}
            log(row)
            rows.append(row)
    return {"rows": rows, "bytes": "fwd: read y (K x [T, d]), write out; bwd: read g per slot and y, write dy"}


SMOKE_OPS = ("compressor", "mhc", "swiglu", "cross_entropy", "moe_combine")


@click.command("kernels")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON on stdout.")
@click.option("--out", type=click.Path(dir_okay=False), default=None, help="Write all results to this JSON file.")
@click.option("--out-dir", type=click.Path(file_okay=False), default=None,
              help="Also write <dir>/<slice>/bench_kernels.json per slice (D3: attention ops, P2: mHC, P5: SwiGLU).")
@click.option("--only", default=",".join(OPS), show_default=True, help="Comma list of ops.")
@click.option("--seqs", default="4096,16384,65536", show_default=True, help="Sparse-attention sequence lengths.")
@click.option("--tokens", default="16384,65536", show_default=True, help="Compressor / mHC token counts.")
@click.option("--heads", default="64", show_default=True,
              help="Sparse-attention head counts (comma list; 64 = DSv4, 16 = proxy); the dense peer uses the first.")
@click.option("--dense-peer/--no-dense-peer", default=True, help="Time dense causal SDPA at the same lengths.")
@click.option("--isolate", is_flag=True, help="Each op in its own process (a CUDA fault does not poison the rest).")
@click.option("--smoke", is_flag=True, help="Tiny compressor / mhc / swiglu sizes; runs on CPU (interpreter).")
def bench_cmd(as_json, out, out_dir, only, seqs, tokens, heads, dense_peer, isolate, smoke):
    """Triton kernels vs naive vs peers on one GPU (H200); JSON with provenance."""
    import tempfile

    from dsv4.harness.errors import BadInput, need_cuda
    from dsv4.harness.goldens import atomic_write_text
    ops = [o for o in only.split(",") if o]
    bad = sorted(set(ops) - set(OPS))
    if bad:
        raise BadInput(f"--only: unknown op {bad[0]!r}; known: {', '.join(OPS)}")
    try:
        seq = [int(x) for x in seqs.split(",")]
        toks = [int(x) for x in tokens.split(",")]
        hs = [int(x) for x in heads.split(",")]
    except ValueError:
        raise BadInput(f"--seqs / --tokens / --heads: comma lists of integers, got {seqs!r} / {tokens!r} / "
                       f"{heads!r}") from None
    if not hs or min(hs) < 1:
        raise BadInput(f"--heads: positive head counts, got {heads!r}")
    import torch
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if smoke:
        toks = [37]
        if dev == "cpu":                             # before any kernels/*/triton.py is imported
            os.environ["TRITON_INTERPRET"] = "1"
    else:
        need_cuda("dsv4 bench kernels")
    log = lambda r: print(json.dumps(r), file=sys.stderr, flush=True)
    res = {"provenance": _provenance(), "ops": {}}
    if smoke:
        res["provenance"]["smoke"] = f"tiny sizes on {dev}: the numbers mean nothing"
    for op in ops:
        t0 = time.time()
        if isolate:
            with tempfile.TemporaryDirectory() as tmp:
                f = Path(tmp) / "r.json"
                args = ["--only", op, "--seqs", seqs, "--tokens", tokens, "--heads", heads, "--out", str(f)] + \
                    ([] if dense_peer else ["--no-dense-peer"]) + (["--smoke"] if smoke else [])
                rc = subprocess.run([sys.executable, "-c", "from dsv4.harness.bench import bench_cmd; bench_cmd()",
                                     *args]).returncode
                r = json.loads(f.read_text())["ops"][op] if f.exists() else _err(f"subprocess rc={rc}")
            res["ops"][op] = r
            print(f"[bench] {op} done in {time.time() - t0:.1f}s (isolated)", file=sys.stderr, flush=True)
            continue
        try:
            if smoke and op not in SMOKE_OPS:
                r = {"skipped": f"--smoke covers {', '.join(SMOKE_OPS)}"}
            elif op == "sparse_attn":
                r = _bench_sparse_attn(seq, dense_peer, log, hs)
            elif op == "indexer":
                r = _bench_indexer([s for s in seq if s <= 16384] or seq[:1], log)
            elif op == "compressor":
                r = _bench_compressor(toks, dev, log, smoke)
            elif op == "mhc":
                r = _bench_mhc(toks, dev, log, smoke)
            elif op == "moe_combine":
                r = _bench_moe_combine(toks, log, dev, smoke)
            elif op == "cross_entropy":
                r = _bench_cross_entropy(log, dev, smoke)
            else:
                r = _bench_swiglu(log, dev, smoke)
        except Exception as e:  # noqa: BLE001
            r = _err(repr(e))
        r["wall_s"] = time.time() - t0
        res["ops"][op] = r
        print(f"[bench] {op} done in {r['wall_s']:.1f}s", file=sys.stderr, flush=True)
    text = json.dumps(res, indent=1)
    if out:
        atomic_write_text(Path(out), text)
    if out_dir:
        for sl in sorted({SLICE_OF[o] for o in ops}):
            sub = {"provenance": res["provenance"], "ops": {o: res["ops"][o] for o in ops if SLICE_OF[o] == sl}}
            atomic_write_text(Path(out_dir) / sl / "bench_kernels.json", json.dumps(sub, indent=1))
    click.echo(text)          # the result, with or without --json (progress went to stderr)
