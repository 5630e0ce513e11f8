"""Profile one fwd+bwd training step (torch.profiler): the summary `dsv4 bench train --profile` stores with each
result, and a command writing the full tables for our model on a GPU.

    python -m dsv4.harness.train.profile_step --tokens 4096 --out DIR [--recompute-from 32768] [--backend triton]

`profile_summary(step, device)`: one step under the profiler (CUDA activity on a GPU, CPU otherwise) ->
launches_per_step (device kernel events; on CPU, CPU op events: `launch_unit` says which), device_ms (sum of
kernel time; None on CPU), host_ms (wall of the profiled step), host_launch_calls (CUDA runtime launch calls,
cudaGraphLaunch included), the top 60 kernels by device time, the top 15 CPU ops by self CPU time,
`device_idle` (CUDA only: the step's kernel span, busy and idle time, and its 10 longest gaps between kernels with
the kernels around each and the innermost host op running in it: where a host-bound step waits), and
`host_syncs` (CUDA only: the step's synchronising CUDA calls -- .item(), nonzero, host<->device copies -- counted
by torch.cuda.set_sync_debug_mode in one more step, each attributed to the innermost frame of this repo).

`by_source(prof)`: the time of a profile taken `with_stack=True`, by the line of model/ / kernels/ / harness/ that
issued it, forward and backward apart (a native backward op takes its forward op's line); the command's `--by-source`
writes it to DIR/profile_<T>_sources.json.

`traffic(step)`: the bytes one step's aten ops read and write, by source line (no profiler: a dispatch mode; any
device); the command's `--traffic` writes DIR/traffic_<T>.json. The elementwise / copy bytes around the kernels,
where they come from, at ~3 TB/s on an H200.

The command writes DIR/profile_<T>.txt: key_averages sorted by CUDA time (self and total), with record_function
ranges around each block's attention / FFN / mHC and the heads (forward only; backward kernels are listed by
name), plus step time and peak memory. Not a benchmark: timings under the profiler carry its overhead.
"""
from __future__ import annotations

import argparse
import json
import os
import time
import warnings
from pathlib import Path

import torch

_LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx",
                 "cudaGraphLaunch", "cudaLaunchCooperativeKernel")


LABELLED = ("attn", "ffn", "indexer", "compressor", "head", "experts", "shared_experts", "gate")   # `_label`'s modules


def _label(model):
    """record_function ranges around the forward of the interesting submodules (pre/post hooks)."""
    from torch.autograd.profiler import record_function

    def pre(name):
        def hook(mod, args):
            mod._rf = record_function(name)
            mod._rf.__enter__()
        return hook

    def post(mod, args, out):
        mod._rf.__exit__(None, None, None)

    for name, mod in model.named_modules():
        if name.split(".")[-1] in LABELLED:
            mod.register_forward_pre_hook(pre(name))
            mod.register_forward_hook(post)


def profile_once(step, device, with_stack: bool = False):
    """(profiler, host seconds) of one call of `step` under torch.profiler, the device synchronised around it;
    with_stack: Python frames recorded too (what `by_source` reads; more profiler overhead)."""
    from torch.profiler import ProfilerActivity, profile

    from dsv4.harness.train.bench import sync
    cuda = torch.device(device).type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync(device)
    with profile(activities=acts, with_stack=with_stack) as prof:
        t = time.perf_counter()
        step()
        sync(device)
        host_s = time.perf_counter() - t
    return prof, host_s


def _annotation(e) -> bool:
    return bool(getattr(e, "is_user_annotation", False)) or \
        str(getattr(e, "activity_type", "") or "").endswith("user_annotation")


def _top(groups: dict, total_us: float, n: int) -> list[dict]:
    rows = sorted(groups.items(), key=lambda kv: -kv[1][0])[:n]
    return [{"name": k[:NAME_CHARS], "ms": us / 1e3, "count": c, "share": us / total_us if total_us else 0.0}
            for k, (us, c) in rows]


TOP_KERNELS, TOP_OPS = 60, 15           # rows kept in a summary (25 kernels left 9.4 of 36.2 ms of the 4K step unnamed)
NAME_CHARS = 240                         # a mangled CUTLASS / ATen name differs only past its first 80 characters
TOP_GAPS = 10                            # device idle gaps kept in a summary


