"""D1: the attention module with `backend="triton"` equals `backend="naive"` (outputs, gradients of the input and
of every parameter, indexer selection and loss), for each layer kind at an odd length.
CPU: Triton's interpreter (fp32, tight). GPU: same check on CUDA tensors with relative tolerances (fp32 tl.dot may
run as TF32 there)."""
from dsv4.kernels._testing import CUDA, use_interpreter

use_interpreter()

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
from dsv4.model.attention import DSv4Attention  # noqa: E402
from dsv4.model.config import get_config  # noqa: E402
from dsv4.model.losses import AuxLosses  # noqa: E402

DEV = "cuda" if CUDA else "cpu"


def _attn(layer):
    cfg = get_config("debug", indexer_loss_coeff=1.0)
    torch.manual_seed(layer)
    attn = DSv4Attention(cfg, layer).to(DEV).train()
    with torch.no_grad():
        for n, p in attn.named_parameters():
            if p.dim() == 1 or n.endswith("ape"):
                p.copy_(torch.randn_like(p) * 0.3 + (1.0 if "norm" in n else 0.0))
    return cfg, attn


@pytest.mark.parametrize("B", [1, 2])
@pytest.mark.parametrize("layer", [0, 1, 2])
def test_triton_backend_matches_naive_through_the_module(layer, B):
    """B = 2: the rows' entries and selections merged into one attention call (DSv4Attention._merge)."""
    cfg, attn = _attn(layer)
    h = torch.randn(B, 21, cfg.hidden_size, device=DEV, requires_grad=True)
    res = {}
    for be in ("naive", "triton"):
        aux = AuxLosses()
        y = attn(h, aux=aux, backend=be)
        il = aux.indexer[0][0] if aux.indexer else None
        loss = y.square().mean() + (il if il is not None else 0)
        grads = torch.autograd.grad(loss, [h] + list(attn.parameters()), allow_unused=True)
        res[be] = (y.detach(), grads, il, aux.picks(None) if aux.selections else None)
    (y0, g0, l0, s0), (y1, g1, l1, s1) = res["naive"], res["triton"]
    rel = lambda a, b: ((a - b).norm() / b.norm().clamp_min(1e-30)).item()   # noqa: E731
    # CPU (Triton interpreter, fp32): measured worst rel 2.6e-7 (outputs, x3.9) and 8.2e-7 (grads, x12) over
    # harness/numerics.py's 11 simulated hosts (native, ATEN default/avx2/avx512, MKL_CBWR=COMPATIBLE/AVX2,
    # MKL_ENABLE_INSTRUCTIONS=SSE4_2/AVX2, DNNL_MAX_CPU_ISA=AVX2, 2 combinations);
    # CUDA: bf16-rounding bounds (bf16 eps 7.8e-3), not measured here (no GPU)
    tol_y, tol_g = (1e-6, 1e-5) if not CUDA else (2e-3, 1e-2)
    assert rel(y1, y0) <= tol_y, f"layer {layer}: output rel err {rel(y1, y0):.3g}"
    names = ["input"] + [n for n, _ in attn.named_parameters()]
    for n, a, b in zip(names, g1, g0):
        assert (a is None) == (b is None), n
        if a is not None and b.norm() > 0:
            assert rel(a, b) <= tol_g, f"layer {layer}: grad {n} rel err {rel(a, b):.3g}"
    if s0 is not None:
        assert torch.equal(s0, s1)
        assert abs(l0.item() - l1.item()) <= 1e-5 * abs(l0.item()) + 1e-7          # measured 3.0e-8 (11 hosts), x20


@pytest.mark.parametrize("layer", [0, 1, 2])
@pytest.mark.parametrize("backend", ["naive", "triton"])
def test_out_rope_fused_equals_separate(backend, layer):
    """DSv4Model.set_out_rope: the output's inverse RoPE inside the attention op ("fused", default) or after it
    ("separate"). naive: the same ops, bit for bit. triton (interpreter, fp32): outputs and every gradient within
    the tolerances above (summation order only), and autograd keeps one [T, H, c] output tensor fewer."""
    cfg, attn = _attn(layer)
    h = torch.randn(2, 21, cfg.hidden_size, device=DEV, requires_grad=True)
    res, kept = {}, {}
    T, H, c = 2 * 21, cfg.num_attention_heads, cfg.head_dim
    for mode in ("separate", "fused"):
        attn.out_rope = mode
        aux, saved = AuxLosses(), []

        def pack(t):
            saved.append(t)
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = attn(h, aux=aux, backend=backend)
        kept[mode] = len({t.untyped_storage().data_ptr() for t in saved if t.numel() == T * H * c})
        il = aux.indexer[0][0] if aux.indexer else 0
        res[mode] = (y.detach(), torch.autograd.grad(y.square().mean() + il, [h] + list(attn.parameters()),
                                                     allow_unused=True))
    (y0, g0), (y1, g1) = res["separate"], res["fused"]
    if backend == "naive":
        assert torch.equal(y0, y1) and all((a is None and b is None) or torch.equal(a, b) for a, b in zip(g0, g1))
        return
    rel = lambda a, b: ((a - b).norm() / b.norm().clamp_min(1e-30)).item()   # noqa: E731
    tol_y, tol_g = (1e-6, 1e-5) if not CUDA else (2e-3, 1e-2)
    assert rel(y1, y0) <= tol_y
    for a, b in zip(g1, g0):
        assert (a is None) == (b is None)
        if a is not None and b.norm() > 0:
            assert rel(a, b) <= tol_g
    assert kept["fused"] == kept["separate"] - 1, kept


