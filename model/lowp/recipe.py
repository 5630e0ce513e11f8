"""Precision recipe (slice X1): which modules run in FP8 / FP4, applied from outside by module path.

`apply_precision_recipe(model, recipe)` walks `model.named_modules()` and
  * replaces each allowed `nn.Linear` by an `FP8Linear` sharing the same weight Parameter (names, optimizer
    state and the P1 selective-FP32 casting are unchanged);
  * with `experts="mxfp4"` / `"mxfp4_fp8"`, registers on every routed `Experts` module a parametrization
    (torch.nn.utils.parametrize) of `w13` and `w2`: the stored tensor is the FP32 master (marked
    `keep_in_fp32`), the value the forward reads is its MXFP4 fake quantisation (e2m1, 1x32 blocks, e8m0
    scales) with a straight-through backward; "mxfp4_fp8" then re-quantises that value to e4m3 in 128x128
    ue8m0 blocks (seed 004's FP32 master -> FP4 -> lossless FP8 path; `fp4_to_fp8` counts any loss);
    with `expert_act_fp8`, a forward pre-hook fake-quantises the experts' input x to e4m3 1x128 tiles (STE),
    so the w13 GEMM sees FP8 x FP8 operands. The w2 GEMM's input (the SwiGLU output) is internal to
    `Experts.forward` and is not quantised.
Nothing replaces a `forward`. Parametrized experts change their state-dict keys to
`...experts.parametrizations.w13.original` (torch's parametrize convention): convert before saving in the
official naming (`remove_expert_qat` restores plain parameters holding the masters).

Kept in high precision (`HIGH_PRECISION`, a reason per pattern on the module path; Megatron #5308 and
DeepSeek's released checkpoint): compressors and the indexer (their projections; the indexer's QK scoring
has its own setting, `indexer_qk_precision`, see kernels/indexer/fp4.py), the router `gate`, mHC, norms, the embedding
and the output `head`, `wo_a` (its weight is read directly by the grouped output projection, never called; DeepSeek's
convert.py dequantises it to BF16 too), and any layer owning a tensor of P1's FP32 set
(model/precision.py `keeps_fp32`).
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.utils import parametrize

from dsv4.kernels.indexer.fp4 import QK_PRECISIONS
from dsv4.model.lowp.fp8_linear import FP8Config, FP8Linear
from dsv4.kernels.quant.naive import QTensor, quantize, ste_fake_quantize
from dsv4.model.precision import keeps_fp32

HIGH_PRECISION: dict[str, str] = {
    r"(^|\.)compressor(\.|$)": "compressor (Megatron #5308)",
    r"(^|\.)indexer(\.|$)": "indexer (Megatron #5308)",
    r"(^|\.)gate$": "router",
    r"(^|\.)hc_": "mHC",
    r"norm$": "norm",
    r"(^|\.)embed$": "embedding",
    r"(^|\.)head$": "output head",
    r"(^|\.)wo_a$": "wo_a: weight read by the grouped output projection (not called); BF16 in DeepSeek's checkpoint",
}


@dataclass
class PrecisionRecipe:
    name: str = "bf16"
    linear: str | None = None                    # None | "fp8"
    fp8: FP8Config = field(default_factory=FP8Config)
    experts: str | None = None                   # None | "mxfp4" | "mxfp4_fp8"
    expert_rule: str = "ocp"                     # MX scale rule: "ocp" (MX v1.0) | "ue8m0" (ceil, no clipping)
    expert_compute_dtype: torch.dtype | None = None   # dtype the experts read (None: the master's); bf16 on GPU
    expert_act_fp8: bool = False                 # fake-quantise the experts' input to e4m3 1x128 (STE)
    indexer_qk_precision: str = "bf16"           # "bf16" | "fp8" | "fp4": the indexer's QK scoring (Indexer.qk_precision,
                                                 # kernels/indexer/fp4.py); its weights stay high precision
    indexer_qk_rerank: float = 0.0               # > 0 at fp8 / fp4: the low-precision top ceil(k (1 + it)) re-ranked
                                                 # in high precision (Indexer.qk_rerank, fp4.py rerank_topk)
    high_precision: dict[str, str] = field(default_factory=lambda: dict(HIGH_PRECISION))

    def __post_init__(self):
        if self.linear not in (None, "fp8"):
            raise ValueError(f"PrecisionRecipe.linear: None|fp8, got {self.linear!r}")
        if self.experts not in (None, "mxfp4", "mxfp4_fp8"):
            raise ValueError(f"PrecisionRecipe.experts: None|mxfp4|mxfp4_fp8, got {self.experts!r}")
        if self.indexer_qk_precision not in QK_PRECISIONS:
            raise ValueError(f"PrecisionRecipe.indexer_qk_precision: {'|'.join(QK_PRECISIONS)}, "
                             f"got {self.indexer_qk_precision!r}")
        if not (isinstance(self.indexer_qk_rerank, (int, float)) and self.indexer_qk_rerank >= 0):
            raise ValueError(f"PrecisionRecipe.indexer_qk_rerank: a margin >= 0, got {self.indexer_qk_rerank!r}")

    def high_precision_reason(self, path: str) -> str | None:
        for pat, why in self.high_precision.items():
            if re.search(pat, path):
                return why
        return None


RECIPES = {
    "bf16": lambda: PrecisionRecipe("bf16"),
    "fp8_tensor": lambda: PrecisionRecipe("fp8_tensor", linear="fp8", fp8=FP8Config(scaling="tensor",
                                                                                      scale_format="fp32")),
    "fp8_block": lambda: PrecisionRecipe("fp8_block", linear="fp8"),            # DeepSeek-V3/V4 FP8
    "fp4_qat": lambda: PrecisionRecipe("fp4_qat", linear="fp8", experts="mxfp4_fp8", expert_act_fp8=True,
                                       indexer_qk_precision="fp4"),             # seed 004
}


def get_recipe(name: str, **overrides) -> PrecisionRecipe:
    if name not in RECIPES:
        raise ValueError(f"precision recipe: unknown {name!r}; known: {', '.join(RECIPES)}")
    r = RECIPES[name]()
    return dataclasses.replace(r, **overrides) if overrides else r


@dataclass
class PrecisionReport:
    fp8: list[str] = field(default_factory=list)          # Linear paths now FP8Linear
    kept: dict[str, str] = field(default_factory=dict)    # Linear path -> why it stays high precision
    experts: list[str] = field(default_factory=list)      # Experts paths with MXFP4 QAT
    indexers: list[str] = field(default_factory=list)     # Indexer paths given the recipe's QK precision
    notes: list[str] = field(default_factory=list)        # what the recipe asked for but this hook does not do


# ------------------------------------------------------------------ MXFP4 QAT of the routed experts

def _fp4_then_fp8(w: torch.Tensor, rule: str) -> tuple[torch.Tensor, QTensor]:
    """FP32 master -> MXFP4 (e2m1, 1x32, e8m0) value -> e4m3 QTensor in 128x128 ue8m0 blocks (last two dims)."""
    fp4 = quantize(w, "e2m1", (1, 32), rule).dequantize()
    return fp4, quantize(fp4, "e4m3", (128, 128), "ue8m0")


def fp4_to_fp8(w: torch.Tensor, rule: str = "ocp") -> tuple[torch.Tensor, QTensor, int]:
    """`_fp4_then_fp8` and the number of elements the FP8 step changed (0 = lossless): a host read, so the
    training forward (`_MXFP4STE`) does not count."""
    fp4, fp8 = _fp4_then_fp8(w, rule)
    return fp4, fp8, int((fp8.dequantize() != fp4).sum())


class MXFP4Weight(nn.Module):
    """Parametrization: FP32 master -> MXFP4 fake-quantised weight (STE), optionally through FP8."""

    def __init__(self, rule: str = "ocp", via_fp8: bool = False, out_dtype: torch.dtype | None = None):
        super().__init__()
        self.rule, self.via_fp8, self.out_dtype = rule, via_fp8, out_dtype

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return _MXFP4STE.apply(w, self.rule, self.via_fp8, self.out_dtype or w.dtype)


class _MXFP4STE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, rule, via_fp8, out_dtype):
        if via_fp8:
            _, q8 = _fp4_then_fp8(w, rule)                 # no lossless count here: one host sync per weight
            return q8.dequantize(out_dtype)
        return quantize(w, "e2m1", (1, 32), rule).dequantize(out_dtype)

    @staticmethod
    def backward(ctx, g):
        return g, None, None, None          # straight-through (the master's dtype is restored by autograd)


def _act_fp8_hook(cfg: FP8Config):
    def hook(module, args):
        x = args[0]
        xq = ste_fake_quantize(x, cfg.fwd_fmt, (1, 128) if cfg.scaling == "blockwise" else None, cfg.scale_format)
        return (xq,) + tuple(args[1:])
    return hook


def enable_expert_qat(experts: nn.Module, recipe: PrecisionRecipe) -> None:
    for name in ("w13", "w2"):
        if parametrize.is_parametrized(experts, name):
            continue
        parametrize.register_parametrization(
            experts, name, MXFP4Weight(recipe.expert_rule, recipe.experts == "mxfp4_fp8",
                                       recipe.expert_compute_dtype))
        getattr(experts.parametrizations, name).original.keep_in_fp32 = True     # FP32 master under casts
    if recipe.expert_act_fp8 and not hasattr(experts, "_x1_act_hook"):
        experts._x1_act_hook = experts.register_forward_pre_hook(_act_fp8_hook(recipe.fp8))


def remove_expert_qat(model: nn.Module) -> None:
    """Undo enable_expert_qat: plain `w13` / `w2` Parameters holding the FP32 masters (official names)."""
    for m in model.modules():
        for name in ("w13", "w2"):
            if parametrize.is_parametrized(m, name):
                parametrize.remove_parametrizations(m, name, leave_parametrized=False)
        h = getattr(m, "_x1_act_hook", None)
        if h is not None:
            h.remove()
            del m._x1_act_hook


# ------------------------------------------------------------------ the hook

def _owns_fp32(path: str, mod: nn.Module) -> bool:
    for tname, t in list(mod.named_parameters(recurse=False)) + list(mod.named_buffers(recurse=False)):
        full = f"{path}.{tname}" if path else tname
        if t is not None and keeps_fp32(full, t, mod):
            return True
    return False


def apply_precision_recipe(model: nn.Module, recipe: PrecisionRecipe | str,
                           backend: str = "naive") -> PrecisionReport:
    """Swap the allowed nn.Linear layers to FP8Linear (their quantiser on kernel backend `backend`; a later
    `model.set_kernel_backend` switches it too), enable expert QAT and set every indexer's QK precision, in place;
    returns what was done."""
    from dsv4.model.indexer import Indexer
    from dsv4.model.moe import Experts
    if isinstance(recipe, str):
        recipe = get_recipe(recipe)
    rep = PrecisionReport()
    for path, mod in list(model.named_modules()):
        if isinstance(mod, Indexer):
            mod.qk_precision = recipe.indexer_qk_precision
            mod.qk_rerank = float(recipe.indexer_qk_rerank)
            rep.indexers.append(path)
        if recipe.experts and isinstance(mod, Experts):
            enable_expert_qat(mod, recipe)
            rep.experts.append(path)
        if type(mod) is not nn.Linear:
            continue
        why = recipe.high_precision_reason(path) or ("P1 FP32 set" if _owns_fp32(path, mod) else None)
        if why is None and mod.bias is not None:
            why = "has a bias"
        if why is not None or recipe.linear is None:
            rep.kept[path] = why or f"recipe {recipe.name}: no FP8 linears"
            continue
        parent_path, _, child = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        setattr(parent, child, FP8Linear.from_linear(mod, recipe.fp8, backend))
        rep.fp8.append(path)
    return rep