def device_idle(kernels: list[tuple[float, float, str]], ops: list[tuple[float, float, str]],
                top: int = TOP_GAPS) -> dict | None:
    """Where the device waits inside one step: kernels [(start_us, end_us, name)] (any stream) merged into busy
    intervals; span = first start to last end, idle = span - busy. The `top` longest gaps between busy intervals,
    each with the kernel that ended before it, the one that started after it, and the innermost host op
    [(start_us, end_us, name)] running at its midpoint (what the host was doing while the device waited; None: no
    op, i.e. Python between ops). None without kernels."""
    if not kernels:
        return None
    ks = sorted(kernels)
    busy, gaps = 0.0, []
    s0, e0, last = ks[0][0], ks[0][1], ks[0][2]
    for s, e, n in ks[1:]:
        if s > e0:                                                          # a gap: the device had nothing to run
            busy += e0 - s0
            gaps.append((s - e0, e0, s, last, n))
            s0, e0 = s, e
        elif e > e0:
            e0 = e
        if e >= e0:
            last = n
    busy += e0 - s0
    span = max(e for _, e, _ in ks) - ks[0][0]

    def host_op(t):
        inside = [(e - s, n) for s, e, n in ops if s <= t <= e]
        return min(inside)[1] if inside else None
    rows = [{"ms": g / 1e3, "after": a[:NAME_CHARS], "before": b[:NAME_CHARS], "host_op": host_op((ge + gs) / 2)}
            for g, ge, gs, a, b in sorted(gaps, key=lambda r: -r[0])[:top]]
    return {"span_ms": span / 1e3, "busy_ms": busy / 1e3, "idle_ms": (span - busy) / 1e3, "gaps": len(gaps),
            "top_gaps": rows}


def summarize(prof, host_s: float, top_kernels: int = TOP_KERNELS, top_ops: int = TOP_OPS) -> dict:
    """The compact summary of one profiled step (see the module docstring); no trace is kept."""
    from torch.autograd import DeviceType
    evs = prof.events()
    kernels, ops, launch_calls = {}, {}, 0
    spans, op_spans = [], []                                                   # (start, end, name): device_idle
    n_kernels = n_ops = 0
    device_us = cpu_self_us = 0.0
    for e in evs:
        if _annotation(e):
            continue
        if e.device_type == DeviceType.CPU:
            if e.name in _LAUNCH_CALLS:
                launch_calls += 1
            us = e.self_cpu_time_total
            op_spans.append((e.time_range.start, e.time_range.end, e.name))   # runtime calls too (cudaMalloc)
            n_ops += 1
            cpu_self_us += us
            a = ops.setdefault(e.name, [0.0, 0])
        else:
            if e.name.startswith(("Memcpy", "Memset")) or \
                    str(getattr(e, "activity_type", "") or "") in ("gpu_memcpy", "gpu_memset"):
                continue
            us = e.time_range.end - e.time_range.start
            spans.append((e.time_range.start, e.time_range.end, e.name))
            n_kernels += 1
            device_us += us
            a = kernels.setdefault(e.name, [0.0, 0])
        a[0] += us
        a[1] += 1
    on_device = n_kernels > 0
    return {"launch_unit": "kernel" if on_device else "cpu_op",
            "launches_per_step": n_kernels if on_device else n_ops,
            "cpu_ops_per_step": n_ops,
            "host_launch_calls": launch_calls if on_device else None,
            "device_ms": device_us / 1e3 if on_device else None,
            "host_ms": host_s * 1e3,
            "top_kernels": _top(kernels, device_us, top_kernels),
            "top_cpu_ops": _top(ops, cpu_self_us, top_ops),
            "device_idle": device_idle(spans, op_spans),
            "note": "one step under torch.profiler (its overhead included); shares of the summed time"}


_MINE = ("model/", "kernels/", "harness/")
_NOT_SOURCE = ("profile_step.py", "train/bench.py", "harness/bench.py", "traffic_cpu.py",   # the measuring code,
               "kernels/_custom_op.py", "kernels/__init__.py")                              # the ops' dispatch


def _repo_path(path: str) -> str | None:
    """A file path of this repo's model/ kernels/ harness/ from the innermost of those folders on; None for any
    other file and for the measuring / dispatch files (_NOT_SOURCE)."""
    if not any(m in path for m in _MINE) or any(x in path for x in _NOT_SOURCE):
        return None
    return path[max(path.rfind(m) for m in _MINE):]


def _repo_frame(name: str) -> str | None:
    """'<dir>/<file>.py(<line>): <function>' of a Python-frame event of this repo's model/ kernels/ harness/ (the
    profiler's with_stack events), None for any other event."""
    if ".py(" not in name:
        return None
    path, rest = name.split(".py(", 1)
    path = _repo_path(path + ".py")
    return None if path is None else path + "(" + rest


