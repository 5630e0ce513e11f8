"""Small helpers shared by the Triton kernels (`kernels/<op>/triton.py`)."""
from __future__ import annotations

import triton


def configs(gpu: list[dict], cpu: dict, **meta) -> dict:
    """Autotune arguments `@triton.autotune(**configs(...), key=...)`: all configs (the `gpu` list and the single
    `cpu` one), and an early prune that picks by the launch's tensor device at call time (`on_cpu`): CPU
    tensors (Triton's interpreter) get the one `cpu` config (no benchmarking), CUDA tensors the `gpu` list.

    Each dict holds the kernel's block sizes plus optional `num_warps` / `num_stages`."""
    def make(c):
        c = dict(c)
        w, s = c.pop("num_warps", 4), c.pop("num_stages", 2)
        return triton.Config({**c, **meta}, num_warps=w, num_stages=s)

    gpu_cfgs, cpu_cfgs = [make(c) for c in gpu], [make(cpu)]

    def by_device(configs, named_args, **kwargs):
        t = next((v for v in named_args.values() if hasattr(v, "device")), None)
        return cpu_cfgs if t is not None and on_cpu(t) else gpu_cfgs

    return {"configs": gpu_cfgs + cpu_cfgs, "prune_configs_by": {"early_config_prune": by_device}}


def pow2(n: int, lo: int = 16) -> int:
    """Smallest power of two >= max(n, lo) (tl.arange and tl.dot need powers of two, dot needs >= 16)."""
    return max(lo, triton.next_power_of_2(int(n)))


def on_cpu(x) -> bool:
    """Launch-time choice: True for CPU tensors, which only Triton's interpreter runs (tests): one small config,
    exact fp32 products; CUDA tensors get the tuned GPU configs. Decided per call from the tensor's device."""
    return x.device.type == "cpu"


@triton.jit
def _probe(X):
    pass


def interpreted() -> bool:
    """Whether this process's @triton.jit kernels run on Triton's CPU interpreter (TRITON_INTERPRET=1 when
    they were decorated): a capability fact for `kernels.check_device`, not a config choice."""
    from triton.runtime.jit import JITFunction
    return not isinstance(_probe, JITFunction)


class FnCtx:
    """A plain record that stands in for autograd's `ctx` when a Triton `autograd.Function`'s forward / backward
    staticmethods run as the bodies of `torch.library` custom ops (`kernels/<op>/op.py`): the launch code and
    the math stay in `triton.py`, once. `save_for_backward` records; attributes are set as usual."""

    saved_tensors: tuple = ()

    def save_for_backward(self, *tensors) -> None:
        self.saved_tensors = tensors
