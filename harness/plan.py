"""`dsv4 plan`: predicted peak GPU memory and FLOPs of one training step per rank (issue 18 §3, extension slice X4).

    dsv4 plan --config proxy --tokens 65536 --batch 1 --recompute --optimizer none [--dp --pp --cp --ep] [--json]

The step: `--batch` B rows of S = tokens / B tokens (the global batch); dp and ep split the rows, cp the tokens of
a row (model/parallel), pp the layers.

One model, per rank, in bytes (what each term counts):

  parameters   every parameter in the dtype it is kept in (`--dtype bf16`: the P1 cast, FP32-kept tensors fp32);
               routed experts / ep; the largest pipeline stage (layers split contiguously, the embedding on the
               first stage, the head and MTP on the last); / dp under FSDP (+ the largest block gathered whole).
  gradients    one per parameter, same dtype and sharding (all of them: a step ends with every gradient).
  optimizer    Muon: one momentum buffer per Muon matrix, AdamW: exp_avg + exp_avg_sq; in the parameter's dtype
               (harness/train/optim.py); `none` = the bench's forward + backward (no optimizer); sharded like params.
  activations  the tensors autograd saves for backward, MEASURED (harness/plan_measure.py: one forward of the
               real model, Triton kernels on Triton's CPU interpreter, `saved_tensors_hooks`, each storage once)
               at a small sequence and scaled per block by their shapes: bytes ∝ T ("token"), ∝ T * N with
               N = S/m the CSA entries of a row (the indexer's [T, N] scores and loss: "entry"), ∝ T * k
               ("topk"). T = B * S / cp tokens of the rank; rows of S tokens. Without recompute every block's
               tensors are alive when backward starts; with recompute (whole blocks, model/recompute.py) the
               blocks keep only their input streams [T, n_hc, d] and one block at a time is re-run, so the
               peak holds the inputs of all blocks plus the largest block's tensors. Pipeline (1F1B): the first
               stage holds pp micro-batches in flight.
  workspace    the largest single transient on top of them (one of the two, whichever is larger): the head's
               blocked cross-entropy backward (model/model.py `_HeadCrossEntropy`: per 8192-row block the bf16
               and fp32 logits and the fp32 softmax, plus the fp32 head-gradient accumulator [V, d]), or, in a
               CSA block, three [S, N] fp32-sized temporaries: in dense mode the indexer teacher's L1
               normalisation (model/indexer.py `indexer_teacher`'s last line), in sparse mode the [S, N] scores
               that pick the top-k and the stable sort over them (values and int64 indices: 16 B per pair, so
               this rule undercounts that sort by 4 B per pair; the H200 peaks stay inside 15%, X4's test).
  The sum counts everything at once (all gradients, the whole largest block, the largest transient): an upper
  bound of the step's peak by construction, no term fitted to the measured peaks.
  cache        generation: the DSv4 KV cache (model/generate.py `cache_elements_per_token`) at --tokens, plus the
               per-layer ring buffers; reported beside the training peak, not added to it.

The allocator's fragmentation and the CUDA context are not counted (measured peaks are
`torch.cuda.max_memory_allocated`, which excludes them too). FLOPs per step: harness/train/flops.py's per-token
formula (the one formula) x tokens. Communication volume per step: FSDP all-gathers (forward + backward) and
reduce-scatters of the sharded parameters, EP all-to-all of the routed slots (dispatch + combine, forward +
backward), the pipeline's stream sends, CP's gathered compressed entries -- bytes per rank, an estimate.
Validated against the H200 peaks in goldens/h200/D9 (slices/X4/test_plan.py): within 15% (issue 18).
"""
from __future__ import annotations

import json
import math
import os

import click

from dsv4.harness.errors import report_bad_input
from dsv4.model.config import ConfigError, DSv4Config, get_config
from dsv4.model.model import HEAD_CE

GIB = 2 ** 30
H200_BYTES = 139 * GIB           # usable HBM of one H200 as `torch.cuda.mem_get_info` reports it (~139 GiB)
CE_CHUNK = 8192                  # model/model.py head_cross_entropy's row block
MEASURE_SEQ, MEASURE_TOPK = 200, 11   # measurement point: T, N = T/m, T/m' and k distinct from the config's dims
MEASURED_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "slices", "X4", "measured")
MEASURE_SEED = 0                 # harness/plan_measure.py seeds torch with it (weights, token ids)


