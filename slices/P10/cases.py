"""P10 golden cases: variable-token EP dispatch, EP = 2 gloo ranks (forked) with 7 and 12 tokens."""
import torch

from dsv4.harness.cases import golden_case

# Tolerances: the cross-host spread stored in goldens/cpu/_spread/P10.json (`dsv4 goldens spread --slice P10`,
# worst over harness/numerics.py's simulated hosts and the host that made the golden) x the margin named.
# outputs (|y| ~ 1e-2..1): worst abs 5.4e-7 (ATEN default + MKL_CBWR=COMPATIBLE), used 0.33 of the old
# (1e-6, 1e-5) -> atol 5e-6 (10x); routing exact.
TOL = (5e-6, 1e-5)


@golden_case("ep2_moe_uneven", tol={"y0": TOL, "y1": TOL})
def ep2_moe_uneven():
    """Hash layer (0) and score layer (1) of the debug config: outputs (first 16 channels) and routing."""
    from dsv4.slices.D8._workers import ep_worker, spawn
    res = spawn(ep_worker, 2, [7, 12], [0, 1], None, None)
    out = {}
    for i in range(2):
        out[f"y{i}"] = torch.cat([r[i]["y"] for r in res])[:, :16]
        out[f"idx{i}"] = torch.cat([r[i]["idx"] for r in res])
    return out
