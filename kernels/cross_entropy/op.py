"""`dsv4::ce_lse` / `dsv4::ce_dlogits`: the Triton cross-entropy rows as torch custom ops (opaque to torch.compile,
fake implementations for shapes). They carry no autograd: the one caller, model/model.py `_HeadCrossEntropy`, is
the autograd.Function. Eager calls run the bodies directly (kernels/_custom_op.py `traced`)."""
import torch

from dsv4.kernels._custom_op import traced
from dsv4.kernels.cross_entropy import triton as T

Tensor = torch.Tensor


def _lse(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    return T.ce_lse(logits, labels)


ce_lse_op = torch.library.custom_op("dsv4::ce_lse", mutates_args=())(_lse)


@ce_lse_op.register_fake
def _(logits, labels):
    dt = torch.promote_types(logits.dtype, torch.float32)
    return logits.new_empty(logits.shape[:1], dtype=dt), logits.new_empty(logits.shape[:1], dtype=dt)


def _dlogits(logits: Tensor, lse: Tensor, labels: Tensor, scale: Tensor) -> Tensor:
    return T.ce_dlogits(logits, lse, labels, scale)


ce_dlogits_op = torch.library.custom_op("dsv4::ce_dlogits", mutates_args=())(_dlogits)


@ce_dlogits_op.register_fake
def _(logits, lse, labels, scale):
    return torch.empty_like(logits)


def ce_lse(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """`naive.ce_lse` as one Triton kernel."""
    return ce_lse_op(logits, labels) if traced((logits, labels)) else _lse(logits, labels)


def ce_dlogits(logits: Tensor, lse: Tensor, labels: Tensor, scale: Tensor) -> Tensor:
    """`naive.ce_dlogits` as one Triton kernel."""
    args = (logits, lse, labels, scale)
    return ce_dlogits_op(*args) if traced(args) else _dlogits(*args)