def _module_label(name: str) -> str | None:
    """'[layers.1.attn]' for a `_label` range's name (a module path ending in LABELLED), None for any other event."""
    if " " in name or "::" in name or ".py(" in name or name.split(".")[-1] not in LABELLED:
        return None
    return f"[{name}]"


def _stack_frame(e) -> str | None:
    """The innermost repo frame of an op's recorded stack (`FunctionEvent.stack`, where a build records frames
    there rather than as Python-function events)."""
    for fr in getattr(e, "stack", None) or []:
        src = _repo_frame(fr)
        if src is not None:
            return src
    return None


def _is_backward_node(e) -> bool:
    """An autograd node's event (MulBackward0, _SparseAttnBackward, ...) or the engine's evaluate_function around
    it (the same sequence number: it also holds the engine's gradient sums of the node's inputs)."""
    return e.sequence_nr >= 0 and "Backward" in e.name and not e.name.startswith("aten::")


def by_source(prof, top: int = 40) -> dict:
    """Time by the line of this repo that issued it, from a profile taken with `with_stack=True`: {"unit",
    "total_ms", "rows": [{"phase", "source", "ms", "share", "ops": {op: ms}}]}. The weight is each CPU op's kernels'
    device time on a GPU (`FunctionEvent.kernels`), else the self CPU time of the `aten::` ops. An op's source is
    the innermost repo frame above it (forward code, and Python backwards such as our autograd Functions'); an op
    under a native backward node (MulBackward0, ...) takes the source of the forward op of the same autograd
    sequence number, with phase "bwd"."""
    from torch.autograd import DeviceType
    evs = [e for e in prof.events() if e.device_type == DeviceType.CPU]
    on_device = any(getattr(e, "kernels", None) for e in evs)

    def walk(e):
        """(phase, source) of event e. Source: the first, walking up its parents, of a repo frame, a `_label`
        module range ('[layers.1.attn]': the GPU build of torch 2.11 linked no Python frames as the ops' parents,
        session 21) and an op's recorded stack's repo frame; or, when a native backward node comes first, that
        node's forward source. Phase: "bwd" when an autograd node or the engine is above e (a Python backward's
        own line counts as bwd too)."""
        src = near = None
        p = e
        while p is not None:
            node = _is_backward_node(p)
            if src is None:
                src = _repo_frame(p.name) or _module_label(p.name)         # the nearer of a line and a range
                if src is None and node:
                    return "bwd", fwd_src.get(p.sequence_nr, f"(no forward source) {p.name}")
                if src is None:
                    src = _stack_frame(p)                                  # a node's own stack is the engine's
                if src is None and near is None and not p.name.startswith("aten::") and ".py(" not in p.name:
                    near = p.name                          # e.g. torch::autograd::AccumulateGrad
            if node or p.name.startswith("autograd::engine") or "run_backward" in p.name:
                return "bwd", src or f"(no repo frame) {near or e.name}"
            p = p.cpu_parent
        return "fwd", src or f"(no repo frame) {near or e.name}"

    fwd_src: dict[int, str] = {}
    for e in evs:                                        # forward ops carry the sequence number of their node
        if e.sequence_nr >= 0 and not _is_backward_node(e) and e.sequence_nr not in fwd_src:
            ph, src = walk(e)
            if ph == "fwd" and not src.startswith("("):
                fwd_src[e.sequence_nr] = src
    rows: dict[tuple, list] = {}
    total = 0.0
    for e in evs:
        if on_device:
            us = sum(k.duration for k in (getattr(e, "kernels", None) or []))
        else:
            us = e.self_cpu_time_total if e.name.startswith("aten::") else 0.0
        if us <= 0:
            continue
        key = walk(e)
        r = rows.setdefault(key, [0.0, {}])
        r[0] += us
        op = e.name if e.name.startswith("aten::") or not e.cpu_parent else e.cpu_parent.name
        r[1][op] = r[1].get(op, 0.0) + us
        total += us
    ranked = sorted(rows.items(), key=lambda kv: -kv[1][0])[:top]
    return {"unit": "device" if on_device else "cpu", "total_ms": total / 1e3,
            "rows": [{"phase": ph, "source": src, "ms": us / 1e3, "share": us / total if total else 0.0,
                      "ops": {k[:60]: v / 1e3 for k, v in sorted(ops.items(), key=lambda kv: -kv[1])[:4]}}
                     for (ph, src), (us, ops) in ranked]}


_NO_DATA = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "view", "_unsafe_view",
            "reshape", "t", "transpose", "as_strided", "detach", "unsqueeze", "squeeze", "expand", "permute", "select",
            "slice", "alias", "split", "split_with_sizes", "unbind", "lift_fresh", "_local_scalar_dense", "unfold",
            "is_same_size", "_to_copy_meta", "sym_size", "sym_stride", "sym_numel", "diagonal", "narrow", "chunk",
            "view_as_real", "view_as_complex", "_reshape_alias", "set_", "resize_", "record_stream"}
