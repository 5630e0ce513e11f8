"""`dsv4::indexer_scores_fwd` / `dsv4::indexer_scores_bwd`: the Triton lightning-indexer scores as torch custom
ops (opaque to torch.compile; fake implementations for shapes). The bodies run `triton._IndexerScores`'s
forward / backward with a plain ctx record (`FnCtx`), so the numerics are those of the autograd.Function.
Packed layout (the contract of `naive.indexer_scores`): qI [Tq,nI,cI], kI [N,cI], w [Tq,nI], document metadata.
Top-k (`indexer_topk`) is plain PyTorch (a stable sort) and needs no registration."""
import torch

from dsv4.kernels._triton_util import FnCtx
from dsv4.kernels.indexer import naive
from dsv4.kernels.indexer import triton as T

Tensor = torch.Tensor


@torch.library.custom_op("dsv4::indexer_scores_fwd", mutates_args=())
def indexer_scores_fwd(qI: Tensor, kI: Tensor, w: Tensor, ratio: int, seg_q: Tensor, pos_q: Tensor,
                       entry_seg: Tensor, entry_j: Tensor) -> Tensor:
    return T._IndexerScores.forward(FnCtx(), qI, kI, w, ratio, seg_q, pos_q, entry_seg, entry_j)


@indexer_scores_fwd.register_fake
def _(qI, kI, w, ratio, seg_q, pos_q, entry_seg, entry_j):
    return qI.new_empty(qI.shape[0], kI.shape[0], dtype=torch.float32)


@torch.library.custom_op("dsv4::indexer_scores_bwd", mutates_args=())
def indexer_scores_bwd(dI: Tensor, qI: Tensor, kI: Tensor, w: Tensor, ratio: int, seg_q: Tensor, pos_q: Tensor,
                       entry_seg: Tensor, entry_j: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    ctx = FnCtx()                                      # what _IndexerScores.forward leaves
    ctx.save_for_backward(qI.contiguous(), kI.contiguous(), w.contiguous(),
                          *T._meta(seg_q, pos_q, entry_seg, entry_j))
    ctx.cfg = (ratio, qI.shape[1] ** -0.5 * qI.shape[2] ** -0.5)
    dq, dk, dw, *_ = T._IndexerScores.backward(ctx, dI)
    return dq, dk, dw


@indexer_scores_bwd.register_fake
def _(dI, qI, kI, w, ratio, seg_q, pos_q, entry_seg, entry_j):
    return qI.new_empty(qI.shape), kI.new_empty(kI.shape), w.new_empty(w.shape)


def _setup(ctx, inputs, output):
    qI, kI, w, ratio, seg_q, pos_q, entry_seg, entry_j = inputs
    ctx.save_for_backward(qI, kI, w, seg_q, pos_q, entry_seg, entry_j)
    ctx.ratio = int(ratio)


def _backward(ctx, dI):
    qI, kI, w, seg_q, pos_q, entry_seg, entry_j = ctx.saved_tensors
    dq, dk, dw = torch.ops.dsv4.indexer_scores_bwd(dI, qI, kI, w, ctx.ratio, seg_q, pos_q, entry_seg, entry_j)
    return dq, dk, dw, None, None, None, None, None


indexer_scores_fwd.register_autograd(_backward, setup_context=_setup)


def indexer_scores(qI: Tensor, kI: Tensor, w: Tensor, ratio: int, seg_q: Tensor, pos_q: Tensor, entry_seg: Tensor,
                   entry_j: Tensor) -> Tensor:
    """qI [Tq,nI,cI], kI [N,cI], w [Tq,nI], metadata -> I [Tq,N] fp32 (-inf where not visible), Triton custom op."""
    naive.check_scores_args(qI, kI, w, ratio, seg_q, pos_q, entry_seg, entry_j)
    return torch.ops.dsv4.indexer_scores_fwd(qI, kI, w, int(ratio), seg_q, pos_q, entry_seg, entry_j)