# ----------------------------------------------------------------------------------------------- params
def _param_bytes(cfg: DSv4Config, dtype: str) -> dict:
    """Parameter bytes per category (meta-device model in the training dtype): {label: {group: bytes}} with
    label "top" / "layers.i" / "mtp.j", group "expert" (routed experts) | "muon" | "adamw"."""
    import torch
    from dsv4.harness.train.optim import param_group_of
    from dsv4.model.model import build_model
    from dsv4.model.precision import cast_model
    model = build_model(cfg, device="meta")
    cast_model(model, {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype])
    out: dict[str, dict] = {}
    for n, p in model.named_parameters():
        parts = n.split(".")
        lab = ".".join(parts[:2]) if parts[0] in ("layers", "mtp") else "top"
        g = "expert" if ".experts." in n else ("muon" if param_group_of(n, p) == "muon" else "adamw")
        d = out.setdefault(lab, {"expert": 0, "muon": 0, "adamw": 0, "expert_muon": 0})
        d[g] += p.numel() * p.element_size()
        if g == "expert" and param_group_of(n, p) == "muon":
            d["expert_muon"] += p.numel() * p.element_size()
    return out


# ----------------------------------------------------------------------------------------------- activations
def measured_path(cfg: DSv4Config) -> str:
    from dsv4.harness.goldens import config_hash
    return os.path.join(MEASURED_DIR, f"saved_{config_hash(cfg.to_dict())}.json")


MEASURE_MAX_EXPERTS = 16          # routed experts built for a measurement (saved tensors are per routed slot)


def measurement_config(cfg: DSv4Config) -> tuple[DSv4Config, dict]:
    """The config a measurement runs: one layer per distinct (attention kind, hash routing, MoE) of cfg's layers,
    in order of first occurrence (hash layers come first, as in cfg), the MTP layer, and at most 16 routed
    experts (a block's saved tensors are per token and per routed slot; only the router's [T, E] scores scale
    with E, a few KB per token). Returns (config, {cfg's label: the measured label})."""
    L = cfg.num_hidden_layers
    keys, reps, lmap = [], [], {}
    for i in range(L):
        key = (cfg.compress_ratios[i], cfg.is_hash(i), cfg.is_moe(i))
        if key not in keys:
            keys.append(key)
            reps.append(i)
        lmap[f"layers.{i}"] = f"layers.{keys.index(key)}"
    n = len(reps)
    for j in range(cfg.num_nextn_predict_layers):
        lmap[f"mtp.{j}"] = f"mtp.{j}"
    lmap["top"] = "top"
    mtp_idx = list(range(L, L + cfg.num_nextn_predict_layers))
    E = min(cfg.n_routed_experts, max(MEASURE_MAX_EXPERTS, cfg.num_experts_per_tok))
    pat = None if cfg.moe_layer_pattern is None else "".join(cfg.moe_layer_pattern[i] for i in reps + mtp_idx)
    mcfg = cfg.replace(num_hidden_layers=n, compress_ratios=[cfg.compress_ratios[i] for i in reps + mtp_idx],
                       num_hash_layers=sum(cfg.is_hash(i) for i in reps), n_routed_experts=E, moe_layer_pattern=pat)
    return mcfg, lmap


def measurement(cfg: DSv4Config, remeasure: bool = False) -> dict:
    """The stored measurement of cfg's saved tensors (slices/X4/measured/saved_<config hash>.json, written by
    `dsv4 plan --measure`), or a fresh one (minutes on a CPU). Its "layer_map" maps cfg's labels to the
    measured ones (measurement_config)."""
    path = measured_path(cfg)
    if os.path.isfile(path) and not remeasure:
        with open(path) as f:
            return json.load(f)
    from dsv4.harness.plan_measure import run_measure
    mcfg, lmap = measurement_config(cfg)
    m = run_measure(mcfg.to_dict(), MEASURE_SEQ, MEASURE_TOPK)
    m["layer_map"] = lmap
    return m


