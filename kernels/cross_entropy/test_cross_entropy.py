"""Cross-entropy rows: Triton == naive (kernels/cross_entropy) at odd shapes, an fp64 oracle written here, and the
head's blocked loss (model/model.py head_cross_entropy) on both backends in values and gradients, with an fp64
gradcheck through the Triton kernels. CPU: Triton's interpreter in fp32 / fp64 (its fp32 -> bf16 stores truncate,
kernels/PERF_NOTES.md, so bf16 is judged on the GPU only, at the `proxy` head's shapes)."""
from dsv4.kernels._testing import CUDA, assert_rel, use_interpreter

use_interpreter()

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
from dsv4.kernels.cross_entropy import naive  # noqa: E402
from dsv4.kernels.cross_entropy import triton as T  # noqa: E402
from dsv4.model.model import HEAD_CE, IGNORE, head_cross_entropy  # noqa: E402

DEV = "cuda" if CUDA else "cpu"


def _oracle(logits, labels, scale):
    """fp64 loops written from the formula: lse_r = log sum_v exp(l_rv); dl_rv = s_r (softmax_rv - [v = y_r])."""
    l = logits.double()
    lse = torch.stack([torch.log(torch.exp(r - r.max()).sum()) + r.max() for r in l])
    tgt = torch.stack([l[i, int(y)] for i, y in enumerate(labels)])
    onehot = torch.zeros_like(l)
    onehot[torch.arange(len(labels)), labels] = 1.0
    return lse, tgt, scale.double()[:, None] * (torch.exp(l - lse[:, None]) - onehot)


@pytest.mark.parametrize("C,V", [(7, 1000), (3, 1), (5, 256), (1, 513)])
@pytest.mark.parametrize("dt", [torch.float32, torch.float64])
def test_triton_matches_naive_and_the_oracle(C, V, dt):
    g = torch.Generator().manual_seed(C * 1000 + V)
    logits = (torch.randn(C, V, generator=g) * 4).to(dt).to(DEV)
    labels = torch.randint(0, V, (C,), generator=g).to(DEV)
    labels[0] = V - 1                                                          # the last column
    scale = torch.rand(C, generator=g).to(torch.promote_types(dt, torch.float32)).to(DEV)
    scale[-1] = 0.0                                                            # an ignored row
    lse_n, tgt_n = naive.ce_lse(logits, labels)
    lse_t, tgt_t = T.ce_lse(logits, labels)
    assert lse_t.dtype == lse_n.dtype and tgt_t.dtype == tgt_n.dtype
    # fp32: the online log-sum-exp sums in another order than torch.logsumexp; measured worst 1 ulp (|diff|
    # 1.9e-6 at |lse| ~ 20, V up to 32768, on the interpreter), margin x4 -> rtol 4 ulps = 5e-7 (fp64: 1e-14)
    tol = 5e-7 if dt == torch.float32 else 1e-14
    torch.testing.assert_close(lse_t, lse_n, atol=0, rtol=tol)
    assert torch.equal(tgt_t, tgt_n)                                           # a copy of one element: exact
    dl_n = naive.ce_dlogits(logits, lse_n, labels, scale)
    dl_t = T.ce_dlogits(logits, lse_n, labels, scale)                         # same lse: the same fp32 formula
    # the same formula from the same lse; exp's rounding differs (measured worst 6.0e-8 absolute), margin x4
    torch.testing.assert_close(dl_t, dl_n, atol=2.5e-7 if dt == torch.float32 else 1e-15, rtol=0)
    lse_o, tgt_o, dl_o = _oracle(logits.cpu(), labels.cpu(), scale.cpu())
    torch.testing.assert_close(lse_t.cpu().double(), lse_o, atol=0, rtol=2 * tol)
    torch.testing.assert_close(tgt_t.cpu().double(), tgt_o, atol=0, rtol=0)
    torch.testing.assert_close(dl_t.cpu().double(), dl_o, atol=1e-6 if dt == torch.float32 else 1e-13, rtol=0)
    assert (dl_t[-1] == 0).all()                                               # scale 0: no gradient


