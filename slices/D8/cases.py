"""D8 golden cases: DSv4 attention under static contiguous CP, emulated in one process (the same halo and
entry-gather math as the multi-process path; the multi-process equality is tested in test_cp_attention.py)."""
import torch

from dsv4.harness.cases import golden_case

# Tolerances: the cross-host spread stored in goldens/cpu/_spread/D8.json (`dsv4 goldens spread --slice D8`,
# worst over harness/numerics.py's simulated hosts and the host that made the golden) x the margin named.
# CP=4 attention out (|out| ~ 8): worst abs 7.6e-6 (CSA, ATEN default) used 0.30 of (1e-5, 1e-4) -> atol 5e-5 (10x).
TOL = (5e-5, 1e-4)


def _run(layer, cp):
    from dsv4.model import context_parallel as cpl
    from dsv4.model.attention import DSv4Attention
    from dsv4.model.config import get_config
    torch.manual_seed(0)
    attn = DSv4Attention(get_config("debug"), layer).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() > 1 else 0.5) + (1.0 if p.dim() == 1 else 0))
    h = torch.randn(1, 48, 64, generator=torch.Generator().manual_seed(2))
    cu = torch.tensor([0, 3, 32, 44, 48])                  # a 29-token document over 3 ranks of 12 (< halo 15)
    with torch.no_grad():
        return {"out": cpl.simulate_cp_attention(attn, h, cu, cp)}


@golden_case("cp4_attention_csa", tol={"out": TOL})
def cp4_attention_csa():
    """CSA layer, cp = 4, chunks of 12 tokens."""
    return _run(1, 4)


@golden_case("cp4_attention_hca", tol={"out": TOL})
def cp4_attention_hca():
    """HCA layer (m' = 16 > chunk 12: entries close on a later rank than they start), cp = 4."""
    return _run(2, 4)
