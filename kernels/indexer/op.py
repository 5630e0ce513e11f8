"""`dsv4::indexer_scores_fwd` / `dsv4::indexer_scores_bwd`: the Triton lightning-indexer scores as torch custom
ops (opaque to torch.compile; fake implementations for shapes). The bodies run `triton._IndexerScores`'s
forward / backward with a plain ctx record (`FnCtx`), so the numerics are those of the autograd.Function.
Packed layout (the contract of `naive.indexer_scores`): qI [Tq,nI,cI], kI [N,cI], w [Tq,nI], document metadata.
`dsv4::indexer_topk`: the radix-select top-k (topk.py), no autograd.

Backend "triton+cudnn" (`indexer_scores_cudnn`, kernels/indexer/cudnn_fwd.py): cuDNN's SM90 indexer forward (bf16 or
FP8 E4M3) as custom op `dsv4::indexer_scores_cudnn_fwd`, same output as `dsv4::indexer_scores_fwd` and the same
registered backward (`dsv4::indexer_scores_bwd`, Triton) when cudnn-frontend is importable and the call qualifies;
otherwise the Triton forward above."""
import torch

from dsv4.kernels._custom_op import autograd_op, backward_op, traced
from dsv4.kernels._triton_util import FnCtx
from dsv4.kernels.indexer import cudnn_fwd as CF
from dsv4.kernels.indexer import naive
from dsv4.kernels.indexer import topk as TK
from dsv4.kernels.indexer import triton as T

Tensor = torch.Tensor


def _indexer_scores_fwd(qI: Tensor, kI: Tensor, w: Tensor, ratio: int, seg_q: Tensor, pos_q: Tensor,
                        entry_seg: Tensor, entry_j: Tensor) -> Tensor:
    return T._IndexerScores.forward(FnCtx(), qI, kI, w, ratio, seg_q, pos_q, entry_seg, entry_j)


indexer_scores_fwd = torch.library.custom_op("dsv4::indexer_scores_fwd", mutates_args=())(_indexer_scores_fwd)


@indexer_scores_fwd.register_fake
def _(qI, kI, w, ratio, seg_q, pos_q, entry_seg, entry_j):
    return qI.new_empty(qI.shape[0], kI.shape[0], dtype=torch.float32)


