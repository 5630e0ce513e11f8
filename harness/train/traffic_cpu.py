"""The bytes around the kernels of one Triton-backend training step, counted on a CPU host (no GPU): analysis only.

    TRITON_INTERPRET=1 python -m dsv4.harness.train.traffic_cpu --config proxy --tokens 2048 --batch 2 --out DIR

`profile_step.traffic` counts the bytes every aten op of a step reads and writes, by source line. On a GPU it runs
on the real step (`profile_step --traffic`). Without one, the Triton backend's step can still be walked on CPU
tensors with every Triton launch replaced by a no-op (`stubbed_kernels`): the aten ops around the kernels -- casts,
copies, gradient sums, the GEMMs -- run on the real shapes, and their bytes are what the GPU step moves around the
kernels, except where a launcher's tiling depends on the device (the interpreter's small tiles make the split
partials of the mHC / RMSNorm backwards larger than on a GPU). Values are meaningless (kernel outputs are zero-
filled, so the indices they would hold stay in range); the grouped expert GEMMs are forced on, as on a GPU.
A proxy step at 2,048 tokens takes ~30 s on 2 cores; bytes grow with the tokens except the head's [V, d] terms.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
from pathlib import Path

import torch

_EMPTY = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}


@contextlib.contextmanager
def stubbed_kernels():
    """Inside: every Triton launch is a no-op (autotuners take their first config), every allocation and every
    dsv4:: custom op's result is zero-filled (outside the counting), the compressor's CPU-only halo check (a
    host read of kernel results) is skipped. Everything is restored on exit."""
    from torch.utils._python_dispatch import TorchDispatchMode
    import triton.runtime.autotuner as A
    import triton.runtime.interpreter as I
    import triton.runtime.jit as J

    from dsv4.kernels.compressor import naive as CN

    class _Zero(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.__name__.split(".")[0] in _EMPTY or func.namespace == "dsv4":
                for o in torch.utils._pytree.tree_leaves(out):
                    if isinstance(o, torch.Tensor):
                        o.zero_()
            return out

    def _first_config(self, *a, **k):
        self.best_config = self.configs[0]

    saved = [(J.JITFunction, "run"), (I.InterpretedFunction, "run"), (A.Autotuner, "run"),
             (A.Heuristics, "run"), (CN, "pool_rows")]
    old = [getattr(o, n) for o, n in saved]
    J.JITFunction.run = I.InterpretedFunction.run = A.Heuristics.run = lambda self, *a, **k: None
    A.Autotuner.run = _first_config
    CN.pool_rows = lambda *a, **k: None
    try:
        with _Zero():
            yield
    finally:
        for (o, n), v in zip(saved, old):
            setattr(o, n, v)


def census(config: str, tokens: int, batch: int, top: int = 80) -> dict:
    """`profile_step.traffic` of one Triton-backend bf16 step of `config` ([batch, tokens / batch] tokens, no
    recompute) on CPU with the kernels stubbed (module doc)."""
    from dsv4.harness.train.bench import build_ours, lm_inputs, make_step
    from dsv4.harness.train.profile_step import traffic
    from dsv4.model.config import get_config
    from dsv4.model.moe import Experts
    cfg = get_config(config)
    model = build_ours(cfg, "triton", torch.device("cpu"))
    for mod in model.modules():
        if isinstance(mod, Experts):
            mod.gemm = "grouped"
    step = make_step(model, lm_inputs(batch, tokens // batch, cfg.vocab_size, torch.device("cpu"), False))
    with stubbed_kernels():
        out = traffic(step, top)
    return {"config": config, "tokens": tokens, "batch": batch, "kernels": "stubbed (CPU)", **out}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="proxy")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    from dsv4.harness.goldens import atomic_write_text
    r = census(args.config, args.tokens, args.batch)
    atomic_write_text(Path(args.out) / f"traffic_cpu_{args.config}_{args.tokens}.json", json.dumps(r, indent=1))
    print(f"{r['total'] / 1e9:.3f} GB: " + ", ".join(f"{k} {v / 1e9:.3f}" for k, v in r["by_kind"].items()))
    for x in r["rows"]:
        print(f"{x['bytes'] / 1e9:8.3f} GB {x['calls']:4d} {x['phase']} {x['kind']:6s} {x['op'][:20]:20s} {x['source']}")


if __name__ == "__main__":
    main()
