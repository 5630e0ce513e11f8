"""Megatron-LM dev as an oracle: import dev's outputs on our cases as goldens, and verify ours against them.

    dsv4 goldens import-megatron --megatron-lm /path/to/Megatron-LM [--slice D1]
        runs, in a subprocess whose sys.path starts with that checkout (so dev's `megatron` package shadows the
        installed megatron-core 0.16.1; torch.compile disabled: dev decorates its eager mHC ops with it, the
        eager semantics are the same), dev's own functions on the inputs and weights that
        `harness/megatron_cases.py` defines, and writes goldens/megatron-dev/<slice>/<case>.json (our golden
        format) with provenance: Megatron repo, commit, the dev function called, our weight mapping.
    dsv4 verify --against megatron-dev [--slice D1]
        runs OUR side of every case and compares it with those goldens under the case's stated tolerances.
        A missing golden is "cannot judge" (exit 2), a failed check a regression (exit 1); no Megatron checkout
        is needed.

Megatron's code is never copied into this repository: only its outputs, the commit and our mapping are stored.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PLATFORM = "megatron-dev"
MEGATRON_REPO = "https://github.com/NVIDIA/Megatron-LM"
PINNED_COMMIT = "d48bd6be0a85cc0d6d3cc71e8750cf357cc6bdb1"   # dev, 2026-08-21 (issue 15)
CONFIG_FIELDS = "slices/D4/megatron_dev_config_fields.json"      # dev's config field names (written on import)


class ImportError_(ValueError):
    """One-line failure of the importer (bad checkout, dev function missing, worker crash)."""


def _pin_numerics():
    from . import numerics
    numerics.apply()


# Our side of every case moves across CPU hosts (harness/numerics.py); the tolerance a case is judged with is its
# stated dev-vs-ours tolerance plus XHOST_MARGIN x our worst cross-host spread of that output, measured by
# `python -m dsv4.harness.megatron_import spread` over numerics.SIMULATED_HOSTS and stored in SPREAD_FILE.
XHOST_MARGIN = 10.0


def _spread_file():
    from . import goldens as G
    return G.GOLDENS / PLATFORM / "_spread.json"


def ours_outputs(cases) -> dict:
    """{case: {output: encoded}} of our side of `cases`, under the numerics contract."""
    import torch

    from . import goldens as G
    from .cases import MAX_ELEMS
    _pin_numerics()
    out = {}
    for c in cases:
        torch.manual_seed(0)
        o = c.ours(c.inputs())
        out[c.name] = G.encode_outputs({k: v for k, v in o.items() if v is not None}, MAX_ELEMS)
    return out


def measure_spread(names: list[str] | None = None, log=print) -> dict:
    """Our side of every case (or of `names`, the other cases' stored spread kept) under each simulated host (one
    fresh process each) vs this host as it is: the worst |diff| per output; written atomically to
    goldens/megatron-dev/_spread.json with provenance."""
    from . import goldens as G
    from . import numerics as N
    runs = []
    for env in N.SIMULATED_HOSTS:
        log(f"megatron-dev spread: {env or '(this host as it is)'}")
        with tempfile.TemporaryDirectory(prefix="dsv4-mspread-") as d:
            e = {k: v for k, v in os.environ.items() if k not in N.HOST_ENV}
            e.update(env)
            out = Path(d) / "o.json"
            proc = subprocess.run([sys.executable, "-m", "dsv4.harness.megatron_import", "_ours", str(out),
                                   *(names or [])], env=e,
                                  capture_output=True, text=True, timeout=1800)
            if proc.returncode != 0:
                raise RuntimeError(f"ours under {env}: {(proc.stdout + proc.stderr).strip().splitlines()[-1:]}")
            runs.append((env, json.loads(out.read_text())))
    ref = runs[0][1]
    spread = {c: {o: N.output_spread({o: enc}, [(env, r[c]) for env, r in runs])[o]["max_abs"]
                  for o, enc in outs.items()} for c, outs in ref.items()}
    if names:
        spread = dict(load_spread(), **spread)
    doc = {"hosts": list(N.SIMULATED_HOSTS), "margin": XHOST_MARGIN, "max_abs": dict(sorted(spread.items())),
           "provenance": G.provenance("cpu", command="python -m dsv4.harness.megatron_import spread"
                                      + "".join(f" {n}" for n in names or []))}
    G.atomic_write_json(_spread_file(), doc)
    return doc


def load_spread() -> dict:
    sf = _spread_file()
    return json.loads(sf.read_text())["max_abs"] if sf.exists() else {}


def case_tol(c, spread: dict) -> dict:
    """The case's stated tolerances, each atol widened by XHOST_MARGIN x our measured cross-host spread."""
    sp = spread.get(c.name, {})
    return {o: (float(a) + XHOST_MARGIN * sp.get(o, 0.0), float(r)) for o, (a, r) in c.tol.items()}


