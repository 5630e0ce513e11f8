"""DeepSeek's official (hub) naming.

  * ours      = DeepSeek's official names, except that routed experts are stacked:
                `layers.{i}.ffn.experts.w13` [E, 2f, d] (cat(w1, w3) rows per expert), `...experts.w2` [E, d, f];
  * official  = the hub checkpoint names (`layers.{i}.ffn.experts.{e}.w1.weight`, ..., `mtp.0.*`,
                `ffn.gate.tid2eid` int32).

DeepSeek's code does not clamp the shared expert: `load_official` is unclamped unless "dsv4_config" says so.
"""
from __future__ import annotations

import re

import torch

from dsv4.model.interop.common import CheckpointError, _build, _read_dir, _write_dir, load_checked
from dsv4.model.interop.hf_config import config_from_hf, config_to_hf

_EXPERT = re.compile(r"^(.*ffn\.experts)\.(\d+)\.(w[123])\.weight$")
_MTP_SHARED = re.compile(r"^mtp\.\d+\.(emb(\..*)?|head\.weight)$")


def ours_to_official(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Split stacked experts into `ffn.experts.{e}.w1|w2|w3.weight`; `tid2eid` as int32."""
    out = {}
    for k, v in sd.items():
        if k.endswith("ffn.experts.w13"):
            pre, f = k[: -len(".w13")], v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{pre}.{e}.w1.weight"] = v[e, :f].contiguous()
                out[f"{pre}.{e}.w3.weight"] = v[e, f:].contiguous()
        elif k.endswith("ffn.experts.w2"):
            pre = k[: -len(".w2")]
            for e in range(v.shape[0]):
                out[f"{pre}.{e}.w2.weight"] = v[e].contiguous()
        elif k.endswith("tid2eid"):
            out[k] = v.to(torch.int32)
        else:
            out[k] = v
    return out


def official_to_ours(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Stack `ffn.experts.{e}.w*` into w13 / w2 (experts must be 0..E-1, all three present)."""
    out, experts = {}, {}
    for k, v in sd.items():
        if _MTP_SHARED.match(k):            # hub duplicates of the shared embedding / head under mtp.*: skipped
            continue
        if k.endswith(".scale") and not re.search(r"hc_(attn|ffn|head)_scale$", k):
            raise CheckpointError(f"quantised tensor {k}: dequantise the checkpoint to bf16/fp32 first")
        m = _EXPERT.match(k)
        if m:
            experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = v
        else:
            out[k] = v
    for pre, per in experts.items():
        E = len(per)
        for e in range(E):
            for w in ("w1", "w2", "w3"):
                if w not in per.get(e, {}):
                    raise CheckpointError(f"missing tensor {pre}.{e}.{w}.weight (experts 0..{E - 1} expected)")
        out[f"{pre}.w13"] = torch.stack([torch.cat([per[e]["w1"], per[e]["w3"]], 0) for e in range(E)])
        out[f"{pre}.w2"] = torch.stack([per[e]["w2"] for e in range(E)])
    return out

def load_official(directory: str, **overrides):
    """An official-naming checkpoint directory (config.json + safetensors) -> DSv4Model (unclamped shared expert)."""
    d, off, where = _read_dir(directory)
    cfg = config_from_hf(d, **overrides)
    model = _build(cfg)
    load_checked(model, official_to_ours(off), where)
    return model


def save_official(model, directory: str) -> None:
    _write_dir(directory, config_to_hf(model.cfg), ours_to_official(model.state_dict()))