def block_activation_bytes(m: dict, label: str, B: int, S: int, cfg: DSv4Config, cp: int = 1) -> float:
    """Saved bytes of one block (or "top") for B rows of S tokens, this rank holding S / cp of each row."""
    d = m["labels"][m.get("layer_map", {}).get(label, label)]
    Sm, Nm, km = m["seq"], m["entries"], m["topk"]
    T = B * S / cp
    N = S // cfg.csa_ratio
    k = min(cfg.index_topk, N)
    return d["token"] / Sm * T + d["entry"] / (Sm * Nm) * T * N + d["topk"] / (Sm * km) * T * k + d["const"]


# ----------------------------------------------------------------------------------------------- plan
def _stages(cfg: DSv4Config, pp: int) -> list[list[str]]:
    L = cfg.num_hidden_layers
    per = math.ceil(L / pp)
    st = [[f"layers.{i}" for i in range(s * per, min(L, (s + 1) * per))] for s in range(pp)]
    st[0].insert(0, "top")
    st[-1] += [f"mtp.{j}" for j in range(cfg.num_nextn_predict_layers)]
    if pp > 1:
        st[-1].append("top")          # the head on the last stage (embedding on the first): "top" counted on both
    return st


def plan(cfg: DSv4Config, tokens: int, batch: int = 1, recompute: bool = False, dtype: str = "bf16",
         optimizer: str = "muon", dp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, config_name: str = "",
         m: dict | None = None, capacity: float = H200_BYTES, head_ce: str = HEAD_CE[0]) -> dict:
    for name, v in (("tokens", tokens), ("batch", batch), ("dp", dp), ("pp", pp), ("cp", cp), ("ep", ep)):
        if v < 1:
            raise ConfigError(f"plan.{name}: must be >= 1, got {v}")
    if tokens % batch:
        raise ConfigError(f"plan.tokens: {tokens} is not a multiple of batch {batch}")
    if optimizer not in ("muon", "adamw", "none"):
        raise ConfigError(f"plan.optimizer: muon|adamw|none, got {optimizer!r}")
    if dtype not in ("bf16", "fp32"):
        raise ConfigError(f"plan.dtype: bf16|fp32, got {dtype!r}")
    if head_ce not in HEAD_CE:
        raise ConfigError(f"plan.head_ce: {'|'.join(HEAD_CE)}, got {head_ce!r}")
    S = tokens // batch
    if S % cp:
        raise ConfigError(f"plan.cp: sequence {S} is not a multiple of cp {cp}")
    if cfg.n_routed_experts % ep:
        raise ConfigError(f"plan.ep: {cfg.n_routed_experts} experts are not a multiple of ep {ep}")
    if batch % (dp * ep):
        raise ConfigError(f"plan.batch: {batch} rows are not a multiple of dp * ep = {dp * ep} (dp and ep split rows)")
    rows = batch // (dp * ep)                          # this rank's rows (model/parallel: dp and ep split rows)
    m = m if m is not None else measurement(cfg)
    pb = _param_bytes(cfg, dtype)
    elem = 2 if dtype == "bf16" else 4
    stages = _stages(cfg, pp)
    best = None
    for s, labels in enumerate(stages):
        P = sum(pb[l]["expert"] / ep + pb[l]["muon"] + pb[l]["adamw"] for l in labels if l in pb)
        if optimizer == "none":
            O = 0.0
        elif optimizer == "adamw":
            O = 2 * P
        else:
            mu = sum(pb[l]["muon"] + pb[l]["expert_muon"] / ep for l in labels if l in pb)
            O = mu + 2 * (P - mu)
        shard = dp                                     # FSDP2 shards params, grads and optimizer state over dp
        gathered = 0.0
        if dp > 1:
            gathered = max(pb[l]["expert"] / ep + pb[l]["muon"] + pb[l]["adamw"] for l in labels if l != "top")
        blocks = [l for l in labels if l != "top"]
        acts = {l: block_activation_bytes(m, l, rows, S, cfg, cp) for l in labels}
        inflight = pp - s if pp > 1 else 1             # 1F1B: stage s holds pp - s micro-batches
        T = rows * S / cp
        if recompute:
            ckpt = len(blocks) * T * cfg.hc_mult * cfg.hidden_size * elem
            A = ckpt + max(acts[l] for l in blocks) + acts["top"]
            A_first = ckpt + acts["top"]
        else:
            A = sum(acts.values())
        A *= inflight
        head_ws = 0.0
        if "top" in labels and (pp == 1 or s == pp - 1):
            ce_rows = min(CE_CHUNK, T)
            # one block's logits / softmax rows, and the fp32 dW [V, d]: recompute forms one in the first head's
            # backward; grad_in_forward holds one a head (LM + MTP) from the forward to the backward (DSv4Model.head_ce)
            n_dw = 1 + cfg.num_nextn_predict_layers if head_ce == "grad_in_forward" else 1
            head_ws = ce_rows * cfg.vocab_size * (2 + 4 + 4) + n_dw * cfg.vocab_size * cfg.hidden_size * 4
        entry_ws = 0.0
        if any(cfg.layer_kind(int(l.split(".")[1]) if l.startswith("layers.") else cfg.num_hidden_layers) == "csa"
               for l in blocks):
            entry_ws = 3 * 4 * (S / cp) * (S // cfg.csa_ratio)       # one row at a time
        W = max(head_ws, entry_ws)
        total = P / shard + P / shard + O / shard + gathered + A + W
        st = {"stage": s, "layers": labels, "parameters": P / shard + gathered, "gradients": P / shard,
              "optimizer": O / shard, "activations": A, "workspace": W,
              "activations_per_block": acts, "peak": total}
        if best is None or total > best["peak"]:
            best = st
    from dsv4.harness.train.flops import flops_per_token
    from dsv4.model.generate import cache_elements_per_token
    f = flops_per_token(cfg, S)
    n_att = cfg.num_hidden_layers + cfg.num_nextn_predict_layers
    cache = cache_elements_per_token(cfg) * tokens * elem + n_att * batch * (cfg.sliding_window + 1) * cfg.head_dim * elem
    comm = _comm(cfg, pb, rows, S, dp, pp, cp, ep, elem)
    res = {"config": config_name, "tokens": tokens, "batch": batch, "seq": S, "recompute": recompute,
           "head_ce": head_ce, "dtype": dtype,
           "optimizer": optimizer, "dp": dp, "pp": pp, "cp": cp, "ep": ep,
           "peak_bytes": best["peak"], "peak_gib": best["peak"] / GIB,
           "breakdown_gib": {k: best[k] / GIB for k in ("parameters", "gradients", "optimizer", "activations",
                                                         "workspace")},
           "activations_per_block_gib": {k: v / GIB for k, v in best["activations_per_block"].items()},
           "stage": best["stage"],
           "generation_cache_gib": cache / GIB,
           "flops_per_step": f["total_training_flops_per_token"] * tokens,
           "flops_per_rank": f["total_training_flops_per_token"] * tokens / (dp * ep * cp * pp),
           "flops_per_token": f["total_training_flops_per_token"],
           "comm_bytes_per_step": comm,
           "capacity_gib": capacity / GIB, "fits": best["peak"] <= capacity,
           "measurement": {"seq": m["seq"], "topk": m["topk"], "provenance": m.get("provenance", {}).get("git_sha")}}
    res["suggestions"] = [] if res["fits"] else suggest(cfg, res, m, capacity, pb)
    return res


def _comm(cfg, pb, B, S, dp, pp, cp, ep, elem) -> dict:
    P = sum(v["expert"] / ep + v["muon"] + v["adamw"] for v in pb.values())
    T = B * S / cp
    moe = sum(cfg.is_moe(i) for i in range(cfg.num_hidden_layers)) + cfg.num_nextn_predict_layers
    out = {"fsdp": 3 * P * (dp - 1) / dp if dp > 1 else 0.0,                 # 2 all-gathers + 1 reduce-scatter
           "ep_all_to_all": 4 * moe * T * cfg.num_experts_per_tok * cfg.hidden_size * elem * (ep - 1) / ep,
           "pp_send": 2 * T * cfg.hc_mult * cfg.hidden_size * elem if pp > 1 else 0.0,
           "cp_entries": 0.0}
    if cp > 1:
        per_tok = 0.0
        for i in range(cfg.num_hidden_layers + cfg.num_nextn_predict_layers):
            kind = cfg.layer_kind(i)
            if kind == "csa":
                per_tok += (cfg.head_dim + cfg.index_head_dim) / cfg.csa_ratio
            elif kind == "hca":
                per_tok += cfg.head_dim / cfg.hca_ratio
        out["cp_entries"] = 2 * B * S * per_tok * elem * (cp - 1) / cp     # gather fwd + reduce bwd
    return out


def suggest(cfg, res, m, capacity, pb) -> list[str]:
    """What makes the step fit: recompute, then the smallest cp (then ep, dp) with everything else kept."""
    out = []
    kw = dict(tokens=res["tokens"], batch=res["batch"], dtype=res["dtype"], optimizer=res["optimizer"],
              dp=res["dp"], pp=res["pp"], ep=res["ep"], m=m, capacity=capacity)
    if not res["recompute"]:
        r = plan(cfg, recompute=True, cp=res["cp"], **kw)
        if r["fits"]:
            return [f"enable recompute (--recompute): peak {r['peak_gib']:.1f} GiB"]
        out.append("enable recompute (--recompute)")
    S = res["seq"]
    for cp in (2, 4, 8, 16, 32, 64, 128, 256):
        if cp > res["cp"] and S % cp == 0:
            r = plan(cfg, recompute=True, cp=cp, **kw)
            if r["fits"]:
                out.append(f"context parallel --cp {cp} (with recompute): peak {r['peak_gib']:.1f} GiB per rank")
                return out
    out.append("does not fit with recompute and any cp <= 256; shard parameters/optimizer (--dp, --ep, --pp)")
    return out


# ----------------------------------------------------------------------------------------------- CLI
def _fmt(res: dict) -> str:
    b = res["breakdown_gib"]
    lines = [f"config {res['config']}  tokens {res['tokens']} (batch {res['batch']} x seq {res['seq']})  "
             f"recompute {'on' if res['recompute'] else 'off'}  {res['dtype']}  optimizer {res['optimizer']}  "
             f"dp {res['dp']} pp {res['pp']} cp {res['cp']} ep {res['ep']}",
             f"{'term':14s} {'GiB':>9s}"]
    for k in ("parameters", "gradients", "optimizer", "activations", "workspace"):
        lines.append(f"{k:14s} {b[k]:9.2f}")
    lines.append(f"{'PEAK':14s} {res['peak_gib']:9.2f}   ({'fits' if res['fits'] else 'does NOT fit'} "
                 f"{res['capacity_gib']:.0f} GiB)")
    lines.append("activations per block (GiB): " + ", ".join(f"{k} {v:.2f}" for k, v in
                                                            res["activations_per_block_gib"].items()))
    lines.append(f"generation KV cache at {res['tokens']} tokens: {res['generation_cache_gib']:.2f} GiB")
    lines.append(f"FLOPs per step {res['flops_per_step']:.3e} ({res['flops_per_token']:.3e} per token, "
                 f"{res['flops_per_rank']:.3e} per rank)")
    lines.append("communication per step per rank (GiB): " + ", ".join(
        f"{k} {v / GIB:.2f}" for k, v in res["comm_bytes_per_step"].items()))
    for s in res["suggestions"]:
        lines.append(f"suggestion: {s}")
    return "\n".join(lines)


@click.command("plan")
@click.option("--config", "config", required=True, help="debug|tiny|proxy|flash|pro or a JSON config file")
@click.option("--set", "overrides", multiple=True, help="field=value override (JSON value), repeatable")
@click.option("--tokens", type=int, default=4096, show_default=True, help="tokens per step (the global batch, B * S)")
@click.option("--seq", type=int, default=None, help="sequence length S (tokens = batch * seq)")
@click.option("--batch", type=int, default=1, show_default=True)
@click.option("--recompute/--no-recompute", default=False, show_default=True)
@click.option("--dtype", type=click.Choice(["bf16", "fp32"]), default="bf16", show_default=True)
@click.option("--head-ce", type=click.Choice(list(HEAD_CE)), default=HEAD_CE[0],
              show_default=True, help="the heads' CE gradients (DSv4Model.set_head_ce): the fp32 dW [V, d] each holds")
@click.option("--optimizer", type=click.Choice(["muon", "adamw", "none"]), default="muon", show_default=True)
@click.option("--dp", type=int, default=1)
@click.option("--pp", type=int, default=1)
@click.option("--cp", type=int, default=1)
@click.option("--ep", type=int, default=1)
@click.option("--capacity-gib", type=float, default=H200_BYTES / GIB, show_default=True)
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="PNG: the plan's terms at tokens/8 .. tokens (powers of two), the same settings otherwise")
@click.option("--measure", is_flag=True, help="re-measure the saved tensors and store them under slices/X4/measured")
@click.option("--json", "as_json", is_flag=True)
def plan_cmd(config, overrides, tokens, seq, batch, recompute, dtype, head_ce, optimizer, dp, pp, cp, ep, capacity_gib,
             plot_path, measure, as_json):
    """Predicted peak memory per rank (parameters, gradients, optimizer, activations, workspace), FLOPs per step."""
    from dsv4.harness.train.flops import _load_config
    try:
        name, cfg = _load_config(config)
        kv = {}
        for o in overrides:
            if "=" not in o:
                raise ConfigError(f"--set {o!r}: need field=value")
            k, v = o.split("=", 1)
            try:
                kv[k] = json.loads(v)
            except json.JSONDecodeError:
                kv[k] = v
        if kv:
            cfg = DSv4Config.from_dict({**cfg.to_dict(), **kv})
        if seq is not None:
            tokens = batch * seq
        m = None
        if measure:
            m = store_measurement(cfg)
        res = plan(cfg, tokens, batch, recompute, dtype, optimizer, dp, pp, cp, ep, name, m=m,
                   capacity=capacity_gib * GIB, head_ce=head_ce)
        if plot_path:
            kw = dict(batch=batch, recompute=recompute, dtype=dtype, optimizer=optimizer, dp=dp, pp=pp, cp=cp, ep=ep,
                      config_name=name, m=m if m is not None else measurement(cfg), capacity=capacity_gib * GIB,
                      head_ce=head_ce)
            ts = sorted({max(batch * cp, tokens >> i) for i in range(4)})
            res["plot"] = plot_plan(cfg, kw, ts, plot_path)
    except (ConfigError, ValueError, TypeError) as e:
        report_bad_input(e)
    if as_json:
        click.echo(json.dumps(res, indent=1))
    else:
        click.echo(_fmt(res))


