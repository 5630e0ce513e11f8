"""D6: Megatron's entry points (DSv4Attention.forward_megatron, DSv4Model.forward_megatron) convert at the edge.

Megatron's attention takes hidden states [s, b, h] and a PackedSeqParams (megatron.core.packed_seq_params:
qkv_format 'thd' | 'sbhd', cu_seqlens_q / kv (+ _padded)). The entry points build the one Layout from those
fields and run the same forward, so on the debug config (window, CSA, HCA layers; the model with mHC, MoE, MTP):
- SBHD [s, b, d] == BSHD [b, s, d] bit for bit (outputs, indexer selections, gradients), plain batch and packed
  THD [t, 1, d] (== forward on Layout.packed); the model's logits, MTP logits, loss and gradients too;
- an sbhd batch with per-row lengths (Transformer Engine's padding mask) == each row's real tokens alone
  (TOL: test_thd_model.py's stated fp32 bound, measured cross-host worst 7.0e-7 x14);
- a bad qkv_format, a 'thd' batch with b > 1, an attention_mask, stream-wide position_ids: one-line errors.
"""
from types import SimpleNamespace

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams

from dsv4.model.config import get_config
from dsv4.model.layout import Layout, LayoutError
from dsv4.model.losses import AuxLosses
from dsv4.model.model import DSv4Model

LENS = [6, 21, 3, 34, 9]          # odd lengths; 34 > one HCA window (m' = 16)
PADDED = [6, 24, 3, 36, 9]        # docs 1, 3 followed by padding
IGNORE = -100
TOL = 1e-5                        # test_thd_model.py: the slice's fp32 bound (logits cross-host worst 7.0e-7)


def _cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


def _thd_params(cls=PackedSeqParams):
    cu, cup = _cu(LENS), _cu(PADDED)
    return cls(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cup,
               cu_seqlens_kv_padded=cup, max_seqlen_q=max(PADDED), max_seqlen_kv=max(PADDED)), cu, cup


from dsv4.slices.D6.cases import _attn  # noqa: E402  (the packed-attention cases' layer builder)


def _run(fn, attn, h):
    """(out, selections, grads of input + parameters) of fn(h, aux) with a fixed random cotangent."""
    aux = AuxLosses()
    h = h.detach().requires_grad_(True)
    out = fn(h, aux)
    r = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    grads = torch.autograd.grad((out * r).sum(), [h] + list(attn.parameters()), allow_unused=True)
    return out, aux.selections, grads


def _assert_same(a, b):
    (oa, sa, ga), (ob, sb, gb) = a, b
    assert torch.equal(oa, ob)
    assert sa.keys() == sb.keys() and all(torch.equal(x, y) for k in sa for x, y in zip(sa[k], sb[k]))
    for x, y in zip(ga, gb):
        assert (x is None and y is None) or torch.equal(x, y)


@pytest.mark.parametrize("layer", [0, 1, 2])               # debug config: window, CSA (m=4), HCA (m'=16)
def test_attention_sbhd_plain_batch_equals_bshd(layer):
    attn = _attn(layer)
    h = torch.randn(2, 40, attn.cfg.hidden_size, generator=torch.Generator().manual_seed(2))     # [b, s, d]
    ref = _run(lambda x, aux: attn(x, None, aux), attn, h)
    for psp in (None, SimpleNamespace(qkv_format="sbhd"), PackedSeqParams(qkv_format="sbhd")):
        got = _run(lambda x, aux: attn.forward_megatron(x.transpose(0, 1), psp, aux).transpose(0, 1), attn, h)
        _assert_same(got, ref)


@pytest.mark.parametrize("layer", [0, 1, 2])
def test_attention_thd_equals_packed_bshd(layer):
    attn = _attn(layer)
    T = sum(PADDED)
    h = torch.randn(1, T, attn.cfg.hidden_size, generator=torch.Generator().manual_seed(2))      # [1, t, d]
    for cls in (PackedSeqParams, SimpleNamespace):          # Megatron's dataclass, and any object with its fields
        psp, cu, cup = _thd_params(cls)
        ref = _run(lambda x, aux: attn(x, Layout.packed(cu, (1, T), cup), aux), attn, h)
        got = _run(lambda x, aux: attn.forward_megatron(x.transpose(0, 1), psp, aux).transpose(0, 1), attn, h)
        _assert_same(got, ref)
        assert bool(got[1]) == (layer == 1)                 # CSA: the indexer selections were compared


def _model():
    torch.manual_seed(0)
    return DSv4Model(get_config("debug"))


