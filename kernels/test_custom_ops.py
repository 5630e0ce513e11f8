"""The Triton ops are torch custom ops (`dsv4::*`, kernels/<op>/op.py) with consistent fake implementations and
registered autograd (`torch.library.opcheck`: schema, fake tensors, autograd registration, AOT dispatch), and
`kernels.get_op` is the one dispatch with one-line capability errors. CPU: Triton's interpreter, tiny shapes."""
from dsv4.kernels._testing import CUDA, use_interpreter

use_interpreter()

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
import dsv4.kernels as K  # noqa: E402

DEV = "cuda" if CUDA else "cpu"


def _r(*s, grad=True, dtype=torch.float32):
    return torch.randn(*s, device=DEV, dtype=dtype).requires_grad_(grad)


def _cases():
    torch.manual_seed(0)
    S, B, H, c, ratio = 9, 1, 2, 16, 4
    idx = torch.tensor([[0, -1], [1, 0]], device=DEV).repeat(S // 2 + 1, 1)[:S]             # [S, 2]
    seg, pos = torch.zeros(S, dtype=torch.long, device=DEV), torch.arange(S, device=DEV)   # one document
    eseg, ej = torch.zeros(S // ratio, dtype=torch.long, device=DEV), torch.arange(S // ratio, device=DEV)
    N, n, d = 5, 4, 8
    yield "sparse_attn_fwd", (_r(S, H, c), _r(S, c), _r(S // ratio, c), idx, _r(H), seg, pos, eseg, ej, 4, ratio,
                              0.25, 0)
    yield "sparse_attn_fwd", (_r(S, H, c), _r(S, c), None, None, _r(H), seg, pos, None, None, 4, 0, 0.25, 0)
    cseg = torch.tensor([0] * 6 + [-1] + [1] * 5, device=DEV)                              # 2 documents + padding
    cpos = torch.tensor([0, 1, 2, 3, 4, 5, 0, 0, 1, 2, 3, 4], device=DEV)
    yield "compress_slots_fwd", (cseg, cpos, 2, True, 0)
    ends, eseg, ej, r0, hp = torch.ops.dsv4.compress_slots_fwd(cseg, cpos, 2, True, 0)
    yield "compress_pool_fwd", (_r(12, 2 * c), _r(12, 2 * c), _r(2, 2 * c), r0, hp, cpos, 2, True, 0)
    yield "indexer_scores_fwd", (_r(S, 2, c), _r(S // ratio, c), _r(S, 2), ratio, seg, pos, eseg, ej)
    yield "indexer_scores_listed_fwd", (_r(S, 2, c), _r(S // ratio, c), _r(S, 2), idx)
    yield "sparse_attn_entry_probs", (_r(S, H, c, grad=False), _r(S // ratio, c, grad=False), idx,
                                      _r(S, H, grad=False).abs() + 3, seg, pos, eseg, ej, ratio, 0.25, 0)
    yield "hc_pre_fwd", (_r(N, n, d), _r((2 + n) * n, n * d), _r((2 + n) * n), _r(3), 3, 1e-6, 1e-6)
    yield "hc_post_fwd", (_r(N, n, d), _r(N, d), _r(N, n), _r(N, n, n))
    yield "clamped_swiglu_fwd", (_r(6, 8), _r(6, 8), 0.5)
    yield "rms_norm_fwd", (_r(5, 24), _r(24), 1e-6)
    yield "rms_norm_fwd", (_r(2, 3, 16), None, 1e-6)
    ang = torch.rand(7, 4, device=DEV) * 9
    yield "rope_rows", (_r(7, 2, 12), ang.cos(), ang.sin(), False)
    yield "rope_rows", (_r(7, 1, 8), ang.cos(), ang.sin(), True)


def test_opcheck_every_triton_custom_op():
    K.prepare("triton", torch.device(DEV))
    seen = set()
    for name, args in _cases():
        seen.add(name)
        torch.library.opcheck(getattr(torch.ops.dsv4, name).default, args)
    assert seen >= {n for n in dir(torch.ops.dsv4) if n.endswith("_fwd")} | {"rope_rows"}


def test_get_op_names_what_is_missing(monkeypatch):
    with pytest.raises(ValueError, match="unknown backend 'cuda'; known: naive, triton"):
        K.get_op("sparse_attn", "cuda")
    with pytest.raises(ValueError, match="unknown op 'attn'"):
        K.get_op("attn", "naive")
    monkeypatch.setitem(K._TRITON, "on_cpu", False)       # a process whose Triton kernels are compiled for GPUs
    with pytest.raises(K.KernelUnavailable, match="backend 'triton' needs CUDA or TRITON_INTERPRET=1"):
        K.get_op("hc_post", "triton", torch.device("cpu"))
    assert K.get_op("hc_post", "naive", torch.device("cpu")) is not None
