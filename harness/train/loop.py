"""`dsv4 train`: a real single-device training loop for the DSv4 model (issue 5; slices P8 data, D9 metrics).

    dsv4 train --recipe debug|tiny|proxy [--steps N] [--out DIR] [--resume DIR] [--seed S]
               [--device cpu|cuda] [--dtype fp32|bf16] [--save-interval K] [--json]
               [--precision bf16|fp8_tensor|fp8_block|fp4_qat] [--indexer-qk-precision bf16|fp8|fp4]
               [--indexer-qk-rerank M]

Per step: forward (LM + MTP + indexer + MoE aux losses inside the model), backward, gradient clipping, Muon +
AdamW step with warm-up + cosine LR (harness/train/optim.py), MoE expert-bias update. Recorded per step, under
Megatron's metric names where one exists: `lm loss`, `mtp_1 loss`, `indexer loss`, `moe aux loss`,
`total loss`, `grad-norm`, `num-zeros` (zero entries in the gradients, as `--log-num-zeros-in-grad`),
`iteration-time`, `tokens-per-sec`, `tflops` (model FLOPs from harness/train/flops.py), `lr`, and on CUDA
`mem-allocated-bytes` / `mem-max-allocated-bytes`.

Outputs in `--out`: TensorBoard events (`tensorboard/`), `golden_values.json` (Megatron's golden-values
format: per metric {start_step, end_step, step_interval, values {"1": ...}}, 5 decimals, "nan" if missing),
`metrics.jsonl`, `run.json`, `provenance.json` (harness.goldens.provenance: what `dsv4 compare` reports show),
`checkpoints/` (harness/train/checkpoint.py; atomic; the last step is always saved, with the model config, so every
run can be resumed and converted: `dsv4 convert <out> <dst> --to hf`).

Runs that would waste time are stopped: a non-finite loss, gradient or parameter stops the run at that step
(exit 1, naming the first non-finite tensor); `--out` holding another run is refused unless `--resume` (in
place) or `--overwrite`; `--resume` with `--steps` <= the checkpoint's step is refused; resuming in place drops
the `metrics.jsonl` rows after the checkpoint's step. Text corpora must be UTF-8 (`--errors replace` to
substitute U+FFFD). JSON output is strict: non-finite floats are written as the strings "nan", "inf", "-inf"
(Megatron's golden-values spelling), never as bare NaN.

Determinism: on CPU, `torch.use_deterministic_algorithms(True)` and a fixed thread count (1 by default), the
data order is a pure function of (seed, consumed samples); resuming from step k replays steps k+1.. exactly.
bf16 uses autocast with FP32 master parameters (the optimiser state stays FP32).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import shutil
import sys
import time
from dataclasses import MISSING, asdict, dataclass, fields

import click
import numpy as np
import torch

from dsv4.harness.train import checkpoint as ckpt
from dsv4.harness import goldens as G
from dsv4.harness.errors import is_disk_full, report_bad_input
from dsv4.harness.train.data import DataError, GPTSamples, IndexedTokens, build_text_dataset, text_documents
from dsv4.harness.train.flops import flops_per_token
from dsv4.harness.train.optim import build_optimizer, lr_at
from dsv4.model.config import ConfigError, DSv4Config, get_config
from dsv4.model.interop.common import load_checked
from dsv4.model.model import HEAD_CE

# Metrics written to golden_values.json: Megatron's exported set plus "indexer loss" -- the ones the harness's
# threshold table (harness/thresholds.py) judges. Everything else (grad-norm, moe aux loss, tokens/s, TFLOP/s,
# lr, fwd/bwd vs optimizer time, moe-max-over-mean) is in metrics.jsonl and TensorBoard.
GOLDEN_METRICS = ("lm loss", "mtp_1 loss", "indexer loss", "total loss", "num-zeros", "iteration-time",
                  "mem-allocated-bytes", "mem-max-allocated-bytes")


@dataclass
class Recipe:
    config: str
    batch_size: int
    seq_len: int
    steps: int
    lr: float
    min_lr: float
    warmup: int
    clip_grad: float = 1.0
    weight_decay: float = 0.1
    device: str = "cpu"
    dtype: str = "fp32"
    threads: int = 1
    save_interval: int = 0
    backend: str = "naive"          # kernel backend of the model: naive | triton
    text: tuple = ()                # text files for the corpus; () = the default offline stdlib corpus
    packing: bool = False           # THD: documents packed into one [1, B*S] row per step (P7 scheduler)
    text_errors: str = "strict"     # text files that are not UTF-8: strict (refuse) | replace (U+FFFD)
    compile: bool = False           # torch.compile every block (DSv4Model.compile_blocks); same math
    cuda_graphs: bool = False       # compile_blocks(mode="reduce-overhead"): each block's fwd / bwd replayed as CUDA
                                    # graphs (Inductor's cudagraph trees; CUDA only); same math, no host launches
    # --- opt-in extensions (issue 18; the defaults keep the debug / tiny / proxy runs and their goldens) ---
    lr_schedule: str = "cosine"     # cosine | wsd (warm-up, stable until decay_start, cosine) -- harness/train/schedule.py
    decay_start: int = 0            # wsd: last step at the peak LR
    mtp_weight_after_decay: float | None = None   # DSv4 §10.2: MTP weight 0.3 -> this (0.1) once the LR decays
    curriculum: str | None = None   # long-context stages (harness/train/curriculum.py); packed rows of each stage's length
    sft: bool = False               # SFT: chat JSONL, assistant-only labels, packed rows (harness/train/sft.py)
    sft_data: str | None = None     # chat JSONL (default: the synthetic arithmetic chats)
    tokenizer: str | None = None    # tokenizer.json for sft_data (default: byte-level)
    init: str | None = None         # start from a checkpoint: HF / official dir or a dsv4 run (harness/train/loading.py)
    recompute: bool = False         # whole-block activation recompute (long sequences)
    head_ce: str = HEAD_CE[0]       # the heads' CE gradients (DSv4Model.set_head_ce): grad_in_forward (3 GEMMs a
                                    # row block) | recompute (4; holds y instead of dy + an fp32 dW [V, d])
    # --- X1 low precision (issue 17): a precision recipe of model/lowp/recipe.py, applied after the model is built
    precision: str | None = None    # None (off) | bf16 | fp8_tensor | fp8_block | fp4_qat
    indexer_qk_precision: str | None = None   # overrides the precision recipe's: bf16 | fp8 | fp4
    indexer_qk_rerank: float | None = None    # overrides the recipe's re-rank margin (fp8 / fp4 picks re-ranked)


RESUME_MAY_CHANGE = ("compile", "cuda_graphs", "head_ce")   # Recipe fields of the same math: a resume may change them


def set_head_ce(model, recipe: Recipe) -> None:
    """recipe.head_ce onto a DSv4Model (HEAD_CE; TrainError naming the field otherwise); other models: nothing."""
    if recipe.head_ce not in HEAD_CE:
        raise TrainError(f"train.head_ce: one of {', '.join(HEAD_CE)}, got {recipe.head_ce!r}")
    if hasattr(model, "set_head_ce"):
        model.set_head_ce(recipe.head_ce)


def stored_recipe(r: dict) -> dict:
    """A checkpoint's stored recipe with the Recipe fields added since it was written at their defaults (so a
    field added later, e.g. indexer_qk_rerank, does not refuse the resume of an older run at that default)."""
    defaults = {f.name: f.default for f in fields(Recipe) if f.default is not MISSING}
    return {**json.loads(json.dumps(defaults)), **r}


RECIPES = {
    # a few seconds on 2 CPU cores
    "debug": Recipe("debug", batch_size=2, seq_len=32, steps=12, lr=1e-2, min_lr=1e-3, warmup=2),
    # the CPU loss-curve golden: >= 200 steps of real text, < 2 min on 2 cores
    "tiny": Recipe("tiny", batch_size=4, seq_len=64, steps=200, lr=6e-3, min_lr=6e-4, warmup=10),
    # one H200 (issue 7 proxy model), bf16, Triton kernels (the naive ops train ~50x slower there: 8.4 s a step)
    "proxy": Recipe("proxy", batch_size=1, seq_len=4096, steps=100, lr=2.7e-4, min_lr=2.7e-5, warmup=10,
                    device="cuda", dtype="bf16", threads=8, backend="triton"),
    # --- issue 18 extensions (X5 SFT / X4 schedules) ---
    # SFT of the debug model on the synthetic chats (or --sft-data), 2 x 64 tokens packed per step
    "sft-debug": Recipe("debug", batch_size=2, seq_len=64, steps=8, lr=3e-3, min_lr=3e-4, warmup=2, sft=True),
    # the DSv4 MTP schedule on a warm-up-stable-decay LR: MTP weight 0.3 for steps <= 8, 0.1 after
    "wsd-debug": Recipe("debug", batch_size=2, seq_len=32, steps=12, lr=1e-2, min_lr=1e-3, warmup=2,
                        lr_schedule="wsd", decay_start=8, mtp_weight_after_decay=0.1),
    # long-context curriculum on CPU (tiny lengths) and on one H200 (4K -> 16K -> 64K)
    "long-debug": Recipe("debug", batch_size=1, seq_len=128, steps=10, lr=1e-2, min_lr=1e-3, warmup=2,
                         curriculum="debug-long"),
    "long-proxy": Recipe("proxy", batch_size=1, seq_len=65536, steps=75, lr=2.7e-4, min_lr=2.7e-5, warmup=10,
                         device="cuda", dtype="bf16", threads=8, backend="triton", curriculum="proxy-long",
                         recompute=True,
                         lr_schedule="wsd", decay_start=65, mtp_weight_after_decay=0.1),
}


DTYPES = ("fp32", "bf16", "fp64")


class TrainError(ValueError):
    """Bad training input; one line."""


class NonFiniteError(RuntimeError):
    """The run diverged: a loss, gradient or parameter is NaN/Inf (exit 1, naming the first such tensor)."""

    def __init__(self, step: int, what: str, name: str, value: str):
        super().__init__(f"train: step {step}: non-finite {what} {name} ({value}); run stopped")
        self.doc = {"step": step, "what": what, "tensor": name, "value": value}


# files and folders that mark an --out directory as holding a run
RUN_FILES = ("run.json", "provenance.json", "metrics.jsonl", "golden_values.json", "routing_stats.json",
             "checkpoints", "tensorboard")


# ------------------------------------------------------------------------------------------------ helpers
def _git_sha() -> str:
    sha, dirty = G.git_sha()
    return sha + ("-dirty" if dirty else "")


def first_nonfinite(named) -> tuple[str, str] | None:
    """(name, "nan" | "inf") of the first tensor in `named` ((name, tensor) pairs) holding a NaN or Inf."""
    for n, t in named:
        if t is not None and not bool(torch.isfinite(t).all()):
            return n, "nan" if bool(torch.isnan(t).any()) else "inf"
    return None


def host_scalars(floats, ints, device) -> tuple[list[float], list[int]]:
    """The step's scalars on the host in ONE device->host copy (the loop used one sync per value: ~165 a step
    for proxy). floats: 0-dim tensors of any floating dtype or Python floats, cast to fp64 on the device (exact:
    float(t) of an fp32 / bf16 / fp64 tensor is the same Python float); ints: int64 tensors of any shape,
    flattened. The fp64 values travel bit-cast to int64 beside the ints and are bit-cast back on the host."""
    f = [v.detach().to(device, torch.float64).reshape(1) if torch.is_tensor(v)
         else torch.tensor([float(v)], dtype=torch.float64, device=device) for v in floats]
    i = [t.detach().to(device, torch.int64).reshape(-1) for t in ints]
    host = torch.cat([torch.cat(f).view(torch.int64), *i]).cpu() if f else torch.cat(i).cpu()
    return host[:len(f)].view(torch.float64).tolist(), host[len(f):].tolist()


def _check_finite(step: int, what: str, named) -> None:
    bad = first_nonfinite(named)
    if bad:
        raise NonFiniteError(step, what, *bad)


def config_hash(cfg: DSv4Config) -> str:
    return hashlib.sha256(json.dumps(cfg.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


def golden_values(history: list[dict], metrics=GOLDEN_METRICS) -> dict:
    """Megatron golden-values JSON from per-step records (dev style: every grid step filled, "nan" if missing)."""
    out = {}
    if not history:
        return out
    steps = [h["step"] for h in history]
    start, end = min(steps), max(steps)
    by_step = {h["step"]: h for h in history}
    for m in metrics:
        if not any(m in h for h in history):
            continue
        vals = {}
        for s in range(start, end + 1):
            v = by_step.get(s, {}).get(m)
            vals[str(s)] = "nan" if v is None or (isinstance(v, float) and not math.isfinite(v)) else round(float(v), 5)
        out[m] = {"start_step": start, "end_step": end, "step_interval": 1, "values": vals}
    return out


def _load_optim(opt, state: dict, model, where: str) -> None:
    """Load the optimiser state; refuse, naming the parameter, a moment whose shape does not fit its parameter."""
    try:
        opt.load_state_dict(state)
    except (ValueError, KeyError, TypeError, RuntimeError) as e:
        raise ckpt.CheckpointError(f"{where}: does not fit the optimiser ({str(e).splitlines()[0]})") from None
    names = {id(p): n for n, p in model.named_parameters()}
    for o in (opt.muon, opt.adamw):
        for group in (o.param_groups if o else []):
            for p in group["params"]:
                for k, v in o.state.get(p, {}).items():
                    if isinstance(v, torch.Tensor) and v.dim() == p.dim() and v.shape != p.shape:
                        raise ckpt.CheckpointError(f"{where}: {k} of {names[id(p)]}: shape {list(v.shape)}, "
                                                   f"parameter has {list(p.shape)}")


_FLOPS_CACHE: dict = {}


def _flops_cached(cfg: DSv4Config, n: int) -> float:
    key = (config_hash(cfg), n)
    if key not in _FLOPS_CACHE:
        _FLOPS_CACHE[key] = flops_per_token(cfg, n)["total_training_flops_per_token"]
    return _FLOPS_CACHE[key]


def build_model(cfg: DSv4Config):
    from dsv4.model import model as _m                                     # imported late: model is big
    return _m.DSv4Model(cfg)


class PackedSource:
    """THD batches (slice P7 scheduler, dp_size 1): every step packs whole documents into one row of
    `capacity` tokens with cu_seqlens; documents are shuffled per epoch from (seed, epoch). Step k of the run is
    a pure function of (seed, k), so resuming is exact. Labels are next tokens inside each document."""

    def __init__(self, data: IndexedTokens, capacity: int, seed: int):
        from dsv4.harness.train.packing import EpochSchedule
        self.data, self.capacity = data, capacity
        self.epochs = EpochSchedule(data.lengths, capacity, seed, salt=1)

    def batch(self, k: int) -> dict:
        """Step k (0-based) -> materialized packed micro-batch (numpy)."""
        from dsv4.harness.train.packing import materialize
        order, mb = self.epochs.step(k)
        return materialize(mb, _Reordered(self.data, order))


def _wait_past_event_files(tb_dir: str) -> None:
    """Sleep (< 1 s) until the clock's second is past that of every event file in `tb_dir`: a resumed run in the
    same second would otherwise sort by pid / writer count as text (".10" before ".9") and be read before the
    run it purges."""
    secs = [int(f.split(".")[3]) for f in (os.listdir(tb_dir) if os.path.isdir(tb_dir) else [])
            if f.startswith("events.out.tfevents.") and f.split(".")[3].isdigit()]
    while secs and time.time() < max(secs) + 1:
        time.sleep(0.05)


class _Reordered:
    def __init__(self, data, order):
        self.data, self.order = data, order

    def __getitem__(self, i):
        return self.data[int(self.order[i])].astype(np.int64)


# ------------------------------------------------------------------------------------------------ the loop
def train(recipe: Recipe, out: str, seed: int = 1234, resume: str | None = None, model_factory=None,
          progress: bool = True, log=lambda s: print(s, file=sys.stderr), overwrite: bool = False,
          save_final: bool = True) -> dict:
    """Run `recipe` into `out`; returns a summary dict. `model_factory(cfg)` builds the model (default
    `build_model`, looked up at call time so tests may swap it).

    The process-wide settings it changes (thread count, deterministic algorithms) are restored on return.
    """
    saved = (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled())
    try:
        return _train(recipe, out, seed, resume, model_factory or build_model, progress, log, overwrite,
                      save_final)
    finally:
        torch.set_num_threads(saved[0])
        torch.use_deterministic_algorithms(saved[1], warn_only=saved[2])


def _prepare_out(out: str, resume: str | None, overwrite: bool) -> str | None:
    """Refuse an --out that holds another run (unless --overwrite, which removes that run's files); returns the
    checkpoint directory to resume from."""
    ck_dir = ckpt.latest_checkpoint(resume) if resume else None
    in_place = ck_dir is not None and os.path.realpath(ck_dir).startswith(os.path.realpath(out) + os.sep)
    held = [f for f in RUN_FILES if os.path.exists(os.path.join(out, f))]
    if held and not in_place:
        if not overwrite:
            raise TrainError(f"train.out: {out} already holds a run ({held[0]}); pass --overwrite to replace it, "
                             f"or --resume {out} to continue it")
        for f in held:
            path = os.path.join(out, f)
            shutil.rmtree(path) if os.path.isdir(path) else os.unlink(path)
    return ck_dir


def _keep_metrics_until(path: str, step: int) -> None:
    """Resuming in place at `step`: drop the metrics.jsonl rows after it (and a torn last line)."""
    if not os.path.exists(path):
        return
    keep = []
    with open(path) as f:
        for line in f:
            try:
                if json.loads(line)["step"] <= step:
                    keep.append(line if line.endswith("\n") else line + "\n")
            except (ValueError, KeyError, TypeError):
                pass
    G.atomic_write_text(path, "".join(keep))


def _train(recipe, out, seed, resume, model_factory, progress, log, overwrite=False, save_final=True) -> dict:
    if recipe.steps < 1:
        raise TrainError(f"train.steps: must be >= 1, got {recipe.steps}")
    if recipe.device not in ("cpu", "cuda"):
        raise TrainError(f"train.device: must be cpu|cuda, got {recipe.device!r}")
    if recipe.device == "cuda" and not torch.cuda.is_available():
        raise TrainError("train.device: cuda requested but no CUDA device is available")
    if recipe.dtype not in DTYPES:
        raise TrainError(f"train.dtype: must be {'|'.join(DTYPES)}, got {recipe.dtype!r}")
    if recipe.cuda_graphs and recipe.device != "cuda":
        raise TrainError(f"train.cuda_graphs: CUDA graphs need --device cuda, got {recipe.device}")
    if recipe.backend == "triton" and not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        raise TrainError("train.backend: triton needs a CUDA GPU: none visible (torch.cuda.is_available() is "
                         "False); use --backend naive")
    t_start = time.time()
    ck_dir = _prepare_out(out, resume, overwrite)
    loaded = None
    if resume:
        loaded = ckpt.load_checkpoint(ck_dir)
        meta = loaded[3]
        for k in ("step", "seed", "config_hash", "recipe", "history"):
            if k not in meta:
                raise TrainError(f"resume: {os.path.join(ck_dir, 'meta.json')}: missing field {k!r}")
        if recipe.steps <= meta["step"]:
            raise TrainError(f"train.steps: --steps {recipe.steps} <= step {meta['step']} of checkpoint {ck_dir}: "
                             f"nothing to train (--steps is the total, give more than {meta['step']})")
    os.makedirs(out, exist_ok=True)
    device = torch.device(recipe.device)
    if device.type == "cpu":
        torch.set_num_threads(recipe.threads)
        torch.use_deterministic_algorithms(True)
    else:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)

    from dsv4.harness.train import schedule as sched
    init_model = None
    if recipe.init:
        from dsv4.harness.train.loading import load_model
        init_model, _ = load_model(recipe.init)
        cfg = init_model.cfg
    else:
        cfg = get_config(recipe.config)
    cfg_hash = config_hash(cfg)                       # before the per-step schedule settings below mutate cfg
    base_mtp = (cfg.mtp_loss_scaling_factor, cfg.indexer_loss_mode)
    sched.decay_start(recipe)                         # validates the schedule
    docs = text_documents(list(recipe.text), recipe.text_errors) if recipe.text else None
    data_info = build_text_dataset(os.path.join(out, "data", "corpus"), docs)
    if data_info["tokens"] and cfg.vocab_size < 256:
        raise TrainError(f"train.config: vocab_size {cfg.vocab_size} < 256 cannot hold byte tokens")
    corpus = IndexedTokens(os.path.join(out, "data", "corpus"))
    packed_src = stages = None
    if recipe.sft:
        from dsv4.harness.train.sft import SFTSource, read_chat_jsonl, synthetic_chats
        from dsv4.harness.train.tokenizer import load_tokenizer
        tok = load_tokenizer(recipe.tokenizer)
        if tok.vocab_size > cfg.vocab_size:
            raise TrainError(f"train.tokenizer: vocabulary {tok.vocab_size} > the model's {cfg.vocab_size}")
        convs = read_chat_jsonl(recipe.sft_data) if recipe.sft_data else synthetic_chats(256, seed)
        packed_src = SFTSource(convs, tok, recipe.batch_size * recipe.seq_len, seed)
        data_info["sft"] = {"conversations": len(convs), "data": recipe.sft_data or "synthetic",
                            "tokenizer": recipe.tokenizer or "byte"}
    elif recipe.curriculum:
        from dsv4.harness.train.curriculum import CurriculumSource, get_curriculum
        stages = get_curriculum(recipe.curriculum)
        packed_src = CurriculumSource(corpus, stages, seed, PackedSource)
    elif recipe.packing:
        packed_src = PackedSource(corpus, recipe.batch_size * recipe.seq_len, seed)
    else:
        samples = GPTSamples(corpus, recipe.seq_len, seed)

    torch.manual_seed(seed)
    # fp64: every parameter in double precision (P1's FP32-kept tensors included) -- the cross-host golden runs
    model = init_model if init_model is not None else model_factory(cfg)
    model = model.to(device, torch.float64) if recipe.dtype == "fp64" else model.to(device)
    if recipe.recompute:
        model.set_recompute(True)
    set_head_ce(model, recipe)
    if recipe.precision is not None or recipe.indexer_qk_precision is not None or recipe.indexer_qk_rerank is not None:
        _apply_precision(model, recipe)
    if recipe.backend != "naive":
        if recipe.backend != "triton" or not hasattr(model, "set_kernel_backend"):
            raise TrainError(f"train.backend: must be naive|triton, got {recipe.backend!r}")
        model.set_kernel_backend(recipe.backend)
    if recipe.compile or recipe.cuda_graphs:
        if not hasattr(model, "compile_blocks"):
            raise TrainError("train.compile: this model has no compile_blocks()")
        model.compile_blocks(**({"mode": "reduce-overhead"} if recipe.cuda_graphs else {}))
    model.train()
    # Newton–Schulz in bf16 for bf16 runs (spec §10.4: "Newton–Schulz can run in BF16"), fp32 otherwise
    opt = build_optimizer(model, lr=recipe.lr, weight_decay=recipe.weight_decay,
                          ns_dtype={"bf16": torch.bfloat16, "fp64": torch.float64}.get(recipe.dtype, torch.float32))
    params = [p for p in model.parameters() if p.requires_grad]
    fl = flops_per_token(cfg, recipe.seq_len)["total_training_flops_per_token"]

    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    step0, history = 0, []
    if resume:
        m_state, o_state, rng, meta = loaded
        def core(r):
            return {k: v for k, v in r.items() if k not in ("steps", "save_interval") + RESUME_MAY_CHANGE}
        now = json.loads(json.dumps(asdict(recipe)))                        # tuples -> lists, as stored
        if meta["config_hash"] != cfg_hash or core(stored_recipe(meta["recipe"])) != core(now):
            raise TrainError(f"resume: checkpoint {resume!r} was made with another recipe/config")
        if meta["seed"] != seed:
            raise TrainError(f"resume: checkpoint seed {meta['seed']} != --seed {seed}")
        load_checked(model, m_state, os.path.join(ck_dir, "model.safetensors"))
        _load_optim(opt, o_state, model, os.path.join(ck_dir, "optim.safetensors"))
        ckpt.set_rng_state(rng)
        step0, history = meta["step"], meta["history"]
        log(f"resumed from {ck_dir} at step {step0}")
    _check_finite(step0, "parameter", named)                    # a NaN init or a poisoned checkpoint: stop now
    prov = G.provenance(G.platform_of(device), config=json.loads(json.dumps(asdict(recipe))), seed=seed)
    G.atomic_write_json(os.path.join(out, "provenance.json"), prov)

    run_info = {"recipe": asdict(recipe), "config": recipe.config, "config_hash": cfg_hash, "seed": seed,
                "git_sha": _git_sha(), "torch": torch.__version__, "python": platform.python_version(),
                "platform": platform.platform(), "machine": platform.machine(), "device": str(device),
                "device_name": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor(),
                "threads": torch.get_num_threads(), "deterministic": torch.are_deterministic_algorithms_enabled(),
                "data": data_info, "flops_per_token": fl, "resumed_from": resume, "start_step": step0 + 1,
                "command": " ".join(sys.argv), "provenance": prov}
    G.atomic_write_json(os.path.join(out, "run.json"), run_info)

    from torch.utils.tensorboard import SummaryWriter
    # resuming in place: TensorBoard readers drop the old events after the checkpoint's step (no duplicate steps),
    # provided the new event file is read after the old ones: readers take the files in name order
    # (events.out.tfevents.<second>.<host>.<pid>.<writer count>), so start it in a later second
    if resume:
        _wait_past_event_files(os.path.join(out, "tensorboard"))
    tb = SummaryWriter(log_dir=os.path.join(out, "tensorboard"), purge_step=step0 + 1 if resume else None)
    from tqdm import tqdm
    bar = tqdm(total=recipe.steps, initial=step0, file=sys.stderr, disable=not progress, desc="train",
               dynamic_ncols=True)
    tokens_per_step = recipe.batch_size * recipe.seq_len
    amp = torch.autocast(device.type, dtype=torch.bfloat16) if recipe.dtype == "bf16" else None
    # bf16 (autocast) runs never hold the [B, S, V] logits: the LM / MTP cross-entropies go through
    # model.head_cross_entropy in row blocks (return_logits=False, as `dsv4 bench train`). fp32 / fp64 runs keep
    # the materialised logits: the chunked CE sums in another order (debug, 3 steps: ~1e-7 relative in fp32,
    # 1 ulp in fp64), which would move the CPU loss-curve goldens (tiny_loss_curve is bit-exact, same host).
    return_logits = amp is None
    ckpt_dir = os.path.join(out, "checkpoints")
    # MoE routing statistics (tokens per expert per layer, read before the bias update resets the counts);
    # written as <out>/routing_stats.json in the format `dsv4 flops --routing-stats` reads
    gates = {n.removesuffix(".ffn.gate").removeprefix("layers."): m for n, m in model.named_modules()
             if hasattr(m, "tokens_per_expert") and hasattr(m, "update_expert_bias")}
    routing: dict = {}
    if resume:
        _keep_metrics_until(os.path.join(out, "metrics.jsonl"), step0)
    metrics_f = open(os.path.join(out, "metrics.jsonl"), "a" if resume else "w")

    def save(step):
        ckpt.save_checkpoint(ckpt_dir, step, model, opt.state_dict(),
                             {"history": history, "consumed_samples": step * recipe.batch_size, "seed": seed,
                              "config_hash": cfg_hash, "recipe": asdict(recipe),
                              "model_config": _cfg_dict(cfg, base_mtp)})
    try:
        for step in range(step0 + 1, recipe.steps + 1):
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            lr = sched.lr_for(recipe, step)
            opt.set_lr(lr)
            cfg.mtp_loss_scaling_factor = sched.mtp_weight_for(recipe, step, base_mtp[0])
            if stages is not None:
                cfg.indexer_loss_mode = packed_src.stage(step).indexer_loss_mode
            if packed_src is not None:
                pb = packed_src.batch(step - 1)
                x = torch.from_numpy(pb["tokens"])[None].to(device)               # [1, B*S]
                y = torch.from_numpy(pb["labels"])[None].to(device)
                # host offsets: Layout.packed checks them there and copies them to the device without a sync
                cu, cup = torch.from_numpy(pb["cu_seqlens"]), torch.from_numpy(pb["cu_seqlens_padded"])
                lens = np.diff(pb["cu_seqlens"])
                real_tokens = int(lens.sum())
                # per document: Megatron's sum L_i^2
                step_flops = sum(int(n) * _flops_cached(cfg, int(n)) for n in lens)
                fwd = lambda: model(x, y, return_logits=return_logits,                    # noqa: E731
                                    cu_seqlens=cu, cu_seqlens_padded=cup)
            else:
                x, y = samples.batch((step - 1) * recipe.batch_size, recipe.batch_size)
                x, y = torch.from_numpy(x).to(device), torch.from_numpy(y).to(device)
                real_tokens, step_flops = tokens_per_step, fl * tokens_per_step
                fwd = lambda: model(x, y, return_logits=return_logits)            # noqa: E731
            opt.zero_grad(set_to_none=True)
            if recipe.cuda_graphs:            # a new iteration of the cudagraph trees (last step's outputs are freed)
                torch.compiler.cudagraph_mark_step_begin()
            if amp is not None:
                with amp:
                    o = fwd()
            else:
                o = fwd()
            o.loss.backward()
            if device.type == "cuda":
                torch.cuda.synchronize()
            t_fb = time.perf_counter() - t0
            grads = [p.grad for p in params if p.grad is not None]
            # = clip_grad_norm_ (same two calls), with the unclipped norm checked in between: a NaN/Inf stops here
            total_norm = torch.nn.utils.get_total_norm(grads)
            # every scalar the step reports, in one device->host copy (host_scalars): losses, the norm, the
            # zero-gradient count (int64 on the device) and the routing counts (read before the bias update)
            zeros = torch.stack([(g == 0).sum() for g in grads]).sum() if grads else torch.zeros((), dtype=torch.long)
            loss_names = list(o.losses)
            hf, it = host_scalars([o.loss, total_norm, *o.losses.values()],
                                  [zeros, *(g.tokens_per_expert for g in gates.values())], device)
            loss_v, gnorm, loss_vals = hf[0], hf[1], dict(zip(loss_names, hf[2:]))
            num_zeros = it[0] + sum(p.numel() for p in params if p.grad is None)
            if not (math.isfinite(loss_v) and math.isfinite(gnorm)):
                _check_finite(step, "loss", [*o.losses.items(), ("total loss", o.loss.detach())])
                _check_finite(step, "gradient", [(n, p.grad) for n, p in named])
                raise NonFiniteError(step, "gradient", "norm", str(gnorm))   # finite grads, norm overflow
            torch.nn.utils.clip_grads_with_norm_(params, recipe.clip_grad, total_norm)
            opt.step()
            step_loads, at = {}, 1
            for k, g in gates.items():
                step_loads[k], at = it[at:at + g.tokens_per_expert.numel()], at + g.tokens_per_expert.numel()
            for k, v in step_loads.items():
                routing[k] = [a + b for a, b in zip(routing.get(k, [0] * len(v)), v)]
            if hasattr(model, "update_expert_bias"):
                model.update_expert_bias()
            if not math.isfinite(float(torch.nn.utils.get_total_norm(params))):      # one reduction; names on failure
                _check_finite(step, "parameter", named)
            if device.type == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            rec = {"step": step, "lr": lr, "total loss": loss_v, "grad-norm": gnorm,
                   "num-zeros": float(num_zeros), "iteration-time": dt, "tokens-per-sec": real_tokens / dt,
                   "tflops": step_flops / dt / 1e12, "fwd-bwd-time": t_fb, "tokens": float(real_tokens),
                   "optimizer-time": dt - t_fb}
            rec.update(loss_vals)
            if recipe.mtp_weight_after_decay is not None:
                rec["mtp-weight"] = cfg.mtp_loss_scaling_factor
            if stages is not None:
                rec["seq-len"] = float(packed_src.stage(step).seq_len)
            imb = [max(v) * len(v) / sum(v) for v in step_loads.values() if sum(v)]
            if imb:
                rec["moe-max-over-mean"] = max(imb)                                # busiest expert / mean, worst layer
            if device.type == "cuda":
                ms = torch.cuda.memory_stats()
                rec["mem-allocated-bytes"] = float(ms["allocated_bytes.all.current"])
                rec["mem-max-allocated-bytes"] = float(ms["allocated_bytes.all.peak"])
            history.append(rec)
            for k, v in rec.items():
                if k != "step":
                    tb.add_scalar(k, v, step)
            metrics_f.write(json.dumps(G.json_safe(rec), allow_nan=False) + "\n")
            metrics_f.flush()
            bar.update(1)
            bar.set_postfix(loss=f"{rec['lm loss']:.4f}", tok_s=f"{rec['tokens-per-sec']:.0f}")
            if recipe.save_interval and step % recipe.save_interval == 0 and step < recipe.steps:
                save(step)
    finally:
        bar.close()
        tb.close()
        metrics_f.close()
    if recipe.save_interval or save_final:
        save(recipe.steps)
    G.atomic_write_json(os.path.join(out, "routing_stats.json"),
                        {"layers": routing, "steps": recipe.steps - step0, "start_step": step0 + 1})
    gv = golden_values(history)
    G.atomic_write_json(os.path.join(out, "golden_values.json"), gv)
    lm = [h["lm loss"] for h in history]
    summary = {"out": os.path.abspath(out), "recipe": recipe.config, "steps": recipe.steps, "start_step": step0 + 1,
               "seed": seed, "device": str(device), "dtype": recipe.dtype,
               "lm_loss_first": lm[0] if lm else None, "lm_loss_last": lm[-1] if lm else None,
               "lm loss": [round(v, 5) for v in lm], "wall_s": round(time.time() - t_start, 3),
               "median_iteration_time": sorted(h["iteration-time"] for h in history)[len(history) // 2],
               "tokens_per_sec": tokens_per_step / (sorted(h["iteration-time"] for h in history)[len(history) // 2]),
               "flops_per_token": fl, "golden_values": os.path.join(os.path.abspath(out), "golden_values.json"),
               "config_hash": cfg_hash}
    return summary


def _apply_precision(model, recipe: Recipe) -> None:
    """The X1 precision recipe `recipe.precision` (default bf16: nothing quantised) with the indexer QK override,
    from outside (model/lowp/recipe.py); before set_kernel_backend, which also sets the FP8 quantiser's backend."""
    from dsv4.kernels.indexer.fp4 import QK_PRECISIONS
    from dsv4.model.lowp.recipe import RECIPES as PRECISIONS, apply_precision_recipe, get_recipe
    name = recipe.precision or "bf16"
    if name not in PRECISIONS:
        raise TrainError(f"train.precision: unknown {name!r}; known: {', '.join(PRECISIONS)}")
    over = {}
    if recipe.indexer_qk_precision is not None:
        if recipe.indexer_qk_precision not in QK_PRECISIONS:
            raise TrainError(f"train.indexer_qk_precision: must be {'|'.join(QK_PRECISIONS)}, "
                             f"got {recipe.indexer_qk_precision!r}")
        over["indexer_qk_precision"] = recipe.indexer_qk_precision
    if recipe.indexer_qk_rerank is not None:
        if not recipe.indexer_qk_rerank >= 0:
            raise TrainError(f"train.indexer_qk_rerank: a margin >= 0, got {recipe.indexer_qk_rerank!r}")
        over["indexer_qk_rerank"] = float(recipe.indexer_qk_rerank)
    apply_precision_recipe(model, get_recipe(name, **over))


def _cfg_dict(cfg, base_mtp) -> dict:
    """The config as built (a checkpoint of an --init run must name it; harness/train/loading.py reads it), with the
    per-step schedule settings reset."""
    d = cfg.to_dict()
    d["mtp_loss_scaling_factor"], d["indexer_loss_mode"] = base_mtp
    return d


# ------------------------------------------------------------------------------------------------ CLI
@click.command("train")
@click.option("--recipe", type=click.Choice(sorted(RECIPES)), required=True)
@click.option("--steps", type=int, default=None, help="number of steps (default: the recipe's)")
@click.option("--out", "out", type=click.Path(), default=None, help="output dir (default runs/<recipe>)")
@click.option("--resume", type=click.Path(), default=None, help="run dir or checkpoint dir to resume from")
@click.option("--seed", type=int, default=1234, show_default=True)
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default=None)
@click.option("--dtype", type=click.Choice(list(DTYPES)), default=None)
@click.option("--save-interval", type=int, default=None,
              help="also checkpoint every K steps (0 = only the last step)")
