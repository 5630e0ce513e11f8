"""D1 golden cases: one DSv4 attention layer of each kind (debug config, seeded weights), compressor pooling."""
import torch

from dsv4.harness.cases import golden_case
from dsv4.model.losses import AuxLosses

# Tolerances: the cross-host spread stored in goldens/cpu/_spread/D1.json (`dsv4 goldens spread --slice D1`,
# worst over harness/numerics.py's simulated hosts and the host that made the golden) x the margin named.
# attention outputs: worst use 0.081 of TOL (CSA, ATEN default + MKL_CBWR=COMPATIBLE) -> 12x.
# compressor pooling: worst abs 6.0e-7 (CSA) / rel 3.9e-5 (HCA, ATEN default) used 0.33 of (1e-6, 1e-5) -> POOL (11x).
TOL = (1e-5, 1e-4)
POOL = (3e-6, 1e-4)


def _layer(layer_idx, **over):
    from dsv4.model.attention import DSv4Attention
    from dsv4.model.config import get_config
    cfg = get_config("debug", **over)
    torch.manual_seed(0)
    attn = DSv4Attention(cfg, layer_idx)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():           # O(1) outputs; non-zero sink / ape, non-unit norm weights
        for n, p in attn.named_parameters():
            if p.dim() == 1 or n.endswith("ape"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (1.0 if "norm" in n else 0.0))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[1] ** -0.5)
    h = torch.randn(1, 37, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    return attn.eval(), h


@golden_case("attention_window_debug", tol={"out": TOL})
def attention_window_debug():
    """Window layer (layer 0), S = 37: output [1, 37, 64]."""
    attn, h = _layer(0)
    with torch.no_grad():
        return {"out": attn(h)}


@golden_case("attention_csa_debug", tol={"out": TOL})
def attention_csa_debug():
    """CSA layer (layer 1, m = 4, top-4 of 9 entries), S = 37: output and the selected entries (exact)."""
    attn, h = _layer(1)
    aux = AuxLosses()
    with torch.no_grad():
        out = attn(h, aux=aux)
    return {"out": out, "selected": aux.picks(None, (1, 37))}


@golden_case("attention_hca_debug", tol={"out": TOL})
def attention_hca_debug():
    """HCA layer (layer 2, m' = 16, 2 entries), S = 37: output [1, 37, 64]."""
    attn, h = _layer(2)
    with torch.no_grad():
        return {"out": attn(h)}


@golden_case("compress_pool_debug", tol={"csa": POOL, "hca": POOL})
def compress_pool_debug():
    """compress_pool on seeded [13, 2, .] inputs: CSA overlap (m = 4, D = 6) and HCA (m = 4, D = 6)."""
    from dsv4.kernels.compressor import compress_pool
    g = torch.Generator().manual_seed(3)
    kv, gate, ape = torch.randn(13, 2, 12, generator=g), torch.randn(13, 2, 12, generator=g), torch.randn(4, 12, generator=g)
    seg, pos = torch.zeros(13, dtype=torch.long), torch.arange(13)         # each batch column: one document

    def pool(kv, gate, ape, overlap):   # [13, 2, W] -> the golden's [13 // 4, 2, D] (the 3 complete windows)
        return torch.stack([compress_pool(kv[:, b], gate[:, b], ape, 4, overlap, seg, pos)[0][:3] for b in range(2)], 1)
    return {"csa": pool(kv, gate, ape, True), "hca": pool(kv[..., :6], gate[..., :6], ape[:, :6], False)}
