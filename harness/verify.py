"""`dsv4 verify`: run a slice's tests and golden checks; every check is printed with its numbers and verdict.

Verdicts per slice: pass (>= 1 check, all pass), regression (a check failed), cannot-judge (no checks, a missing
golden for the platform, a platform whose device is absent, a case that crashed). Exit code: 1 if any slice
regressed, else 2 if any could not be judged, else 0.
"""
from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

from . import goldens as G
from . import numerics
from .cases import MAX_ELEMS, CaseError, case_hash, collect
from .errors import InputError, one_line
from .registry import REPO, Registry, Slice

PASS, REGRESSION, CANNOT_JUDGE, SKIPPED = "pass", "regression", "cannot-judge", "skipped"
STALE_PATHS = ("model", "kernels")         # the code every golden case runs (harness/ only drives it)
PLATFORM_DEVICE = {"cpu": "cpu", "h200": "cuda", "h100": "cuda", "gb200": "cuda"}


def log(msg: str = "") -> None:
    print(msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------- tests
def _module_of(test_path: str) -> str:
    return test_path[:-3].replace("/", ".") if test_path.endswith(".py") else test_path.replace("/", ".")


def run_pytest(paths: list[str], workers: int = 0) -> list[dict]:
    """Run pytest on `paths`, streaming its per-test progress to stderr; the junit testcases (parse_junit).

    The junit report lives in a temporary directory that is removed afterwards.
    """
    with tempfile.TemporaryDirectory(prefix="dsv4-verify-") as tmp:
        out = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-v", "--tb=no", "--no-header", "-p", "no:cacheprovider",
               f"--junitxml={out}", "-o", "junit_family=xunit1", *paths]
        if workers:
            cmd[4:4] = ["-n", str(workers)]
        log(f"running: {' '.join(cmd[3:])}")
        t0, tail = time.time(), []
        with subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              bufsize=1) as proc:
            for line in proc.stdout:
                line = line.rstrip()
                if line:
                    log(f"  pytest: {line}" if "::" in line else f"  {line}")
                    tail = (tail + [line])[-5:]
        log(f"pytest exit {proc.returncode} in {time.time() - t0:.1f}s")
        if not out.exists():
            raise RuntimeError("pytest wrote no junit report: " + " | ".join(tail))
        return parse_junit(out)


def parse_junit(path: Path) -> list[dict]:
    """Testcases of a junit xml as {file, module, name, verdict, time, detail}."""
    try:
        root = ET.parse(path).getroot()
    except (ET.ParseError, OSError) as e:
        raise InputError(f"--junit {path}: not a readable junit xml ({one_line(e)})") from None
    if root.tag not in ("testsuites", "testsuite"):
        raise InputError(f"--junit {path}: not a junit xml (root element <{root.tag}>, expected <testsuite(s)>)")
    out = []
    for tc in root.iter("testcase"):
        verdict, detail = "pass", ""
        for tag, v in (("failure", "fail"), ("error", "fail"), ("skipped", "skip")):
            el = tc.find(tag)
            if el is not None:
                verdict, detail = v, (el.get("message") or "").splitlines()[0][:200] if el.get("message") else tag
                break
        out.append({"file": tc.get("file", ""), "module": tc.get("classname", ""), "name": tc.get("name", ""),
                    "verdict": verdict, "time": float(tc.get("time", 0) or 0), "detail": detail})
    return out


def test_checks(sl: Slice, junit_cases: list[dict]) -> list[dict]:
    recs = []
    for path in sl.tests:
        mod = _module_of(path)
        mine = [c for c in junit_cases if c["file"] == path or c["module"] == mod or c["module"].startswith(mod + ".")]
        if not mine:
            recs.append({"check": path, "kind": "test", "verdict": "missing",
                         "detail": "no test results for this file (collection error or not run)"})
        for c in mine:
            recs.append({"check": f"{path}::{c['name']}", "kind": "test", "verdict": c["verdict"],
                         "time_s": round(c["time"], 3), "detail": c["detail"]})
    return recs


