"""ext #5008 golden cases: the variable-token padding primitive (exact)."""
import torch

from dsv4.harness.cases import golden_case


# Exact floats: padding copies values (no arithmetic), identical on every simulated host (goldens/cpu/_spread/ext_5008.json).
@golden_case("pad_routed_tokens_5_to_8", tol={"x": (0.0, 0.0), "w": (0.0, 0.0)})
def pad_routed_tokens_5_to_8():
    from dsv4.model.ep_dispatch import pad_routed_tokens
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 3, generator=g), torch.rand(5, 2, generator=g)
    idx = torch.randint(0, 8, (5, 2), generator=g)
    xp, wp, ip, valid = pad_routed_tokens(x, w, idx, 8)
    return {"x": xp, "w": wp, "idx": ip, "valid": valid}