def dev_commit(path: Path) -> tuple[str, str]:
    """(sha, commit date) of the checkout at `path`; ('unknown', '') without git metadata."""
    try:
        out = subprocess.run(["git", "-C", str(path), "log", "-1", "--format=%H %cI"], capture_output=True,
                             text=True, timeout=20).stdout.split()
        if len(out) == 2 and len(out[0]) == 40:
            return out[0], out[1]
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown", ""


def check_checkout(path: Path) -> None:
    need = ["megatron/core/transformer/experimental_attention_variant/csa.py",
            "megatron/core/transformer/hyper_connection.py", "megatron/core/transformer/moe/router.py",
            "megatron/core/fusions/fused_bias_swiglu.py"]
    for rel in need:
        if not (path / rel).exists():
            raise ImportError_(f"--megatron-lm {path}: no {rel} (not a Megatron-LM dev checkout with DSv4 code)")


# ------------------------------------------------------------------------------------------- worker side
def _dev_modules(path: str):
    """Dev's modules, imported from `path` (first on sys.path)."""
    import contextlib

    import torch
    # CPU torch has no NVTX; dev wraps regions in torch.cuda.nvtx.range: make them no-ops (no numerics involved)
    torch.cuda.nvtx.range = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.nvtx.range_push = lambda *a, **k: None
    torch.cuda.nvtx.range_pop = lambda *a, **k: None
    # dev's rotary tables move themselves to torch.cuda.current_device(): on this CPU build that is the CPU
    torch.cuda.current_device = lambda: "cpu"
    sys.path.insert(0, path)
    import megatron.core      # `megatron` itself is a namespace package in dev (no __init__.py)
    where = Path(megatron.core.__file__).resolve()
    if not where.is_relative_to(Path(path).resolve()):
        raise ImportError_(f"imported megatron from {where}, not from {path}")
    from megatron.core.fusions import fused_bias_swiglu as swiglu
    from megatron.core.transformer import hyper_connection as hc
    from megatron.core.transformer.experimental_attention_variant import csa, dsa, dsa_masking
    from megatron.core.transformer.moe import router
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    class M:
        pass
    M.dsa_masking, M.MLATransformerConfig = dsa_masking, MLATransformerConfig
    M.csa, M.dsa, M.hc, M.router, M.swiglu, M.TransformerConfig = csa, dsa, hc, router, swiglu, TransformerConfig
    M.file = str(where)
    return M


def _worker(path: str, out_path: str, names: list[str]) -> None:
    import warnings
    warnings.filterwarnings("ignore")
    _pin_numerics()
    from dsv4.harness import goldens as G
    from dsv4.harness import megatron_cases as MC
    from dsv4.harness.cases import MAX_ELEMS
    M = _dev_modules(path)
    res = {"megatron_file": M.file, "cases": {}}
    for n in names:
        c = MC.get(n)
        out = c.dev(c.inputs(), M)
        res["cases"][n] = G.encode_outputs(out, MAX_ELEMS)
    import dataclasses
    from megatron.core.transformer.transformer_config import MLATransformerConfig
    res["config_fields"] = sorted(f.name for f in dataclasses.fields(MLATransformerConfig))
    Path(out_path).write_text(json.dumps(res))


