"""X5 / issue 18 §5: a synthetic checkpoint in DeepSeek's released formats (FP8 e4m3 linears with 128 x 128 ue8m0
block scales, MXFP4 routed experts: packed e2m1 pairs + 1 x 32 e8m0 scales, BF16 for the rest; one block in the
V3 style: fp32 scales under HF's `weight_scale_inv` name) converts and loads.

The oracle is written here, independent of model/lowp and model/interop/released.py: e4m3fn / e2m1 / e8m0 decoded
from their bit fields by Python arithmetic on each of the 256 / 16 / 256 codes, block scales expanded by index
arithmetic (scale[r // br, c // bc]). The loaded weights must equal the oracle's decoding of the stored bytes
exactly (each value is a short significand times a power of two: exact in bf16), and stay within the
quantisation error bound of the bf16 weights they were made from: half a quantum of the format at the element's
binade, times the block scale (RNE; ue8m0 scales never saturate)."""
import json
import math
import os

import pytest
import torch
from click.testing import CliRunner

from dsv4.model.config import get_config
from dsv4.model.interop import CheckpointError, from_hf, load_official
from dsv4.model.interop.hf_config import config_to_hf
from dsv4.model.interop.official import ours_to_official
from dsv4.kernels.quant.naive import fp4_pack, mx_quantize, mx_scale_codes, quantize
from dsv4.model.model import DSv4Model

QCFG = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "activation_scheme": "dynamic",
        "weight_block_size": [128, 128], "expert_dtype": "fp4"}
FP8_KEYS = ("attn.wq_a.weight", "attn.wq_b.weight", "attn.wkv.weight", "attn.wo_a.weight", "attn.wo_b.weight",
            "attn.indexer.wq_b.weight", "shared_experts.w1.weight", "shared_experts.w2.weight",
            "shared_experts.w3.weight", "e_proj.weight", "h_proj.weight")


# ------------------------------------------------------------------------------------------- the oracle
def _e4m3(b):                       # float8_e4m3fn: s eeee mmm, bias 7, no inf, 0x7f / 0xff NaN
    s, e, m = b >> 7, (b >> 3) & 15, b & 7
    if e == 15 and m == 7:
        return math.nan
    v = (m / 8) * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    return -v if s else v


def _e2m1(c):                       # s ee m, bias 1
    s, e, m = c >> 3, (c >> 1) & 3, c & 1
    v = m * 0.5 if e == 0 else (1 + m / 2) * 2.0 ** (e - 1)
    return -v if s else v


E4M3 = torch.tensor([_e4m3(b) for b in range(256)], dtype=torch.float64)
E2M1 = torch.tensor([_e2m1(c) for c in range(16)], dtype=torch.float64)
E8M0 = torch.tensor([2.0 ** (b - 127) if b < 255 else math.nan for b in range(256)], dtype=torch.float64)


