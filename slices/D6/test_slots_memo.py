"""D6: the compressor's slot metadata once per layout (issue 14). `Layout.compress_slots` memoises
kernels.compressor.compress_slots per (ratio, overlap, halo, batch row); DSv4Model.forward fills it before the
blocks run and every compressor of a key (the CSA layers, their indexers, the MTP block) reuses it.

Oracles: the metadata computed fresh (naive and Triton) from the seg / pos the attention actually sees, built
independently of the layout's memo (plain rows; `rank_layout` for a context-parallel rank with its halo); the
model run with the memo bypassed (every compressor computes its own, as before) for bit-identical outputs and
gradients.
"""
from dsv4.kernels._testing import CUDA, use_interpreter

use_interpreter()

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
from dsv4.kernels.compressor import compress_slots  # noqa: E402
from dsv4.model.attention import DSv4Attention, attention_halo  # noqa: E402
from dsv4.model.config import get_config  # noqa: E402
from dsv4.model.context_parallel import _SimRankLayout, contiguous_chunk, rank_layout  # noqa: E402
from dsv4.model.layout import Layout, seg_pos_from_cu_seqlens  # noqa: E402
from dsv4.model.model import DSv4Model  # noqa: E402

CU = torch.tensor([0, 5, 24, 27, 44])                 # odd lengths 5, 19, 3, 17
CUP = torch.tensor([0, 8, 28, 31, 48])                # padded slots, T = 48
DEV = "cuda" if CUDA else "cpu"                      # triton needs CUDA tensors there (no interpreter)
KEYS = [(4, True, 7), (4, False, 7), (4, True, 3), (16, False, 15), (3, True, 0)]   # (ratio, overlap, halo)


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert (torch.equal(x, y) and x.dtype == y.dtype) if isinstance(x, torch.Tensor) else x == y


@pytest.mark.parametrize("backend", ["naive", "triton"])
def test_memo_equals_fresh_metadata(backend):
    """Packed odd-length documents (one row; two rows of a [2, 24] batch) and the ranks of a 3-way CP split with
    their halo: the memo == the metadata computed fresh on both backends, a second call returns the memoised
    object, and keys that differ in ratio, overlap, halo or row never share an entry."""
    layouts = [(Layout.packed(CU, (1, 48), CUP, device=DEV), None)]
    rows = Layout.packed(torch.tensor([0, 7, 24, 37, 48]), (2, 24), device=DEV)    # documents 7+17 | 13+11
    layouts += [(rows, r) for r in range(2)]
    gseg, gpos = (t.to(DEV) for t in seg_pos_from_cu_seqlens(CU, 48, CUP))
    for rank in range(3):
        s, e = contiguous_chunk(48, 3, rank)
        layouts.append((_SimRankLayout(gseg, gpos, s, e, None, {}, rank, 3), ("cp", rank)))
    for lay, row in layouts:
        for ratio, ov, halo in KEYS:
            if isinstance(row, tuple):                                  # a CP rank: its halo rows, then its chunk
                seg, pos = (t.to(DEV) for t in rank_layout(CU, 48, 3, row[1], halo, CUP))
                first, r = halo, None
            elif row is None:
                seg, pos, first, r = lay.seg, lay.pos, 0, None
            else:
                seg, pos, first, r = lay.seg[row * 24:(row + 1) * 24], lay.pos[row * 24:(row + 1) * 24], 0, row
            got = lay.compress_slots(ratio, ov, halo, r, backend)
            for be in ("naive", "triton"):
                _same(got, compress_slots(seg, pos, ratio, ov, first, backend=be))
            assert lay.compress_slots(ratio, ov, halo, r, backend) is got
        assert len(lay._slots) == len(KEYS) * (row + 1 if row in (0, 1) else 1)     # one entry per key
    assert set(rows._slots) == {(m, ov, h, r) for m, ov, h in KEYS for r in range(2)}


