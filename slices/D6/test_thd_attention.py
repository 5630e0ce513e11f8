"""D6: packed THD DSv4 attention (window / CSA / HCA layers) == DSv4Attention on each document alone.

Oracle: the same module `DSv4Attention.forward` run on each document separately (a Python loop over documents,
the default layout: one document), fp32, outputs and gradients (input + every parameter) <= 3e-5 (7x the measured
cross-host worst), indexer selections identical.
"""
import pytest
import torch

from dsv4.model.attention import DSv4Attention
from dsv4.model.config import get_config
from dsv4.model.layout import Layout, seg_pos_from_cu_seqlens
from dsv4.model.losses import AuxLosses

LENS = [5, 19, 3, 37, 2, 17]          # odd: < a CSA window, < an HCA window, not multiples of 4 or 16
# the slice's stated bound (fp32 <= 1e-5, docstring); measured worst
# over the 11 simulated hosts of harness/numerics.py (native, ATEN default/avx2/avx512, MKL_CBWR=COMPATIBLE/AVX2,
# MKL_ENABLE_INSTRUCTIONS=SSE4_2/AVX2, DNNL_MAX_CPU_ISA=AVX2, 2 combinations):
# outputs 4.3e-6, gradients 0.12 of 1e-5, chunk outputs 2.4e-6: the old 1e-5 left x2.3 -> TOL = 3e-5 (x7)
TOL = 3e-5


def _randomize(mod):
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in mod.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() > 1 else 0.5) + (1.0 if p.dim() == 1 else 0))


def packed_attn(attn, h, cu, cup, aux=None):
    """attn on the packed stream h [1, T, d] described by cu_seqlens (+ padded)."""
    return attn(h, Layout.packed(cu, tuple(h.shape[:2]), cup), aux)


def _cu(padded):
    lens = torch.tensor(LENS)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
    if not padded:
        return cu, None, int(cu[-1])
    plens = (lens + 3) // 4 * 4 + 2                                             # padded slot per document
    cup = torch.cat([torch.zeros(1, dtype=torch.long), plens.cumsum(0)])
    return cu, cup, int(cup[-1])


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("layer", [0, 1, 2])               # debug config: window, CSA (m=4), HCA (m'=16)
def test_packed_attention_equals_separate(layer, padded):
    cfg = get_config("debug")
    torch.manual_seed(0)
    attn = DSv4Attention(cfg, layer).eval()
    _randomize(attn)
    cu, cup, T = _cu(padded)
    h = torch.randn(1, T, cfg.hidden_size, requires_grad=True)
    seg, pos = seg_pos_from_cu_seqlens(cu, T, cup)
    r = torch.randn(1, T, cfg.hidden_size)
    real = seg >= 0
    params = [p for p in attn.parameters()]

    aux = AuxLosses()
    out = packed_attn(attn, h, cu, cup, aux)
    packed = aux.picks_doc(None) if attn.kind == "csa" else None           # (doc, j) per query
    grads = torch.autograd.grad((out * r).sum(), [h] + params, allow_unused=True)
    assert out.shape == h.shape and torch.isfinite(out).all()
    if (~real).any():
        assert out[0, ~real].abs().max() == 0                                   # padding: sink only

    ref = torch.zeros_like(out)
    loss_ref = 0.0
    n_sel = 0
    for d in range(len(LENS)):
        rows = torch.nonzero(seg == d).flatten()
        aux_d = AuxLosses()
        o_d = attn(h[:, rows], aux=aux_d)                                       # one document (default layout)
        ref[0, rows] = o_d[0].detach()
        loss_ref = loss_ref + (o_d * r[:, rows]).sum()
        if attn.kind == "csa":                                                  # selections identical
            sep = aux_d.picks(None)                                            # [L, k_d]
            for t_loc, t in enumerate(rows.tolist()):
                got = packed[t]
                want = [(d, j) for j in sep[t_loc].tolist() if j >= 0]
                assert got == want, (d, t_loc, got, want)
                n_sel += len(want)
    ref_grads = torch.autograd.grad(loss_ref, [h] + params, allow_unused=True)
    err = (out[0, real] - ref[0, real]).abs().max().item()
    assert err <= TOL, err
    names = ["h"] + [n for n, _ in attn.named_parameters()]
    for name, a, b in zip(names, grads, ref_grads):
        if a is None and b is None:
            continue
        a = torch.zeros_like(b) if a is None else a
        b = torch.zeros_like(a) if b is None else b
        assert (a - b).abs().max().item() <= TOL * max(1.0, b.abs().max().item()), name
    if attn.kind == "csa":
        assert n_sel > 0


