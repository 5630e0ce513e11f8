"""P6: interleaved partial RoPE on the last r dims, YaRN tables, inverse rotation, table-width check.

Oracles written here: complex-number rotation (pairs (2i, 2i+1) as x_{2i} + i x_{2i+1}), YaRN inverse frequencies
from the formula of spec §5.6 in Python floats, and HF's own rope init (`transformers.modeling_rope_utils`).
"""
import math

import pytest
import torch

from dsv4.model.config import get_config, yarn_low_high
from dsv4.model.rope import (RopeError, RotaryTable, apply_rope, apply_rope_cos_sin, inv_freq_for, rope_cos_sin,
                             rope_inv_freq, rope_table_name)


def oracle_rotate(x, pos, theta_list, r, sign=1.0):
    """fp64 complex oracle: last r dims of x [N, c] rotated by pos[N] * theta."""
    x = x.double()
    c = x.shape[-1]
    th = torch.tensor(theta_list, dtype=torch.float64)
    z = torch.complex(x[:, c - r::2], x[:, c - r + 1::2])               # [N, r/2]
    z = z * torch.exp(1j * sign * pos.double()[:, None] * th[None, :])
    out = x.clone()
    out[:, c - r::2], out[:, c - r + 1::2] = z.real, z.imag
    return out


