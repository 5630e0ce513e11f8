"""D6: the packed path runs the Triton kernels -- DSv4Model (debug config, training mode: indexer KL, MoE aux) on a
packed row [1, T] with padded documents, its attention layers on the Triton backend (sparse attention, indexer
scores / top-k, compressor pooling: the kernels that take the document metadata) == the naive backend: logits,
MTP logits, loss, indexer selections and every parameter gradient. CPU: Triton's interpreter, fp32. (The mHC /
SwiGLU Triton kernels are per token, layout-independent, and checked in kernels/mhc, kernels/swiglu: through
the whole model their fp32 reassociation alone gives ~1e-3 relative on the tiny hc_head_scale gradients.)"""
from dsv4.kernels._testing import CUDA, use_interpreter

use_interpreter()

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
from dsv4.model.attention import DSv4Attention  # noqa: E402
from dsv4.model.config import get_config  # noqa: E402
from dsv4.model.model import DSv4Model  # noqa: E402

DEV = "cuda" if CUDA else "cpu"


def test_packed_model_triton_equals_naive():
    torch.manual_seed(0)
    model = DSv4Model(get_config("debug", indexer_loss_coeff=1.0)).to(DEV).train()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("attn_sink") or n.endswith(".ape"):
                p.copy_(torch.randn_like(p) * 0.5)
    cu = torch.tensor([0, 5, 24, 27, 44])
    cup = torch.tensor([0, 8, 28, 31, 48])                   # padded slots, T = 48
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, model.cfg.vocab_size, (1, 48), generator=g).to(DEV)
    labels = torch.randint(0, model.cfg.vocab_size, (1, 48), generator=g).to(DEV)
    params = list(model.parameters())
    res = {}
    for be in ("naive", "triton"):
        for m in model.modules():
            if isinstance(m, DSv4Attention):
                m.backend = be
        out = model(ids, labels, cu_seqlens=cu, cu_seqlens_padded=cup)
        grads = torch.autograd.grad(out.loss, params, allow_unused=True)
        res[be] = (out, grads)
    (o0, g0), (o1, g1) = res["naive"], res["triton"]
    tol = 1e-5 if not CUDA else 2e-3
    rel = lambda a, b: ((a - b).norm() / b.norm().clamp_min(1e-30)).item()   # noqa: E731
    assert rel(o1.logits, o0.logits) <= tol and rel(o1.mtp_logits, o0.mtp_logits) <= tol
    assert abs(o1.loss.item() - o0.loss.item()) <= tol * abs(o0.loss.item())
    assert "indexer loss" in o0.losses and "moe aux loss" in o0.losses
    for k in o0.aux.selections:                              # identical indexer picks
        assert torch.equal(o0.aux.selections[k][0], o1.aux.selections[k][0]), k
    errs = {}                                                # the criterion of test_thd_model (packed == alone)
    for (n, _), a, b in zip(model.named_parameters(), g1, g0):
        assert (a is None) == (b is None), n
        if a is not None:
            errs[n] = (a - b).abs().max().item() / max(1.0, b.abs().max().item())
    assert max(errs.values()) <= tol, sorted(errs.items(), key=lambda kv: -kv[1])[:3]
