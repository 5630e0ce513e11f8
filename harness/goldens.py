"""Golden store: `goldens/<platform>/<slice>/<case>.json`, written atomically, each with provenance.

A golden that cannot be judged (its format/slice/case/platform disagree with its path, an unknown output
kind, len(values) != prod(shape), a missing key, a bad dtype, a string where a number belongs) is refused by
check_golden in one line naming the file and the field; verify reports it as cannot-judge (exit 2).

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


CODE_DIRS = ("model", "kernels", "harness")   # what a measured number depends on (slices/ and goldens/ are not code)


def code_hash(rev: str | None = None) -> str:
    """A hash of the code itself: sha256 over (path, content) of every .py file under CODE_DIRS, sorted by path ->
    16 hex digits. rev None: the files on disk (what runs, whatever .git says: the device machine's copy carries a
    stale .git); rev a commit: the same files as committed there (`git ls-tree` / `git cat-file`). A result whose
    code_hash equals code_hash(<sha>) ran that commit's code (`dsv4 goldens code RESULT --at SHA`)."""
    h = hashlib.sha256()
    if rev is None:
        files = sorted(p.relative_to(REPO).as_posix() for d in CODE_DIRS for p in (REPO / d).rglob("*.py")
                       if "__pycache__" not in p.parts)
        read = lambda f: (REPO / f).read_bytes()                                # noqa: E731
    else:
        out = subprocess.run(["git", "ls-tree", "-r", "--name-only", rev, "--", *CODE_DIRS], cwd=REPO,
                             capture_output=True, text=True, timeout=30, check=True).stdout
        files = sorted(f for f in out.splitlines() if f.endswith(".py"))
        read = lambda f: subprocess.run(["git", "cat-file", "blob", f"{rev}:{f}"], cwd=REPO, capture_output=True,  # noqa: E731
                                        timeout=30, check=True).stdout
    for f in files:
        data = read(f)
        h.update(f"{f}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()[:16]


def platform_of(device: torch.device | str) -> str:
    """The goldens' platform name of a device (cpu | h200 | h100 | gb200, from the GPU's name), else "cuda"."""
    device = torch.device(device)
    if device.type != "cuda":
        return "cpu"
    gpu = torch.cuda.get_device_name(device).lower()
    return next((p for p in ("gb200", "h200", "h100") if p in gpu), "cuda")


def config_hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def provenance(platform: str, config=None, seed=None, command: str | None = None, case_hash: str | None = None) -> dict:
    """Where a golden / report came from: code, config, seed, versions, and the host's numerics (CPU model, ISA,
    ATen capability, MKL / oneDNN builds, steering variables, the contract's pinned settings)."""
    from . import numerics
    sha, dirty = git_sha()
    h = numerics.host()
    prov = {
        "git_sha": sha, "git_dirty": dirty, "code_hash": code_hash(), "platform": platform, "seed": seed,
        "config_hash": case_hash or (config_hash(config) if config is not None else None),
        "torch": torch.__version__, "python": _platform.python_version(),
        "machine": _platform.machine(), "host_cpu": h["cpu_model"], "host": h,
        "numerics": numerics.settings(), "host_fingerprint": numerics.fingerprint(h),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command or " ".join(["dsv4"] + sys.argv[1:]),
    }
    if torch.cuda.is_available():
        prov["gpu"] = torch.cuda.get_device_name(0)
        prov["cuda"] = torch.version.cuda
    return prov


# ------------------------------------------------------------------------------------------- atomic IO
def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` so that a reader sees the old file or the new one, never half of one.

    The file gets the mode a plain open() would give (0666 minus the umask), not mkstemp's 0600. An OSError
    (a full disk, say) leaves the old file as it was and is re-raised naming `path`.
    """
    path = Path(path)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if tmp and os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError) and e.errno is not None:
            raise OSError(e.errno, f"cannot write {path}: {e.strerror}") from None
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_savefig(fig, path: Path, **kw) -> Path:
    """A matplotlib figure written with atomic_write_bytes (format from the suffix)."""
    import io
    buf = io.BytesIO()
    fig.savefig(buf, format=Path(path).suffix.lstrip(".") or "png", **kw)
    atomic_write_bytes(path, buf.getvalue())
    return Path(path)


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


def json_safe(obj):
    """Strict JSON: every non-finite float -> "nan" / "inf" / "-inf" (the golden-values spelling), recursively.
    Writers then use json.dumps(..., allow_nan=False), so no bare NaN / Infinity ever reaches a file or stdout."""
    if isinstance(obj, float):
        return _finite(obj)
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


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


def load_case(platform: str, slice_name: str, case: str, slice_id: str | None = None) -> dict | None:
    """The golden of one case, or None if there is none; a golden that cannot be judged is a GoldenError."""
    p = case_path(platform, slice_name, case)
    if not p.exists():
        return None
    return check_golden(read_json(p), p, {"slice": slice_id or slice_name, "case": case, "platform": platform})


# ------------------------------------------------------------------------------------------- validation
OUTPUT_KINDS = ("tensor", "float", "int", "curve")
NONFINITE = ("nan", "inf", "-inf")


def _num_ok(v) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) or v in NONFINITE


def check_golden(g, path: Path, expect: dict | None = None) -> dict:
    """`g` if it is a golden that can be judged, else a GoldenError naming the file and the field: the format,
    slice/case/platform against `expect` (what its path says), every output's kind, dtype, shape and values."""
    where = _rel(path)

    def bad(field, why):
        raise GoldenError(f"{where}: {field}: {why}")
    if not isinstance(g, dict) or g.get("format") != FORMAT:
        bad("format", f"is {g.get('format') if isinstance(g, dict) else g!r}, expected {FORMAT!r}")
    for k in ("slice", "case", "platform", "provenance", "outputs"):
        if k not in g:
            bad(k, "missing")
    for k, v in (expect or {}).items():
        if g[k] != v:
            bad(k, f"is {g[k]!r} but its path says {v!r}")
    if g.get("scope", "portable") not in ("portable", "same-host"):
        bad("scope", f"{g['scope']!r} is not portable|same-host")
    if not isinstance(g["outputs"], dict) or not g["outputs"]:
        bad("outputs", "empty or not an object: cannot judge")
    for name, o in g["outputs"].items():
        f = f"outputs.{name}"
        if not isinstance(o, dict) or o.get("kind") not in OUTPUT_KINDS:
            bad(f"{f}.kind", f"{o.get('kind') if isinstance(o, dict) else o!r} is not one of {', '.join(OUTPUT_KINDS)}")
        need = {"tensor": ("dtype", "shape", "values"), "float": ("value",), "int": ("value",),
                "curve": ("metrics",)}[o["kind"]]
        for k in need:
            if k not in o:
                bad(f"{f}.{k}", "missing")
        if o["kind"] == "tensor":
            dtype = getattr(torch, str(o["dtype"]), None)
            if not isinstance(dtype, torch.dtype):
                bad(f"{f}.dtype", f"{o['dtype']!r} is not a torch dtype")
            if not isinstance(o["shape"], list) or not all(isinstance(n, int) and n >= 0 for n in o["shape"]):
                bad(f"{f}.shape", f"{o['shape']!r} is not a list of sizes")
            if not isinstance(o["values"], list) or len(o["values"]) != math.prod(o["shape"]):
                n = len(o["values"]) if isinstance(o["values"], list) else type(o["values"]).__name__
                bad(f"{f}.values", f"holds {n} values, shape {o['shape']} needs {math.prod(o['shape'])}")
            ok = (_num_ok if dtype.is_floating_point else
                  (lambda v: isinstance(v, bool)) if dtype == torch.bool else
                  (lambda v: isinstance(v, int) and not isinstance(v, bool)))
            i = next((i for i, v in enumerate(o["values"]) if not ok(v)), None)
            if i is not None:
                bad(f"{f}.values[{i}]", f"{o['values'][i]!r} is not a {o['dtype']} value")
        elif o["kind"] == "float" and not _num_ok(o["value"]):
            bad(f"{f}.value", f"{o['value']!r} is not a number")
        elif o["kind"] == "int" and not (isinstance(o["value"], int) and not isinstance(o["value"], bool)):
            bad(f"{f}.value", f"{o['value']!r} is not an integer")
        elif o["kind"] == "curve":
            check_curves(o["metrics"], where, f"{f}.metrics")
    return g


def check_curves(doc, where: str, field: str = "") -> dict:
    """Megatron golden-values curves {metric: {start_step, end_step, step_interval, values}} that can be judged."""
    pre = f"{field}." if field else ""
    if not isinstance(doc, dict) or not doc:
        raise GoldenError(f"{where}: {field or 'metrics'}: no metrics: cannot judge")
    for m, c in doc.items():
        if not isinstance(c, dict) or not {"start_step", "end_step", "step_interval", "values"} <= set(c):
            raise GoldenError(f"{where}: {pre}{m}: metric is not in Megatron golden-values format "
                              f"(needs ['end_step', 'start_step', 'step_interval', 'values'])")
        if not isinstance(c["values"], dict):
            raise GoldenError(f"{where}: {pre}{m}.values: not an object of step -> value")
        for k, v in c["values"].items():
            if not str(k).isdigit() or not _num_ok(v):
                raise GoldenError(f"{where}: {pre}{m}.values[{k!r}]: {v!r} is not a number or 'nan'")
    return doc


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
        verdicts = {s["verdict"] for s in subs}
        rec.update(verdict="fail" if "fail" in verdicts else ("error" if verdicts - {"pass"} else "pass"), metrics=subs,
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


def diff_case(platform: str, slice_name: str, case: str, slice_id: str, new: dict) -> list[str]:
    """What writing outputs `new` changes in a case's golden; a golden that cannot be judged is replaced."""
    try:
        old = load_case(platform, slice_name, case, slice_id)
    except GoldenError as e:
        return [f"  ! replaces a golden that cannot be judged ({e})"]
    return diff_outputs(old["outputs"] if old else None, new)


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
            elif o["kind"] == n["kind"] == "curve":
                lines += [f"  ~ {name}.{line}" for line in diff_curves(o["metrics"], n["metrics"])]
            elif o["kind"] in ("float", "int") and o["kind"] == n["kind"]:
                lines.append(f"  ~ {name}: {o['value']} -> {n['value']}")
            else:
                lines.append(f"  ~ {name}: changed ({o['kind']} -> {n['kind']})")
    return lines or ["  = unchanged"]


def diff_curves(old: dict, new: dict) -> list[str]:
    """What changes between two Megatron golden-values documents, one line per changed metric."""
    lines = []
    for m in sorted(set(old) | set(new)):
        if m not in new:
            lines.append(f"{m}: removed")
        elif m not in old:
            lines.append(f"{m}: added ({len(new[m]['values'])} steps)")
        elif old[m] != new[m]:
            o, n = old[m]["values"], new[m]["values"]
            steps = set(o) | set(n)
            changed = [k for k in steps if o.get(k) != n.get(k)]
            d = [abs(float(o[k]) - float(n[k])) for k in changed if k in o and k in n]
            d = [x for x in d if math.isfinite(x)]
            lines.append(f"{m}: {len(changed)}/{len(steps)} steps changed"
                         + (f", max |diff| {max(d):.3e}" if d else "")
                         + (f", steps {min(map(int, o), default=0)}..{max(map(int, o), default=0)} -> "
                            f"{min(map(int, n), default=0)}..{max(map(int, n), default=0)}" if set(o) != set(n) else ""))
    return lines
