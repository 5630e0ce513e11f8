"""DeepSeek's released weight formats, dequantised on load (issue 18 §5): one pass over a checkpoint's tensors.

What the hub checkpoints hold (transformers 5.23 `quantizer_finegrained_fp8.py` / `integrations/finegrained_fp8.py`,
`FineGrainedFP8Config(scale_fmt, expert_dtype)`; config.json `quantization_config` = {"quant_method": "fp8",
"fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [128, 128], "expert_dtype": "fp4", ...}):

  FP8 linears     `P.weight` float8_e4m3fn [R, C] + `P.scale` (official naming; HF's FP8 integration renames it
                  `P.weight_scale_inv`) [ceil(R/128), ceil(C/128)]: one scale per 128 x 128 block, stored as
                  float8_e8m0fnu (ue8m0: a power of two, byte = exponent + 127) or fp32 (V3 style);
                  W = fp8 * scale, block-wise (the "inv" in HF's name notwithstanding, the stored value multiplies).
  FP4 experts     `...experts.{e}.w{1,2,3}.weight` int8 [R, C/2]: two e2m1 codes per byte (element 2j in the low
                  nibble), + `.scale` [R, C/32] e8m0: MXFP4, one scale per 1 x 32 block (expert_dtype "fp4").
  BF16            the compressor / indexer projections, `weights_proj`, the router, embedding, head, norms, mHC,
                  sinks, ape: no scale, loaded as they are.

The block shape of each pair follows from the two shapes (as transformers derives it): FP8 uses the config's
`weight_block_size` (default 128 x 128, the last block of a dimension may be partial), FP4 1 x 32. Scales stored as
uint8 bytes are e8m0 codes. Every product is exact in fp32 (a 4- or 2-bit significand times a power of two), and
so is the bf16 result. The format math is model/lowp/quant.py's (`e8m0_decode`, `fp4_unpack`, `apply_scale`).
"""
from __future__ import annotations

import torch

from dsv4.model.interop.common import CheckpointError
from dsv4.kernels.quant.naive import apply_scale, e8m0_decode, fp4_unpack

SCALE_SUFFIXES = (".scale", ".weight_scale_inv")
_E8M0 = getattr(torch, "float8_e8m0fnu", None)
_FP4X2 = getattr(torch, "float4_e2m1fn_x2", None)
FP8_DTYPES = (torch.float8_e4m3fn,)
FP4_DTYPES = tuple(t for t in (torch.int8, torch.uint8, _FP4X2) if t is not None)


def _scale_values(s: torch.Tensor, key: str) -> torch.Tensor:
    if _E8M0 is not None and s.dtype == _E8M0:
        return e8m0_decode(s.view(torch.uint8))
    if s.dtype == torch.uint8:
        return e8m0_decode(s)
    if s.is_floating_point() and s.element_size() >= 2:
        return s.float()
    raise CheckpointError(f"tensor {key}: scale dtype {s.dtype} is not e8m0 / uint8 / fp32 / bf16")


def dequantize_pair(w: torch.Tensor, s: torch.Tensor, key: str, block=(128, 128),
                    dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """One released (weight, scale) pair -> the dequantised weight in `dtype`. key names the weight in errors."""
    sv = _scale_values(s, key + " scale")
    if w.dtype in FP8_DTYPES:
        vals = w.float()
        R, C = vals.shape[-2:]
        blk = tuple(block)
    elif w.dtype in FP4_DTYPES:
        vals = fp4_unpack(w)
        R, C = vals.shape[-2:]
        blk = (1, 32)
    else:
        raise CheckpointError(f"tensor {key}: dtype {w.dtype} has a scale but is neither float8_e4m3fn nor packed fp4")
    want = (-(-R // blk[0]), -(-C // blk[1]))
    if tuple(sv.shape[-2:]) != want:
        raise CheckpointError(f"tensor {key}: scale shape {list(sv.shape)} does not fit weight [{R}, {C}] in "
                              f"{blk[0]}x{blk[1]} blocks (expected {list(want)})")
    return apply_scale(vals, sv, blk, "mul").to(dtype)


def dequantize_released(sd: dict[str, torch.Tensor], quantization_config: dict | None = None, where: str = "checkpoint",
                        dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors with every (weight, scale) pair replaced by its dequantised weight (names kept,
    scales dropped); unscaled tensors pass through. A scale without its weight, or an fp8 / packed weight
    without its scale, is refused in one line naming `where` and the tensor."""
    qc = quantization_config or {}
    block = qc.get("weight_block_size") or (128, 128)
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise CheckpointError(f"{where}: quantization_config.weight_block_size must be two positive ints, got {block!r}")
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise CheckpointError(f"{where}: quantization_config.fmt {fmt!r} not supported (e4m3)")
    out, scales = {}, {}
    for k, v in sd.items():
        suf = next((s for s in SCALE_SUFFIXES if k.endswith(s)), None)
        if suf is not None and not k.endswith(("hc_attn_scale", "hc_ffn_scale", "hc_head_scale")) and \
                not k.endswith((".attn_hc.scale", ".ffn_hc.scale", "hc_head.hc_scale")):
            scales[k[: -len(suf)] + ".weight"] = (k, v)
        else:
            out[k] = v
    for wk, (sk, s) in scales.items():
        if wk not in out:
            raise CheckpointError(f"{where}: scale {sk} has no weight {wk}")
        out[wk] = dequantize_pair(out[wk], s, wk, block, dtype)
    for k, v in out.items():
        if v.dtype in FP8_DTYPES or (k.endswith(".weight") and v.dtype in FP4_DTYPES):
            raise CheckpointError(f"{where}: tensor {k} is {v.dtype} but has no scale (.scale / .weight_scale_inv)")
    return out
