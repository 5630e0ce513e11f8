"""Small helpers shared by the Triton kernels (`kernels/<op>/triton.py`)."""
from __future__ import annotations

import os

import triton


def interpreting() -> bool:
    """True when Triton runs its CPU interpreter (`TRITON_INTERPRET=1`): use one small config, no autotuning."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def configs(gpu: list[dict], cpu: dict, **meta) -> list[triton.Config]:
    """Autotune configs: the `gpu` list on a device, the single `cpu` config under the interpreter.

    Each dict holds the kernel's block sizes plus optional `num_warps` / `num_stages`."""
    out = []
    for c in ([cpu] if interpreting() else gpu):
        c = dict(c)
        w, s = c.pop("num_warps", 4), c.pop("num_stages", 2)
        out.append(triton.Config({**c, **meta}, num_warps=w, num_stages=s))
    return out


def pow2(n: int, lo: int = 16) -> int:
    """Smallest power of two >= max(n, lo) (tl.arange and tl.dot need powers of two, dot needs >= 16)."""
    return max(lo, triton.next_power_of_2(int(n)))