def yarn_formula(r, base, factor, L0, beta_fast, beta_slow):
    """Spec §5.6 in Python floats (independent of the code under test)."""
    corr = lambda nrot: r * math.log(L0 / (nrot * 2 * math.pi)) / (2 * math.log(base))   # noqa: E731
    low, high = max(math.floor(corr(beta_fast)), 0), min(math.ceil(corr(beta_slow)), r - 1)
    if low == high:
        high += 0.001
    out = []
    for i in range(r // 2):
        f = base ** (-2 * i / r)
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        out.append(f / factor * ramp + f * (1 - ramp))
    return out, (low, high)


# ------------------------------------------------------------------------------------------- rotation

@pytest.mark.parametrize("table", ["main", "compress"])
def test_rotation_matches_complex_oracle(table):
    cfg = get_config("flash")                                             # c = 512, r = 64
    r, c = cfg.qk_rope_head_dim, cfg.head_dim
    g = torch.Generator().manual_seed(0)
    x = torch.randn(23, c, generator=g)
    pos = torch.tensor([0, 1, 2, 3, 5, 7, 11, 13, 17, 64, 100, 127, 128, 129, 200, 255, 31, 30, 9, 8, 4, 6, 1])
    got = apply_rope(x, pos, inv_freq_for(cfg, table), r)
    if table == "main":
        theta = [cfg.rope_theta ** (-2 * i / r) for i in range(r // 2)]
    else:
        rs = cfg.rope_scaling
        theta, _ = yarn_formula(r, cfg.compress_rope_theta, rs["factor"], rs["original_max_position_embeddings"],
                                rs["beta_fast"], rs["beta_slow"])
    ref = oracle_rotate(x, pos, theta, r)
    assert torch.equal(got[:, : c - r], x[:, : c - r])                   # nope dims untouched, bitwise
    err = (got.double() - ref).abs().max().item()
    # fp32 angles up to 255 rad (fp32 ulp at 255 = 1.5e-5 rad): measured 7.6e-6 on all 11 simulated hosts, x6.6
    assert err <= 5e-5, f"rotation vs complex oracle: {err:.3g}"


def test_rotation_sbhd_broadcast_and_2d_positions():
    cfg = get_config("debug")
    r = cfg.qk_rope_head_dim
    inv = inv_freq_for(cfg, "compress")
    x = torch.randn(7, 2, 3, cfg.head_dim)                                # [S, B, H, c]
    pos = torch.tensor([4, 0, 9, 1, 1, 30, 2])                            # any LongTensor, not monotonic
    y = apply_rope(x, pos, inv, r)
    y2 = apply_rope(x, pos[:, None].expand(7, 2).contiguous(), inv, r)    # per-(s, b) positions [S, B]
    assert torch.equal(y, y2)
    for s in range(7):                                                    # = rotating each row alone
        row = apply_rope(x[s].reshape(6, -1), pos[s].expand(6), inv, r)
        assert torch.equal(row.view(2, 3, -1), y[s])


def test_inverse_undoes_rotation():
    cfg = get_config("flash")
    r = cfg.qk_rope_head_dim
    x = torch.randn(40, 4, cfg.head_dim)
    pos = torch.randint(0, 70000, (40,))
    for table in ("main", "compress"):
        inv = inv_freq_for(cfg, table)
        back = apply_rope(apply_rope(x, pos, inv, r), pos, inv, r, inverse=True)
        assert (back - x).abs().max().item() <= 1e-5                  # measured 4.8e-7 (11 hosts), x21
        # inverse by p == forward by -p
        # measured bit-equal on all 11 hosts; atol 1e-6 (+ allclose's rtol 1e-5) = a few fp32 ulps of O(1) values
        assert torch.allclose(apply_rope(x, pos, inv, r, inverse=True), apply_rope(x, -pos, inv, r), atol=1e-6)


@pytest.mark.parametrize("table", ["main", "compress"])
def test_relative_position_property(table):
    """q(p) . k(p + delta) after RoPE depends only on delta (rope part), and the nope part is unchanged."""
    cfg = get_config("flash")
    r = cfg.qk_rope_head_dim
    inv = inv_freq_for(cfg, table)
    q, k = torch.randn(1, cfg.head_dim, dtype=torch.float64), torch.randn(1, cfg.head_dim, dtype=torch.float64)
    for delta in (0, 1, 3, 17):
        dots = []
        for p in (0, 5, 40, 333):
            qr = apply_rope(q, torch.tensor([p]), inv, r)
            kr = apply_rope(k, torch.tensor([p + delta]), inv, r)
            dots.append((qr * kr).sum().item())
        # fp64, |dot| <= 45: measured spread 2.1e-14 (DNNL_MAX_CPU_ISA=AVX2; 11 hosts), x14 (was 1e-9)
        assert max(dots) - min(dots) <= 3e-13, (delta, dots)


def test_bf16_rotation_is_fp32_then_cast_once():
    cfg = get_config("debug")
    r = cfg.qk_rope_head_dim
    inv = inv_freq_for(cfg, "compress")
    x = torch.randn(11, 2, cfg.head_dim).to(torch.bfloat16)
    pos = torch.arange(11) * 37
    y = apply_rope(x, pos, inv, r)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, apply_rope(x.float(), pos, inv, r).to(torch.bfloat16))


# ------------------------------------------------------------------------------------------- tables

def test_yarn_inv_freq_vs_formula_flash_and_debug():
    for name in ("flash", "debug", "tiny", "pro"):
        cfg = get_config(name)
        rs = cfg.rope_scaling
        ref, (low, high) = yarn_formula(cfg.qk_rope_head_dim, cfg.compress_rope_theta, rs["factor"],
                                        rs["original_max_position_embeddings"], rs["beta_fast"], rs["beta_slow"])
        got = inv_freq_for(cfg, "compress")
        assert got.dtype == torch.float32 and got.shape == (cfg.qk_rope_head_dim // 2,)
        # fp32 table vs fp64 formula: measured worst rel 1.6e-7 (fp32 rounding; 11 hosts), x6
        assert torch.allclose(got.double(), torch.tensor(ref, dtype=torch.float64), rtol=1e-6, atol=0), name
        assert yarn_low_high(cfg) == (low, int(high)), name
        main = inv_freq_for(cfg, "main")
        ref_main = [cfg.rope_theta ** (-2 * i / cfg.qk_rope_head_dim) for i in range(cfg.qk_rope_head_dim // 2)]
        # measured worst rel 7.0e-8 (11 hosts), x14
        assert torch.allclose(main.double(), torch.tensor(ref_main, dtype=torch.float64), rtol=1e-6, atol=0)
    assert yarn_low_high(get_config("flash")) == (15, 25)                 # spec §5.6


def test_tables_bitwise_equal_to_hf_rope_init():
    transformers = pytest.importorskip("transformers")
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding
    for name in ("flash", "debug"):
        cfg = get_config(name)
        rs = cfg.rope_scaling
        hcfg = DeepseekV4Config(
            hidden_size=64, num_hidden_layers=1, num_attention_heads=4, head_dim=cfg.head_dim,
            qk_rope_head_dim=cfg.qk_rope_head_dim, rope_theta=cfg.rope_theta,
            compress_rope_theta=cfg.compress_rope_theta, max_position_embeddings=cfg.max_position_embeddings,
            rope_parameters={"rope_type": "yarn", **{k: rs[k] for k in
                             ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow")}})
        rot = DeepseekV4RotaryEmbedding(hcfg)
        assert torch.equal(inv_freq_for(cfg, "compress"), rot.compress_inv_freq), name
        assert torch.equal(inv_freq_for(cfg, "main"), rot.main_inv_freq), name
        assert rot.compress_attention_scaling == 1.0                      # no mscale (spec §5.6)
        # and the rotation itself equals HF's apply_rotary_pos_emb in fp32
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb
        x = torch.randn(2, 3, 9, cfg.head_dim)                            # [B, H, S, c]
        pos = torch.arange(9)[None].expand(2, 9) * 1000
        cos, sin = rot(x, pos, layer_type="compress")
        ref = apply_rotary_pos_emb(x, cos, sin)
        ours = apply_rope(x.permute(0, 2, 1, 3), pos, inv_freq_for(cfg, "compress"), cfg.qk_rope_head_dim)
        # measured bit-equal to HF on all 11 hosts; 1e-6 = a few fp32 ulps of O(1) outputs
        assert (ours.permute(0, 2, 1, 3) - ref).abs().max().item() <= 1e-6


def test_table_by_layer_kind():
    cfg = get_config("debug")                                             # ratios [0, 4, 16, 0]
    assert [rope_table_name(cfg, i) for i in range(4)] == ["main", "compress", "compress", "main"]
    assert torch.equal(RotaryTable(cfg, "main").inv_freq, rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta))
    plain = get_config("debug", rope_scaling=None)
    assert torch.equal(inv_freq_for(plain, "compress"), rope_inv_freq(8, plain.compress_rope_theta))
    t = RotaryTable(cfg, "compress").to(torch.bfloat16)                   # module casts must not round the table
    assert t.inv_freq.dtype == torch.float32


# ------------------------------------------------------------------------------------------- errors

def test_table_width_error_is_one_clear_line():
    """The Megatron-Bridge #4271 situation: a table built for 8 dims used to rotate 64 -> refused."""
    x = torch.randn(5, 512)
    cos, sin = rope_cos_sin(rope_inv_freq(8, 10000.0), torch.arange(5))   # covers 8 dims
    with pytest.raises(RopeError, match=r"^rope: cos/sin table covers 8 dims but the rotated width is 64") as e:
        apply_rope_cos_sin(x, cos, sin, 64)
    assert "\n" not in str(e.value)
    with pytest.raises(RopeError, match="covers 8 dims but the rotated width is 64"):
        apply_rope(x, torch.arange(5), rope_inv_freq(8, 10000.0), 64)
    with pytest.raises(RopeError, match="rope_dim 16 must be even and <= head dim 8"):
        apply_rope(torch.randn(5, 8), torch.arange(5), rope_inv_freq(16, 10000.0), 16)
    with pytest.raises(RopeError, match="positive even"):
        rope_inv_freq(7, 10000.0)
    with pytest.raises(RopeError, match="integer tensor"):
        apply_rope(x, torch.arange(5.0), rope_inv_freq(64, 10000.0), 64)
    with pytest.raises(RopeError, match="not a prefix"):
        apply_rope(x, torch.arange(4), rope_inv_freq(64, 10000.0), 64)
    with pytest.raises(RopeError, match="type must be 'yarn'"):
        rope_inv_freq(64, 10000.0, {"type": "linear", "factor": 2.0})


def test_rotary_table_moves_with_the_module_not_its_dtype():
    """RotaryTable.inv_freq follows the module's device (so a step copies nothing host->device: on the H200 that
    copy synchronised 29 times a proxy step) and never its dtype; from meta, to_empty rebuilds the exact table."""
    import torch
    from dsv4.model.config import get_config
    from dsv4.model.rope import RotaryTable, inv_freq_for
    cfg = get_config("debug")
    for table in ("main", "compress"):
        want = inv_freq_for(cfg, table)
        t = RotaryTable(cfg, table).to(torch.bfloat16)
        assert t.inv_freq.dtype == torch.float32 and torch.equal(t.inv_freq, want)
        t = t.to("meta")
        assert t.inv_freq.device.type == "meta"
        t = t.to_empty(device="cpu")
        assert t.inv_freq.device.type == "cpu" and torch.equal(t.inv_freq, want)
        assert "inv_freq" not in t.state_dict()