def run_dev(path: Path, names: list[str]) -> dict:
    """Run dev's side of `names` in a subprocess (checkout first on sys.path). Returns {name: encoded outputs}."""
    with tempfile.TemporaryDirectory(prefix="dsv4-mdev-") as td:
        out = Path(td) / "dev.json"
        env = dict(os.environ, TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        cmd = [sys.executable, "-m", "dsv4.harness.megatron_import", "_worker", str(path), str(out), *names]
        t0 = time.time()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tempfile.gettempdir())
        if proc.returncode != 0 or not out.exists():
            tail = [line for line in (proc.stderr or proc.stdout).strip().splitlines() if line.strip()][-1:]
            raise ImportError_(f"dev worker failed (exit {proc.returncode}): {' '.join(tail)}")
        doc = json.loads(out.read_text())
        doc["elapsed_s"] = round(time.time() - t0, 1)
        return doc


# ------------------------------------------------------------------------------------------- import
def select(slice_name: str | None):
    from . import megatron_cases as MC
    from .registry import Registry
    cases = MC.CASES
    if slice_name:
        sl = Registry.load().get(slice_name)
        cases = [c for c in cases if c.slice == sl.name]
        if not cases:
            raise ImportError_(f"slice {sl.id}: no megatron-dev cases (slices with cases: "
                               f"{', '.join(sorted(MC.by_slice()))})")
    return cases


def import_megatron(path: Path, slice_name: str | None = None, log=print) -> list[dict]:
    from . import goldens as G
    path = Path(path).resolve()
    check_checkout(path)
    sha, date = dev_commit(path)
    cases = select(slice_name)
    from . import megatron_cases as MC
    cases = cases + [c for c in MC.DIFF_CASES if c.slice in {x.slice for x in cases}]
    doc = run_dev(path, [c.name for c in cases])
    written = []
    for c in cases:
        enc = doc["cases"][c.name]
        old = G.load_case(PLATFORM, c.slice, c.name)
        prov = G.provenance(PLATFORM, config={"case": c.name, "mapping": c.mapping}, seed=None,
                            command=f"dsv4 goldens import-megatron --megatron-lm {path}"
                                    + (f" --slice {slice_name}" if slice_name else ""))
        prov.update({"megatron_repo": MEGATRON_REPO, "megatron_commit": sha, "megatron_commit_date": date,
                     "megatron_pinned": sha == PINNED_COMMIT, "megatron_module_file": doc["megatron_file"],
                     "dev_function": c.function, "weight_mapping": c.mapping, "case_inputs": c.doc,
                     "torch_compile": "disabled (TORCHDYNAMO_DISABLE=1; eager semantics)",
                     "ours": "dsv4.harness.megatron_cases." + c.ours.__name__})
        gdoc = {"format": G.FORMAT, "slice": c.slice, "case": c.name, "platform": PLATFORM, "provenance": prov,
                "outputs": enc}
        p = G.case_path(PLATFORM, c.slice, c.name)
        G.atomic_write_json(p, gdoc)
        lines = G.diff_outputs(old["outputs"] if old else None, enc)
        log(f"{G._rel(p)}")
        for line in lines:
            log(line)
        written.append({"case": c.name, "slice": c.slice, "path": G._rel(p), "diff": lines})
    from .registry import REPO
    fields_path = REPO / CONFIG_FIELDS
    G.atomic_write_json(fields_path, {
        "what": "field names of Megatron-LM dev's MLATransformerConfig (dataclasses.fields), the truth for "
                "model/megatron_config.py's FIELD_MAP", "megatron_repo": MEGATRON_REPO, "megatron_commit": sha,
        "megatron_commit_date": date, "command": "dsv4 goldens import-megatron", "fields": doc["config_fields"]})
    log(f"{CONFIG_FIELDS}: {len(doc['config_fields'])} MLATransformerConfig fields")
    log(f"dev {sha[:12]} ({date}) via {doc['megatron_file']}: {len(written)} goldens in {doc['elapsed_s']}s")
    return written