_GEMM = {"mm", "bmm", "addmm", "baddbmm", "addbmm", "_grouped_mm", "linear", "matmul", "_scaled_mm",
         "_scaled_grouped_mm", "convolution"}
_COPY = {"copy_", "_to_copy", "clone", "contiguous", "to", "_copy_from", "_copy_from_and_resize"}


def _op_kind(func, name: str) -> str:
    if func.namespace == "dsv4":
        return "kernel"
    return "gemm" if name in _GEMM else "copy" if name in _COPY else "other"


def traffic(step, top: int = 40) -> dict:
    """The bytes one call of `step` moves in aten ops (no profiler; any device, CPU included), by the line of
    model/ / kernels/ / harness/ that issued them: {"unit": "bytes", "total", "by_kind", "rows": [{"phase",
    "source", "kind", "op", "calls", "bytes"}]}. An op's bytes are those it reads (its tensor arguments but `out=`,
    each once) and writes (its results; an in-place op's self is read and written); views and allocations move
    nothing and are skipped; "kind" is gemm / copy (dtype casts, clones,
    contiguous) / other (elementwise, reductions, indexing) / kernel (a dsv4:: custom op: its arguments and
    results). Our kernels' own launches inside eager autograd Functions are not aten ops and do not appear: this
    counts the traffic around them. Backward ops take the forward line of their autograd node (the
    node's forward stack, recorded by anomaly mode without its NaN checks, then "[<node>]"), or, inside a Python
    backward (our autograd Functions), that code's own line; phase "bwd". At a GPU's ~3 TB/s a
    GB of "copy" / "other" is about 0.33 ms: the elementwise share of a step, where it comes from, before any
    device time is spent on it."""
    import traceback

    from torch.utils._python_dispatch import TorchDispatchMode
    rows: dict[tuple, list] = {}

    def src_of(frames) -> str | None:
        """'<path>:<line> <function>' of the innermost repo frame (traceback frames or (file, line, function))."""
        for f in reversed(frames):
            name, line, fn = (f.filename, f.lineno, f.name) if hasattr(f, "filename") else f
            path = _repo_path(name)
            if path is not None:
                return f"{path}:{line} {fn}"
        return None

    def nbytes(ts) -> int:
        seen, n = set(), 0
        for t in ts:
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                key = (t.untyped_storage().data_ptr(), t.data_ptr(), t.numel())
                if key not in seen:
                    seen.add(key)
                    n += t.numel() * t.element_size()
        return n

    class _Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            name = func.__name__.split(".")[0]
            if name in _NO_DATA:
                return out
            flat_in = torch.utils._pytree.tree_leaves((args, {k: v for k, v in kwargs.items() if k != "out"}))
            flat_out = torch.utils._pytree.tree_leaves(out)             # out= / in-place: the written tensor
            here = src_of(traceback.extract_stack()[:-1])
            node = torch._C._current_autograd_node()
            if node is not None:                       # a Python backward's own line, else the node's forward line
                tb = (node.metadata or {}).get("traceback_")
                fwd = src_of(_parse_tb(tb)) if tb else None
                src, phase = here or f"{fwd or '(no forward stack)'} [{node.name()}]", "bwd"
            else:
                src, phase = here or "(no repo frame)", "fwd"
            r = rows.setdefault((phase, src, _op_kind(func, name), name), [0, 0])
            r[0] += 1
            r[1] += nbytes(flat_in) + nbytes(flat_out)                  # read + written (in place: self both)
            return out

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Anomaly Detection has been enabled")
        with torch.autograd.detect_anomaly(check_nan=False), _Count():
            step()
    total = sum(b for _, b in rows.values())
    kinds: dict[str, int] = {}
    for (_, _, k, _), (_, b) in rows.items():
        kinds[k] = kinds.get(k, 0) + b
    ranked = sorted(rows.items(), key=lambda kv: -kv[1][1])[:top]
    return {"unit": "bytes", "total": total, "by_kind": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
            "rows": [{"phase": ph, "source": src, "kind": k, "op": op, "calls": c, "bytes": b}
                     for (ph, src, k, op), (c, b) in ranked]}


def _parse_tb(tb) -> list[tuple]:
    """[(file, line, function)] of an anomaly-mode forward traceback (a list of formatted lines, or one string)."""
    import re
    text = "".join(tb) if isinstance(tb, (list, tuple)) else str(tb)
    return [(m.group(1), int(m.group(2)), m.group(3))
            for m in re.finditer(r'File "([^"]+)", line (\d+), in (\S+)', text)]


