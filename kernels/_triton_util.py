"""Small helpers shared by the Triton kernels (`kernels/<op>/triton.py`)."""
from __future__ import annotations

import triton


def configs(gpu: list[dict], cpu: dict, prune=None, pre_hook=None, **meta) -> dict:
    """Autotune arguments `@triton.autotune(**configs(...), key=...)`: all configs (the `gpu` list and the single
    `cpu` one), and an early prune that picks by the launch's tensor device at call time (`on_cpu`): CPU
    tensors (Triton's interpreter) get the one `cpu` config (no benchmarking), CUDA tensors the `gpu` list,
    narrowed by `prune(configs, launch_args) -> configs` when given (e.g. a tile-size budget that depends on a
    constexpr of the launch, or one config for a problem too small to tune; at least one must survive).

    Each dict holds the kernel's block sizes plus optional `num_warps` / `num_stages`. `pre_hook(nargs)` runs
    before every launch of a config (Triton's Config.pre_hook: e.g. setting a host TMA descriptor's block shape
    from the config's block sizes)."""
    def make(c):
        c = dict(c)
        w, s = c.pop("num_warps", 4), c.pop("num_stages", 2)
        return triton.Config({**c, **meta}, num_warps=w, num_stages=s, pre_hook=pre_hook)

    gpu_cfgs, cpu_cfgs = [make(c) for c in gpu], [make(cpu)]

    def by_device(configs, named_args, **kwargs):
        t = next((v for v in named_args.values() if hasattr(v, "device")), None)
        if t is not None and on_cpu(t):
            return cpu_cfgs
        if prune is None:
            return gpu_cfgs
        kept = prune(gpu_cfgs, {**named_args, **kwargs})
        if not kept:
            raise ValueError(f"autotune prune left no config for {sorted(kwargs)}")
        return kept

    return {"configs": gpu_cfgs + cpu_cfgs, "prune_configs_by": {"early_config_prune": by_device}}


def tuned(kernel, name: str):
    """The value of meta-parameter `name` in the config the autotuned `kernel` used at its LAST launch (for
    launch code whose follow-up depends on it: how many split-K partials to reduce)."""
    return kernel.best_config.kwargs[name]


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
