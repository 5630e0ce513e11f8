"""`dsv4 compare`: per-metric verdicts of a run against a golden curve, and a Markdown report with PNG plots
(golden vs run with the tolerance band, a relative-difference panel, the verdict table and provenance)."""
from __future__ import annotations

import json
import math
from pathlib import Path

from . import goldens as G
from .thresholds import CHECK_THRESHOLDS, DEFAULT_METRICS, compare_metric

METRIC_KEYS = {"start_step", "end_step", "step_interval", "values"}


def load_curves(path: Path) -> tuple[dict, dict]:
    """(metrics in Megatron golden format, provenance) from a run dir, a Megatron JSON, or a dsv4 golden."""
    path = Path(path)
    prov: dict = {}
    if path.is_dir():
        cand = path / "golden_values.json"
        if not cand.exists():
            raise G.GoldenError(f"{path}: run directory has no golden_values.json")
        if (path / "run.json").exists():
            prov = G.read_json(path / "run.json").get("provenance", {})
        path = cand
    doc = G.read_json(path)
    side = path.with_name(path.stem + ".provenance.json")
    if side.exists():
        prov = G.read_json(side)
    if doc.get("format") == G.FORMAT:
        curves = [o for o in doc["outputs"].values() if o["kind"] == "curve"]
        if len(curves) != 1:
            raise G.GoldenError(f"{path}: dsv4 golden holds {len(curves)} curve outputs, expected 1")
        return curves[0]["metrics"], doc.get("provenance", {})
    for k, v in doc.items():
        if not isinstance(v, dict) or not METRIC_KEYS <= set(v):
            raise G.GoldenError(f"{path}: metric {k!r} is not in Megatron golden-values format "
                                f"(needs {sorted(METRIC_KEYS)})")
    return doc, prov


def compare_files(run: Path, golden: Path, mode: str, metrics: list[str] | None) -> dict:
    rc, rprov = load_curves(run)
    gc, gprov = load_curves(golden)
    # default as Megatron: lm loss and num-zeros (+ mtp_1 loss); timing and memory only when asked for
    names = metrics or [m for m in DEFAULT_METRICS if m in gc] or list(gc)
    missing = [m for m in names if m not in gc]
    if missing:
        raise G.GoldenError(f"{golden}: golden has no metric {missing[0]!r}")
    checks = [compare_metric(m, gc[m], rc.get(m), mode) for m in names]
    code = 1 if any(c["verdict"] != "pass" for c in checks) else 0
    return {"run": str(run), "golden": str(golden), "mode": mode, "checks": checks,
            "verdict": "pass" if code == 0 else "regression", "exit_code": code,
            "run_curves": rc, "golden_curves": gc, "run_provenance": rprov, "golden_provenance": gprov}


def _series(m: dict) -> tuple[list[int], list[float]]:
    pts = sorted((int(k), (float("nan") if isinstance(v, str) else float(v))) for k, v in m["values"].items())
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_metric(metric: str, golden: dict, run: dict | None, mode: str, path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    axr.axhline(0, color="#333", lw=0.6)
    axr.set_ylabel("(run−golden)/|golden|")
    axr.set_xlabel("step")
    ax.set_ylabel(metric)
    ax.set_title(f"{metric}: run vs golden")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    axr.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def write_report(doc: dict, out_dir: Path) -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = [f"# dsv4 compare — **{doc['verdict']}** ({doc['mode']} mode)", "",
             f"- run: `{doc['run']}`", f"- golden: `{doc['golden']}`", "",
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
        plot_metric(m, doc["golden_curves"][m], doc["run_curves"].get(m), c["mode"], out_dir / fn)
        lines += [f"## {m}", "", f"![{m}]({fn})", ""]
    lines += ["## Provenance", "", "Run:", "```json", json.dumps(doc["run_provenance"], indent=1), "```",
              "Golden:", "```json", json.dumps(doc["golden_provenance"], indent=1), "```"]
    G.atomic_write_text(out_dir / "report.md", "\n".join(lines) + "\n")
    G.atomic_write_json(out_dir / "compare.json", {k: v for k, v in doc.items()
                                                   if k not in ("run_curves", "golden_curves")})
    return out_dir / "report.md"