@pytest.mark.parametrize("mode", ["sparse", "dense"])
def test_packed_indexer_loss_equals_separate(mode):
    """Training mode, CSA layer: the packed indexer KL loss == the per-document losses weighted by their
    number of queries with a candidate; indexer parameter gradients equal (the LM path never reaches them)."""
    # window 12 > 2m: a query with >= 2 candidates (pos >= 7) can have window keys before its document start,
    # the only case where a document leak in the teacher's window part would change the (normalised) target
    cfg = get_config("debug", indexer_loss_mode=mode, sliding_window=12)
    torch.manual_seed(0)
    attn = DSv4Attention(cfg, 1).train()
    _randomize(attn)
    cu, cup, T = _cu(True)
    h = torch.randn(1, T, cfg.hidden_size)
    seg, _ = seg_pos_from_cu_seqlens(cu, T, cup)
    iparams = list(attn.indexer.parameters())
    aux = AuxLosses()
    packed_attn(attn, h, cu, cup, aux)
    loss = aux.indexer[0][0]
    g_packed = torch.autograd.grad(loss, iparams)
    num, den = 0.0, 0
    m = cfg.csa_ratio
    for d, L in enumerate(LENS):
        rows = torch.nonzero(seg == d).flatten()
        aux_d = AuxLosses()
        attn(h[:, rows], aux=aux_d)
        n_q = max(0, L - m + 1)                                                 # queries with >= 1 entry
        assert int(aux_d.indexer[0][1]) == n_q
        if n_q:
            num = num + aux_d.indexer[0][0] * n_q
            den += n_q
    ref = num / den
    g_ref = torch.autograd.grad(ref, iparams)
    # the loss is small (coeff 1e-2): compare relative to its own size, and each gradient to its own max
    e_loss = abs(loss.item() - ref.item()) / abs(ref.item())
    assert e_loss <= TOL, (loss.item(), ref.item())
    for a, b in zip(g_packed, g_ref):
        assert (a - b).abs().max().item() <= TOL * b.abs().max().item()
    assert loss.item() > 0


@pytest.mark.parametrize("layer", [0, 1, 2])
def test_packed_attention_bf16(layer):
    """bf16 module and input: packed == separate within one bf16 rounding of the output (measured: 0)."""
    cfg = get_config("debug")
    torch.manual_seed(0)
    attn = DSv4Attention(cfg, layer).eval()
    _randomize(attn)
    attn = attn.to(torch.bfloat16)
    cu, cup, T = _cu(True)
    h = torch.randn(1, T, cfg.hidden_size).to(torch.bfloat16)
    seg, _ = seg_pos_from_cu_seqlens(cu, T, cup)
    with torch.no_grad():
        out = packed_attn(attn, h, cu, cup)
        assert out.dtype == torch.bfloat16
        for d in range(len(LENS)):
            rows = torch.nonzero(seg == d).flatten()
            ref = attn(h[:, rows])[0].float()
            assert (out[0, rows].float() - ref).abs().max().item() <= 2 ** -7 * ref.abs().max().item()


def test_packed_dense_mode_eval_equals_separate():
    """indexer_loss_mode="dense" is a model phase (all causal entries attended, also in eval)."""
    cfg = get_config("debug", indexer_loss_mode="dense")
    torch.manual_seed(0)
    attn = DSv4Attention(cfg, 1).eval()
    _randomize(attn)
    cu, cup, T = _cu(False)
    h = torch.randn(1, T, cfg.hidden_size)
    seg, _ = seg_pos_from_cu_seqlens(cu, T, cup)
    with torch.no_grad():
        out = packed_attn(attn, h, cu, cup)
        for d in range(len(LENS)):
            rows = torch.nonzero(seg == d).flatten()
            assert (out[0, rows] - attn(h[:, rows])[0]).abs().max().item() <= TOL


def test_layout_from_packed_seq_params():
    """A Megatron PackedSeqParams gives the same layout (and output) as its cu_seqlens."""
    from dsv4.model.packed_seq import make_params
    cfg = get_config("debug")
    torch.manual_seed(0)
    attn = DSv4Attention(cfg, 1).eval()
    _randomize(attn)
    cu, cup, T = _cu(True)
    h = torch.randn(1, T, cfg.hidden_size)
    with torch.no_grad():
        lay = Layout.from_packed_seq_params(make_params(cu, cup), (1, T))
        assert torch.equal(attn(h, lay), packed_attn(attn, h, cu, cup))
