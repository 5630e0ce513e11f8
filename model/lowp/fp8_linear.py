"""FP8 linear layer (slice X1): e4m3 forward and backward GEMM operands, high-precision master weights.

GEMMs of y = x W^T (x [M, K], W [N, K], no bias), following DeepSeek-V3's recipe in "blockwise" mode:
    fprop  y  = x  · W^T     x tiles 1x128 along K,      W blocks 128x128
    dgrad  dx = dy · W       dy tiles 1x128 along N,     W blocks 128x128 (the forward quantisation of W)
    wgrad  dW = dy^T · x     dy^T and x^T tiles 1x128 along M (the tokens: DeepSeek's 128x1 tiles)
and one scale per operand in "tensor" mode. Scales are ue8m0 (powers of two, DeepSeek-V4) or fp32
(amax / 448). The operands are quantised exactly (kernels/quant/naive.py); the GEMM then runs as:
  * CPU / "emulate": fp32 matmul of the dequantised operands (with power-of-two scales every product is exact,
    only the fp32 summation order differs from an FP8 tensor core);
  * CUDA, tensor mode: `torch._scaled_mm` (e4m3 operands, second one column-major, dims multiples of 16),
    a true FP8 GEMM;
  * CUDA, blockwise: `torch._scaled_mm` with 1x128 x 128x128 (fprop, dgrad) and 1x128 x 1x128 (wgrad)
    scales, when a one-time probe shows this torch build runs it on this device and matches the emulation
    (`blockwise_scaled_mm_ok`; on the H200 with torch 2.11 it does, with scale_a (M, K/128) outer-dim-major
    and scale_b (K/128, N/128) K-major with 16-byte aligned strides, resp. (K/128, N) row-major); otherwise
    the dequantised operands are multiplied in bf16 (exact dequantisation for ue8m0 scales, fp32
    accumulation, bf16 output): an emulation at bf16 speed, not an FP8 speed-up. `LAST_PATH` records what
    ran, `SCALED_MM_FAILURES` any shape where scaled_mm failed after the probe.
  * Speed (H200 log slices/X1/logs/h200_fp8_gemm_check.json): the GEMMs are fast (blockwise 628, per-tensor
    984 TFLOP/s vs bf16 731 at 16384x2048x2048) but the eager quantisers are not (about 1 ms for a 16384x2048
    activation), so FP8Linear's forward ran at 85-106 TFLOP/s there with them; hence the fused Triton quantiser
    (kernels/quant/triton.py, the FP8Linear's `backend = "triton"`; same bits as the exact one).
Gradients: dx in x's dtype, dW in the master weight's dtype (fp32 masters stay fp32).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dsv4.kernels.quant import fp8_quantize
from dsv4.kernels.quant.naive import QTensor
from dsv4.model.precision import autocast_operands

TILE = 128
LAST_PATH: dict[str, str] = {}          # "fprop" | "dgrad" | "wgrad" -> "emulate" | "scaled_mm" | "bf16-dequant"
SCALED_MM_FAILURES: list[str] = []     # blockwise scaled_mm calls that failed after a passing probe


@dataclass(frozen=True)
class FP8Config:
    scaling: str = "blockwise"          # "blockwise" (1x128 activations, 128x128 weights) | "tensor"
    fwd_fmt: str = "e4m3"               # x and W
    bwd_fmt: str = "e4m3"               # dy (DeepSeek: e4m3 everywhere; "e5m2" = the hybrid recipe)
    scale_format: str = "ue8m0"         # "ue8m0" | "fp32"
    out_dtype: torch.dtype | None = None   # None: x's dtype
    backend: str = "auto"               # "auto" (scaled_mm on CUDA where possible) | "emulate"

    def __post_init__(self):
        if self.scaling not in ("blockwise", "tensor"):
            raise ValueError(f"FP8Config.scaling: blockwise|tensor, got {self.scaling!r}")
        if self.backend not in ("auto", "emulate"):
            raise ValueError(f"FP8Config.backend: auto|emulate, got {self.backend!r}")


def _quant(t: torch.Tensor, fmt: str, block, cfg: FP8Config, backend: str = "naive", transpose: bool = False):
    """t [R, C] -> QTensor (float8 values; kernels/quant `fp8_quantize`: the exact quantiser, or the fused Triton
    one with backend "triton", bit-identical); with transpose also the QTensor of t^T from the same pass."""
    out = fp8_quantize(t, fmt, block, cfg.scale_format, transpose, backend=backend)
    q = QTensor(out[0], out[1], fmt, block)
    return (q, QTensor(out[2], out[3], fmt, block)) if transpose else q


def _act_block(cfg: FP8Config):
    """Operands quantised along their last (contraction) dim: 1x128 tiles, or per tensor."""
    return (1, TILE) if cfg.scaling == "blockwise" else None


def _w_block(cfg: FP8Config):
    return (TILE, TILE) if cfg.scaling == "blockwise" else None


def _q_act(t: torch.Tensor, fmt: str, cfg: FP8Config, backend: str = "naive") -> QTensor:
    return _quant(t, fmt, _act_block(cfg), cfg, backend)


def _q_weight(w: torch.Tensor, cfg: FP8Config, backend: str = "naive") -> QTensor:
    return _quant(w, cfg.fwd_fmt, _w_block(cfg), cfg, backend)


def _aligned(*dims: int) -> bool:
    return all(d % 16 == 0 for d in dims)


def _scaled_mm_tensor(a: QTensor, b: QTensor, out_dtype) -> torch.Tensor:
    """a [M, K], b [N, K], per-tensor scales -> a b^T via cuBLAS FP8."""
    af = a.fp8().contiguous()
    bf = b.fp8().contiguous().t()                                     # [K, N] column-major
    return torch._scaled_mm(af, bf, scale_a=a.scale.float().reshape(()), scale_b=b.scale.float().reshape(()),
                            out_dtype=out_dtype)


def _col_major(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous().t()


def _col_major_aligned(t: torch.Tensor) -> torch.Tensor:
    """t [R, C] as a column-major view whose column stride (leading dim) is padded to a multiple of 4 floats."""
    return _inner_major_aligned(t.t()).t()


def _inner_major_aligned(t: torch.Tensor) -> torch.Tensor:
    """t [R, C] as a row-major view whose row stride is padded to a multiple of 4 floats (16 bytes)."""
    R, C = t.shape
    buf = torch.zeros(R, -(-C // 4) * 4, dtype=torch.float32, device=t.device)
    buf[:, :C] = t
    return buf[:, :C]


# Candidate scale layouts for torch's blockwise _scaled_mm (its contract moves between releases); each is
# (name, scale_a(a), scale_b(b)) for a [M, K] with 1x128 scales [M, K/128] and b = W [N, K] with 128x128
# [N/128, K/128] or 1x128 [N, K/128] scales. The first is torch 2.11's stated SM90 contract: scale_a (M, K/128)
# outer-dim-major; scale_b (K/128, N/128) near-inner-dim-major with 16-byte aligned strides (128x128) or
# (K/128, N) (1x128). The probe keeps the first that runs AND matches the emulation on operands whose block
# scales all differ, so a transposed interpretation cannot pass.
_LAYOUTS = [
    ("a (M,K/128) col-major; b (K/128,N/128) K-major 16B-aligned | (K/128,N) row-major",
     lambda a: _col_major(a.scale),
     lambda b: _col_major_aligned(b.scale.t()) if b.block == (128, 128) else b.scale.t().contiguous()),
    ("torch 2.11: a (M,K/128) col-major; b (K/128,N/128) row-major 16B-aligned | (K/128,N) row-major",
     lambda a: _col_major(a.scale),
     lambda b: _inner_major_aligned(b.scale.t()) if b.block == (128, 128) else b.scale.t().contiguous()),
    ("a col-major; b^T contiguous", lambda a: _col_major(a.scale), lambda b: b.scale.t().contiguous()),
    ("a col-major; b^T view", lambda a: _col_major(a.scale), lambda b: b.scale.t()),
    ("a col-major; b as stored", lambda a: _col_major(a.scale), lambda b: b.scale.contiguous()),
    ("a row-major; b^T contiguous", lambda a: a.scale.contiguous(), lambda b: b.scale.t().contiguous()),
]
BLOCKWISE_LAYOUT: dict[str, dict] = {}     # device -> {"128x128": name|None, "1x128": name|None, "errors": [...]}


def _scaled_mm_block(a: QTensor, b: QTensor, out_dtype, layout) -> torch.Tensor:
    """a [M, K] with 1x128 scales [M, K/128]; b [N, K] with 128x128 [N/128, K/128] or 1x128 [N, K/128] scales."""
    _, fa, fb = layout
    return torch._scaled_mm(a.fp8().contiguous(), b.fp8().contiguous().t(), scale_a=fa(a).float(),
                            scale_b=fb(b).float(), out_dtype=out_dtype)


def _probe_blockwise(device: torch.device) -> dict:
    """Which _LAYOUTS entry (if any) runs blockwise _scaled_mm on `device` and matches the emulation (max error
    <= 1e-2 of max |ref| on a 256x512 @ 512x1024 product whose blocks have distinct power-of-two scales),
    separately for 128x128 and 1x128 second operands."""
    key = str(device)
    if key not in BLOCKWISE_LAYOUT:
        res = {"128x128": None, "1x128": None, "errors": []}
        if device.type == "cuda" and hasattr(torch, "_scaled_mm"):
            g = torch.Generator(device="cpu").manual_seed(0)
            M, K, N = 256, 512, 1024          # non-square block grids: a transposed scale grid has the wrong shape
            x = torch.randn(M, K, generator=g) * torch.exp2(torch.randint(-8, 8, (M, K // 128), generator=g)
                                                            .float()).repeat_interleave(128, 1)
            ws = torch.exp2(torch.randint(-8, 8, (N // 128, K // 128), generator=g).float())
            w = torch.randn(N, K, generator=g) * ws.repeat_interleave(128, 0).repeat_interleave(128, 1)
            w = w * torch.exp2(torch.randint(-3, 3, (N, 1), generator=g).float())   # distinct 1x128 scales too
            x, w = x.to(device), w.to(device)
            cfg = FP8Config()
            a = _q_act(x, "e4m3", cfg)
            for kind, b in (("128x128", _q_weight(w, cfg)), ("1x128", _q_act(w, "e4m3", cfg))):
                ref = emulated_gemm(a, b)
                for lay in _LAYOUTS:
                    try:
                        got = _scaled_mm_block(a, b, torch.bfloat16, lay).float()
                        err = float((got - ref).abs().max() / ref.abs().max())
                        if err <= 1e-2:
                            res[kind] = lay[0]
                            break
                        res["errors"].append(f"{kind} {lay[0]}: rel err {err:.3g}")
                    except Exception as e:  # noqa: BLE001 - unsupported layout / build / arch
                        res["errors"].append(f"{kind} {lay[0]}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
        BLOCKWISE_LAYOUT[key] = res
    return BLOCKWISE_LAYOUT[key]


def blockwise_scaled_mm_ok(device: torch.device, kind: str = "128x128") -> bool:
    return _probe_blockwise(device)[kind] is not None


def _layout(device, kind):
    name = _probe_blockwise(device)[kind]
    return next(l for l in _LAYOUTS if l[0] == name)


def fp8_gemm(a: QTensor, b: QTensor, out_dtype: torch.dtype, cfg: FP8Config, tag: str = "gemm") -> torch.Tensor:
    """a [M, K] (1x128 or per-tensor), b [N, K] (128x128, 1x128 or per-tensor) quantised -> a b^T [M, N]."""
    M, K = a.values.shape
    N = b.values.shape[0]
    dev = a.values.device
    if dev.type == "cuda" and cfg.backend == "auto" and hasattr(torch, "_scaled_mm") and _aligned(M, N, K):
        if cfg.scaling == "tensor":
            LAST_PATH[tag] = "scaled_mm"
            return _scaled_mm_tensor(a, b, out_dtype)
        kind = "128x128" if b.block == (TILE, TILE) else "1x128"
        if K % TILE == 0 and N % TILE == 0 and blockwise_scaled_mm_ok(dev, kind):
            try:
                y = _scaled_mm_block(a, b, torch.bfloat16, _layout(dev, kind)).to(out_dtype)
                LAST_PATH[tag] = "scaled_mm"
                return y
            except RuntimeError as e:       # a shape the probe did not cover: record it, use the fallback
                SCALED_MM_FAILURES.append(f"{tag} {kind} M{M} K{K} N{N}: {str(e).splitlines()[0][:200]}")
    if dev.type == "cuda" and cfg.backend == "auto":
        LAST_PATH[tag] = "bf16-dequant"
        return (a.dequantize(torch.bfloat16) @ b.dequantize(torch.bfloat16).t()).to(out_dtype)
    LAST_PATH[tag] = "emulate"
    return (a.dequantize() @ b.dequantize().t()).to(out_dtype)


def emulated_gemm(a: QTensor, b: QTensor) -> torch.Tensor:
    """The reference: fp32 matmul of the dequantised operands."""
    return a.dequantize() @ b.dequantize().t()


class _FP8LinearFn(torch.autograd.Function):
    """Each operand is quantised once, with the transposed copy its backward GEMM reads written by the same pass:
    forward W (128x128) -> W and W^T (dgrad), x (1x128) -> x and x^T in 1x128 tiles along M (wgrad);
    backward dy -> dy (1x128 along N, dgrad) and dy^T (1x128 along M, wgrad). The saved tensors are the FP8
    W^T and x^T (and their scales), not x and W."""

    @staticmethod
    def forward(ctx, x2, weight, cfg: FP8Config, backend: str):
        out_dtype = cfg.out_dtype or x2.dtype
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        qw = _quant(weight, cfg.fwd_fmt, _w_block(cfg), cfg, backend, transpose=need_dx)
        qx = _quant(x2, cfg.fwd_fmt, _act_block(cfg), cfg, backend, transpose=need_dw)
        qw, qw_t = qw if need_dx else (qw, None)
        qx, qx_t = qx if need_dw else (qx, None)
        y = fp8_gemm(qx, qw, out_dtype, cfg, "fprop")
        w_t = (qw_t.values, qw_t.scale) if need_dx else (None, None)
        x_t = (qx_t.values, qx_t.scale) if need_dw else (None, None)
        ctx.save_for_backward(*w_t, *x_t)
        ctx.cfg, ctx.backend, ctx.dtypes = cfg, backend, (x2.dtype, weight.dtype)
        return y

    @staticmethod
    def backward(ctx, gy):
        w_t, w_ts, x_t, x_ts = ctx.saved_tensors
        cfg, backend = ctx.cfg, ctx.backend
        x_dtype, w_dtype = ctx.dtypes
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dx = dw = None
        acc = torch.promote_types(x_dtype, torch.float32)
        if not (need_dx or need_dw):
            return None, None, None, None
        qg = _quant(gy, cfg.bwd_fmt, _act_block(cfg), cfg, backend, transpose=need_dw)
        qg, qg_t = qg if need_dw else (qg, None)
        if need_dx:                                                      # dy [M, N] . (W^T [K, N])^T
            dx = fp8_gemm(qg, QTensor(w_t, w_ts, cfg.fwd_fmt, _w_block(cfg)), acc, cfg, "dgrad").to(x_dtype)
        if need_dw:                                                      # dy^T [N, M] . (x^T [K, M])^T
            dw = fp8_gemm(qg_t, QTensor(x_t, x_ts, cfg.fwd_fmt, _act_block(cfg)), acc, cfg, "wgrad").to(w_dtype)
        return dx, dw, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, cfg: FP8Config = FP8Config(),
               backend: str = "naive") -> torch.Tensor:
    """x [..., K], weight [N, K] -> [..., N] through FP8 GEMMs (forward and backward); `backend` is the kernel
    backend of the quantiser (kernels/quant: "naive" exact, "triton" fused; the same bits), `cfg.backend` the
    GEMM's. Under autocast x is cast to the autocast dtype (model.precision.autocast_operands), so y and dx
    come out in it, as from the nn.Linear it replaces -- else an FP8 projection would hand fp32 queries to
    kernels whose other operands are bf16. The master weight is quantised as it is."""
    x, = autocast_operands(x)
    lead = x.shape[:-1]
    y = _FP8LinearFn.apply(x.reshape(-1, x.shape[-1]), weight, cfg, backend)
    return y.reshape(*lead, weight.shape[0])


class FP8Linear(nn.Linear):
    """nn.Linear whose GEMMs run in FP8; the weight Parameter (the master) is the one of the replaced layer."""

    def __init__(self, in_features: int, out_features: int, cfg: FP8Config = FP8Config(), device=None,
                 dtype=None, backend: str = "naive"):
        super().__init__(in_features, out_features, bias=False, device=device, dtype=dtype)
        self.fp8 = cfg
        self.backend = backend                    # the quantiser's kernel backend (model.set_kernel_backend)

    @classmethod
    def from_linear(cls, lin: nn.Linear, cfg: FP8Config, backend: str = "naive") -> "FP8Linear":
        if lin.bias is not None:
            raise ValueError("FP8Linear: layers with a bias are not supported (DSv4 has none)")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = lin.in_features, lin.out_features
        new.weight = lin.weight                                              # the same Parameter object
        new.register_parameter("bias", None)
        new.fp8 = cfg
        new.backend = backend
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.fp8, self.backend)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", fp8={self.fp8.scaling}/{self.fp8.fwd_fmt}/{self.fp8.scale_format}, quantiser={self.backend}"