def oracle(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Stored (weight, scale) -> fp64 weight."""
    if w.dtype == torch.float8_e4m3fn:
        vals = E4M3[w.view(torch.uint8).long()]
        br, bc = 128, 128
    else:                                                     # packed fp4: low nibble = even column
        u = w.view(torch.uint8).long()
        vals = torch.stack([E2M1[u & 15], E2M1[u >> 4]], -1).reshape(u.shape[0], -1)
        br, bc = 1, 32
    sc = E8M0[s.view(torch.uint8).long()] if s.element_size() == 1 else s.double()
    r = torch.arange(vals.shape[0])[:, None] // br
    c = torch.arange(vals.shape[1])[None, :] // bc
    return vals * sc[r, c]


def error_bound(x: torch.Tensor, s_full: torch.Tensor, m_bits: int, emin: int) -> torch.Tensor:
    """Half a quantum of the format at x / scale's binade, times the scale (RNE error bound)."""
    v = (x.double() / s_full).abs()
    e = torch.floor(torch.log2(v.clamp_min(2.0 ** emin))).clamp_min(emin)
    return 0.5 * torch.pow(2.0, e - m_bits) * s_full


# ------------------------------------------------------------------------------------------- the checkpoint
def _e8m0_tensor(codes: torch.Tensor) -> torch.Tensor:
    return codes.view(torch.float8_e8m0fnu) if hasattr(torch, "float8_e8m0fnu") else codes


def write_released(model, directory):
    """model -> directory in the released formats; returns {official weight name: bf16 reference}."""
    off = ours_to_official(model.state_dict())
    out, ref = {}, {}
    for k, v in off.items():
        if not v.is_floating_point():
            out[k] = v
            continue
        b = v.to(torch.bfloat16)
        ref[k] = b
        if ".ffn.experts." in k:                                          # MXFP4 routed expert
            q = mx_quantize(b.float(), "e2m1", 32, "ue8m0")
            out[k] = fp4_pack(q.values).view(torch.int8)
            out[k[: -len("weight")] + "scale"] = _e8m0_tensor(mx_scale_codes(q))
        elif k.endswith(FP8_KEYS) and v.dim() == 2:
            q = quantize(b.float(), "e4m3", (128, 128), "ue8m0")
            out[k] = q.fp8()
            if k.startswith("mtp."):                                      # V3 style: fp32 scale, HF's name
                out[k[: -len("weight")] + "weight_scale_inv"] = q.scale.float()
            else:
                out[k[: -len("weight")] + "scale"] = _e8m0_tensor(mx_scale_codes(q))
        else:
            out[k] = b
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({**config_to_hf(model.cfg), "quantization_config": QCFG}, f)
    from safetensors.torch import save_file
    half = sorted(out)[: len(out) // 2]                                   # two shards
    save_file({k: out[k].contiguous() for k in half}, os.path.join(directory, "model-00001-of-00002.safetensors"))
    save_file({k: out[k].contiguous() for k in out if k not in half},
              os.path.join(directory, "model-00002-of-00002.safetensors"))
    return out, ref


def _model():
    cfg = get_config("debug", hidden_size=160, moe_intermediate_size=64, q_lora_rank=192)
    torch.manual_seed(0)
    m = DSv4Model(cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if p.dim() >= 2:                    # O(1) weights, with blocks of very different magnitude
                p.copy_(torch.randn(p.shape, generator=g) * torch.exp2(torch.randint(-6, 4, p.shape[:-2] + (1, 1),
                                                                                      generator=g).float()))
                if p.shape[-1] > 128:
                    p[..., 128:] *= 2.0 ** -9
    return m


def test_released_checkpoint_loads_within_quantisation_error(tmp_path):
    model = _model()
    stored, ref = write_released(model, str(tmp_path / "released"))
    loaded = ours_to_official(load_official(str(tmp_path / "released")).state_dict())
    n_fp8 = n_fp4 = n_v3 = 0
    for k, r in ref.items():
        got = loaded[k].double()
        sk = next((k[: -len("weight")] + s for s in ("scale", "weight_scale_inv") if k[: -len("weight")] + s in stored),
                  None)
        if sk is None:                                                    # bf16 tensors: exact
            assert torch.equal(got, r.double()), k
            continue
        w, s = stored[k], stored[sk]
        want = oracle(w, s)
        assert torch.equal(got, want), (k, (got - want).abs().max().item())
        fp4 = w.dtype != torch.float8_e4m3fn
        br, bc = (1, 32) if fp4 else (128, 128)
        sf = (E8M0[s.view(torch.uint8).long()] if s.element_size() == 1 else s.double())
        sf = sf.repeat_interleave(br, 0)[: r.shape[0]].repeat_interleave(bc, 1)[:, : r.shape[1]]
        bound = error_bound(r, sf, 1 if fp4 else 3, 0 if fp4 else -6)
        err = (got - r.double()).abs()
        assert (err <= bound).all(), (k, (err - bound).max().item())
        n_fp4 += fp4
        n_fp8 += not fp4
        n_v3 += sk.endswith("weight_scale_inv")
    assert n_fp8 >= 10 and n_fp4 >= 3 * 8 * 3 and n_v3 >= 2, (n_fp8, n_fp4, n_v3)


def test_dsv4_convert_released_to_hf_and_official(tmp_path):
    from dsv4.harness.convert_cli import convert_cmd
    model = _model()
    src = str(tmp_path / "released")
    write_released(model, src)
    want = load_official(src).state_dict()
    for to, load in (("hf", from_hf), ("official", load_official)):
        dst = str(tmp_path / to)
        r = CliRunner().invoke(convert_cmd, [src, dst, "--from", "official", "--to", to, "--json",
                                             "--hf-clamp-shared-expert"])
        assert r.exit_code == 0, r.output
        kw = {"shared_expert_clamp": False} if to == "hf" else {}
        got = load(dst, **kw).state_dict()
        for k, v in want.items():
            assert torch.equal(got[k], v), (to, k)


def test_released_bad_input_one_line(tmp_path):
    from dsv4.harness.convert_cli import convert_cmd
    from safetensors.torch import load_file, save_file
    model = _model()
    src = str(tmp_path / "released")
    write_released(model, src)
    f = os.path.join(src, "model-00001-of-00002.safetensors")
    t = load_file(f)
    k = next(k for k in t if k.endswith(".scale") and "experts" not in k and "hc_" not in k)
    del t[k]
    save_file(t, f)
    with pytest.raises(CheckpointError, match="has no scale"):
        load_official(src)
    r = CliRunner().invoke(convert_cmd, [src, str(tmp_path / "o"), "--from", "official", "--to", "official"])
    assert r.exit_code == 2 and "has no scale" in r.output and len(r.output.strip().splitlines()) == 1, r.output