@click.option("--final-checkpoint/--no-final-checkpoint", default=True, show_default=True,
              help="checkpoint the last step (resumable, convertible with `dsv4 convert`)")
@click.option("--overwrite", is_flag=True, help="replace the run already in --out")
@click.option("--threads", type=int, default=None, help="CPU threads (determinism needs a fixed count)")
@click.option("--backend", type=click.Choice(["naive", "triton"]), default=None, help="model kernel backend")
@click.option("--text", "text", multiple=True, type=click.Path(), help="text file(s) for the corpus (repeatable; "
              "default: the offline stdlib corpus)")
@click.option("--errors", "text_errors", type=click.Choice(["strict", "replace"]), default=None,
              help="--text files that are not UTF-8: strict (refuse, naming file and byte offset; default) | "
                   "replace (U+FFFD)")
@click.option("--packing/--no-packing", default=None, help="THD: pack whole documents into one row per step")
@click.option("--compile/--no-compile", "compile_", default=None, help="torch.compile every block")
@click.option("--cuda-graphs/--no-cuda-graphs", default=None, help="torch.compile every block in Inductor's "
              "reduce-overhead mode: its forward and backward replay as CUDA graphs (CUDA only; `dsv4 bench train "
              "--impls ours_cudagraph` measures it)")