def _model_run(model, fn):
    out = fn()
    grads = torch.autograd.grad(out.loss, list(model.parameters()), allow_unused=True)
    return out, grads


def _assert_same_model(a, b):
    (oa, ga), (ob, gb) = a, b
    assert torch.equal(oa.logits, ob.logits) and torch.equal(oa.mtp_logits, ob.mtp_logits)
    assert torch.equal(oa.loss, ob.loss)
    for x, y in zip(ga, gb):
        assert (x is None and y is None) or torch.equal(x, y)


def test_model_megatron_plain_and_thd_equal_forward():
    model = _model()
    V = model.cfg.vocab_size
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, V, (2, 32), generator=g)
    labels = torch.randint(0, V, (2, 32), generator=g)
    ref = _model_run(model, lambda: model(ids, labels))
    pos = torch.arange(32).expand(2, 32)                    # Megatron's default position_ids
    got = _model_run(model, lambda: model.forward_megatron(ids, pos, None, labels))
    _assert_same_model(got, ref)

    psp, cu, cup = _thd_params()
    T = sum(PADDED)
    ids = torch.randint(0, V, (1, T), generator=g)
    labels = torch.randint(0, V, (1, T), generator=g)
    ref = _model_run(model, lambda: model(ids, labels, cu_seqlens=cu, cu_seqlens_padded=cup))
    got = _model_run(model, lambda: model.forward_megatron(ids, labels=labels, packed_seq_params=psp))
    _assert_same_model(got, ref)


def test_model_sbhd_padded_rows_equal_each_row_alone():
    """sbhd with cu_seqlens_q [b+1]: row i's first len_i tokens are document i, the rest padding."""
    model = _model().eval()
    lens, S = [20, 32, 7], 32
    ids = torch.randint(0, model.cfg.vocab_size, (3, S), generator=torch.Generator().manual_seed(2))
    psp = PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=_cu(lens), cu_seqlens_kv=_cu(lens))
    with torch.no_grad():
        out = model.forward_megatron(ids, packed_seq_params=psp)
        for r, n in enumerate(lens):
            alone = model(ids[r:r + 1, :n])
            assert (out.logits[r, :n] - alone.logits[0]).abs().max().item() <= TOL
            assert (out.mtp_logits[r, :n] - alone.mtp_logits[0]).abs().max().item() <= TOL


def _one_line(excinfo, field):
    msg = str(excinfo.value)
    assert "\n" not in msg and msg.startswith(field), msg


@pytest.mark.parametrize("fmt", ["bshd", None, "THD"])
def test_bad_qkv_format_is_one_line(fmt):
    attn, model = _attn(1), _model()
    psp = SimpleNamespace(qkv_format=fmt, cu_seqlens_q=_cu(LENS))
    with pytest.raises(LayoutError) as e:
        attn.forward_megatron(torch.zeros(sum(LENS), 1, attn.cfg.hidden_size), psp)
    _one_line(e, "packed_seq_params.qkv_format")
    with pytest.raises(LayoutError) as e:
        model.forward_megatron(torch.zeros(1, sum(LENS), dtype=torch.long), packed_seq_params=psp)
    _one_line(e, "packed_seq_params.qkv_format")


def test_other_bad_megatron_inputs_are_one_line():
    attn, model = _attn(0), _model()
    psp, cu, cup = _thd_params()
    T = sum(PADDED)
    cases = [
        (lambda: attn.forward_megatron(torch.zeros(T, 2, attn.cfg.hidden_size), psp), "packed_seq_params.qkv_format"),
        (lambda: model.forward_megatron(torch.zeros(1, T, dtype=torch.long), torch.arange(T)[None], None, None, psp),
         "position_ids"),                                   # stream-wide positions: DSv4 restarts per document
        (lambda: model.forward_megatron(torch.zeros(1, T, dtype=torch.long), None, torch.ones(1, 1, T, T), None, psp),
         "attention_mask"),
        (lambda: model.forward_megatron(torch.zeros(2, 8, dtype=torch.long),
                                        packed_seq_params=PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=_cu([8, 9]))),
         "packed_seq_params.cu_seqlens_q"),
        (lambda: model.forward_megatron(torch.zeros(1, T, dtype=torch.long), packed_seq_params=PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=_cu(PADDED))), "packed_seq_params.cu_seqlens_kv"),
    ]
    for fn, field in cases:
        with pytest.raises(LayoutError) as e:
            fn()
        _one_line(e, field)
