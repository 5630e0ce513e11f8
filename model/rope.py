"""Interleaved partial RoPE on the LAST r dims of a head, with the two DSv4 tables (spec §5.1, §5.4, §5.6).

* Layout of a head: `[nope (c - r) | rope (r)]`; the rope slice is rotated as r/2 complex numbers formed by the
  pairs (2i, 2i+1) ("interleaved", DeepSeek's `view_as_complex`; HF's `repeat_interleave` + `rotate_half`):
      (x_{2i}, x_{2i+1}) -> (x_{2i} cos(p θ_i) - x_{2i+1} sin(p θ_i),  x_{2i} sin(p θ_i) + x_{2i+1} cos(p θ_i))
  The rotation runs in fp32 (fp64 for fp64 inputs; cos/sin are never rounded to bf16) and the result is cast back to x's dtype once.
* Inverse rotation (spec §5.4, the attention output rotated back by the QUERY position) = rotation by -p.
* Tables (`inv_freq`, r/2 entries):
    "main"     θ_i = rope_theta^{-2i/r}, no scaling: window-only layers and the MTP layer;
    "compress" θ_i = compress_rope_theta^{-2i/r} with YaRN (spec §5.6): CSA / HCA layers, their compressors and
               the indexer. YaRN blends θ_i/factor and θ_i with a linear ramp over i in [low, high] (Flash: 15, 25);
               No magnitude (mscale) scaling of cos/sin by default (DeepSeek's code) and no change of the softmax
               scale. `rope_scaling["attention_factor"]` (default 1.0; HF's YaRN key) multiplies cos and sin of the
               "compress" table, as HF does, so a converted HF config with attention_factor != 1 keeps its function.
* The width of the cos/sin table must equal the rotated width r: a mismatch is refused with one line (the silent
  "8 of 64 dims rotated" bug of Megatron-Bridge #4271 came from a table built for r * partial_rotary_factor dims).
* Positions are any integer tensor (packed sequences restart them per document).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from dsv4.kernels.norm_rope import norm_rope_rows
from dsv4.kernels.rope import rope_rows
from dsv4.kernels.rope.naive import rotate_pairs

from .config import ConfigError, DSv4Config, yarn_correction_range


class RopeError(ValueError):
    """A RoPE shape / table mismatch (one line)."""


# --------------------------------------------------------------------------------------------- tables (§5.6)

def rope_inv_freq(rope_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """Inverse frequencies [r/2] fp32: θ_i = theta^{-2i/r}, optionally YaRN-blended (spec §5.6)."""
    if rope_dim <= 0 or rope_dim % 2:
        raise RopeError(f"rope: rope_dim must be a positive even number, got {rope_dim}")
    pos_freqs = theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim)   # theta^{2i/r}
    if not scaling:
        return 1.0 / pos_freqs
    kind = scaling.get("type", scaling.get("rope_type"))
    if kind != "yarn":
        raise RopeError(f"rope: rope_scaling type must be 'yarn' (or rope_scaling None), got {kind!r}")
    factor = float(scaling["factor"])
    low, high = yarn_correction_range(rope_dim, theta, scaling["original_max_position_embeddings"],
                                      scaling.get("beta_fast", 32.0), scaling.get("beta_slow", 1.0))
    if low == high:
        high += 0.001                                                       # avoid a zero-width ramp
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp                                                         # weight of the unscaled θ_i
    # same operation order as HF's `_compute_yarn_parameters`, so the table is bit-identical to it
    return (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def rope_attention_factor(cfg: DSv4Config, table: str) -> float:
    """The factor on cos/sin of a table: rope_scaling["attention_factor"] for 'compress' (default 1), else 1."""
    return float((cfg.rope_scaling or {}).get("attention_factor", 1.0)) if table == "compress" else 1.0


def rope_table_name(cfg: DSv4Config, layer_idx: int) -> str:
    """'main' for window-only layers (and a window-only MTP layer), 'compress' for CSA / HCA layers."""
    return "main" if cfg.layer_kind(layer_idx) == "window" else "compress"


def inv_freq_for(cfg: DSv4Config, table: str) -> torch.Tensor:
    """The [r/2] fp32 inverse frequencies of table 'main' or 'compress' for this config."""
    if table == "main":
        return rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, None)
    if table == "compress":
        return rope_inv_freq(cfg.qk_rope_head_dim, cfg.compress_rope_theta, cfg.rope_scaling)
    raise ConfigError(f"rope: table must be 'main' or 'compress', got {table!r}")


# --------------------------------------------------------------------------------------------- rotation

def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor,
                 dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [*positions.shape, r/2] of angles positions * θ, in fp32 (or `dtype`, fp64 for gradcheck)."""
    if positions.is_floating_point():
        raise RopeError(f"rope: positions must be an integer tensor, got {positions.dtype}")
    ang = positions.to(dtype)[..., None] * inv_freq.to(device=positions.device, dtype=dtype)
    return ang.cos(), ang.sin()


def apply_rope_cos_sin(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dim: int,
                       inverse: bool = False) -> torch.Tensor:
    """Rotate the last `rope_dim` dims of x (pairs (2i, 2i+1)); cos/sin [..., r/2] broadcast to x[..., :r/2]
    (the reference rotation, kernels/rope/naive.py)."""
    _check_widths(x, cos, sin, rope_dim)
    return rotate_pairs(x, cos, sin, inverse)