@click.option("--init", "init", type=click.Path(), default=None,
              help="start from a checkpoint: HF / official directory or a dsv4 run")
@click.option("--sft-data", type=click.Path(), default=None, help="SFT recipes: chat JSONL ({'messages': [...]})")
@click.option("--tokenizer", type=click.Path(), default=None, help="tokenizer.json for --sft-data (default: bytes)")
@click.option("--curriculum", default=None, help="long-context stages (harness/train/curriculum.py: debug-long, "
              "proxy-long)")
@click.option("--lr-schedule", type=click.Choice(["cosine", "wsd"]), default=None)
@click.option("--decay-start", type=int, default=None, help="wsd: last step at the peak LR")
@click.option("--mtp-weight-after-decay", type=float, default=None,
              help="MTP loss weight once the LR decays (DSv4: 0.3 -> 0.1)")
@click.option("--recompute/--no-recompute", default=None, help="whole-block activation recompute")
@click.option("--head-ce", type=click.Choice(list(HEAD_CE)), default=None,
              help="bf16 single-device runs: when the heads' cross-entropy gradients form (DSv4Model.set_head_ce): "
              "grad_in_forward (default; 3 GEMMs a row block) or recompute (4 GEMMs; no fp32 dW [V, d] held from "
              "the forward)")
