"""ext_4531 golden cases: Sinkhorn in DeepSeek's order, and a block with mHC recompute (checkpoint without
output): outputs, input gradients and the number of freed checkpoint outputs."""
import torch

from dsv4.harness.cases import golden_case


# Tolerances: the cross-host spread stored in goldens/cpu/_spread/ext_4531.json (`dsv4 goldens spread --slice ext_4531`,
# worst over harness/numerics.py's simulated hosts and the host that made the golden) x the margin named.
# sinkhorn comb: worst use 0.068 (15x); block recompute: worst use 0.085 of (1e-5, 1e-4) (x_grad, 12x).
@golden_case("sinkhorn_debug", tol={"comb": (1e-6, 1e-5)})
def sinkhorn_debug():
    """sinkhorn(logits [5, 4, 4] ~ 2 N(0,1), 20 iters, eps 1e-6)."""
    from dsv4.kernels.mhc import sinkhorn
    logits = torch.randn(5, 4, 4, generator=torch.Generator().manual_seed(0)) * 2
    return {"comb": sinkhorn(logits, 20, 1e-6)}


@golden_case("block_mhc_recompute_debug", tol={"y_token_sum": (1e-5, 1e-4), "x_grad": (1e-5, 1e-4),
                                               "fn_grad_norm": (1e-5, 1e-4)})
def block_mhc_recompute_debug():
    """debug CSA block (layer 1) with recompute_mhc, S = 11: per-(token, stream) output sums, dL/dX[..., :8],
    |dL/d hc_attn_fn|, and how many checkpointed tensors were freed (exact: 6)."""
    import dsv4.model.block as block_mod
    from dsv4.model.config import get_config
    cfg = get_config("debug")
    torch.manual_seed(0)
    blk = block_mod.Block(cfg, 1)
    blk.recompute_mhc = True
    kept = []
    orig = block_mod.CheckpointWithoutOutput

    class Spy(orig):
        def checkpoint(self, fn, *inputs):
            out = super().checkpoint(fn, *inputs)
            kept.extend(out)
            return out

    block_mod.CheckpointWithoutOutput = Spy
    try:
        X = torch.randn(1, 11, cfg.hc_mult, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
        X.requires_grad_()
        y = blk(X, torch.randint(0, cfg.vocab_size, (1, 11), generator=torch.Generator().manual_seed(2)))
    finally:
        block_mod.CheckpointWithoutOutput = orig
    freed = sum(int(t.untyped_storage().size() == 0) for t in kept)
    (y * y).sum().backward()
    return {"y_token_sum": y.detach().sum(-1)[0], "x_grad": X.grad[0, :, :, :8],
            "fn_grad_norm": blk.hc_attn_fn.grad.norm().item(), "freed": freed}
