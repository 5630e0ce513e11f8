"""P2 golden cases: mHC hc_pre / hc_post / hc_head on seeded inputs and the debug DSv4Model (mHC in every
sublayer, HyperHead, MTP with mHC) forward losses and logits slices."""
import torch

from dsv4.harness.cases import golden_case

# Tolerances: the cross-host spread stored in goldens/cpu/_spread/P2.json (`dsv4 goldens spread --slice P2`,
# worst over harness/numerics.py's simulated hosts and the host that made the golden) x the margin named.
# mhc ops: worst use 0.079 of T (x_new, MKL_CBWR=COMPATIBLE) -> 13x margin. model forward: logits 0.03 of T
# (33x); the losses are sharper: lm/mtp worst rel 8.6e-8 -> LOSS rtol 1e-6 (12x), indexer rel 3.2e-7 -> rtol 3e-6
# (9x), aux identical on every host -> rtol 1e-6 (8 fp32 ulp floor).
T = (1e-5, 1e-4)
LOSS = (0.0, 1e-6)


@golden_case("mhc_ops_debug", tol={"u": T, "post": T, "comb": T, "x_new": T, "head": T})
def mhc_ops_debug():
    """hc_pre/hc_post/hc_head on x [7, 4, 16], random fn/base/scale (20 Sinkhorn iterations)."""
    from dsv4.kernels.mhc import hc_head, hc_post, hc_pre
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 4, 16, generator=g)
    fn, base = torch.randn(24, 64, generator=g) * 0.3, torch.randn(24, generator=g)
    scale = torch.rand(3, generator=g) + 0.5
    u, post, comb = hc_pre(x, fn, base, scale, 20, 1e-6, 1e-6)
    out = torch.randn(7, 16, generator=g)
    return {"u": u, "post": post, "comb": comb, "x_new": hc_post(x, out, post, comb),
            "head": hc_head(x, fn[:4], base[:4], scale[:1], 1e-6, 1e-6)}


@golden_case("model_debug_forward", tol={"lm": LOSS, "mtp": LOSS, "indexer": (0.0, 3e-6), "aux": LOSS,
                                         "logits": T, "mtp_logits": T})
def model_debug_forward():
    """Seeded debug DSv4Model (train mode), S = 37: the four Megatron losses and logits[0, :, :16]."""
    from dsv4.model.config import get_config
    from dsv4.model.model import DSv4Model
    torch.manual_seed(0)
    m = DSv4Model(get_config("debug")).train()
    ids = torch.randint(0, 256, (2, 37), generator=torch.Generator().manual_seed(1))
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
    with torch.no_grad():
        out = m(ids, labels=labels)
    L = out.losses
    return {"lm": L["lm loss"].item(), "mtp": L["mtp_1 loss"].item(), "indexer": L["indexer loss"].item(),
            "aux": L["moe aux loss"].item(), "logits": out.logits[0, :, :16], "mtp_logits": out.mtp_logits[0, :, :16]}