def _model(backend):
    torch.manual_seed(0)
    # naive: CSA, HCA, CSA layers and a CSA MTP block (three CSA attentions, six compressors, share one slot
    # entry), the indexer loss on; triton (the interpreter is slow): one CSA layer (main + indexer compressor)
    over = dict(compress_ratios=[4, 16, 4, 4], indexer_loss_coeff=1.0) if backend == "naive" else \
        dict(num_hidden_layers=1, compress_ratios=[4, 0])
    cfg = get_config("debug", **over)
    model = DSv4Model(cfg).train()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("attn_sink") or n.endswith(".ape"):
                p.copy_(torch.randn_like(p) * 0.5)
    for m in model.modules():
        if isinstance(m, DSv4Attention):
            m.backend = backend
    return model


def _run(model, layout, ids, labels):
    out = model(ids, labels, layout=layout)
    grads = torch.autograd.grad(out.loss, list(model.parameters()), allow_unused=True)
    return out, grads


@pytest.mark.parametrize("backend,shape,recompute", [("naive", (1, 48), False), ("naive", (2, 24), True),
                                                      ("triton", (1, 16), False)])
def test_model_bit_identical_with_and_without_memo(backend, shape, recompute, monkeypatch):
    """Logits, MTP logits, loss, indexer picks and every gradient with the memo == with every compressor
    computing its own metadata (bit for bit); after the forward the memo holds exactly one entry per distinct
    (ratio, overlap, halo, row): CSA (main + indexer, all layers) and HCA apart. On the CPU (the triton case in the
    interpreter); a GPU host has no interpreter, and its sparse-attention backward's fp32 atomics make gradients
    bitwise run-to-run different anyway (the metadata test above runs the triton slots on CUDA there)."""
    if backend == "triton" and CUDA:
        pytest.skip("the triton model case runs in the CPU interpreter (none on a GPU host; GPU grads not bitwise)")
    model = _model(backend).set_recompute(recompute)
    cfg = model.cfg
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, cfg.vocab_size, shape, generator=g)
    labels = torch.randint(0, cfg.vocab_size, shape, generator=g)
    cu, cup = {(1, 48): (CU, CUP), (1, 16): (torch.tensor([0, 5, 15]), torch.tensor([0, 6, 16])),
               (2, 24): (torch.tensor([0, 7, 24, 37, 48]), None)}[shape]
    lay = lambda: Layout.packed(cu, shape, cup)                             # noqa: E731
    layout = lay()
    o1, g1 = _run(model, layout, ids, labels)
    rows = [None] if shape[0] == 1 else list(range(shape[0]))
    assert set(layout._slots) == {(m, cfg.layer_kind(i) == "csa", attention_halo(cfg, i), r)
                                  for i, m in enumerate(cfg.compress_ratios) if m for r in rows}
    assert len(layout._slots) == len(rows) * len({m for m in cfg.compress_ratios if m})
    monkeypatch.setattr(DSv4Attention, "_slots", lambda self, *a: None)    # bypass: each compressor computes
    layout0 = lay()
    o0, g0 = _run(model, layout0, ids, labels)
    assert layout0._slots == {}
    for a, b in [(o1.logits, o0.logits), (o1.mtp_logits, o0.mtp_logits), (o1.loss, o0.loss)]:
        assert torch.equal(a, b)
    assert o1.aux.selections.keys() == o0.aux.selections.keys()
    for k in o0.aux.selections:
        assert all(torch.equal(a, b) for a, b in zip(o1.aux.selections[k], o0.aux.selections[k])), k
    for n, a, b in zip([n for n, _ in model.named_parameters()], g1, g0):
        assert (a is None and b is None) or torch.equal(a, b), n


def test_compiled_code_reads_the_memo_and_never_fills_it():
    """Under torch.compile a miss is computed in the graph and not stored (no side effect on the layout, nothing
    a CUDA graph would own); an eagerly filled entry is read as a graph input."""
    layout = Layout.packed(CU, (1, 48), CUP)
    f = torch.compile(lambda lay: lay.compress_slots(4, True, 7).r0 + 1, backend="eager", fullgraph=True)
    fresh = compress_slots(layout.seg, layout.pos, 4, True, 0)
    assert torch.equal(f(layout), fresh.r0 + 1) and layout._slots == {}
    s = layout.compress_slots(4, True, 7)
    assert torch.equal(f(layout), s.r0 + 1) and list(layout._slots) == [(4, True, 7, None)]