@click.option("--precision", default=None, help="X1 precision recipe (model/lowp/recipe.py): bf16 | fp8_tensor | "
              "fp8_block | fp4_qat")
@click.option("--indexer-qk-precision", default=None, help="the indexer's QK scoring: bf16 | fp8 | fp4 "
              "(overrides the precision recipe's)")
@click.option("--indexer-qk-rerank", type=float, default=None, help="at fp8 / fp4 QK: the low-precision top "
              "ceil(k (1 + M)) re-ranked by the bf16 scores (0 = off; overrides the precision recipe's)")
@click.option("--json", "as_json", is_flag=True, help="print one JSON summary on stdout (strict JSON: non-finite "
              "floats as \"nan\" / \"inf\" / \"-inf\")")
@click.option("--dp", type=int, default=None, help="data parallel (FSDP2) size; any parallel flag or torchrun's "
              "WORLD_SIZE selects the distributed loop (harness/train/dist.py)")
@click.option("--pp", type=int, default=None, help="pipeline stages (torch.distributed.pipelining)")
@click.option("--vpp", type=int, default=None, help="chunks per pipeline rank (needs --schedule interleaved1f1b)")
@click.option("--cp", type=int, default=None, help="context parallel size (the CP layout)")
@click.option("--ep", type=int, default=None, help="expert parallel size (the EP dispatcher)")
@click.option("--schedule", type=click.Choice(["gpipe", "1f1b", "interleaved1f1b"]), default=None,
              help="pipeline schedule (required with --pp > 1)")