@pytest.mark.parametrize("lens", [(19,), (19, 7, 12), (20,)])
def test_csa_lists_every_visible_entry_streams_them_contiguously(lens, monkeypatch):
    """DSv4Attention._lists_every_visible: when no document is longer than m (k + 1) - 1 tokens (debug: m 4, k 4 ->
    19), the top-k lists every entry a query can see, so the Triton attention is given no selection and streams
    each query's visible range (MODE_ALL) -- the same keys as the naive backend's listed path, in another order.
    (19,) and (19, 7, 12) (a packed row) switch, (20,) (5 visible entries > k) keeps the listed path. Oracle: the
    naive backend, which always attends the listed entries; outputs, every gradient, the selection and the
    indexer loss within the module test's bounds (summation order only)."""
    from dsv4.model import attention as attention_mod
    from dsv4.model.layout import Layout
    cfg, attn = _attn(1)                                           # layer 1: CSA, ratio 4
    T = sum(lens)
    h = torch.randn(1, T, cfg.hidden_size, device=DEV, requires_grad=True)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    seen, second_pass = [], []
    real = attention_mod.sparse_attn
    monkeypatch.setattr(attention_mod, "sparse_attn",
                        lambda *a, **k: seen.append((k["backend"], a[3] is None)) or real(*a, **k))
    from dsv4.model import indexer as indexer_mod                  # the teacher's second pass over the picks
    real_ep = indexer_mod.entry_probs
    monkeypatch.setattr(indexer_mod, "entry_probs",
                        lambda *a, **k: second_pass.append(k["backend"]) or real_ep(*a, **k))
    res = {}
    for be in ("naive", "triton"):
        aux = AuxLosses()
        y = attn(h, Layout.packed(cu, (1, T), device=DEV), aux=aux, backend=be)
        il = aux.indexer[0][0]
        grads = torch.autograd.grad(y.square().mean() + il, [h] + list(attn.parameters()), allow_unused=True)
        res[be] = (y.detach(), grads, il.detach(), aux.picks(None))
    switched = max(lens) // cfg.csa_ratio <= cfg.index_topk
    assert seen == [("naive", False), ("triton", switched)]
    # the Triton forward hands the teacher its mass on the picks in both reads (listed: by pick; contiguous: by
    # each pick's slot in its query's range, `probs_idx`), so only the naive backend runs the second pass
    assert second_pass == ["naive"], second_pass
    (y0, g0, l0, s0), (y1, g1, l1, s1) = res["naive"], res["triton"]
    rel = lambda a, b: ((a - b).norm() / b.norm().clamp_min(1e-30)).item()   # noqa: E731
    # the module test's bounds; measured here (native CPU): outputs 2.8e-7, grads 6.2e-7, loss 7.7e-8 relative
    tol_y, tol_g = (1e-6, 1e-5) if not CUDA else (2e-3, 1e-2)
    assert rel(y1, y0) <= tol_y, f"{lens}: output rel err {rel(y1, y0):.3g}"
    for n, a, b in zip(["input"] + [n for n, _ in attn.named_parameters()], g1, g0):
        assert (a is None) == (b is None), n
        if a is not None and b.norm() > 0:
            assert rel(a, b) <= tol_g, f"{lens}: grad {n} rel err {rel(a, b):.3g}"
    assert torch.equal(s0, s1)
    assert abs(l0.item() - l1.item()) <= 1e-5 * abs(l0.item()) + 1e-7
    attn.all_picked = "listed"                                     # DSv4Model.set_all_picked("listed"): never
    attn(h, Layout.packed(cu, (1, T), device=DEV), aux=AuxLosses(), backend="triton")
    assert seen[-1] == ("triton", False)