def test_empty_block_and_bad_shapes():
    e = torch.empty(0, 5, device=DEV)
    lse, tgt = T.ce_lse(e, torch.empty(0, dtype=torch.long, device=DEV))
    assert lse.shape == (0,) and tgt.shape == (0,)
    with pytest.raises(ValueError, match=r"logits \[C, V\] and labels \[C\]"):
        T.ce_lse(torch.zeros(3, 4, device=DEV), torch.zeros(2, dtype=torch.long, device=DEV))
    with pytest.raises(ValueError, match="contiguous"):
        T.ce_lse(torch.zeros(4, 3, device=DEV).t(), torch.zeros(3, dtype=torch.long, device=DEV))


def _head_case(N, d, V, dt, seed):
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(N, d, generator=g, dtype=dt).to(DEV)
    W = (torch.randn(V, d, generator=g, dtype=dt) * 0.5).to(DEV)
    lab = torch.randint(0, V, (N,), generator=g).to(DEV)
    lab[::4] = IGNORE
    return y, W, lab


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_head_cross_entropy_triton_equals_naive(reduction):
    """The model's blocked head loss (3 blocks, the last one short) on both backends: loss and dy / dW."""
    y, W, lab = _head_case(23, 16, 300, torch.float32, 3)
    out = {}
    for backend in ("naive", "triton"):
        yy, WW = y.clone().requires_grad_(), W.clone().requires_grad_()
        loss = head_cross_entropy(yy, WW, lab, chunk=10, reduction=reduction, backend=backend)
        loss.backward()
        out[backend] = (loss.detach(), yy.grad, WW.grad)
    for name, a, b in zip(("loss", "dy", "dW"), out["triton"], out["naive"]):
        # lse's 1-ulp reorder (test above) reaches the loss and, through exp(l - lse), the gradients: measured
        # worst 7.4e-8 relative (dy), margin x13 -> 1e-6
        assert_rel(name, a, b, 1e-6)


@pytest.mark.parametrize("grads", HEAD_CE)
def test_head_cross_entropy_gradcheck_fp64_through_triton(grads):
    y, W, lab = _head_case(6, 5, 37, torch.float64, 4)
    y.requires_grad_(), W.requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: head_cross_entropy(a, b, lab, chunk=4, backend="triton",
                                                                    grads=grads), (y, W))


GPU_ONLY = pytest.mark.skipif(not CUDA, reason="bf16 kernels are judged on the GPU (the interpreter's bf16 stores truncate)")


