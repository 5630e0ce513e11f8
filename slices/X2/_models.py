"""Random O(1)-scale DSv4 test models for the generation tests (HF-style init gives logits ~1e-2, which would
make a 1e-5 logits check say little): linear weights ~ N(0, 1/fan_in), sinks / ape / mHC base random."""
import torch

from dsv4.model.config import get_config
from dsv4.model.model import DSv4Model


def randomize(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() >= 2 and "hc_" not in n and "embed" not in n:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
            elif any(s in n for s in ("attn_sink", "ape", "_base")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif n.endswith("_scale"):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            elif n.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
        for n, b in model.named_buffers():
            if n.endswith(".bias") and b.is_floating_point():
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    return model


def debug_model(seed=0, **over):
    torch.manual_seed(seed)
    return randomize(DSv4Model(get_config("debug", **over)), seed).eval()
