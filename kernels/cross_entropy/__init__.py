"""Cross-entropy rows of a logits block (the head's loss): `ce_lse(logits, labels)` -> (lse, target logit) and
`ce_dlogits(logits, lse, labels, scale)` -> dlogits, with backend="naive"|"triton", via `kernels.get_op`."""
from __future__ import annotations

from dsv4.kernels import get_op


def ce_lse(logits, labels, backend: str = "naive"):
    return get_op("ce_lse", backend, logits.device)(logits, labels)


def ce_dlogits(logits, lse, labels, scale, backend: str = "naive"):
    return get_op("ce_dlogits", backend, logits.device)(logits, lse, labels, scale)
