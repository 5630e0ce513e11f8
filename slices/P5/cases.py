"""P5 golden cases: clamped SwiGLU (values and gradients) and an MoE layer with active clamps, shared expert
unclamped (DeepSeek) and clamped (HF)."""
import torch

from dsv4.harness.cases import golden_case

# Tolerances: the cross-host spread stored in goldens/cpu/_spread/P5.json (`dsv4 goldens spread --slice P5`,
# worst over harness/numerics.py's simulated hosts and the host that made the golden) x the margin named.
# y05/dgate/dup: worst use 0.11 of T (dgate, ATEN default) -> 9x. y10 (|y| up to ~40): worst abs 4.8e-6, rel
# 2.7e-6 (ATEN default's vectorised exp in the sigmoid) used 0.26 of T -> Y10 rtol 3e-5 (11x).
T = (1e-6, 1e-5)
Y10 = (1e-6, 3e-5)


@golden_case("clamped_swiglu_debug", tol={"y10": Y10, "y05": T, "dgate": T, "dup": T})
def clamped_swiglu_debug():
    """clamped_swiglu on gate/up [3, 17] ~ 4 N(0,1) with L = 10 and L = 0.5, and gradients of sum(y05 * w)."""
    from dsv4.kernels.swiglu import clamped_swiglu
    g = torch.Generator().manual_seed(0)
    gate, up = (torch.randn(3, 17, generator=g) * 4).requires_grad_(), (torch.randn(3, 17, generator=g) * 4).requires_grad_()
    y05 = clamped_swiglu(gate, up, 0.5)
    (y05 * torch.linspace(-1, 1, 51).view(3, 17)).sum().backward()
    return {"y10": clamped_swiglu(gate, up, 10.0).detach(), "y05": y05.detach(), "dgate": gate.grad, "dup": up.grad}


@golden_case("moe_clamped_debug", tol={"unclamped_shared": (1e-5, 1e-4), "clamped_shared": (1e-5, 1e-4)})
def moe_clamped_debug():
    """debug MoE layer 1 with swiglu_limit 0.3, S = 13: output token sums with the shared expert unclamped
    (DeepSeek) and clamped (HF 5.23)."""
    from dsv4.model.config import get_config
    from dsv4.model.moe import MoE
    cfg = get_config("debug", swiglu_limit=0.3)
    outs = {}
    for key, clamp in (("unclamped_shared", False), ("clamped_shared", True)):
        torch.manual_seed(0)
        moe = MoE(cfg.replace(shared_expert_clamp=clamp), 1)
        with torch.no_grad():
            moe.experts.w13.mul_(20)
            moe.shared_experts.w1.weight.mul_(20)
            moe.shared_experts.w3.weight.mul_(20)
            x = torch.randn(1, 13, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
            outs[key] = moe(x)[0].sum(-1)
    return outs