def _indexer_scores_bwd(dI: Tensor, qI: Tensor, kI: Tensor, w: Tensor, ratio: int, seg_q: Tensor, pos_q: Tensor,
                        entry_seg: Tensor, entry_j: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    ctx = FnCtx()                                      # what _IndexerScores.forward leaves
    ctx.save_for_backward(qI.contiguous(), kI.contiguous(), w.contiguous(),
                          *T._meta(seg_q, pos_q, entry_seg, entry_j))
    ctx.cfg = (ratio, qI.shape[1] ** -0.5 * qI.shape[2] ** -0.5)
    dq, dk, dw, *_ = T._IndexerScores.backward(ctx, dI)
    return dq, dk, dw


indexer_scores_bwd = torch.library.custom_op("dsv4::indexer_scores_bwd", mutates_args=())(_indexer_scores_bwd)


@indexer_scores_bwd.register_fake
def _(dI, qI, kI, w, ratio, seg_q, pos_q, entry_seg, entry_j):
    return qI.new_empty(qI.shape), kI.new_empty(kI.shape), w.new_empty(w.shape)


def _setup(ctx, inputs, output):
    qI, kI, w, ratio, seg_q, pos_q, entry_seg, entry_j = inputs
    ctx.save_for_backward(qI, kI, w, seg_q, pos_q, entry_seg, entry_j)
    ctx.ratio = int(ratio)


def _backward(ctx, dI):
    qI, kI, w, seg_q, pos_q, entry_seg, entry_j = ctx.saved_tensors
    bwd = backward_op(ctx, indexer_scores_bwd, _indexer_scores_bwd)
    dq, dk, dw = bwd(dI, qI, kI, w, ctx.ratio, seg_q, pos_q, entry_seg, entry_j)
    return dq, dk, dw, None, None, None, None, None


_scores = autograd_op(indexer_scores_fwd, _indexer_scores_fwd, _setup, _backward)


def indexer_scores(qI: Tensor, kI: Tensor, w: Tensor, ratio: int, seg_q: Tensor, pos_q: Tensor, entry_seg: Tensor,
                   entry_j: Tensor) -> Tensor:
    """qI [Tq,nI,cI], kI [N,cI], w [Tq,nI], metadata -> I [Tq,N] fp32 (-inf where not visible), Triton custom op."""
    naive.check_scores_args(qI, kI, w, ratio, seg_q, pos_q, entry_seg, entry_j)
    return _scores(qI, kI, w, int(ratio), seg_q, pos_q, entry_seg, entry_j)



# ------------------------------------------------------------------ scores at the listed entries (sparse-mode loss)
# The Triton kernels of `triton.listed_scores` / `listed_scores_bwd` (the math is written there), recomputed in
# backward, registered as custom ops so the compiler sees one node. They replace a chunked PyTorch version whose
# [512, k, cI] gathers of kI were 34 of a 4K CUDA-graph step's launches (5.1 of its 69 ms of kernels, H200).


def _indexer_scores_listed_fwd(qI: Tensor, kI: Tensor, w: Tensor, idx: Tensor) -> Tensor:
    return T.listed_scores(qI, kI, w, idx)


indexer_scores_listed_fwd = torch.library.custom_op("dsv4::indexer_scores_listed_fwd",
                                                    mutates_args=())(_indexer_scores_listed_fwd)


@indexer_scores_listed_fwd.register_fake
def _(qI, kI, w, idx):
    return qI.new_empty(idx.shape, dtype=torch.float32)


def _indexer_scores_listed_bwd(dI: Tensor, qI: Tensor, kI: Tensor, w: Tensor,
                               idx: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return T.listed_scores_bwd(dI, qI, kI, w, idx)


indexer_scores_listed_bwd = torch.library.custom_op("dsv4::indexer_scores_listed_bwd",
                                                    mutates_args=())(_indexer_scores_listed_bwd)


@indexer_scores_listed_bwd.register_fake
def _(dI, qI, kI, w, idx):
    return qI.new_empty(qI.shape), kI.new_empty(kI.shape), w.new_empty(w.shape)


def _setup_listed(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward_listed(ctx, dI):
    qI, kI, w, idx = ctx.saved_tensors
    dq, dk, dw = backward_op(ctx, indexer_scores_listed_bwd, _indexer_scores_listed_bwd)(dI, qI, kI, w, idx)
    return dq, dk, dw, None


_scores_listed = autograd_op(indexer_scores_listed_fwd, _indexer_scores_listed_fwd, _setup_listed, _backward_listed)


def indexer_scores_listed(qI: Tensor, kI: Tensor, w: Tensor, idx: Tensor) -> Tensor:
    """`naive.indexer_scores_listed` by the Triton kernels (custom op; CUDA or Triton's interpreter), the scores
    recomputed in backward."""
    return _scores_listed(qI, kI, w, idx)


# ------------------------------------------------------------------ top-k (no autograd: indices)
def _indexer_topk(I: Tensor, k: int) -> Tensor:
    return TK.indexer_topk(I, k, sort_max_n=TK.SORT_MAX_N, row_max_n=TK.ROW_MAX_N)


indexer_topk_op = torch.library.custom_op("dsv4::indexer_topk", mutates_args=())(_indexer_topk)


@indexer_topk_op.register_fake
def _(I, k):
    return I.new_empty(*I.shape[:-1], min(k, I.shape[-1]), dtype=torch.long)


def indexer_topk(I: Tensor, k: int) -> Tensor:
    """I [..., N] -> idx [..., min(k, N)] long == `naive.indexer_topk`: rows of up to topk.ROW_MAX_N entries
    on registers (topk.row_topk), longer ones by radix select per chunk of rows (topk.py); the custom op while traced, the body
    directly in eager."""
    if k < 1:
        raise ValueError(f"indexer_topk: k must be >= 1, got {k}")
    return indexer_topk_op(I, int(k)) if traced((I,)) else _indexer_topk(I, int(k))


# ------------------------------------------------ backend "triton+cudnn": cuDNN's SM90 indexer forward (cudnn_fwd.py)
def _indexer_scores_cudnn_fwd(qI: Tensor, kI: Tensor, w: Tensor, ratio: int, seg_q: Tensor, pos_q: Tensor,
                              entry_seg: Tensor, entry_j: Tensor, precision: str) -> Tensor:
    """cuDNN's indexer forward (cudnn_fwd.forward) -> I [Tq,N] fp32: the output of `dsv4::indexer_scores_fwd`, so
    `dsv4::indexer_scores_bwd` (which reads only the inputs) is its backward."""
    fn, why = CF.load()
    if fn is None:
        raise RuntimeError(f"dsv4::indexer_scores_cudnn_fwd: {why}")
    return CF.forward(fn, qI, kI, w, ratio, seg_q, pos_q, entry_seg, entry_j, precision)


indexer_scores_cudnn_fwd = torch.library.custom_op("dsv4::indexer_scores_cudnn_fwd",
                                                   mutates_args=())(_indexer_scores_cudnn_fwd)


@indexer_scores_cudnn_fwd.register_fake
def _(qI, kI, w, ratio, seg_q, pos_q, entry_seg, entry_j, precision):
    return qI.new_empty(qI.shape[0], kI.shape[0], dtype=torch.float32)


def _setup_cudnn(ctx, inputs, output):
    _setup(ctx, inputs[:8], output)                     # the Triton forward's record: the backward is ours


def _backward_cudnn(ctx, dI):
    return _backward(ctx, dI) + (None,)                 # no gradient for precision


indexer_scores_cudnn_fwd.register_autograd(_backward_cudnn, setup_context=_setup_cudnn)


class _CudnnEager(torch.autograd.Function):
    """The eager call (as `_custom_op.autograd_op`'s, skipping the dispatcher) with the cuDNN function `fn` an
    explicit argument: indexer_forward_wrapper, or a stand-in with its signature and returns (the CPU tests)."""

    @staticmethod
    def forward(ctx, fn, *args):
        out = CF.forward(fn, *args)
        _setup_cudnn(ctx, args, out)
        ctx.eager = True
        return out

    @staticmethod
    def backward(ctx, dI):
        return (None,) + _backward_cudnn(ctx, dI)


def indexer_scores_cudnn(qI: Tensor, kI: Tensor, w: Tensor, ratio: int, seg_q: Tensor, pos_q: Tensor,
                         entry_seg: Tensor, entry_j: Tensor, precision: str = "bf16", *, fwd_fn=None,
                         capability=None) -> Tensor:
    """Backend "triton+cudnn": cuDNN's SM90 indexer forward + our Triton backward when the call qualifies
    (`cudnn_fwd.unqualified`: importable, SM90, cI 128, nI 16/32/64 (fp8: 32/64), bf16 qI / kI at "bf16"), else
    `indexer_scores` (the Triton forward and backward). Same contract and returns as `indexer_scores`.
    precision: "bf16" | "fp8" -- "fp8" says qI / kI are the indexer's FP8 features (kernels/indexer/fp4.py
    qk_fake_quant: e4m3 times one power-of-two scale per row), which cuDNN then scores in FP8 E4M3 with per-token
    descales; the Triton fallback scores the same features in fp32. fwd_fn: a stand-in with indexer_forward_wrapper's
    signature and returns (tests; eager only); None: the real one. capability: the device's (major, minor) (None:
    read from qI's device)."""
    naive.check_scores_args(qI, kI, w, ratio, seg_q, pos_q, entry_seg, entry_j)
    fn = CF.load()[0] if fwd_fn is None else fwd_fn
    cap = CF.capability(qI) if capability is None else capability
    why = CF.unqualified(qI, kI, w, precision, fn, cap)
    if why is not None:
        if why.startswith("precision must be"):
            raise ValueError(f"indexer_scores_cudnn: {why}")
        return indexer_scores(qI, kI, w, ratio, seg_q, pos_q, entry_seg, entry_j)
    args = (qI, kI, w, int(ratio), seg_q, pos_q, entry_seg, entry_j, str(precision))
    if traced(args):
        if fwd_fn is not None:
            raise ValueError("indexer_scores_cudnn: a stand-in fwd_fn runs eagerly only, not under torch.compile")
        return indexer_scores_cudnn_fwd(*args)
    return _CudnnEager.apply(fn, *args)
