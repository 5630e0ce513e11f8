"""P6 golden cases: RoPE tables (main / compress with YaRN) and rotations, forward and inverse."""
import torch

from dsv4.harness.cases import golden_case


@golden_case("rope_inv_freq_flash", tol={"main": (0.0, 1e-6), "compress": (0.0, 1e-6)})
def rope_inv_freq_flash():
    """Flash inverse frequencies [32] of both tables and the YaRN ramp bounds (15, 25)."""
    from dsv4.model.config import get_config, yarn_low_high
    from dsv4.model.rope import inv_freq_for
    cfg = get_config("flash")
    low, high = yarn_low_high(cfg)
    return {"main": inv_freq_for(cfg, "main"), "compress": inv_freq_for(cfg, "compress"),
            "yarn_low": int(low), "yarn_high": int(high)}


# Tolerances: the cross-host spread stored in goldens/cpu/_spread/P6.json (`dsv4 goldens spread --slice P6`,
# worst over harness/numerics.py's simulated hosts and the host that made the golden) x the margin named.
# inv_freq tables: identical on every host (tol = HF's fp32 table within 1e-6 rel). Rotations: worst abs 9.2e-7
# (ATEN default's scalar cos/sin) used 0.36 of the old (1e-6, 1e-5) -> atol 1e-5 (11x).
@golden_case("rope_rotate_debug", tol={k: (1e-5, 1e-5) for k in ("main", "compress", "compress_inv")})
def rope_rotate_debug():
    """Seeded x [5, 2, 32] (debug head, r = 8) rotated at positions (0, 3, 17, 100, 1023), both tables; inverse."""
    from dsv4.model.config import get_config
    from dsv4.model.rope import apply_rope, inv_freq_for
    cfg = get_config("debug")
    x = torch.randn(5, 2, cfg.head_dim, generator=torch.Generator().manual_seed(0))
    pos = torch.tensor([0, 3, 17, 100, 1023])
    r = cfg.qk_rope_head_dim
    return {"main": apply_rope(x, pos, inv_freq_for(cfg, "main"), r),
            "compress": apply_rope(x, pos, inv_freq_for(cfg, "compress"), r),
            "compress_inv": apply_rope(x, pos, inv_freq_for(cfg, "compress"), r, inverse=True)}
