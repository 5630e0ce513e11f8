"""Golden cases for #5672 (static-shape PackedSeqParams)."""
import torch

from dsv4.harness.cases import golden_case


def _buf():
    from dsv4.model.packed_seq import flatten, make_params
    cu = torch.tensor([0, 13, 16, 35])
    cup = torch.tensor([0, 16, 20, 40])
    return cu, cup, flatten(make_params(cu, cup), max_seqs=6, max_seqlen=64)


@golden_case("static_buffer_seg_pos")
def static_buffer_seg_pos():
    """The static buffer of a 3-document batch padded to 6 slots, and (seg, pos) of its 44 tokens."""
    from dsv4.model.packed_seq import seg_pos_static
    _, _, buf = _buf()
    seg, pos = seg_pos_static(buf, 44)
    return {"buffer": buf, "seg": seg, "pos": pos}


# Tolerances: the cross-host spread stored in goldens/cpu/_spread/ext_5672.json (`dsv4 goldens spread --slice ext_5672`,
# worst over harness/numerics.py's simulated hosts and the host that made the golden) x the margin named.
# padded attention: worst use 0.043 of the tolerance (out_sum, 23x).
@golden_case("padded_attention_csa", tol={"out_rows": (1e-6, 1e-5), "out_sum": (1e-5, 1e-6)})
def padded_attention_csa():
    """THD attention of the debug CSA layer driven by the static (padded) metadata."""
    from dsv4.model import get_config
    from dsv4.model.attention import DSv4Attention
    from dsv4.model.layout import Layout
    cfg = get_config("debug")
    torch.manual_seed(0)
    attn = DSv4Attention(cfg, 1).eval()
    with torch.no_grad():
        attn.attn_sink.normal_()
        _, _, buf = _buf()
        h = torch.randn(1, 40, cfg.hidden_size)
        out = attn(h, Layout.packed(buf[0].long(), tuple(h.shape[:2]), buf[2].long()))[0]
    return {"out_rows": out[[0, 12, 16, 19, 20, 36, 39]], "out_sum": float(out.double().sum())}