# ------------------------------------------------------------------------------------------- goldens
def load_cases(sl: Slice):
    """The golden cases of a slice, imported from its folder's cases.py (by path, so any folder works)."""
    path = sl.folder / "cases.py"
    if not path.exists():
        return []
    mod_name = f"dsv4.slices.{sl.name}.cases" if sl.folder.parent == REPO / "slices" else f"_dsv4_cases_{sl.name}"

    def _load():
        if mod_name in sys.modules:
            del sys.modules[mod_name]
        spec = importlib.util.spec_from_file_location(mod_name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = mod
        spec.loader.exec_module(mod)
        return mod
    return collect(_load)


def run_case(case, device: str) -> dict:
    """One golden case under the numerics contract (harness/numerics.py), the global RNG seeded first."""
    if device == "cpu":
        numerics.apply()
    torch.manual_seed(numerics.CASE_SEED)
    return case.run(device)


def golden_checks(sl: Slice, platform: str, mode: str) -> list[dict]:
    recs: list[dict] = []
    try:
        cases = {c.name: c for c in load_cases(sl)}
    except Exception as e:  # noqa: BLE001 - a broken cases module is "cannot judge" with its reason
        return [{"check": f"{sl.name}/cases.py", "kind": "golden", "verdict": "error",
                 "detail": f"cannot import cases: {type(e).__name__}: {e}"}]
    declared = list(sl.golden_cases)
    for name in declared:
        if name not in cases:
            recs.append({"check": name, "kind": "golden", "verdict": "error",
                         "detail": f"manifest lists golden case {name!r} but slices/{sl.name}/cases.py does not define it"})
    for name in sorted(set(cases) - set(declared)):
        recs.append({"check": name, "kind": "golden", "verdict": "error",
                     "detail": f"cases.py defines {name!r} but the manifest's golden_cases does not list it"})
    device = PLATFORM_DEVICE[platform]
    for name in declared:
        case = cases.get(name)
        if case is None or platform not in case.platforms:
            continue
        try:
            golden = G.load_case(platform, sl.name, name, sl.id)
        except G.GoldenError as e:
            recs.append({"check": name, "kind": "golden", "verdict": "error", "detail": str(e)})
            continue
        if golden is None:
            recs.append({"check": name, "kind": "golden", "verdict": "missing",
                         "detail": f"no golden goldens/{platform}/{sl.name}/{name}.json (run: dsv4 goldens regen "
                                   f"--slice {sl.id} --platform {platform})"})
            continue
        if device == "cuda" and not torch.cuda.is_available():
            recs.append({"check": name, "kind": "golden", "verdict": "missing",
                         "detail": f"platform {platform} needs a CUDA device; none here"})
            continue
        if case.scope == "same-host" and device == "cpu":
            made_on, here = golden["provenance"].get("host_fingerprint"), numerics.fingerprint()
            if made_on != here:
                sha = golden["provenance"].get("git_sha")
                changed = code_changed_since(sha)
                rec = {"check": name, "kind": "golden", "verdict": "skip", "same_host": True,
                       "stale": bool(changed),
                       "detail": f"same-host evidence, made on [{made_on}]; this host is [{here}]: not "
                                 f"judged here (regen on this host to judge it)"}
                if changed:
                    rec["detail"] += (f"; {len(changed)} file(s) of {'/ '.join(STALE_PATHS)}/ changed since its "
                                      f"commit {sha[:8]} (e.g. {changed[0]}): it may be stale, regen it on a "
                                      f"[{made_on}] host to check")
                recs.append(rec)
                continue
        t0 = time.time()
        log(f"running golden case {sl.id}/{name} on {platform} ...")
        try:
            out = run_case(case, device)
        except Exception as e:  # noqa: BLE001
            recs.append({"check": name, "kind": "golden", "verdict": "error",
                         "detail": f"case raised {type(e).__name__}: {e}"})
            log(traceback.format_exc())
            continue
        recs += compare_outputs(name, golden["outputs"], out, case.tol, mode, time.time() - t0)
    return recs


def code_changed_since(sha: str | None) -> list[str] | None:
    """The source files under STALE_PATHS (tests and notes left out) that differ between commit `sha` and this
    checkout; None when that cannot be told (no git, a shallow or foreign history, an unknown sha)."""
    if not sha or len(sha) != 40:
        return None
    try:
        r = subprocess.run(["git", "diff", "--name-only", sha, "--", *STALE_PATHS], cwd=REPO, capture_output=True,
                           text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if r.returncode != 0:
        return None
    return [f for f in r.stdout.splitlines() if f.endswith(".py") and not Path(f).name.startswith("test_")]


def compare_outputs(case: str, golden: dict, out: dict, tol: dict, mode: str = "deterministic", dt: float = 0.0,
                    missing_hint: str = "regen needed?") -> list[dict]:
    """One check record per output of `case`: ours (`out`) against the golden's encoded `golden` outputs, each
    under tol[output] (the one compare loop of `dsv4 verify` and `dsv4 verify --against megatron-dev`). An output
    the golden lacks fails; one the run lacks fails in goldens.compare_output."""
    recs = []
    for oname in sorted(set(golden) | set(out)):
        if oname not in golden:
            recs.append({"check": f"{case}.{oname}", "kind": "golden", "verdict": "fail",
                         "detail": f"output not in the golden ({missing_hint})"})
            continue
        r = G.compare_output(oname, golden[oname], out.get(oname), tol, mode)
        r["check"] = f"{case}.{oname}"
        r["time_s"] = round(dt, 3)
        recs.append(r)
    return recs


def slice_verdict(recs: list[dict]) -> str:
    counted = [r for r in recs if r["verdict"] != "skip"]
    if any(r["verdict"] == "fail" for r in counted):
        return REGRESSION
    if not counted or any(r["verdict"] in ("missing", "error") for r in counted):
        return CANNOT_JUDGE
    return PASS


def fmt(r: dict) -> str:
    tag = {"pass": "PASS", "fail": "FAIL", "skip": "SKIP", "missing": "MISSING", "error": "ERROR"}[r["verdict"]]
    s = f"  [{tag:7}] {r['kind']:6} {r['check']}"
    if "max_abs" in r:
        tol = "exact" if r.get("exact") or (r.get("atol") == 0 and r.get("rtol") == 0) else \
            f"atol {r.get('atol')}, rtol {r.get('rtol')}"
        s += f"  max|abs| {r['max_abs']:.3e}  max|rel| {r['max_rel']:.3e}  tol {tol}"
    if r.get("detail") and r["verdict"] != "pass":
        s += f"  -- {r['detail']}"
    return s


def verify(reg: Registry, ids: list[str], platform: str, mode: str, junit: Path | None = None,
           workers: int = 0, only_implemented: bool = True, run_tests: bool = True, say=log) -> dict:
    """Verify slices `ids` (already in dependency order). Returns the JSON-able result document.

    Progress goes to stderr (log); each check and verdict to `say` (the CLI: stdout unless --json)."""
    results, t_start = [], time.time()
    todo = [reg.get(i) for i in ids]
    runnable = [s for s in todo if s.implemented_on(platform) or not only_implemented]
    test_paths = [t for s in runnable for t in s.tests] if run_tests else []
    can_run = platform == "cpu" or torch.cuda.is_available()
    junit_cases: list[dict] = []
    if test_paths and can_run:
        if junit is not None:
            junit_cases = parse_junit(junit)
            log(f"using test results from {junit} ({len(junit_cases)} testcases)")
        else:
            junit_cases = run_pytest(test_paths, workers)
    for s in todo:
        t0 = time.time()
        if s not in runnable:
            say(f"{s.id:6} {s.title}\n  [SKIP   ] status on {platform} is {s.status[platform]}")
            results.append({"id": s.id, "verdict": SKIPPED, "status": s.status[platform], "checks": [],
                            "detail": f"status on {platform} is {s.status[platform]}"})
            continue
        recs = []
        if run_tests and can_run:
            recs += test_checks(s, junit_cases)
        recs += golden_checks(s, platform, mode)
        v = slice_verdict(recs)
        say(f"{s.id:6} {s.title}")
        for r in recs:
            say(fmt(r))
        n_pass = sum(r["verdict"] == "pass" for r in recs)
        say(f"  => {v.upper()} ({n_pass}/{len(recs)} checks pass, {time.time() - t0:.1f}s)")
        results.append({"id": s.id, "verdict": v, "status": s.status[platform], "checks": recs,
                        "n_checks": len(recs), "n_pass": n_pass})
    verdicts = [r["verdict"] for r in results]
    if REGRESSION in verdicts:
        overall, code = REGRESSION, 1
    elif CANNOT_JUDGE in verdicts or not any(v == PASS for v in verdicts):
        overall, code = CANNOT_JUDGE, 2
    else:
        overall, code = PASS, 0
    return {"platform": platform, "mode": mode, "verdict": overall, "exit_code": code,
            "elapsed_s": round(time.time() - t_start, 2), "slices": results,
            "provenance": G.provenance(platform)}


def summary_lines(doc: dict) -> list[str]:
    """Failures first: each regressed slice with its failing checks, then those that could not be judged, then
    the verdict line with the counts."""
    lines = []
    for verdict, bad in ((REGRESSION, ("fail",)), (CANNOT_JUDGE, ("missing", "error"))):
        for s in (s for s in doc["slices"] if s["verdict"] == verdict):
            checks = [r for r in s["checks"] if r["verdict"] in bad]
            lines.append(f"{verdict.upper()} {s['id']}: " + ("; ".join(
                f"{r['check']}" + (f" ({r['detail']})" if r.get("detail") else "") for r in checks[:5])
                + (f"; ... {len(checks) - 5} more" if len(checks) > 5 else "") if checks else "no checks"))
    unjudged = [(s["id"], r) for s in doc["slices"] for r in s["checks"] if r.get("same_host")]
    if unjudged:
        stale = [f"{sid}/{r['check']}" for sid, r in unjudged if r.get("stale")]
        lines.append(f"NOT JUDGED HERE: {len(unjudged)} same-host golden(s) made on another host"
                     + (f"; {len(stale)} predate changes to {'/ '.join(STALE_PATHS)}/ and may be stale: "
                        f"{', '.join(stale)} (regen each on its host to check)" if stale else ""))
    n = {v: sum(s["verdict"] == v for s in doc["slices"]) for v in (PASS, REGRESSION, CANNOT_JUDGE, SKIPPED)}
    lines.append(f"verify {doc['platform']}: {doc['verdict'].upper()} ({n[PASS]} pass, {n[REGRESSION]} regression, "
                 f"{n[CANNOT_JUDGE]} cannot judge, {n[SKIPPED]} not implemented) in {doc['elapsed_s']}s")
    return lines


def write_report(doc: dict, out_dir: Path) -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    G.atomic_write_json(out_dir / "verify.json", doc)
    lines = [f"# dsv4 verify — platform `{doc['platform']}` — **{doc['verdict']}**", "",
             f"git `{doc['provenance']['git_sha'][:12]}`, torch {doc['provenance']['torch']}, "
             f"{doc['elapsed_s']} s, mode {doc['mode']}", "", "## Summary (failures first)", "",
             *[f"- {line}" for line in summary_lines(doc)], "",
             "| slice | verdict | checks passing |", "|---|---|---|"]
    for s in doc["slices"]:
        lines.append(f"| {s['id']} | {s['verdict']} | {s.get('n_pass', 0)}/{s.get('n_checks', 0)} |")
    lines.append("")
    for s in doc["slices"]:
        if s["checks"]:
            lines += [f"## {s['id']}", "", "| check | kind | max abs | max rel | tol | verdict |",
                      "|---|---|---|---|---|---|"]
            for r in s["checks"]:
                tol = "exact" if r.get("exact") else (f"{r.get('atol')}/{r.get('rtol')}" if "atol" in r else "")
                ma = f"{r['max_abs']:.2e}" if "max_abs" in r else ""
                mr = f"{r['max_rel']:.2e}" if "max_rel" in r else ""
                lines.append(f"| `{r['check']}` | {r['kind']} | {ma} | {mr} | {tol} | {r['verdict']} |")
            lines.append("")
    G.atomic_write_text(out_dir / "verify.md", "\n".join(lines) + "\n")
    return out_dir / "verify.md"


# ------------------------------------------------------------------------------------------- regen
def regen(reg: Registry, sl: Slice, platform: str, cases_filter: list[str] | None = None, say=log) -> list[dict]:
    """Rerun the slice's golden cases and rewrite their goldens atomically, printing the diff."""
    device = PLATFORM_DEVICE[platform]
    if device == "cuda" and not torch.cuda.is_available():
        raise CaseError(f"platform {platform}: needs a CUDA device to regenerate goldens; none here")
    cases = {c.name: c for c in load_cases(sl)}
    if not cases:
        raise CaseError(f"slice {sl.id}: slices/{sl.name}/cases.py defines no golden cases")
    missing = [n for n in sl.golden_cases if n not in cases]
    if missing:
        raise CaseError(f"slice {sl.id}: manifest golden_cases lists {missing[0]!r}, not defined in cases.py")
    names = cases_filter or list(sl.golden_cases) or sorted(cases)
    # compute everything first, write afterwards: a crash leaves every golden as it was
    computed = []
    for n in names:
        if n not in cases:
            raise CaseError(f"slice {sl.id}: no golden case {n!r}")
        c = cases[n]
        if platform not in c.platforms:
            continue
        log(f"running case {sl.id}/{n} on {platform} ...")
        try:
            out = run_case(c, device)
        except CaseError:
            raise
        except Exception as e:  # noqa: BLE001 - nothing is written; say which case broke, in one line
            raise CaseError(f"golden case {sl.id}/{n}: raised {type(e).__name__}: {e}") from None
        for k, v in out.items():
            is_float = (isinstance(v, torch.Tensor) and v.dtype.is_floating_point) or isinstance(v, float)
            if is_float and k not in c.tol:
                raise CaseError(f"golden case {n}: floating output {k!r} has no tolerance in tol=")
        computed.append((n, G.encode_outputs(out, MAX_ELEMS)))
    changes = []
    for n, enc in computed:
        lines = G.diff_case(platform, sl.name, n, sl.id, enc)
        doc = {"format": G.FORMAT, "slice": sl.id, "case": n, "platform": platform,
               "scope": cases[n].scope,
               "provenance": G.provenance(platform, seed=numerics.CASE_SEED, case_hash=case_hash(cases[n]),
                                          command=f"dsv4 goldens regen --slice {sl.id} --platform {platform}"),
               "outputs": enc}
        G.atomic_write_json(G.case_path(platform, sl.name, n), doc)
        say(f"goldens/{platform}/{sl.name}/{n}.json")
        for line in lines:
            say(line)
        changes.append({"case": n, "path": G._rel(G.case_path(platform, sl.name, n)), "diff": lines})
    return changes