def _check_widths(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dim: int) -> None:
    if cos.shape[-1] * 2 != rope_dim or sin.shape[-1] != cos.shape[-1]:
        raise RopeError(f"rope: cos/sin table covers {2 * cos.shape[-1]} dims but the rotated width is "
                        f"{rope_dim} (partial-rotary misconfiguration, cf. Megatron-Bridge #4271)")
    if rope_dim % 2 or rope_dim > x.shape[-1]:
        raise RopeError(f"rope: rope_dim {rope_dim} must be even and <= head dim {x.shape[-1]}")


def _tables(positions: torch.Tensor, inv_freq: torch.Tensor, scale: float, x_dtype: torch.dtype):
    """cos, sin [*positions.shape, r/2] of a table at `positions`, times `scale`, in fp32 (fp64 for fp64 x)."""
    dt = torch.promote_types(x_dtype, torch.float32)                        # fp32 (fp64 for fp64 x)
    cos, sin = rope_cos_sin(inv_freq, positions, dt)
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale                                 # HF: freqs.cos() * attention_scaling
    return cos, sin


def _rows(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, rope_dim: int, scale: float):
    """(x as [P, G, c], cos [P, r/2], sin [P, r/2]): the kernels' row layout of x at `positions` (a prefix of x's
    shape; the remaining dims broadcast), the angles in fp32 (fp64 for fp64 x), times `scale`."""
    if tuple(positions.shape) != tuple(x.shape[: positions.dim()]) or positions.dim() >= x.dim():
        raise RopeError(f"rope: positions shape {tuple(positions.shape)} is not a prefix of x's leading dims "
                        f"{tuple(x.shape[:-1])}")
    cos, sin = _tables(positions, inv_freq, scale, x.dtype)                 # [*pos, r/2]
    _check_widths(x, cos, sin, rope_dim)
    P, G = positions.numel(), math.prod(x.shape[positions.dim():-1])
    return x.reshape(P, G, x.shape[-1]), cos.reshape(P, cos.shape[-1]), sin.reshape(P, sin.shape[-1])


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, rope_dim: int,
               inverse: bool = False, scale: float = 1.0, backend: str = "naive") -> torch.Tensor:
    """Rotate the last `rope_dim` dims of x by `positions` (inverse: by -positions).

    positions' shape is a prefix of x's shape (e.g. [S] for SBHD x [S,B,H,c] or compressed [T,B,c], or [S,B]);
    the remaining dims are broadcast. `scale` multiplies cos and sin (HF's YaRN attention_factor; 1 = none).
    The rotation is kernels/rope `rope_rows` on the view x [P, G, c] (P = positions, G = the broadcast rows).
    """
    x3, cos, sin = _rows(x, positions, inv_freq, rope_dim, scale)
    return rope_rows(x3, cos, sin, inverse, backend=backend).view(x.shape)


def apply_norm_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, rope_dim: int, eps: float,
                    scale: float = 1.0, backend: str = "naive") -> torch.Tensor:
    """`apply_rope(rms_norm(x, None, eps), ...)`: the unweighted RMSNorm of x's last dim, then the rotation, as one
    op (kernels/norm_rope `norm_rope_rows`: its naive backend is those two reference ops; its Triton kernel keeps
    the normed row in fp32 and, for the backward, the output instead of x)."""
    x3, cos, sin = _rows(x, positions, inv_freq, rope_dim, scale)
    return norm_rope_rows(x3, cos, sin, eps, backend=backend).view(x.shape)


class RotaryTable(nn.Module):
    """One table's inv_freq, kept as a plain fp32 attribute (not a buffer): `module.to(bf16)` must not round it,
    and it is not part of the state dict (as in HF). It moves with the module's device (`_apply`: `.to(device)`,
    `.cuda()`, `to_empty`), never its dtype, so a step copies nothing host->device (that copy synchronises: 29
    host syncs a proxy step on the H200 when it followed the positions' device at every call)."""

    def __init__(self, cfg: DSv4Config, table: str):
        super().__init__()
        self.cfg, self.table, self.rope_dim = cfg, table, cfg.qk_rope_head_dim
        self.inv_freq = inv_freq_for(cfg, table)
        self.scale = rope_attention_factor(cfg, table)
        self.backend = "naive"                                              # set by DSv4Model.set_kernel_backend

    def _apply(self, fn, recurse=True):
        dev = fn(torch.empty(0, device=self.inv_freq.device)).device         # where fn sends tensors (not dtype)
        if dev != self.inv_freq.device:
            src = self.inv_freq if self.inv_freq.device.type != "meta" else inv_freq_for(self.cfg, self.table)
            self.inv_freq = src.to(dev)
        return super()._apply(fn, recurse)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        return apply_rope(x, positions, self.inv_freq, self.rope_dim, inverse, self.scale, self.backend)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [P, r/2] at positions [P] for x of `dtype`: what `forward` rotates by (the sparse attention's
        fused output rotation takes them, kernels/sparse_attn `out_rope`)."""
        return _tables(positions, self.inv_freq, self.scale, dtype)

    def norm_rotate(self, x: torch.Tensor, positions: torch.Tensor, eps: float,
                    backend: str | None = None) -> torch.Tensor:
        """forward(rms_norm(x, None, eps), positions) as one op (`apply_norm_rope`): the queries' per-head norm."""
        return apply_norm_rope(x, positions, self.inv_freq, self.rope_dim, eps, self.scale, backend or self.backend)

    def extra_repr(self) -> str:
        return f"table={self.table}, rope_dim={self.rope_dim}" + (f", scale={self.scale}" if self.scale != 1 else "")
