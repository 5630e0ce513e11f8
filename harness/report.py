"""`dsv4 compare`: per-metric verdicts of a run against a golden curve, and a Markdown report with PNG plots
(golden vs run with the tolerance band, a relative-difference panel, the verdict table and provenance)."""
from __future__ import annotations

import json
import math
from pathlib import Path

from . import goldens as G
from .thresholds import CANNOT_JUDGE, CHECK_THRESHOLDS, DEFAULT_METRICS, compare_metric


def load_curves(path: Path) -> tuple[dict, dict]:
    """(metrics in Megatron golden format, provenance) from a run dir, a Megatron JSON, or a dsv4 golden.

    A run dir's provenance is its `provenance.json` (written by `dsv4 train`), else its `run.json`; a Megatron
    JSON's is its sidecar `<stem>.provenance.json`. A run dir cut before its end (killed at a time limit: no
    golden_values.json yet) is read from its per-step `metrics.jsonl`, the records `dsv4 train` builds
    golden_values.json from, up to its last complete line. Curves that cannot be judged are a GoldenError (exit 2).
    """
    path = Path(path)
    prov: dict = {}
    if path.is_dir():
        for name in ("provenance.json", "run.json"):
            if (path / name).exists():
                prov = G.read_json(path / name)
                break
        cand = path / "golden_values.json"
        if not cand.exists():
            if not (path / "metrics.jsonl").exists():
                raise G.GoldenError(f"{path}: run directory has no golden_values.json or metrics.jsonl")
            return G.check_curves(curves_from_metrics(path / "metrics.jsonl"), str(path / "metrics.jsonl")), prov
        path = cand
    doc = G.read_json(path)
    side = path.with_name(path.stem + ".provenance.json")
    if side.exists():
        prov = G.read_json(side)
    if isinstance(doc, dict) and doc.get("format") == G.FORMAT:
        G.check_golden(doc, path)
        curves = [o for o in doc["outputs"].values() if o["kind"] == "curve"]
        if len(curves) != 1:
            raise G.GoldenError(f"{path}: dsv4 golden holds {len(curves)} curve outputs, expected 1")
        return curves[0]["metrics"], doc.get("provenance", {})
    return G.check_curves(doc, str(path)), prov


def metrics_records(path: Path) -> list[dict]:
    """The per-step records of a `dsv4 train` metrics.jsonl (complete lines; a torn last line of a killed run
    is dropped, any other bad line is a GoldenError naming it)."""
    lines = Path(path).read_text().splitlines()
    records = []
    for i, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines):          # the line being written when the run was killed
                break
            raise G.GoldenError(f"{path}:{i}: not a JSON metrics record") from None
    if not records:
        raise G.GoldenError(f"{path}: no metrics records: cannot judge")
    return records


def curves_from_metrics(path: Path) -> dict:
    """Megatron golden-values curves of a `dsv4 train` metrics.jsonl, as `dsv4 train` writes them at its end."""
    from dsv4.harness.train.loop import golden_values
    return golden_values(metrics_records(path))


def window(m: dict, lo: int, hi: int) -> dict:
    """A Megatron curve restricted to steps lo..hi (inclusive); GoldenError when none of its steps is there."""
    vals = {k: v for k, v in m["values"].items() if lo <= int(k) <= hi}
    if not vals:
        raise G.GoldenError(f"--steps {lo}:{hi}: the curve has no step there (it covers "
                            f"{m.get('start_step')}..{m.get('end_step')})")
    steps = [int(k) for k in vals]
    return {**m, "start_step": min(steps), "end_step": max(steps), "values": vals}


def parse_steps(text: str | None) -> tuple[int, int] | None:
    """"N" (steps 1..N) or "A:B" -> (lo, hi); None -> None. Bad text is a GoldenError (exit 2)."""
    if text is None:
        return None
    try:
        lo, hi = (1, int(text)) if ":" not in text else tuple(int(t) for t in text.split(":", 1))
    except ValueError:
        raise G.GoldenError(f"--steps: expected N or A:B, got {text!r}") from None
    if not 1 <= lo <= hi:
        raise G.GoldenError(f"--steps: need 1 <= A <= B, got {text!r}")
    return lo, hi


def compare_files(run: Path, golden: Path, mode: str, metrics: list[str] | None,
                  steps: tuple[int, int] | None = None) -> dict:
    """Per-metric verdicts; `steps` = (lo, hi) judges only those steps of both curves (e.g. a longer run's
    first 100 steps against a 100-step golden, or a run cut at its time limit against a longer golden)."""
    rc, rprov = load_curves(run)
    gc, gprov = load_curves(golden)
    if steps is not None:
        gc = {k: window(v, *steps) for k, v in gc.items()}
        rc = {k: window(v, *steps) for k, v in rc.items()}
    # default as Megatron: lm loss and num-zeros (+ mtp_1 loss); timing and memory only when asked for
    names = metrics or [m for m in DEFAULT_METRICS if m in gc] or list(gc)
    missing = [m for m in names if m not in gc]
    if missing:
        raise G.GoldenError(f"{golden}: golden has no metric {missing[0]!r}: cannot judge")
    checks = [compare_metric(m, gc[m], rc.get(m), mode) for m in names]
    verdicts = {c["verdict"] for c in checks}
    code = 1 if "fail" in verdicts else (2 if verdicts - {"pass"} or not checks else 0)
    return {"run": str(run), "golden": str(golden), "mode": mode, "steps": list(steps) if steps else None,
            "checks": checks,
            "verdict": {0: "pass", 1: "regression", 2: CANNOT_JUDGE}[code], "exit_code": code,
            "run_curves": rc, "golden_curves": gc, "run_provenance": rprov, "golden_provenance": gprov}