@click.option("--microbatches", type=int, default=None, help="pipeline micro-batches per step (default pp)")
@click.option("--timeout", "timeout_s", type=float, default=120.0, show_default=True,
              help="seconds before any collective fails (a dead rank is an error, not a hang)")
@click.option("--optimizer", type=click.Choice(["muon", "adamw"]), default=None,
              help="muon (default: Muon matrices + AdamW) or adamw (AdamW everywhere); distributed loop")
@click.option("--fsdp-bf16", is_flag=True, help="FSDP2 bf16 all-gather / compute (P1's FP32-kept parameters "
              "outside FSDP) instead of FP32 masters under autocast; needs --dp > 1, --pp 1, --dtype fp32")
def train_cmd(recipe, steps, out, resume, seed, device, dtype, save_interval, final_checkpoint, overwrite, threads,
              backend, text, text_errors, packing, compile_, cuda_graphs, init, sft_data, tokenizer, curriculum,
              lr_schedule, decay_start, mtp_weight_after_decay, recompute, head_ce, precision, indexer_qk_precision,
              indexer_qk_rerank, as_json, dp, pp, vpp, cp, ep, schedule, microbatches, timeout_s, optimizer, fsdp_bf16):
    """Train a DSv4 model on one device (debug: seconds on CPU; tiny: the CPU loss-curve golden), or under
    torchrun on a (pp, dp, cp, ep) mesh with --dp/--pp/--vpp/--cp/--ep."""
    r = RECIPES[recipe]
    kw = {k: v for k, v in dict(steps=steps, device=device, dtype=dtype, save_interval=save_interval,
                                 threads=threads, backend=backend, text=tuple(text) or None,
                                 text_errors=text_errors, packing=packing, compile=compile_, cuda_graphs=cuda_graphs,
                                 init=init,
                                 sft_data=sft_data, tokenizer=tokenizer, curriculum=curriculum,
                                 lr_schedule=lr_schedule, decay_start=decay_start,
                                 mtp_weight_after_decay=mtp_weight_after_decay, recompute=recompute,
                                 head_ce=head_ce, precision=precision, indexer_qk_precision=indexer_qk_precision,
                                 indexer_qk_rerank=indexer_qk_rerank).items()
          if v is not None}
    try:
        if steps is not None and steps < 1:
            raise TrainError(f"train.steps: must be >= 1, got {steps}")
        if save_interval is not None and save_interval < 0:
            raise TrainError(f"train.save_interval: must be >= 0, got {save_interval}")
        if threads is not None and threads < 1:
            raise TrainError(f"train.threads: must be >= 1, got {threads}")
        if resume and "steps" not in kw:
            raise TrainError("train.steps: --resume needs --steps (the total number of steps)")
        if sft_data or tokenizer:
            kw["sft"] = True
        r = Recipe(**{**asdict(r), **kw})
        if head_ce is not None and r.dtype != "bf16":
            raise TrainError("train.head_ce: only bf16 runs take the loss through the blocked head cross-entropy "
                             f"(a {r.dtype} run forms full logits)")
        if r.curriculum and "steps" not in kw:
            from dsv4.harness.train.curriculum import get_curriculum, total_steps
            r = Recipe(**{**asdict(r), "steps": total_steps(get_curriculum(r.curriculum))})
        par = dict(dp=dp, pp=pp, vpp=vpp, cp=cp, ep=ep, schedule=schedule, microbatches=microbatches)
        if any(v is not None for v in par.values()) or optimizer is not None or fsdp_bf16 or \
                int(os.environ.get("WORLD_SIZE", "1")) > 1:
            if r.precision is not None or r.indexer_qk_precision is not None or r.indexer_qk_rerank is not None:
                raise TrainError("train.precision: the distributed loop does not apply precision recipes (one "
                                 "device only)")
            if head_ce is not None:
                raise TrainError("train.head_ce: the distributed loop forms full logits (no blocked head "
                                 "cross-entropy)")
            from dsv4.harness.train.dist import train_distributed
            from dsv4.model.parallel import ParallelPlan
            par = {k: v for k, v in par.items() if v is not None}
            par.setdefault("microbatches", par.get("pp", 1))
            res = train_distributed(r, out or os.path.join("runs", recipe), ParallelPlan(**par), seed=seed,
                                    resume=resume, timeout_s=timeout_s, optimizer=optimizer or "muon",
                                    fsdp_bf16=fsdp_bf16)
            if int(os.environ.get("RANK", "0")) != 0:
                return
        else:
            res = train(r, out or os.path.join("runs", recipe), seed=seed, resume=resume, progress=True,
                        overwrite=overwrite, save_final=final_checkpoint)
    except (TrainError, ConfigError, DataError, ckpt.CheckpointError, ValueError) as e:
        report_bad_input(e)
    except NonFiniteError as e:                                          # diverged: exit 1, not bad input
        click.echo(f"dsv4: {e}", err=True)
        if as_json:
            click.echo(json.dumps(G.json_safe({"error": str(e), "exit_code": 1, **e.doc}), allow_nan=False))
        sys.exit(1)
    except OSError as e:
        if not is_disk_full(e):
            raise
        report_bad_input(e)                                              # full disk: one line naming the file
    if as_json:
        click.echo(json.dumps(G.json_safe(res), allow_nan=False))
    else:
        click.echo(f"{recipe}: {res['steps']} steps, lm loss {res['lm_loss_first']:.4f} -> {res['lm_loss_last']:.4f}, "
                   f"{res['tokens_per_sec']:.0f} tokens/s, {res['wall_s']:.1f} s; wrote {res['golden_values']}")
