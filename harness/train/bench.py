"""`dsv4 bench train`: end-to-end training throughput of our DSv4 model against Hugging Face's DeepseekV4 on
the same config, in the same process and run (the peer measured in the same conditions).

Per (implementation, tokens): fwd+bwd steps of a random-token LM batch of `--batch` rows in bf16 on one GPU,
after `--warmup` steps (their wall seconds, compile included, are `first_steps_s`); tokens/s, peak memory, and
model FLOPs utilisation by our FLOP accounting (`harness/train/flops.py`) against the H200's dense bf16 peak
(989 TFLOP/s spec; 797 measured for a large matmul — both are reported). OOM is recorded as such, not as a crash.

Implementations (`--impls`, comma list):
  ours                 our model, eager (FP32-kept tensors of P1, kernels by `--backend`)
  ours_compile         DSv4Model.compile_blocks(): torch.compile of every block, Inductor default mode
  ours_cudagraph       compile_blocks(mode="reduce-overhead"): CUDA graphs through Inductor's cudagraph trees
                       (torch.compiler.cudagraph_mark_step_begin() before every step; at least 3 warm-up
                       steps: warm-up run, record, then replays)
  ours_packed          eager ours on packed THD rows: each of the `--batch` rows of S = tokens / batch slots
                       holds whole documents of mixed lengths (log-uniform in [--doc-min, S], seeded) placed by
                       the P7 scheduler (harness/train/packing.py: schedule over batch "ranks", step 0; longer
                       documents are cut), fed as host cu_seqlens / cu_seqlens_padded (no per-step host sync);
                       tokens/s counts real tokens, MFU uses each document's own length
  ours_packed_compile  ours_packed with compile_blocks()
  ours_packed_graph    ours_packed as one captured CUDA graph of the whole step through a static PackedSeqParams
                       buffer (P11, harness/train/packed_graph.py: the rows loaded once, every step a replay;
                       eager on CPU)
  hf_eager, hf_compile Hugging Face DeepseekV4ForCausalLM, eager / torch.compile default mode
`--compile` (kept from before) turns `ours` into `ours_compile` and `ours_packed` into `ours_packed_compile`.
Compiled rows carry `compile_stats` (Dynamo graphs, graph breaks, Inductor cudagraph skips during the row).

`--profile`: after timing, one more step under torch.profiler (harness/train/profile_step.py `profile_summary`):
kernel launches per step, device and host ms, top kernels and top CPU ops, and the host syncs by source line
(one more step under torch.cuda.set_sync_debug_mode); no trace is kept.

Output: after every row `--out` is rewritten atomically with all rows so far (a killed run keeps its finished
rows). `--append`: rows of an existing `--out` are kept, a new row replacing the one of the same
(impl, tokens, batch); every row carries its own git sha, backend, steps, warm-up; ratios are recomputed
over all rows (ours_* over hf_eager / hf_compile, ours_packed over ours, compiled over eager, same tokens and
batch). `--smoke`: the debug config, on the GPU if one is visible, else on CPU (naive kernels): checks the
machinery, the numbers mean nothing.
"""
from __future__ import annotations

import gc
import itertools
import json
import math
import sys
import time

import click
import numpy as np
import torch

H200_PEAK_BF16 = 989e12
H200_MEASURED_MATMUL = 797e12

# impl -> (family, torch.compile mode or None, packed rows)
IMPLS = {
    "ours": ("ours", None, False),
    "ours_compile": ("ours", "default", False),
    "ours_cudagraph": ("ours", "reduce-overhead", False),
    "ours_packed": ("ours", None, True),
    "ours_packed_compile": ("ours", "default", True),
    "ours_packed_graph": ("ours", None, True),
    "hf_eager": ("hf", None, False),
    "hf_compile": ("hf", "default", False),
}
GRAPHED = ("ours_packed_graph",)          # the whole step as one captured CUDA graph (PackedGraphStep)
PEERS = ("hf_eager", "hf_compile")
# (numerator, denominator) beyond ours_* over the peers: what each variant buys over its base
PAIRS = [("ours_packed", "ours"), ("ours_packed_compile", "ours_compile"), ("ours_packed_graph", "ours_packed"),
         ("ours_compile", "ours"),
         ("ours_cudagraph", "ours"), ("ours_cudagraph", "ours_compile")]
