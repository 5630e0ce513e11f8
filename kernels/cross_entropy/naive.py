"""Cross-entropy rows of a logits block (the head's loss, model/model.py `head_cross_entropy`), the reference.

    lse_r = log sum_v exp(l_rv),   tgt_r = l_{r, y_r}                         (forward: loss_r = lse_r - tgt_r)
    dl_rv = s_r (exp(l_rv - lse_r) - [v = y_r])                               (backward, s_r = valid_r * dLoss)

Logits arrive in the head's dtype (bf16 under autocast) and are upcast to fp32 (fp64 stays fp64) as
`F.cross_entropy(head(y).float(), labels)` does; dl is returned in the logits' dtype. `y` must be a valid column
for every row (ignored rows carry any valid label and s_r = 0).
"""
from __future__ import annotations

import torch


def ce_lse(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [C, V], labels [C] int (0 <= y < V) -> (lse [C], tgt [C]) in fp32 (fp64 for fp64 logits)."""
    lf = logits.to(torch.promote_types(logits.dtype, torch.float32))           # [C, V]
    return torch.logsumexp(lf, dim=-1), lf.gather(1, labels[:, None]).squeeze(1)


def ce_dlogits(logits: torch.Tensor, lse: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """logits [C, V], lse [C], labels [C], scale [C] (lse's dtype) -> dlogits [C, V] in the logits' dtype."""
    p = torch.exp(logits.to(lse.dtype) - lse[:, None])                         # softmax [C, V]
    p.scatter_add_(1, labels[:, None], torch.full_like(p[:, :1], -1.0))
    p *= scale[:, None]
    return p.to(logits.dtype)