def _bf16_rows_on_gpu(C, V, seed):
    """Triton vs naive on a bf16 [C, V] block by relative norm: lse in fp32 from the same bf16 logits (1e-6), the
    target logit exact, dlogits rounded to bf16 once on each side (1e-2). labels[0] = V - 1, the last column."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(C, V, generator=g) * 3).to(torch.bfloat16).cuda()
    labels = torch.randint(0, V, (C,), generator=g).cuda()
    labels[0] = V - 1
    scale = torch.rand(C, generator=g).cuda()
    lse_n, tgt_n = naive.ce_lse(logits, labels)
    lse_t, tgt_t = T.ce_lse(logits, labels)
    assert_rel("lse", lse_t, lse_n, 1e-6)
    assert torch.equal(tgt_t, tgt_n)
    assert_rel("dlogits", T.ce_dlogits(logits, lse_n, labels, scale), naive.ce_dlogits(logits, lse_n, labels, scale),
               1e-2)


@GPU_ONLY
def test_full_vocab_partial_last_block_bf16_on_gpu():
    """DSv4's vocabulary V = 129280 = 31 x 4096 + 2304: the GPU's BLOCK_V = 4096 loop ends on a partial block (the
    proxy's V = 32768 divides evenly)."""
    _bf16_rows_on_gpu(64, 129280, 1)


@GPU_ONLY
def test_proxy_head_bf16_on_gpu():
    """The proxy head's block: C = 8192 rows, V = 32768."""
    _bf16_rows_on_gpu(8192, 32768, 0)


@GPU_ONLY
def test_head_grad_in_forward_equals_recompute_bf16_on_gpu():
    """The proxy head at 16K rows (2 blocks of 8192, V = 32768, d = 2048), bf16, both gradient modes of the model's
    head loss under an upstream gradient of 0.3 (the MTP coefficient's role): the same loss (the forward is the
    same code), dy / dW by relative norm 1e-2 (the dlogits are rounded to bf16 scaled by 1 / n instead of
    0.3 / n, and dy then rounded once more after the scaling: 2.5 bf16 unit roundoffs)."""
    g = torch.Generator().manual_seed(5)
    y = (torch.randn(16384, 2048, generator=g) * 0.5).to(torch.bfloat16).cuda()
    W = (torch.randn(32768, 2048, generator=g) * 0.02).to(torch.bfloat16).cuda()
    lab = torch.randint(0, 32768, (16384,), generator=g).cuda()
    lab[::7] = IGNORE
    out = {}
    for grads in HEAD_CE:
        yy, WW = y.clone().requires_grad_(), W.clone().requires_grad_()
        loss = head_cross_entropy(yy, WW, lab, reduction="mean", backend="triton", grads=grads)
        (0.3 * loss).backward()
        out[grads] = (loss.detach(), yy.grad, WW.grad)
    (la, dya, dwa), (lb, dyb, dwb) = out["grad_in_forward"], out["recompute"]
    assert torch.equal(la, lb)
    assert_rel("dy", dya, dyb, 1e-2)
    assert_rel("dW", dwa, dwb, 1e-2)


@GPU_ONLY
def test_head_dw_blocks_are_formed_in_fp32_on_gpu():
    """On CUDA the head's dW blocks are written / added by the GEMM in fp32 (`_dw_add`: mm / addmm `out_dtype`),
    never rounded to bf16 between blocks: 3 blocks of bf16 dlogits and y against the fp64 sum of the same bf16
    operands, relative norm 1e-5 (fp32 accumulation over 512-row blocks is ~1e-7). The old form, each block's
    product rounded to bf16 and then added, is ~2e-3 off, and the check below shows this test tells them apart."""
    from dsv4.model.model import _dw_add
    g = torch.Generator().manual_seed(7)
    gls = [(torch.randn(512, 1024, generator=g) * 1e-3).to(torch.bfloat16).cuda() for _ in range(3)]
    ys = [torch.randn(512, 256, generator=g).to(torch.bfloat16).cuda() for _ in range(3)]
    acc = None
    for gl, yb in zip(gls, ys):
        acc = _dw_add(acc, gl, yb, torch.float32)
    ref = sum(gl.double().t() @ yb.double() for gl, yb in zip(gls, ys))
    assert acc.dtype == torch.float32
    assert_rel("dW in fp32", acc, ref, 1e-5)
    rounded = sum((gl.t() @ yb).float() for gl, yb in zip(gls, ys))
    assert ((rounded.double() - ref).norm() / ref.norm()).item() > 1e-4


@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float32])
def test_head_grad_in_forward_scales_once_in_fp32(dt):
    """grad_in_forward's backward: the gradients are the kept dy / dW (at g = 1) times the upstream g formed in
    fp32 and rounded once to the parameters' dtype, bit for bit. g = 0.37 is not a bf16 number, so a product
    formed in bf16 (a 0-d fp32 g cast to the bf16 operand's dtype, as a CUDA elementwise kernel may do) fails.
    Also: 3 blocks of 16 (the first block's dW taken as it is, the later ones added in place) equal one block."""
    g = torch.Generator().manual_seed(6)
    y = torch.randn(40, 32, generator=g).to(dt).to(DEV).requires_grad_()
    W = (torch.randn(64, 32, generator=g) * 0.2).to(dt).to(DEV).requires_grad_()
    lab = torch.randint(0, 64, (40,), generator=g).to(DEV)
    loss = head_cross_entropy(y, W, lab, chunk=16, grads="grad_in_forward")
    dy1, dw1 = loss.grad_fn.saved_tensors                     # dy in y's dtype, dW in fp32, at g = 1
    assert dw1.dtype == torch.float32
    up = torch.tensor(0.37, device=DEV)
    hy, hW = torch.autograd.grad(loss, (y, W), up)
    assert torch.equal(hy, (dy1.float() * up).to(dt))
    assert torch.equal(hW, (dw1 * up).to(dt))
    one = head_cross_entropy(y, W, lab, chunk=64, grads="grad_in_forward")
    _, dw_one = one.grad_fn.saved_tensors
    # fp32 sums of 3 block products vs one product over all rows: rounding of the block order only. Measured on
    # this host (CPU): fp32 2.2e-8 abs (|dW| <= 0.11), bound 2e-7 (x9); bf16 (on CPU each block's product is
    # rounded to bf16 first; on CUDA the GEMM adds it in fp32, `_dw_add`) 2.4e-3 by relative norm, bound 1e-2 (x4)
    torch.testing.assert_close(dw1, dw_one, atol=2e-7, rtol=0) if dt == torch.float32 else \
        assert_rel("dW blocks", dw1, dw_one, 1e-2)
