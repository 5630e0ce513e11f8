"""D6 golden cases: packed THD DSv4 attention layers and the packed full model (debug config)."""
import torch

from dsv4.harness.cases import golden_case

# Tolerances: the cross-host spread stored in goldens/cpu/_spread/D6.json (`dsv4 goldens spread --slice D6`,
# worst over harness/numerics.py's simulated hosts and the host that made the golden) x the margin named.
# packed attention out (|out| ~ 8): worst abs 7.6e-6 (CSA; ATEN default) used 0.31 of (1e-5, 1e-4) -> OUT atol 5e-5
# (10x at |out| 8); model logits use 0.023 of TOL (43x), loss identical; indexer loss rel 2.3e-7 -> (0, 3e-6) 13x.
TOL = (1e-5, 1e-4)
OUT = (5e-5, 1e-4)
CU, CUP = [0, 5, 24, 27, 64], [0, 8, 28, 31, 68]     # odd documents, padded slots


def _attn(layer):
    from dsv4.model.attention import DSv4Attention
    from dsv4.model.config import get_config
    torch.manual_seed(0)
    attn = DSv4Attention(get_config("debug"), layer).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() > 1 else 0.5) + (1.0 if p.dim() == 1 else 0))
    return attn


def _packed_attention(layer):
    from dsv4.model.layout import Layout
    from dsv4.model.losses import AuxLosses
    attn = _attn(layer)
    h = torch.randn(1, CUP[-1], 64, generator=torch.Generator().manual_seed(2))
    aux = AuxLosses()
    with torch.no_grad():
        out = attn(h, Layout.packed(torch.tensor(CU), (1, CUP[-1]), torch.tensor(CUP)), aux)
    return aux, out


@golden_case("thd_attention_csa_packed", tol={"out": OUT})
def thd_attention_csa_packed():
    """CSA layer (1) on 4 padded documents [5, 19, 3, 37] (T = 68): output and selected entries (exact), the
    entries as indices into the stream-ordered list of (non-empty) entries."""
    aux, out = _packed_attention(1)
    idx, es, _ = aux.selections[None]
    rank = torch.cumsum((es >= 0).long(), 0) - 1
    return {"out": out, "selected": torch.where(idx >= 0, rank[idx.clamp(min=0)], torch.full_like(idx, -1))}


@golden_case("thd_attention_hca_packed", tol={"out": OUT})
def thd_attention_hca_packed():
    """HCA layer (2, m' = 16) on the same packed stream."""
    return {"out": _packed_attention(2)[1]}


@golden_case("thd_model_packed", tol={"logits": TOL, "mtp_logits": TOL, "loss": TOL})
def thd_model_packed():
    """DSv4Model (debug) on the packed stream: logits / MTP logits of the first 16 vocab ids, and the loss."""
    from dsv4.model.config import get_config
    from dsv4.model.layout import seg_pos_from_cu_seqlens
    from dsv4.model.model import DSv4Model
    torch.manual_seed(0)
    model = DSv4Model(get_config("debug")).eval()
    cu, cup = torch.tensor(CU), torch.tensor(CUP)
    T = CUP[-1]
    ids = torch.randint(0, 256, (1, T), generator=torch.Generator().manual_seed(3))
    seg, _ = seg_pos_from_cu_seqlens(cu, T, cup)
    labels = torch.full((1, T), -100)
    for d in range(4):
        rows = torch.nonzero(seg == d).flatten()
        labels[0, rows[:-1]] = ids[0, rows[1:]]
    with torch.no_grad():
        out = model(ids, labels, cu_seqlens=cu, cu_seqlens_padded=cup)
    return {"logits": out.logits[..., :16], "mtp_logits": out.mtp_logits[..., :16], "loss": out.loss.item()}


@golden_case("thd_indexer_loss_packed", tol={"indexer_loss": (0.0, 3e-6)})
def thd_indexer_loss_packed():
    """Training mode, CSA layer, window 12, sparse indexer loss on the packed stream (document-local teacher)."""
    from dsv4.model.attention import DSv4Attention
    from dsv4.model.config import get_config
    from dsv4.model.layout import Layout
    from dsv4.model.losses import AuxLosses
    torch.manual_seed(0)
    attn = DSv4Attention(get_config("debug", sliding_window=12), 1).train()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() > 1 else 0.5) + (1.0 if p.dim() == 1 else 0))
    h = torch.randn(1, CUP[-1], 64, generator=torch.Generator().manual_seed(2))
    aux = AuxLosses()
    attn(h, Layout.packed(torch.tensor(CU), (1, CUP[-1]), torch.tensor(CUP)), aux)
    return {"indexer_loss": aux.indexer[0][0].item(), "queries": int(aux.indexer[0][1])}
