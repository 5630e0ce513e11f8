"""Golden store: `goldens/<platform>/<slice>/<case>.json`, written atomically, each with provenance.

A tensor-case golden file:
    {"format": "dsv4-golden/1", "slice": "P6", "case": "...", "platform": "cpu",
     "provenance": {git_sha, git_dirty, config_hash, seed, torch, python, platform, host, created},
     "outputs": {"out": {"kind": "tensor", "dtype": "float32", "shape": [...], "values": [...]},
                 "loss": {"kind": "float", "value": 1.25}, "n": {"kind": "int", "value": 3},
                 "curve": {"kind": "curve", "metrics": {<Megatron golden-values JSON>}}}}
Curves imported from Megatron runs (`dsv4 goldens import`) are stored in Megatron's own format
(`{metric: {start_step, end_step, step_interval, values}}`) with a sidecar `<name>.provenance.json`.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import math
import os
import platform as _platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from .registry import REPO

GOLDENS = Path(os.environ.get("DSV4_GOLDENS_DIR") or REPO / "goldens")   # override: tests only
FORMAT = "dsv4-golden/1"


class GoldenError(ValueError):
    """A golden file that cannot be read; one line naming the file."""


# ------------------------------------------------------------------------------------------- provenance
def git_sha() -> tuple[str, bool]:
    """(sha, dirty). DSV4_GIT_SHA overrides it where the checkout has no history (the GPU machine's copy)."""
    if os.environ.get("DSV4_GIT_SHA"):
        return os.environ["DSV4_GIT_SHA"], os.environ.get("DSV4_GIT_DIRTY", "0") == "1"
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        if len(sha) != 40:
            return "unknown", False
        # goldens/ itself is excluded: a regen of several slices must not call its own output "dirty code"
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                     ":(exclude)goldens"], cwd=REPO,
                                    capture_output=True, text=True, timeout=10).stdout.strip())
        return sha, dirty
    except (OSError, subprocess.SubprocessError):
        return "unknown", False


def config_hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def provenance(platform: str, config=None, seed=None, command: str | None = None) -> dict:
    sha, dirty = git_sha()
    prov = {
        "git_sha": sha, "git_dirty": dirty, "platform": platform, "seed": seed,
        "config_hash": config_hash(config) if config is not None else None,
        "torch": torch.__version__, "python": _platform.python_version(),
        "machine": _platform.machine(), "host_cpu": _platform.processor() or _platform.machine(),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command or " ".join(["dsv4"] + sys.argv[1:]),
    }
    if torch.cuda.is_available():
        prov["gpu"] = torch.cuda.get_device_name(0)
        prov["cuda"] = torch.version.cuda
    return prov


# ------------------------------------------------------------------------------------------- atomic IO
def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to `path` so that a reader sees the old file or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_json(path: Path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=1, sort_keys=False, allow_nan=False) + "\n")


