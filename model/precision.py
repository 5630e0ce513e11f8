"""Selective FP32 (slice P1; Megatron #5929 `mark_keep_in_fp32` / Float16Module).

Under a cast to bf16/fp16 the tensors DSv4 keeps in FP32 stay FP32: mHC `hc_*_fn|base|scale` (incl.
`hc_head_*`), attention sinks `attn_sink`, compressor `ape`, the router `bias` (a buffer), and every RMSNorm
weight. A tensor can also opt in by carrying `keep_in_fp32 = True` (Megatron's marker). Integer buffers
(`tid2eid`, counters) are never cast. AdamW creates its state `zeros_like(param)`, so the FP32-kept
parameters get FP32 moments and the optimizer holds mixed-dtype parameter groups; `save_optimizer` /
`load_optimizer` store such a state exactly in safetensors (tensors) + JSON metadata (the rest).
"""
from __future__ import annotations

import json
import re

import torch
from torch import nn

from dsv4.model.norm import RMSNorm

FP32_NAME = re.compile(r"(^|\.)(hc_(attn|ffn|head)_(fn|base|scale)|attn_sink|ape|gate\.bias)$")


def autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast computes a GEMM of x in (None: autocast is off for x's device, or x is not a floating
    type autocast casts: fp64 stays fp64)."""
    dev = x.device.type
    if not torch.is_autocast_enabled(dev) or not x.is_floating_point() or x.dtype == torch.float64:
        return None
    return torch.get_autocast_dtype(dev)


def autocast_operands(*ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The operands of a custom autograd Function cast to the autocast dtype when autocast is on for their
    device -- what the nn.Linear / matmul it stands for computes in there (`dsv4 train --dtype bf16`: FP32
    masters under autocast). A Function is not autocast-aware, and its backward runs outside autocast, where
    a bf16 activation would meet an FP32 master."""
    dev = ts[0].device.type
    if not torch.is_autocast_enabled(dev):
        return ts
    dt = torch.get_autocast_dtype(dev)
    return tuple(t.to(dt) for t in ts)


def keeps_fp32(name: str, t: torch.Tensor, owner: nn.Module) -> bool:
    """Whether the parameter/buffer `name` (full dotted name) of `owner` stays FP32 (see the module doc)."""
    return bool(getattr(t, "keep_in_fp32", False)) or bool(FP32_NAME.search(name)) or isinstance(owner, RMSNorm)


def fp32_kept_names(model: nn.Module) -> list[str]:
    out = []
    for mname, mod in model.named_modules():
        for tname, t in list(mod.named_parameters(recurse=False)) + list(mod.named_buffers(recurse=False)):
            full = f"{mname}.{tname}" if mname else tname
            if t is not None and t.is_floating_point() and keeps_fp32(full, t, mod):
                out.append(full)
    return out


@torch.no_grad()
def cast_model(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast floating parameters/buffers to `dtype` in place, except the FP32-kept ones, which become at least fp32
    (fp32 under a bf16/fp16 cast, fp64 under an fp64 cast: "kept in FP32" never lowers a precision)."""
    keep = torch.promote_types(dtype, torch.float32)
    for mname, mod in model.named_modules():
        for tname, p in list(mod.named_parameters(recurse=False)):
            full = f"{mname}.{tname}" if mname else tname
            want = keep if keeps_fp32(full, p, mod) else dtype
            if p.is_floating_point() and p.dtype != want:
                marker = getattr(p, "keep_in_fp32", None)
                p.data = p.data.to(want)
                if p.grad is not None:
                    p.grad = p.grad.to(want)
                if marker is not None:
                    p.keep_in_fp32 = marker
        for tname, b in list(mod.named_buffers(recurse=False)):
            full = f"{mname}.{tname}" if mname else tname
            if b is not None and b.is_floating_point():
                want = keep if keeps_fp32(full, b, mod) else dtype
                if b.dtype != want:
                    mod._buffers[tname] = b.to(want)
    return model


# ------------------------------------------------------------------ optimizer checkpoints (mixed dtypes)

def optimizer_to_tensors(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], str]:
    """Flatten `opt.state_dict()` into {"state.<pid>.<key>": tensor} + a JSON string of the rest (exact)."""
    sd = opt.state_dict()
    tensors, meta_state = {}, {}
    for pid, st in sd["state"].items():
        meta_state[str(pid)] = {}
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                tensors[f"state.{pid}.{k}"] = v.detach().contiguous().clone()
                meta_state[str(pid)][k] = {"tensor": True}
            else:
                meta_state[str(pid)][k] = {"value": _encode(v)}
    return tensors, json.dumps({"state": meta_state, "param_groups": _encode(sd["param_groups"])})


def _encode(v):
    """JSON with tuples kept (AdamW's `betas` is a tuple; an exact round trip must give it back as one)."""
    if isinstance(v, tuple):
        return {"__tuple__": [_encode(x) for x in v]}
    if isinstance(v, list):
        return [_encode(x) for x in v]
    if isinstance(v, dict):
        return {k: _encode(x) for k, x in v.items()}
    return v


def _decode(v):
    if isinstance(v, dict):
        return tuple(_decode(x) for x in v["__tuple__"]) if set(v) == {"__tuple__"} else \
            {k: _decode(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_decode(x) for x in v]
    return v


def optimizer_from_tensors(opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: str) -> None:
    m = json.loads(meta)
    state = {}
    for pid, st in m["state"].items():
        state[int(pid)] = {k: (tensors[f"state.{pid}.{k}"] if v.get("tensor") else _decode(v["value"]))
                           for k, v in st.items()}
    opt.load_state_dict({"state": state, "param_groups": _decode(m["param_groups"])})


def save_optimizer(opt: torch.optim.Optimizer, path: str) -> None:
    """Optimizer state -> one safetensors file (dtype of every moment preserved; metadata holds the rest)."""
    from safetensors.torch import save_file
    tensors, meta = optimizer_to_tensors(opt)
    save_file(tensors, path, metadata={"optimizer": meta})


def load_optimizer(opt: torch.optim.Optimizer, path: str) -> None:
    from safetensors import safe_open
    with safe_open(path, framework="pt") as f:
        meta = f.metadata()["optimizer"]
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    optimizer_from_tensors(opt, tensors, meta)