def sync_sites(step, device, top: int = 20) -> dict | None:
    """{"per_step", "sites": [{"where", "count"}]}: the synchronising CUDA calls of one call of `step`
    (torch.cuda.set_sync_debug_mode("warn"); a warning each), by the innermost stack frame under this repo's
    model/ kernels/ harness/ (else the innermost frame). None off CUDA."""
    import collections
    import traceback
    if torch.device(device).type != "cuda":
        return None
    sites: collections.Counter = collections.Counter()
    mine = ("/model/", "/kernels/", "/harness/")

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" not in str(message):
            return
        fr = [f for f in traceback.extract_stack()[:-1] if any(m in f.filename for m in mine)
              and not f.filename.endswith(("profile_step.py", "bench.py"))]
        f = fr[-1] if fr else None
        where = f"{f.filename.rsplit('/', 2)[-2]}/{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}" if f \
            else f"{filename}:{lineno}"
        sites[where] += 1

    torch.cuda.synchronize()
    old_mode, old_show = torch.cuda.get_sync_debug_mode(), warnings.showwarning
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(old_mode)
            warnings.showwarning = old_show
    torch.cuda.synchronize()
    return {"per_step": sum(sites.values()),
            "sites": [{"where": w, "count": c} for w, c in sites.most_common(top)]}


def profile_summary(step, device, top_kernels: int = TOP_KERNELS, top_ops: int = TOP_OPS) -> dict:
    prof, host_s = profile_once(step, device)
    out = summarize(prof, host_s, top_kernels, top_ops)
    out["host_syncs"] = sync_sites(step, device)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="proxy")
    ap.add_argument("--tokens", default="4096")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--recompute-from", type=int, default=32768)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--by-source", action="store_true",
                    help="also profile one step with Python frames and write profile_<T>_sources.json (by_source)")
    ap.add_argument("--traffic", action="store_true",
                    help="also count one step's aten bytes by source line and write traffic_<T>.json (traffic)")
    args = ap.parse_args(argv)
    from dsv4.harness.goldens import atomic_write_text
    from dsv4.harness.train.bench import build_ours, lm_inputs, make_step, time_step_fn
    from dsv4.model.config import get_config
    cfg = get_config(args.config)
    dev = torch.device("cuda")
    for T in [int(t) for t in args.tokens.split(",")]:
        S = T // args.batch
        model = build_ours(cfg, args.backend, dev)
        model.set_recompute(T >= args.recompute_from)
        _label(model)
        step = make_step(model, lm_inputs(args.batch, S, cfg.vocab_size, dev, False))
        t = time_step_fn(step, 3, 2, dev)
        dt, peak = t["step_s"], t["peak_mem_bytes"] / 2**30
        prof, _ = profile_once(step, dev)
        ka = prof.key_averages()
        head = f"T={T} B={args.batch} S={S} step {dt * 1e3:.1f} ms, {T / dt:,.0f} tok/s, peak {peak:.1f} GiB\n"
        txt = head + ka.table(sort_by="self_cuda_time_total", row_limit=60, max_name_column_width=70) + \
            "\n\n" + ka.table(sort_by="cuda_time_total", row_limit=60, max_name_column_width=70)
        atomic_write_text(Path(args.out) / f"profile_{T}.txt", txt)
        print(head, flush=True)
        print(ka.table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=60), flush=True)
        if args.by_source:
            del prof
            prof, _ = profile_once(step, dev, with_stack=True)
            src = by_source(prof, 60)
            atomic_write_text(Path(args.out) / f"profile_{T}_sources.json", json.dumps(src, indent=1))
            for r in src["rows"][:25]:
                print(f"{r['ms']:8.2f} ms {r['share']:6.1%} {r['phase']} {r['source'][:90]}  {list(r['ops'])[:3]}",
                      flush=True)
        if args.traffic:
            tr = traffic(step, 80)
            atomic_write_text(Path(args.out) / f"traffic_{T}.json", json.dumps(tr, indent=1))
            print(f"traffic {tr['total'] / 1e9:.2f} GB: " + ", ".join(f"{k} {v / 1e9:.2f}" for k, v in
                                                                     tr["by_kind"].items()), flush=True)
            for r in tr["rows"][:25]:
                print(f"{r['bytes'] / 1e9:8.3f} GB {r['calls']:4d} {r['phase']} {r['kind']:6s} {r['op'][:20]:20s} "
                      f"{r['source'][:80]}", flush=True)
        del model, prof, step
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
