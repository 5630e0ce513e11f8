"""D4 golden cases: pattern parsing (exact), Flash/Pro parameter counts (exact), a pattern-built model with
dense layers (losses), and HF-name round trip of a seeded debug model (logits slice)."""
import torch

from dsv4.harness.cases import golden_case


# Tolerances: the cross-host spread stored in goldens/cpu/_spread/D4.json (`dsv4 goldens spread --slice D4`,
# worst over harness/numerics.py's simulated hosts and the host that made the golden) x the margin named.
# dense model: losses identical on every host, logits use 0.017 of (1e-5, 1e-4) (60x); HF round trip: logits
# worst abs 2.8e-7 use 0.23 of (1e-6, 1e-5) -> 4x; its `bit_exact` flag is exact.
@golden_case("hybrid_pattern_parse")
def hybrid_pattern_parse():
    """`WEC-|H-C-/W-` on the debug sizes: ratios, MoE flags, stage split; Flash/Pro parameter counts."""
    from dsv4.model.config import get_config
    from dsv4.model.hybrid import count_params, parse_pattern
    lay = parse_pattern("WEC-|H-C-/W-", "debug")
    f, p = count_params(get_config("flash")), count_params(get_config("pro"))
    return {"ratios": torch.tensor(lay.cfg.compress_ratios), "moe": torch.tensor([lay.cfg.is_moe(i) for i in range(5)]),
            "stage_sizes": torch.tensor([len(s) for s in lay.stages]),
            "flash_total": f["total"], "flash_total_main": f["total_main"], "flash_active": f["active"],
            "pro_total": p["total"], "pro_total_main": p["total_main"], "pro_active": p["active"]}


@golden_case("hybrid_dense_model_forward", tol={"lm": (1e-5, 1e-4), "mtp": (1e-5, 1e-4),
                                                "logits": (1e-5, 1e-4)})
def hybrid_dense_model_forward():
    """Seeded model from `WEC-|H-/W-` (debug sizes; dense `-` layers), S = 23, eval: losses, logits[0,:,:8]."""
    from dsv4.model.hybrid import parse_pattern
    from dsv4.model.model import DSv4Model
    cfg = parse_pattern("WEC-|H-/W-", "debug").cfg
    torch.manual_seed(0)
    m = DSv4Model(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 23), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = m(ids, labels=ids)
    return {"lm": out.losses["lm loss"].item(), "mtp": out.losses["mtp_1 loss"].item(),
            "logits": out.logits[0, :, :8]}


@golden_case("hf_round_trip_logits", tol={"logits": (1e-6, 1e-5)})
def hf_round_trip_logits():
    """Seeded debug model -> to_hf -> from_hf (tmp dir): state bit-exact (flag, exact) and logits[0,:,:8]."""
    import tempfile

    from dsv4.model.config import get_config
    from dsv4.model.interop.hf import from_hf, to_hf
    from dsv4.model.model import DSv4Model
    torch.manual_seed(0)
    m = DSv4Model(get_config("debug", shared_expert_clamp=True)).eval()
    with tempfile.TemporaryDirectory() as d:
        to_hf(m, d)
        back = from_hf(d).eval()
    same = all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), back.state_dict().values()))
    ids = torch.randint(0, 256, (1, 29), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = back(ids).logits[0, :, :8]
    return {"bit_exact": int(same), "logits": logits}
