"""X1: the emulated FP8 GEMM against torch._scaled_mm on the H200.

The tolerances come from the stored H200 log slices/X1/logs/h200_fp8_gemm_check.json (kernels/lowp_gpu_check.py,
provenance beside it): max |scaled_mm - ref| / max |ref| over the proxy GEMM shapes, ref = the fp64 product of
the dequantised operands (what the emulation computes, up to summation order):
    per-tensor scales, fp32 output   2.7e-4   (Hopper's FP8 accumulation is not fp32-exact)
    per-tensor / blockwise, bf16 out 3.4e-3   (bf16 output rounding, 2^-8 relative)
    emulation in fp32 on the GPU     2.5e-6
Bounds = measured x 2. The CPU test checks the stored log against the bounds (and that the quantisers were
bit-identical on the GPU and the CPU); the CUDA test re-measures live and is skipped without a GPU.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

LOG = Path(__file__).parent / "logs" / "h200_fp8_gemm_check.json"
TOL = {"tensor_scaled_mm_float32": 5.4e-4, "tensor_scaled_mm_bfloat16": 6.8e-3, "block_scaled_mm_bf16": 6.8e-3,
       "block_bf16_dequant_fallback": 6.8e-3, "tensor_emulation_fp32": 5e-6, "blockwise_emulation_fp32": 5e-6}
LINEAR_TOL = {"tensor": 5.4e-4, "blockwise": 6.8e-3}   # FP8Linear y/dx/dW on CUDA vs the CPU emulation


def _judge(rep: dict) -> list[str]:
    bad = []
    for g in rep["gemms"]:
        shape = (g["M"], g["K"], g["N"])
        for flag in ("tensor_quant_bitexact_vs_cpu", "blockwise_quant_bitexact_vs_cpu",
                     "tensor_quant_cast_equals_formula", "blockwise_quant_cast_equals_formula"):
            if g.get(flag) is not True:
                bad.append(f"{shape} {flag}={g.get(flag)}")
        for k, tol in TOL.items():
            if k in g and not g[k].get("max_rel", float("inf")) <= tol:
                bad.append(f"{shape} {k}={g[k]} > {tol}")
    for mode, tol in LINEAR_TOL.items():
        lin = rep["fp8_linear_vs_cpu"][mode]
        for t in ("y", "dx", "dw"):
            if not lin[t]["max_rel"] <= tol:
                bad.append(f"fp8_linear {mode} {t} {lin[t]} > {tol}")
    return bad


def test_stored_h200_log_is_within_the_tolerances():
    rep = json.loads(LOG.read_text())
    assert rep["status"] == "done" and rep["capability"] == [9, 0]
    assert len(rep["gemms"]) >= 5
    assert all("tensor_scaled_mm_float32" in g and "block_scaled_mm_bf16" in g for g in rep["gemms"])
    assert rep["fp8_linear_vs_cpu"]["blockwise"]["paths"] == {"fprop": "scaled_mm", "dgrad": "scaled_mm",
                                                              "wgrad": "scaled_mm"}
    assert _judge(rep) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the H200)")
def test_live_gpu_check_within_the_tolerances():
    from dsv4.kernels import lowp_gpu_check as C
    dev = torch.device("cuda")
    rep = {"gemms": [C.check_shape(*s, dev, timing=False) for s in C.SHAPES[:4]],
           "fp8_linear_vs_cpu": C.check_linear(dev)}
    assert _judge(rep) == []