def plot_plan(cfg: DSv4Config, kw: dict, tokens_list: list[int], path: str, measured=None) -> str:
    """Stacked peak terms per tokens value (the same plan otherwise), the capacity line, and measured peaks
    (`measured`: [(tokens, bytes | None for OOM)]) -> PNG at `path` (atomic)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from dsv4.harness.goldens import atomic_savefig
    terms = ("parameters", "gradients", "optimizer", "activations", "workspace")
    res = [plan(cfg, t, **kw) for t in tokens_list]
    fig, ax = plt.subplots(figsize=(7, 4))
    x = list(range(len(tokens_list)))
    bottom = [0.0] * len(x)
    for k in terms:
        v = [r["breakdown_gib"][k] for r in res]
        ax.bar(x, v, bottom=bottom, label=k)
        bottom = [b + a for b, a in zip(bottom, v)]
    ax.axhline(res[0]["capacity_gib"], color="k", ls="--", lw=1, label="capacity")
    for t, b in measured or []:
        if t in tokens_list:
            i = tokens_list.index(t)
            if b is None:
                ax.annotate("OOM", (i, res[0]["capacity_gib"]), ha="center", va="bottom", color="r")
            else:
                ax.plot([i], [b / GIB], "r*", ms=12, label="measured" if i == 0 else None)
    ax.set_xticks(x, [f"{t // 1024}K" for t in tokens_list])
    ax.set_xlabel("tokens per step")
    ax.set_ylabel("GiB per rank")
    ax.set_title(f"dsv4 plan: {res[0]['config']} (recompute {'on' if kw.get('recompute') else 'off'})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    atomic_savefig(fig, path)
    plt.close(fig)
    return path


def store_measurement(cfg: DSv4Config) -> dict:
    """Measure cfg's saved tensors and store them (with provenance) under slices/X4/measured (atomic write)."""
    from dsv4.harness.goldens import atomic_write_json, provenance
    m = measurement(cfg, remeasure=True)
    m["provenance"] = provenance("cpu", config=cfg.to_dict(), seed=MEASURE_SEED)
    m["provenance"]["command"] = "dsv4 plan --config ... --measure (harness/plan_measure.py, TRITON_INTERPRET=1)"
    os.makedirs(MEASURED_DIR, exist_ok=True)
    atomic_write_json(measured_path(cfg), m)
    return m