# ------------------------------------------------------------------------------------------- verify
def verify_against(slice_name: str | None = None, log=print) -> dict:
    """Ours vs the stored megatron-dev goldens (verify.compare_outputs, the loop `dsv4 verify` uses). Exit code 1
    regression, 2 cannot judge, 0 pass."""
    import torch

    from . import goldens as G
    from .verify import compare_outputs, fmt, slice_verdict
    _pin_numerics()
    torch.manual_seed(0)
    t_start = time.time()
    cases = select(slice_name)
    spread = load_spread()
    by: dict[str, list] = {}
    for c in cases:
        by.setdefault(c.slice, []).append(c)
    results = []
    for sl, cs in by.items():
        recs = []
        for c in cs:
            try:
                golden = G.load_case(PLATFORM, c.slice, c.name)
            except G.GoldenError as e:
                recs.append({"check": c.name, "kind": "golden", "verdict": "error", "detail": str(e)})
                continue
            if golden is None:
                recs.append({"check": c.name, "kind": "golden", "verdict": "missing",
                             "detail": f"no golden goldens/{PLATFORM}/{c.slice}/{c.name}.json (run: dsv4 goldens "
                                       f"import-megatron --megatron-lm PATH --slice {c.slice})"})
                continue
            t0 = time.time()
            try:
                out = c.ours(c.inputs())
            except Exception as e:  # noqa: BLE001 - a crashing case cannot be judged; say why
                recs.append({"check": c.name, "kind": "golden", "verdict": "error",
                             "detail": f"case raised {type(e).__name__}: {e}"})
                continue
            recs += compare_outputs(c.name, golden["outputs"], out, case_tol(c, spread), dt=time.time() - t0,
                                    missing_hint="megatron-dev: re-import")
        v = slice_verdict(recs)
        log(f"{sl}  (against {PLATFORM})")
        for r in recs:
            log(fmt(r))
        n_pass = sum(r["verdict"] == "pass" for r in recs)
        log(f"  => {v.upper()} ({n_pass}/{len(recs)} checks pass)")
        results.append({"id": sl, "verdict": v, "checks": recs, "n_checks": len(recs), "n_pass": n_pass,
                        "megatron_commits": sorted({(G.load_case(PLATFORM, c.slice, c.name) or {}).get(
                            "provenance", {}).get("megatron_commit", "missing") for c in cs})})
    verdicts = [r["verdict"] for r in results]
    if "regression" in verdicts:
        overall, code = "regression", 1
    elif "cannot-judge" in verdicts or not verdicts:
        overall, code = "cannot-judge", 2
    else:
        overall, code = "pass", 0
    return {"platform": PLATFORM, "against": PLATFORM, "mode": "tolerance (per case, megatron_cases.py)",
            "verdict": overall, "exit_code": code,
            "elapsed_s": round(time.time() - t_start, 2), "slices": results,
            "n_modules": len(cases), "provenance": G.provenance("cpu")}


if __name__ == "__main__":
    if len(sys.argv) >= 4 and sys.argv[1] == "_worker":
        _worker(sys.argv[2], sys.argv[3], sys.argv[4:])
    elif len(sys.argv) >= 3 and sys.argv[1] == "_ours":
        from dsv4.kernels._testing import use_interpreter
        use_interpreter()
        from dsv4.harness import goldens as _G
        from dsv4.harness import megatron_cases as _MC
        _cases = [_MC.get(n) for n in sys.argv[3:]] or select(None)
        _G.atomic_write_json(Path(sys.argv[2]), ours_outputs(_cases))
    elif len(sys.argv) >= 2 and sys.argv[1] == "spread":
        measure_spread(sys.argv[2:] or None)
    else:
        print("usage: python -m dsv4.harness.megatron_import (spread [CASE...] | _worker PATH OUT.json CASE... | "
              "_ours OUT.json [CASE...])", file=sys.stderr)
        sys.exit(2)
