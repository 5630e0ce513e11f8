"""GPU check of slice X1 (run on the H200): the emulated FP8 GEMM against torch._scaled_mm, as JSON.

    python -m dsv4.kernels.lowp_gpu_check --out goldens/h200/X1/fp8_gemm_check.json

For each GEMM shape (M, K, N) of the proxy model: quantise x [M, K] and W [N, K] with the exact quantisers
(and check that the CUDA quantisation is bit-identical to the CPU one), then compare against the fp64 product
of the dequantised operands (the exact value an FP8 tensor core should produce, up to its accumulation order):
  * emulation: fp32 matmul (TF32 off) of the dequantised operands on the GPU;
  * scaled_mm tensor: torch._scaled_mm with per-tensor fp32 scales, fp32 and bf16 outputs;
  * scaled_mm block: 1x128 x 128x128 ue8m0 scales, when this torch build supports it (probe result and the
    errors of each tried scale layout are recorded); otherwise the bf16-dequant fallback FP8Linear uses;
  * FP8Linear forward + backward on CUDA vs the CPU emulation (y, dx, dW).
Errors: max_abs = max |got - ref|, max_rel = max_abs / max |ref|, p99_rel = 99th percentile of
|got - ref| / (|ref| + 1e-3 max |ref|). Timings (CUDA events, median of 20) give bf16 vs FP8 TFLOP/s.
Exit status: 0 done (the JSON is the evidence; no pass/fail is decided here), 2 no CUDA (cannot judge).
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch

from dsv4.model.lowp import fp8_linear as L
from dsv4.kernels.quant.naive import quantize

SHAPES = [(512, 512, 512), (4096, 2048, 2048), (4096, 2048, 512), (4096, 512, 2048), (4096, 2048, 1024),
          (4096, 1024, 2048), (16384, 2048, 2048)]


def _err(got: torch.Tensor, ref: torch.Tensor) -> dict:
    d = (got.double() - ref).abs()
    m = ref.abs().max()
    rel = d / (ref.abs() + 1e-3 * m)
    flat = rel.flatten()
    k = max(1, int(0.99 * flat.numel()))
    p99 = flat.kthvalue(k).values if flat.numel() < 2 ** 24 else flat[::max(1, flat.numel() // 2 ** 22)].quantile(0.99)
    return {"max_abs": float(d.max()), "max_rel": float(d.max() / m), "p99_rel": float(p99)}


def _time(fn, n=20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    return sorted(ts)[len(ts) // 2]


def _same_q(qa, qb) -> bool:
    va, vb = qa.values.cpu(), qb.values.cpu()
    sa, sb = qa.scale.cpu(), qb.scale.cpu()
    return bool(torch.equal(va, vb) and torch.equal(sa, sb))


def check_shape(M, K, N, dev, timing=True) -> dict:
    g = torch.Generator().manual_seed(M * 7 + K * 3 + N)
    x = torch.randn(M, K, generator=g)
    w = torch.randn(N, K, generator=g) * 0.02
    xd, wd = x.to(dev), w.to(dev)
    out = {"M": M, "K": K, "N": N}
    res = {}
    for mode, blk_x, blk_w, sf in (("tensor", None, None, "fp32"), ("blockwise", (1, 128), (128, 128), "ue8m0")):
        qx, qw = quantize(xd, "e4m3", blk_x, sf), quantize(wd, "e4m3", blk_w, sf)
        res[f"{mode}_quant_cast_equals_formula"] = _same_q(qx, quantize(xd, "e4m3", blk_x, sf, method="formula"))
        res[f"{mode}_quant_bitexact_vs_cpu"] = _same_q(qx, quantize(x, "e4m3", blk_x, sf)) and \
            _same_q(qw, quantize(w, "e4m3", blk_w, sf))
        ref = qx.dequantize().double() @ qw.dequantize().double().t()
        torch.backends.cuda.matmul.allow_tf32 = False
        res[f"{mode}_emulation_fp32"] = _err(L.emulated_gemm(qx, qw), ref)
        if mode == "tensor":
            for od in (torch.float32, torch.bfloat16):
                try:
                    y = L._scaled_mm_tensor(qx, qw, od)
                    res[f"tensor_scaled_mm_{str(od)[6:]}"] = _err(y.float(), ref)
                except Exception as e:  # noqa: BLE001
                    res[f"tensor_scaled_mm_{str(od)[6:]}"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        else:
            if L.blockwise_scaled_mm_ok(dev, "128x128"):
                try:
                    y = L._scaled_mm_block(qx, qw, torch.bfloat16, L._layout(dev, "128x128"))
                    res["block_scaled_mm_bf16"] = _err(y.float(), ref)
                except Exception as e:  # noqa: BLE001
                    res["block_scaled_mm_bf16"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            res["block_bf16_dequant_fallback"] = _err(
                (qx.dequantize(torch.bfloat16) @ qw.dequantize(torch.bfloat16).t()).float(), ref)
        if timing and dev.type == "cuda":
            if mode == "tensor":
                f8x, f8w = qx.fp8().contiguous(), qw.fp8().contiguous().t()
                one = torch.ones((), device=dev)
                try:
                    t = _time(lambda: torch._scaled_mm(f8x, f8w, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
                    res["tflops_scaled_mm_tensor"] = 2 * M * N * K / t / 1e12
                except Exception as e:  # noqa: BLE001
                    res["tflops_scaled_mm_tensor"] = f"error: {type(e).__name__}"
                xb, wb = xd.bfloat16(), wd.bfloat16().t()
                res["tflops_bf16_matmul"] = 2 * M * N * K / _time(lambda: xb @ wb) / 1e12
            elif L.blockwise_scaled_mm_ok(dev, "128x128") and "error" not in res.get("block_scaled_mm_bf16", {}):
                lay = L._layout(dev, "128x128")
                res["tflops_scaled_mm_block"] = 2 * M * N * K / _time(
                    lambda: L._scaled_mm_block(qx, qw, torch.bfloat16, lay)) / 1e12
            res[f"ms_quantize_x_{mode}"] = 1e3 * _time(lambda: quantize(xd.bfloat16(), "e4m3", blk_x, sf))
            res[f"tflops_fp8linear_{mode}_fwd_incl_quant"] = 2 * M * N * K / _time(
                lambda: L.fp8_linear(xd.bfloat16(), wd, L.FP8Config(scaling=mode, scale_format=sf))) / 1e12
    out.update(res)
    return out


def check_linear(dev, M=1024, K=2048, N=512) -> dict:
    """FP8Linear fwd+bwd on CUDA (whatever path it picks) vs the CPU emulation."""
    res = {}
    g = torch.Generator().manual_seed(5)
    x = torch.randn(M, K, generator=g)
    w = torch.randn(N, K, generator=g) * 0.02
    gy = torch.randn(M, N, generator=g)
    for mode, sf in (("tensor", "fp32"), ("blockwise", "ue8m0")):
        cfg = L.FP8Config(scaling=mode, scale_format=sf)
        outs = {}
        for d in ("cpu", dev):
            xr, wr = x.to(d).detach().clone().requires_grad_(), w.to(d).detach().clone().requires_grad_()
            y = L.fp8_linear(xr, wr, cfg)
            y.backward(gy.to(d))
            outs[str(d)] = (y.detach().cpu(), xr.grad.cpu(), wr.grad.cpu(), dict(L.LAST_PATH))
        c, u = outs["cpu"], outs[str(dev)]
        res[mode] = {"paths": u[3], "scaled_mm_failures": list(L.SCALED_MM_FAILURES), "y": _err(u[0], c[0].double()), "dx": _err(u[1], c[1].double()),
                     "dw": _err(u[2], c[2].double())}
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--shapes", default=None, help="M,K,N;M,K,N;... (default: the proxy GEMMs)")
    a = ap.parse_args(argv)
    rep = {"check": "X1 fp8 gemm: emulation vs torch._scaled_mm", "torch": torch.__version__,
           "cuda": torch.version.cuda, "python": platform.python_version()}
    from dsv4.harness.goldens import git_sha
    rep["git_sha"] = git_sha()[0]             # DSV4_GIT_SHA first: the device copy's .git can be stale
    if not torch.cuda.is_available():
        rep["status"] = "cannot judge: no CUDA device"
        print(json.dumps(rep, indent=1))
        return 2
    dev = torch.device("cuda")
    rep["device"] = torch.cuda.get_device_name(dev)
    rep["capability"] = list(torch.cuda.get_device_capability(dev))
    rep["has_scaled_mm"] = hasattr(torch, "_scaled_mm")
    rep["blockwise_probe"] = L._probe_blockwise(dev)
    print(json.dumps(rep["blockwise_probe"]), file=sys.stderr, flush=True)
    shapes = SHAPES if a.shapes is None else [tuple(int(v) for v in s.split(",")) for s in a.shapes.split(";")]
    rep["gemms"] = [check_shape(*s, dev, timing=not a.no_timing) for s in shapes]
    rep["fp8_linear_vs_cpu"] = check_linear(dev)
    rep["scaled_mm_failures"] = list(L.SCALED_MM_FAILURES)
    rep["status"] = "done"
    txt = json.dumps(rep, indent=1)
    print(txt)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(txt + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