CUDAGRAPH_MIN_WARMUP = 3


def _log(msg):
    print(msg, file=sys.stderr, flush=True)


def build_ours(cfg, backend: str, device, compile_: bool | str = False):
    """Our model in bf16; compile_: False | True / "default" (compile_blocks()) | a torch.compile mode."""
    from dsv4.model import DSv4Model
    from dsv4.model.precision import cast_model
    model = DSv4Model(cfg).to(device)
    cast_model(model, torch.bfloat16)
    model.set_kernel_backend(backend)
    if compile_ is True or compile_ == "default":
        model.compile_blocks()                     # torch.compile of every block (Triton ops: custom ops)
    elif compile_:
        model.compile_blocks(mode=compile_)
    return model.train()


def build_hf(cfg, device, compile_: bool):
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
    from dsv4.model.interop.hf_config import config_to_hf
    d = config_to_hf(cfg)
    d.pop("dsv4_config", None)
    d.pop("architectures", None)
    d.pop("model_type", None)
    hcfg = DeepseekV4Config(**d)
    hcfg._attn_implementation = "eager"
    model = DeepseekV4ForCausalLM(hcfg).to(device=device, dtype=torch.bfloat16).train()
    with torch.no_grad():   # HF initialises the hash table to zeros: give it distinct experts per token
        g = torch.Generator().manual_seed(0)
        for mod in model.modules():
            if hasattr(mod, "tid2eid"):
                t = torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)[:cfg.num_experts_per_tok]
                                 for _ in range(cfg.vocab_size)])
                mod.tid2eid.copy_(t.to(mod.tid2eid.device))
    return torch.compile(model) if compile_ else model


# ------------------------------------------------------------------------------------------- inputs
def lm_inputs(B: int, S: int, V: int, device, is_hf: bool) -> dict:
    """Model kwargs of a random-token LM batch [B, S] (seeded). Ours: the loss from row blocks of the head (no
    [B, S, V] logits kept; same loss), see DSv4Model.forward."""
    g = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, V, (B, S), generator=g).to(device)
    kw = {"use_cache": False} if is_hf else {"return_logits": False}
    return {"input_ids": ids, "labels": ids, **kw}