def _series(m: dict) -> tuple[list[int], list[float]]:
    pts = sorted((int(k), (float("nan") if isinstance(v, str) else float(v))) for k, v in m["values"].items())
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_metric(metric: str, golden: dict, run: dict | None, check: dict, path: Path) -> Path:
    """Golden vs run (tolerance band in approximate mode), relative difference below; the failing steps are
    marked on both panels and the verdict is in the title (in exact mode a failure is otherwise invisible)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mode = check["mode"]
    gx, gy = _series(golden)
    fig, (ax, axr) = plt.subplots(2, 1, figsize=(8, 5.5), dpi=110, sharex=True,
                                  gridspec_kw={"height_ratios": [3, 1.3]})
    atol, rtol = CHECK_THRESHOLDS.get(metric, {}).get(mode, CHECK_THRESHOLDS.get(metric, {}).get(
        "approximate", (0.0, 0.0)))
    band = [atol + rtol * abs(y) if math.isfinite(y) else 0 for y in gy]
    ax.plot(gx, gy, color="#2b8cbe", lw=1.8, label="golden")
    if rtol or atol:
        ax.fill_between(gx, [y - b for y, b in zip(gy, band)], [y + b for y, b in zip(gy, band)],
                        color="#2b8cbe", alpha=0.18, label=f"tolerance ({mode}: atol {atol}, rtol {rtol})")
    if run:
        rx, ry = _series(run)
        ax.plot(rx, ry, color="#e34a33", lw=1.2, ls="--", label="run")
        rd = dict(zip(rx, ry))
        rel = [(rd.get(x, float("nan")) - y) / abs(y) if y else float("nan") for x, y in zip(gx, gy)]
        axr.plot(gx, rel, color="#e34a33", lw=1.0)
        if rtol:
            axr.axhline(rtol, color="#999", ls=":", lw=1)
            axr.axhline(-rtol, color="#999", ls=":", lw=1)
        fails = check.get("failing_steps", [])
        if fails:
            gd = dict(zip(gx, gy))
            fy = [rd.get(s, math.nan) if math.isfinite(rd.get(s, math.nan)) else gd.get(s, math.nan) for s in fails]
            ax.scatter(fails, fy, marker="x",
                       color="#b2182b", s=40, zorder=5, label=f"failing steps ({len(fails)})")
            for s in fails:
                axr.axvline(s, color="#b2182b", lw=0.6, alpha=0.5)
    axr.axhline(0, color="#333", lw=0.6)
    axr.set_ylabel("(run−golden)/|golden|")
    axr.set_xlabel("step")
    ax.set_ylabel(metric)
    first = f", first failing step {check['failing_steps'][0]}" if check.get("failing_steps") else ""
    ax.set_title(f"{metric}: run vs golden: {check['verdict'].upper()} ({mode}{first})",
                 color="#b2182b" if check["verdict"] != "pass" else "black")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    axr.grid(alpha=0.3)
    fig.tight_layout()
    try:
        return G.atomic_savefig(fig, path)
    finally:
        plt.close(fig)


def _prov_line(p: dict) -> str:
    if not p:
        return "no provenance"
    keys = ("git_sha", "git_dirty", "seed", "config_hash", "torch", "platform", "host_cpu")
    return ", ".join(f"{k} {str(p[k])[:12]}" for k in keys if p.get(k) is not None) or "provenance: see below"


def write_report(doc: dict, out_dir: Path) -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = [f"# dsv4 compare — **{doc['verdict']}** ({doc['mode']} mode)", "",
             f"- run: `{doc['run']}` ({_prov_line(doc['run_provenance'])})",
             f"- golden: `{doc['golden']}` ({_prov_line(doc['golden_provenance'])})", "",
             "| metric | verdict | max abs | max rel | tolerance | failing steps (allowed) |",
             "|---|---|---|---|---|---|"]
    for c in doc["checks"]:
        tol = "exact" if c.get("atol") == 0 and c.get("rtol") == 0 else f"atol {c.get('atol')}, rtol {c.get('rtol')}"
        fail = f"{c.get('n_failing')}/{c.get('steps')} ({c.get('allowed_failures')})" if "steps" in c else \
            (f"median over steps {c['window']}" if "window" in c else c.get("detail", ""))
        lines.append(f"| {c['check']} | {c['verdict']} | {c.get('max_abs', float('nan')):.3e} | "
                     f"{c.get('max_rel', float('nan')):.3e} | {tol} | {fail} |")
    lines.append("")
    for c in doc["checks"]:
        m = c["check"]
        fn = "plot_" + "".join(ch if ch.isalnum() else "_" for ch in m) + ".png"
        plot_metric(m, doc["golden_curves"][m], doc["run_curves"].get(m), c, out_dir / fn)
        lines += [f"## {m}", "", f"![{m}]({fn})", ""]
    lines += ["## Provenance", "", "Run:", "```json", json.dumps(doc["run_provenance"], indent=1), "```",
              "Golden:", "```json", json.dumps(doc["golden_provenance"], indent=1), "```"]
    G.atomic_write_text(out_dir / "report.md", "\n".join(lines) + "\n")
    G.atomic_write_json(out_dir / "compare.json", {k: v for k, v in doc.items()
                                                   if k not in ("run_curves", "golden_curves")})
    return out_dir / "report.md"
