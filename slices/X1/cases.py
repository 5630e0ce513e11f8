"""X1 golden cases: the debug model's loss curve in fp32 and under the FP8 (per-tensor, blockwise) and FP4-QAT
precision recipes, through `dsv4 train` (slices/X1/curves.py; compared with each other by
slices/X1/test_lowp_curves.py)."""
import torch

from dsv4.harness.cases import golden_case


@golden_case("lowp_curves_debug", tol={k: (0, 0) for k in ("lm_loss_fp32", "lm_loss_fp8_tensor", "lm_loss_fp8_block",
                                                           "lm_loss_fp4_qat")}, scope="same-host")
def lowp_curves_debug():
    """`dsv4 train --recipe debug --steps 32` (CPU, fp32) without a precision recipe and with --precision
    fp8_tensor / fp8_block / fp4_qat (experts MXFP4 with STE via FP8, FP8 linears, FP4 indexer QK). Same-host
    evidence, bit-exact on the host that made it: quantisation rounding boundaries, MoE routing and top-k
    flips amplify cross-host rounding differences."""
    from dsv4.slices.X1.curves import LOWP, lm_curve
    out = {"lm_loss_fp32": torch.tensor(lm_curve(None), dtype=torch.float64)}
    for name in LOWP:
        out[f"lm_loss_{name}"] = torch.tensor(lm_curve(name), dtype=torch.float64)
    return out