def packed_inputs(B: int, S: int, V: int, device, seed: int = 0, doc_min: int = 128) -> tuple[dict, dict]:
    """(model kwargs, packing summary) of B packed THD rows of S slots: documents with lengths log-uniform in
    [min(doc_min, S // 8), S] (seeded) placed by the P7 scheduler over B "ranks" (step 0; its look-ahead window
    is twice the step's capacity and 3x capacity of documents are drawn, so every row is filled). Labels are
    the next token inside each document (materialize)."""
    from dsv4.harness.train.packing import materialize, schedule
    rng = np.random.default_rng(seed)
    lo = max(1, min(doc_min, S // 8))
    lengths, total = [], 0
    while total < 3 * B * S:
        n = int(round(math.exp(rng.uniform(math.log(lo), math.log(S)))))
        lengths.append(n)
        total += n
    docs = [rng.integers(0, V, n) for n in lengths]
    rows = schedule(lengths, dp_size=B, tokens_per_rank=S)[0]
    mats = [materialize(mb, docs) for mb in rows]
    real, padded = [], []
    for r, (mb, m) in enumerate(zip(rows, mats)):
        cup = m["cu_seqlens_padded"].astype(np.int64)
        if not mb.segments or len(cup) != len(mb.segments) + 1:     # extend_last: the row ends with its last doc
            raise RuntimeError(f"packed_inputs: row {r} has no documents or a dummy tail (internal error)")
        real += np.diff(m["cu_seqlens"]).tolist()
        padded += (cup[:-1] + r * S).tolist()
    # the offsets stay on the host, as the data loader yields them: Layout.packed checks them there and sends a
    # non-blocking copy to the tokens' device (device offsets would cost one host synchronisation per step)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(real)]), dtype=torch.int32)
    cup = torch.tensor(padded + [B * S], dtype=torch.int32)
    ids = torch.from_numpy(np.stack([m["tokens"] for m in mats])).to(device)
    labels = torch.from_numpy(np.stack([m["labels"] for m in mats])).to(device)
    info = {"doc_lengths": [[s.length for s in mb.segments] for mb in rows],
            "real_tokens": int(sum(real)), "fill": sum(real) / (B * S),
            "lengths": f"log-uniform [{lo}, {S}], seed {seed}; P7 schedule dp_size={B}, step 0"}
    return {"input_ids": ids, "labels": labels, "return_logits": False, "cu_seqlens": cu,
            "cu_seqlens_padded": cup}, info


# ------------------------------------------------------------------------------------------- timing
def make_step(model, inputs: dict, mark_step: bool = False):
    """One fwd+bwd training step on fixed inputs; gradients dropped after it (no optimizer)."""
    params = [p for p in model.parameters() if p.requires_grad]

    def step():
        if mark_step:                      # cudagraph trees: a new iteration (frees the previous one's outputs)
            torch.compiler.cudagraph_mark_step_begin()
        out = model(**inputs)
        out.loss.backward()
        for p in params:
            p.grad = None
    return step


def graph_step(model, inputs: dict, shape: tuple[int, int]):
    """`ours_packed_graph`'s step: the packed rows loaded once into a PackedGraphStep (max_seqs = their documents),
    every call a replay of the captured fwd + bwd (a CUDA model; eager elsewhere). Its gradients are the graph's."""
    from dsv4.harness.train.packed_graph import PackedGraphStep
    g = PackedGraphStep(model, shape, max_seqs=len(inputs["cu_seqlens"]) - 1)
    g.load(inputs["input_ids"], inputs["labels"], inputs["cu_seqlens"], inputs["cu_seqlens_padded"])
    return g.step


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def time_step_fn(step, steps: int, warmup: int, device) -> dict:
    """first_steps_s (wall of each warm-up step, compile included), step_s (mean of the timed steps), peak memory
    (CUDA; None on CPU, where this is a smoke run of the same loop)."""
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    first = []
    for _ in range(warmup):
        t = time.perf_counter()
        step()
        sync(device)
        first.append(time.perf_counter() - t)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    return {"first_steps_s": first, "step_s": (time.perf_counter() - t0) / steps,
            "peak_mem_bytes": torch.cuda.max_memory_allocated() if cuda else None}


def time_steps(model, B, S, V, steps, warmup, device, is_hf: bool):
    """A random-token [B, S] batch timed by time_step_fn (+ tokens_per_s); used by lowp_bench too."""
    rec = time_step_fn(make_step(model, lm_inputs(B, S, V, device, is_hf)), steps, warmup, device)
    rec["tokens_per_s"] = B * S / rec["step_s"]
    return rec


def _compile_counters() -> dict:
    from torch._dynamo.utils import counters
    return {"graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(counters["graph_break"].values()),
            "cudagraph_skips": counters["inductor"]["cudagraph_skips"]}


# ------------------------------------------------------------------------------------------- results
# DSv4Model switches a bench row can set (the ours rows run once per combination of the listed modes): row field
# -> (DSv4Model setter, default mode, the mode of a stored ours row without the field). Every ours row written since
# the head_ce default became grad_in_forward (session 21) carries every field; older rows carry a field only where
# it was not the default of their day: head_ce absent = "recompute", out_rope absent = "fused" (rows before c456743
# ran the separate rotation, the only one then: compare rows of one call), all_picked absent = "listed" (rows before
# session 24). HF rows have no switches.
SWITCHES = {"head_ce": ("set_head_ce", "grad_in_forward", "recompute"), "out_rope": ("set_out_rope", "fused", "fused"),
            "all_picked": ("set_all_picked", "contiguous", "listed")}
DEFAULTS = tuple(d for _, d, _ in SWITCHES.values())


def _switches(r) -> tuple:
    if IMPLS.get(r["impl"], ("",))[0] != "ours":
        return DEFAULTS
    return tuple(r.get(f, a) for f, (_, _, a) in SWITCHES.items())


def _key(r) -> tuple:
    return (r["impl"], r["tokens"], r["batch"], _switches(r))


def merge_results(old: list[dict], new: list[dict]) -> list[dict]:
    """old rows in order, each replaced by the new row of its (impl, tokens, batch, switches); then the other new
    rows."""
    fresh = {_key(r): r for r in new}
    out = [fresh.pop(_key(r), r) for r in old]
    return out + [r for r in new if _key(r) in fresh]


def _named(impl: str, sw: tuple) -> str:
    """'ours[head_ce=recompute]': an impl with its non-default switch modes."""
    return impl + "".join(f"[{f}={m}]" for f, m, d in zip(SWITCHES, sw, DEFAULTS) if m != d)


def ratios(results: list[dict]) -> dict:
    """tokens/s ratios between rows of one commit (git_sha) at the same tokens and batch: each ours_* row (any
    switch modes) over each HF peer and over its PAIRS partner of the same modes, and each row of non-default modes
    (`--head-ce`, `--out-rope`, `--all-picked`) over the same impl's row one switch nearer the default (each such switch). Keys
    `<a>_over_<b>@<tokens>`, a row of non-default modes named `<a>[head_ce=<mode>]...` (`/b<batch>` appended
    where the rows hold several batches at those tokens)."""
    every, sha = {}, {}
    for r in results:
        if r.get("tokens_per_s"):
            k = _key(r)
            every[k], sha[k] = r["tokens_per_s"], r.get("git_sha")
    batches: dict[int, set] = {}
    for _, T, B, _ in every:
        batches.setdefault(T, set()).add(B)
    out = {}
    for (a, T, B, sw), v in sorted(every.items(), key=lambda kv: (kv[0][1], kv[0][2])):
        if IMPLS.get(a, ("",))[0] != "ours":
            continue
        tag = f"@{T}" + (f"/b{B}" if len(batches[T]) > 1 else "")
        others = [(p, DEFAULTS) for p in PEERS] + [(q, sw) for x, q in PAIRS if x == a]
        others += [(a, sw[:i] + (d,) + sw[i + 1:]) for i, (m, d) in enumerate(zip(sw, DEFAULTS)) if m != d]
        for b, swb in others:
            kb = (b, T, B, swb)
            if kb in every and sha[kb] == sha[(a, T, B, sw)]:
                out[f"{_named(a, sw)}_over_{_named(b, swb)}{tag}"] = v / every[kb]
    return out


def load_existing(path, config: str, platform: str) -> list[dict]:
    """The rows of an earlier `dsv4 bench train --out` file (for --append); each keeps or gains its git sha."""
    from dsv4.harness.errors import BadInput
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise BadInput(f"--append: cannot read {path} ({type(e).__name__}: {str(e).splitlines()[0][:120]})") \
            from None
    if not isinstance(doc, dict) or doc.get("bench") != "train" or not isinstance(doc.get("results"), list) or \
            not all(isinstance(r, dict) and {"impl", "tokens", "batch"} <= r.keys() for r in doc["results"]):
        raise BadInput(f"--append: {path} is not a `dsv4 bench train` result (bench: train with results rows)")
    if doc.get("config") != config:
        raise BadInput(f"--append: {path} was measured on config {doc.get('config')!r}, this run is {config!r}")
    prov = doc.get("provenance") or {}
    if prov.get("platform", platform) != platform:
        raise BadInput(f"--append: {path} was measured on platform {prov['platform']!r}, this run is {platform!r}")
    sha = prov.get("git_sha")
    return [dict(r, git_sha=r.get("git_sha", sha)) for r in doc["results"]]


def parse_args(tokens: str, batch: int, impls: str, steps: int, warmup: int, compile_: bool) -> tuple:
    """(tokens list, impls list) or BadInput naming the option."""
    from dsv4.harness.errors import BadInput
    try:
        toks = [int(t) for t in tokens.split(",")]
    except ValueError:
        raise BadInput(f"--tokens: a comma list of integers, got {tokens!r}") from None
    if batch < 1:
        raise BadInput(f"--batch: must be >= 1, got {batch}")
    for T in toks:
        if T < batch or T % batch:
            raise BadInput(f"--tokens: {T} is not a positive multiple of --batch {batch}")
    if steps < 1 or warmup < 0:
        raise BadInput(f"--steps / --warmup: need steps >= 1 and warmup >= 0, got {steps} / {warmup}")
    names = [i for i in impls.split(",") if i]
    bad = [i for i in names if i not in IMPLS]
    if bad or not names:
        raise BadInput(f"--impls: unknown implementation {bad[0] if bad else impls!r}; known: {', '.join(IMPLS)}")
    if compile_:                                    # the old flag: ours compiled
        names = [{"ours": "ours_compile", "ours_packed": "ours_packed_compile"}.get(i, i) for i in names]
    return toks, list(dict.fromkeys(names))


PROFILE_PENDING = "the profile step did not finish (the row was written before it; a time limit cut it)"


def _row(cfg, impl, T, batch, steps, warmup, backend, recompute_from, device, profile, doc_min,
         on_timed=None, switches: dict | None = None) -> dict:
    """One measured row. With `profile`, `on_timed(row)` first gets the timed row (its profile marked pending), so
    that a caller's time limit hitting the extra profiled step does not lose the timing (the 64K rows at 7298853
    on the H200 were cut there twice)."""
    from dsv4.harness.train.flops import flops_per_token
    family, mode, packed = IMPLS[impl]
    S = T // batch
    warm = max(warmup, CUDAGRAPH_MIN_WARMUP) if mode == "reduce-overhead" else warmup
    rec = {"impl": impl, "tokens": T, "batch": batch, "seq": S, "steps": steps, "warmup": warm,
           "compile_mode": mode}
    if mode:
        torch._dynamo.reset()
        c0 = _compile_counters()
    t = time.perf_counter()
    if family == "ours":
        rec["backend"] = backend
        model = build_ours(cfg, backend, device, mode or False)
        rec["recompute"] = T >= recompute_from                 # whole-block activation recompute
        model.set_recompute(rec["recompute"])
        for f, (setter, d, _) in SWITCHES.items():            # DSv4Model.set_head_ce, ... (`run` keys the row)
            getattr(model, setter)((switches or {}).get(f, d))
    else:
        model = build_hf(cfg, device, mode is not None)
    if packed:
        inputs, rec["packing"] = packed_inputs(batch, S, cfg.vocab_size, device, doc_min=doc_min)
    else:
        inputs = lm_inputs(batch, S, cfg.vocab_size, device, family == "hf")
    rec["build_s"] = time.perf_counter() - t
    step = graph_step(model, inputs, (batch, S)) if impl in GRAPHED else \
        make_step(model, inputs, mark_step=mode == "reduce-overhead")
    rec.update(time_step_fn(step, steps, warm, device))
    if packed:
        lens = [n for row in rec["packing"]["doc_lengths"] for n in row]
        ntok = sum(lens)
        per = {n: flops_per_token(cfg, n)["total_training_flops_per_token"] for n in set(lens)}
        f = sum(n * per[n] for n in lens) / ntok           # each document at its own length
        rec["slot_tokens_per_s"] = T / rec["step_s"]
    else:
        ntok = T
        f = flops_per_token(cfg, S)["total_training_flops_per_token"]
    rec["tokens_per_s"] = ntok / rec["step_s"]
    rec["model_tflops"] = f * rec["tokens_per_s"] / 1e12
    rec["mfu_vs_989"] = f * rec["tokens_per_s"] / H200_PEAK_BF16
    rec["mfu_vs_797_measured"] = f * rec["tokens_per_s"] / H200_MEASURED_MATMUL
    if mode:
        c1 = _compile_counters()
        rec["compile_stats"] = {k: c1[k] - c0[k] for k in c0}
    if profile:
        from dsv4.harness.train.profile_step import profile_summary
        if on_timed is not None:
            on_timed(dict(rec, profile_missing=PROFILE_PENDING))
        rec["profile"] = profile_summary(step, device)
    del model, step, inputs
    return rec


def _progress(rec) -> str:
    head = f"{rec['impl']:10} {rec['tokens']:>6} tokens" + "".join(f" {f}={rec[f]}" for f in SWITCHES if f in rec) \
        + ": "
    if "error" in rec:
        return head + ("OOM" if rec["error"] == "oom" else rec["error"])
    mem = "n/a" if rec["peak_mem_bytes"] is None else f"{rec['peak_mem_bytes'] / 2**30:.1f}"
    line = head + f"{rec['tokens_per_s']:,.0f} tok/s, {mem} GiB, MFU {100 * rec['mfu_vs_989']:.1f}%, " \
        f"warm-up {sum(rec['first_steps_s']):.1f}s"
    if "profile" in rec:
        p = rec["profile"]
        line += f", {p['launches_per_step']} {p['launch_unit']}s/step, host {p['host_ms']:.0f} ms"
        line += "" if p["device_ms"] is None else f", device {p['device_ms']:.0f} ms"
        idle = p.get("device_idle")
        line += "" if idle is None else f" (idle {idle['idle_ms']:.1f} ms in {idle['gaps']} gaps)"
        line += "" if p.get("host_syncs") is None else f", {p['host_syncs']['per_step']} host syncs"
    if "compile_stats" in rec:
        line += ", " + " ".join(f"{k}={v}" for k, v in rec["compile_stats"].items())
    return line


def run(config: str | None, tokens: list[int], batch: int, steps: int, warmup: int, impls: list[str],
        backend: str | None = None, recompute_from: int = 32768, compile_: bool = False, *, smoke: bool = False,
        profile: bool = False, out=None, append: bool = False, doc_min: int = 128,
        switch_modes: dict[str, tuple[str, ...]] | None = None) -> dict:
    """Measure every (impl, tokens) row, ours' rows once per combination of the switch_modes (a SWITCHES field ->
    its modes, e.g. {"head_ce": ("recompute", "grad_in_forward")}: DSv4Model.set_head_ce; the combinations of one
    impl and tokens back to back); after each, `out` (if given) is rewritten atomically with every row so far
    (merged into its earlier rows under `append`). Returns the document written."""
    import os

    from dsv4.harness.errors import BadInput, need_cuda
    from dsv4.harness.goldens import atomic_write_json, platform_of, provenance
    from dsv4.model.config import get_config
    toks, names = parse_args(",".join(map(str, tokens)), batch, ",".join(impls), steps, warmup, compile_)
    config = config or ("debug" if smoke else "proxy")
    if append and not out:
        raise BadInput("--append: needs --out (the file to add the rows to)")
    if torch.cuda.is_available():
        device = torch.device("cuda")
    elif smoke:
        device = torch.device("cpu")
    else:
        need_cuda("dsv4 bench train")
    backend = backend or ("triton" if device.type == "cuda" else "naive")
    cfg = get_config(config)
    platform = platform_of(device)       # from the GPU's name: an H100 run is not filed as h200
    old = load_existing(out, config, platform) if append and os.path.exists(out) else []
    prov = provenance(platform, config=cfg.to_dict())
    if smoke:
        prov["smoke"] = f"{config} on {device.type}: checks the machinery, the numbers mean nothing"
    where = {k: prov[k] for k in ("git_sha", "git_dirty", "code_hash", "created")}     # each row's own, from prov
    where.update(torch=torch.__version__, device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu")
    new: list[dict] = []

    def doc(pending=None):
        rows = merge_results(old, new + ([pending] if pending else []))
        return {"bench": "train", "config": config, "backend": backend, "steps": steps, "warmup": warmup,
                "recompute_from_tokens": recompute_from,
                "compile": any(r["impl"] in ("ours_compile", "ours_cudagraph", "ours_packed_compile")
                               for r in rows),
                "results": rows, "ratios": ratios(rows), "provenance": prov}

    modes = [(switch_modes or {}).get(f, (d,)) for f, (_, d, _) in SWITCHES.items()]
    combos = [dict(zip(SWITCHES, c)) for c in itertools.product(*modes)]
    plan = [(impl, T, sw) for impl in names for T in toks
            for sw in (combos if IMPLS[impl][0] == "ours" else [{}])]
    for impl, T, sw in plan:
        tag = dict(sw)                 # ours rows carry every switch's mode (SWITCHES); HF rows none

        def timed(rec):                # the timed row on disk before its profile step (`_row`)
            if out:
                atomic_write_json(out, doc(dict(rec, **tag, **where)))
        try:
            rec = _row(cfg, impl, T, batch, steps, warmup, backend, recompute_from, device, profile, doc_min,
                       on_timed=timed, switches=sw)
        except torch.OutOfMemoryError:
            rec = {"impl": impl, "tokens": T, "batch": batch, "seq": T // batch, "error": "oom"}
        except Exception as e:  # noqa: BLE001 - a peer failing is a result, recorded with its reason
            rec = {"impl": impl, "tokens": T, "batch": batch, "seq": T // batch,
                   "error": f"{type(e).__name__}: {str(e)[:300]}"}
        rec.update(tag, **where)
        new.append(rec)
        _log(_progress(rec))
        if IMPLS[impl][1]:             # compiled: drop Dynamo's caches and the cudagraph trees' memory pool
            torch._dynamo.reset()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if out:
            atomic_write_json(out, doc())
    return doc()


@click.command("train")
@click.option("--config", default=None, help="Model config (default proxy; debug under --smoke).")
@click.option("--tokens", default="4096,8192", help="Comma list of tokens per step (B * S).")
@click.option("--batch", default=2, type=int, help="Rows per step (packed impls: packed rows of tokens / batch).")
@click.option("--steps", default=5, type=int)
@click.option("--warmup", default=2, type=int, help="Untimed steps first (compile happens here; cudagraph: >= 3).")
@click.option("--impls", default="ours,hf_eager,hf_compile", help=f"Comma list of: {', '.join(IMPLS)}.")
@click.option("--backend", default=None, type=click.Choice(["naive", "triton"]),
              help="Ours' kernels (default triton on a GPU, naive on CPU).")
@click.option("--recompute-from", default=32768, type=int,
              help="Ours: recompute block activations in backward from this many tokens per step on.")
@click.option("--compile", "compile_", is_flag=True,
              help="Ours: torch.compile every block (ours -> ours_compile, ours_packed -> ours_packed_compile).")
@click.option("--profile", is_flag=True, help="Profile one extra step per row; a summary is stored with it.")
@click.option("--doc-min", default=128, type=int, help="Packed impls: shortest document drawn (tokens).")
@click.option("--head-ce", "head_ce", default="grad_in_forward",
              help="Ours: comma list of head cross-entropy gradient modes (grad_in_forward | recompute), one row "
                   "each (DSv4Model.set_head_ce); every ours row carries head_ce, a non-default row a ratio over "
                   "the default row.")
@click.option("--out-rope", "out_rope", default="fused",
              help="Ours: comma list of where the attention output's inverse RoPE runs (fused | separate), one row "
                   "each (DSv4Model.set_out_rope; crossed with --head-ce); every ours row carries out_rope, a "
                   "non-default row a ratio over the default row.")
@click.option("--all-picked", "all_picked", default="contiguous",
              help="Ours: comma list of how a CSA selection listing every visible entry is read (contiguous | "
                   "listed), one row each (DSv4Model.set_all_picked; crossed with the other switches); only rows "
                   "whose documents are at most m (k + 1) - 1 tokens long take it (proxy: 2,051).")
@click.option("--out", "out", default=None, type=click.Path(dir_okay=False),
              help="JSON written atomically after every row.")
@click.option("--append", is_flag=True, help="Keep the rows already in --out (same impl/tokens/batch replaced).")
@click.option("--smoke", is_flag=True, help="The debug config; on CPU (naive kernels) when no GPU is visible.")
@click.option("--json", "as_json", is_flag=True)
def bench_train_cmd(config, tokens, batch, steps, warmup, impls, backend, recompute_from, compile_, profile,
                    doc_min, head_ce, out_rope, all_picked, out, append, smoke, as_json):
    """Training tokens/s, peak memory and MFU of ours (eager, compiled, CUDA graphs, packed) vs Hugging Face
    DeepseekV4 (eager, compiled)."""
    from dsv4.harness.errors import BadInput
    from dsv4.model.attention import ALL_PICKED, OUT_ROPES
    from dsv4.model.model import HEAD_CE
    toks, names = parse_args(tokens, batch, impls, steps, warmup, False)
    switch_modes = {}
    for flag, field, known, given in (("--head-ce", "head_ce", HEAD_CE, head_ce),
                                      ("--out-rope", "out_rope", OUT_ROPES, out_rope),
                                      ("--all-picked", "all_picked", ALL_PICKED, all_picked)):
        modes = tuple(m.strip() for m in given.split(",") if m.strip())
        bad = [m for m in modes if m not in known]
        if bad or not modes or len(set(modes)) != len(modes):
            raise BadInput(f"{flag}: a comma list of distinct modes from {', '.join(known)}; got {given!r}")
        switch_modes[field] = modes
    doc = run(config, toks, batch, steps, warmup, names, backend, recompute_from, compile_, smoke=smoke,
              profile=profile, out=out, append=append, doc_min=doc_min, switch_modes=switch_modes)
    click.echo(json.dumps(doc, indent=1))    # the result, with or without --json (progress went to stderr)