def read_json(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise GoldenError(f"{_rel(path)}: not valid JSON ({e})") from None


def _rel(p: Path) -> str:
    p = Path(p).resolve()
    return str(p.relative_to(REPO)) if p.is_relative_to(REPO) else str(p)


# ------------------------------------------------------------------------------------------- encoding
def _finite(x: float):
    return x if math.isfinite(x) else ("nan" if math.isnan(x) else ("inf" if x > 0 else "-inf"))


def _unfinite(x) -> float:
    """The inverse of `_finite`: float("nan" | "inf" | "-inf") parses the strings, float(x) the numbers."""
    return float(x)


def encode_outputs(outputs: dict, max_elems: int) -> dict:
    enc = {}
    for name, v in outputs.items():
        if isinstance(v, torch.Tensor):
            t = v.detach().cpu()
            if t.numel() > max_elems:
                raise GoldenError(f"output {name!r}: {t.numel()} elements > {max_elems}; store a slice or a sum")
            if t.dtype.is_floating_point:
                vals = [_finite(float(x)) for x in t.to(torch.float64).flatten().tolist()]
            elif t.dtype == torch.bool:
                vals = [bool(x) for x in t.flatten().tolist()]
            else:
                vals = [int(x) for x in t.flatten().tolist()]
            enc[name] = {"kind": "tensor", "dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape),
                         "values": vals}
        elif isinstance(v, bool):
            enc[name] = {"kind": "int", "value": int(v)}
        elif isinstance(v, int):
            enc[name] = {"kind": "int", "value": v}
        elif isinstance(v, float):
            enc[name] = {"kind": "float", "value": _finite(v)}
        elif isinstance(v, dict) and v and all(isinstance(m, dict) and "values" in m for m in v.values()):
            enc[name] = {"kind": "curve", "metrics": v}
        else:
            raise GoldenError(f"output {name!r}: unsupported type {type(v).__name__}")
    return enc


def decode_tensor(e: dict) -> torch.Tensor:
    dtype = getattr(torch, e["dtype"])
    if dtype.is_floating_point:
        t = torch.tensor([_unfinite(x) for x in e["values"]], dtype=torch.float64)
    elif dtype == torch.bool:
        t = torch.tensor(e["values"], dtype=torch.bool)
    else:
        t = torch.tensor(e["values"], dtype=torch.int64)
    return t.reshape(e["shape"])


# ------------------------------------------------------------------------------------------- paths
def case_path(platform: str, slice_name: str, case: str) -> Path:
    return GOLDENS / platform / slice_name / f"{case}.json"


def load_case(platform: str, slice_name: str, case: str) -> dict | None:
    p = case_path(platform, slice_name, case)
    if not p.exists():
        return None
    g = read_json(p)
    if g.get("format") != FORMAT or "outputs" not in g or "provenance" not in g:
        raise GoldenError(f"{_rel(p)}: not a {FORMAT} golden (missing format/outputs/provenance)")
    return g


def coverage(platform: str, slice_name: str) -> int:
    d = GOLDENS / platform / slice_name
    return len([p for p in d.glob("*.json") if not p.name.endswith(".provenance.json")]) if d.exists() else 0


# ------------------------------------------------------------------------------------------- comparing
def compare_output(name: str, golden: dict, actual, tol: dict, mode: str = "deterministic") -> dict:
    """One check record: {check, kind, max_abs, max_rel, atol, rtol, verdict, detail}."""
    from .thresholds import compare_metric

    rec = {"check": name, "kind": golden["kind"]}
    if golden["kind"] == "curve":
        subs = [compare_metric(m, g, (actual or {}).get(m), mode) for m, g in golden["metrics"].items()]
        bad = [s for s in subs if s["verdict"] != "pass"]
        rec.update(verdict="fail" if bad else "pass", metrics=subs,
                   max_abs=max((s.get("max_abs", 0.0) for s in subs), default=0.0),
                   max_rel=max((s.get("max_rel", 0.0) for s in subs), default=0.0),
                   atol=0.0 if mode == "deterministic" else None, rtol=0.0 if mode == "deterministic" else None,
                   detail="; ".join(f"{s['check']}: {s['verdict']}" for s in subs))
        return rec
    if golden["kind"] in ("int", "float"):
        g = torch.tensor([_unfinite(golden["value"])], dtype=torch.float64)
        if isinstance(actual, torch.Tensor):
            actual = actual.item()
        if actual is None:
            rec.update(verdict="fail", detail="output missing from the run")
            return rec
        a = torch.tensor([float(actual)], dtype=torch.float64)
        exact = golden["kind"] == "int"
    else:
        g = decode_tensor(golden)
        if not isinstance(actual, torch.Tensor):
            rec.update(verdict="fail", detail=f"expected a tensor, got {type(actual).__name__}")
            return rec
        a = actual.detach().cpu()
        if list(a.shape) != list(g.shape):
            rec.update(verdict="fail", detail=f"shape {list(a.shape)} != golden {list(g.shape)}")
            return rec
        exact = not g.dtype.is_floating_point
        a = a.to(torch.float64) if not exact else a.to(g.dtype)
    if exact:
        atol = rtol = 0.0
    else:
        if name not in tol:
            rec.update(verdict="fail", detail=f"no tolerance declared for floating output {name!r}")
            return rec
        atol, rtol = (float(x) for x in tol[name])
    a64, g64 = a.to(torch.float64), g.to(torch.float64)
    nan_mismatch = bool((torch.isnan(a64) != torch.isnan(g64)).any()) if a64.numel() else False
    both_fin = torch.isfinite(a64) & torch.isfinite(g64)
    inf_mismatch = bool(((~torch.isfinite(a64) | ~torch.isfinite(g64)) & ~(a64 == g64) &
                         ~(torch.isnan(a64) & torch.isnan(g64))).any()) if a64.numel() else False
    diff = (a64 - g64).abs().where(both_fin, torch.zeros_like(a64))
    max_abs = float(diff.max()) if diff.numel() else 0.0
    rel = diff / g64.abs().where(both_fin & (g64 != 0), torch.ones_like(g64))
    max_rel = float(rel.max()) if rel.numel() else 0.0
    ok = (not nan_mismatch and not inf_mismatch and bool((diff <= atol + rtol * g64.abs().where(both_fin, torch.zeros_like(g64))).all()))
    rec.update(max_abs=max_abs, max_rel=max_rel, atol=atol, rtol=rtol, exact=exact,
               verdict="pass" if ok else "fail", numel=int(g.numel()))
    if not ok:
        rec["detail"] = "non-finite mismatch" if (nan_mismatch or inf_mismatch) else "outside tolerance"
    return rec


def diff_outputs(old: dict | None, new: dict) -> list[str]:
    """Human lines describing what a regen changes."""
    if old is None:
        return [f"  + new golden ({len(new)} outputs: {', '.join(new)})"]
    lines = []
    for name in sorted(set(old) | set(new)):
        if name not in new:
            lines.append(f"  - {name} removed")
        elif name not in old:
            lines.append(f"  + {name} added ({new[name]['kind']})")
        elif old[name] != new[name]:
            o, n = old[name], new[name]
            if o["kind"] == n["kind"] == "tensor" and o["shape"] == n["shape"]:
                a, b = decode_tensor(o).double(), decode_tensor(n).double()
                fin = torch.isfinite(a) & torch.isfinite(b)
                d = float((a - b).abs()[fin].max()) if fin.any() else float("nan")
                lines.append(f"  ~ {name}: {int((a != b).sum())}/{a.numel()} values changed, max |diff| {d:.3e}")
            elif o["kind"] in ("float", "int") and o["kind"] == n["kind"]:
                lines.append(f"  ~ {name}: {o['value']} -> {n['value']}")
            else:
                lines.append(f"  ~ {name}: changed ({o['kind']} -> {n['kind']})")
    return lines or ["  = unchanged"]
