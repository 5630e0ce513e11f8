"""The CPU numerics contract of goldens: what `dsv4 goldens regen`, `dsv4 verify` and the test suite pin, what
they record, and how the spread that remains across hosts is measured.

Pinned in-process by `apply()` (so it holds whatever is exported from outside):
  * intra-op threads = 1      -- ATen's parallel reductions and MKL's GEMM split work by thread count;
  * deterministic algorithms  -- `torch.use_deterministic_algorithms(True)`;
  * fp32 matmul precision "highest" (no TF32 / bf16 down-conversion inside fp32 GEMMs);
  * the global RNG seeded with CASE_SEED before every golden case (cases seed their own generators too).
Recorded, not pinned (they select the host's code paths; a user or CI host may export any value):
  CPU model / vendor / ISA flags, ATen's CPU capability, the MKL / oneDNN builds, and the environment variables
  that steer them (`ATEN_CPU_CAPABILITY`, `MKL_CBWR`, `MKL_ENABLE_INSTRUCTIONS`, `DNNL_MAX_CPU_ISA`, thread
  counts). Pinning them would hide, not remove, the host dependence: `ATEN_CPU_CAPABILITY=default` changes
  vectorised exp/log/reductions, `MKL_CBWR` and `MKL_ENABLE_INSTRUCTIONS` change GEMM blocking and FMA use,
  `DNNL_MAX_CPU_ISA` changes oneDNN's bf16 kernels. Goldens must therefore be sharp *and* portable: their
  tolerances cover the spread `spread()` measures over SIMULATED_HOSTS (each a subprocess with those variables
  exported), times a stated margin; curves that chaos amplifies (long MoE runs) stay same-host evidence
  (see harness/verify.py: a golden with `"scope": "same-host"` is judged only on the host that made it).
"""
from __future__ import annotations

import json
import os
import platform as _platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

CASE_SEED = 0
THREADS = 1
# the variables that select a CPU host's floating-point code paths; exporting them simulates another host
HOST_ENV = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "DNNL_MAX_CPU_ISA",
            "OMP_NUM_THREADS", "MKL_NUM_THREADS")
# other x86-64 hosts, simulated: ATen's three capabilities x MKL's reproducibility / instruction modes x oneDNN ISA
SIMULATED_HOSTS = (
    {},
    {"ATEN_CPU_CAPABILITY": "default"},
    {"ATEN_CPU_CAPABILITY": "avx2"},
    {"ATEN_CPU_CAPABILITY": "avx512"},
    {"MKL_CBWR": "COMPATIBLE"},
    {"MKL_CBWR": "AVX2"},
    {"MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    {"MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
    {"DNNL_MAX_CPU_ISA": "AVX2"},
    {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE", "DNNL_MAX_CPU_ISA": "SSE41"},
    {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "DNNL_MAX_CPU_ISA": "AVX2"},
)


def apply() -> dict:
    """Pin the contract's settings in this process; returns them (for provenance)."""
    torch.set_num_threads(THREADS)
    torch.use_deterministic_algorithms(True)
    torch.set_float32_matmul_precision("highest")
    return settings()


def settings() -> dict:
    return {"intra_op_threads": torch.get_num_threads(),
            "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "case_seed": CASE_SEED}


def _cpuinfo() -> dict:
    info = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            k, _, v = line.partition(":")
            k = k.strip()
            if k in ("model name", "vendor_id", "flags") and k not in info:
                info[k] = v.strip()
    except OSError:
        pass
    return info


def host() -> dict:
    """What decides this host's floating-point results: CPU, ISA, library builds, the steering variables."""
    ci = _cpuinfo()
    flags = set(ci.get("flags", "").split())
    isa = [f for f in ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
                       "avx512_bf16", "amx_bf16", "amx_tile") if f in flags]
    cfg = torch.__config__.show()
    lib = lambda tag: next((ln.strip() for ln in cfg.splitlines() if tag in ln), None)   # noqa: E731
    return {"cpu_model": ci.get("model name") or _platform.processor() or _platform.machine(),
            "cpu_vendor": ci.get("vendor_id"), "isa": isa, "machine": _platform.machine(),
            "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "mkl": lib("Intel(R) oneAPI Math Kernel Library") or lib("MKL"),
            "onednn": lib("oneDNN") or lib("MKLDNN"), "libc": "-".join(_platform.libc_ver()),
            "env": {k: os.environ[k] for k in HOST_ENV if k in os.environ}}


def fingerprint(h: dict | None = None) -> str:
    """The same-host key: CPU model + ATen capability + MKL/oneDNN steering + torch version."""
    h = h or host()
    env = h.get("env", {})
    return "|".join([h.get("cpu_model") or "?", h.get("aten_cpu_capability") or "?", torch.__version__,
                     *(f"{k}={env[k]}" for k in sorted(env) if k in ("MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS",
                                                                      "DNNL_MAX_CPU_ISA"))])


# ------------------------------------------------------------------------------------------ spread
def run_cases_subprocess(pairs: list[tuple[str, str]], env: dict, timeout: float = 1800) -> dict:
    """Run golden cases [(slice_id, case)] in one fresh interpreter with `env` exported (as `dsv4 verify` runs
    them: one process, in order); returns {slice_id: {case: encoded outputs}} and the host it saw."""
    with tempfile.TemporaryDirectory(prefix="dsv4-spread-") as d:
        out = Path(d) / "out.json"
        e = {k: v for k, v in os.environ.items() if k not in HOST_ENV}
        e.update(env)
        cmd = [sys.executable, "-m", "dsv4.harness.numerics", "--out", str(out), *(f"{s}/{c}" for s, c in pairs)]
        proc = subprocess.run(cmd, env=e, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
            raise RuntimeError(f"golden cases under {env}: exit {proc.returncode}: {' | '.join(tail)}")
        return json.loads(out.read_text())


def _values(e: dict) -> list[float] | None:
    """The numbers of one encoded output (tensor values, a scalar, or a curve's metrics concatenated)."""
    if e["kind"] == "tensor":
        return [float(x) for x in e["values"]]
    if e["kind"] in ("int", "float"):
        return [float(e["value"])]
    if e["kind"] == "curve":
        return [float(x) for m in sorted(e["metrics"]) for x in e["metrics"][m]["values"]]
    return None


def output_spread(ref: dict, runs: list[tuple[dict, dict]]) -> dict:
    """Per output of `ref` (encoded outputs): the worst |diff| and |diff| / |ref| over `runs` [(env, outputs)]."""
    res = {}
    for name, r in ref.items():
        rv = _values(r)
        worst = {"max_abs": 0.0, "max_rel": 0.0, "env": {}, "kind": r["kind"], "identical": True}
        for env, outs in runs:
            o = outs.get(name)
            ov = _values(o) if o is not None else None
            if ov is None or len(ov) != len(rv):
                worst.update(identical=False, max_abs=float("inf"), max_rel=float("inf"), env=env)
                continue
            d = torch.tensor(ov, dtype=torch.float64) - torch.tensor(rv, dtype=torch.float64)
            fin = torch.isfinite(d)
            a = float(d[fin].abs().max()) if fin.any() else 0.0
            rel = float((d[fin].abs() / torch.tensor(rv, dtype=torch.float64)[fin].abs().clamp_min(1e-300)).max()) \
                if fin.any() else 0.0
            worst["identical"] &= ov == rv
            if a > worst["max_abs"]:
                worst.update(max_abs=a, env=env)
            worst["max_rel"] = max(worst["max_rel"], rel)
        res[name] = worst
    return res


def spread(slice_id: str, case: str, reference: dict | None = None, hosts=SIMULATED_HOSTS,
           log=lambda s: print(s, file=sys.stderr, flush=True)) -> dict:
    """Run `case` under every simulated host; the spread of each output around `reference` (the stored golden's
    outputs, else the run with nothing exported)."""
    runs = []
    for env in hosts:
        log(f"  {slice_id}/{case} under {env or 'this host as it is'}")
        runs.append((env, run_case_subprocess(slice_id, case, env)["outputs"]))
    ref = reference if reference is not None else runs[0][1]
    return {"slice": slice_id, "case": case, "hosts": [e for e, _ in runs], "outputs": output_spread(ref, runs)}


def headroom(name: str, ref: dict, runs: list[tuple[dict, dict]], tol) -> float:
    """max over runs and elements of |diff| / (atol + rtol |ref|): the fraction of the tolerance that the spread
    uses (0 = identical everywhere; > 1 = the golden fails on some simulated host). tol None = exact."""
    rv = torch.tensor(_values(ref), dtype=torch.float64)
    worst = 0.0
    for _, outs in runs:
        ov = _values(outs[name]) if name in outs else None
        if ov is None or len(ov) != len(rv):
            return float("inf")
        d = (torch.tensor(ov, dtype=torch.float64) - rv).abs()
        d = torch.where(torch.isnan(d), torch.zeros_like(d), d)          # NaN at the same place: not a spread
        if tol is None:
            worst = max(worst, float("inf") if bool((d > 0).any()) else 0.0)
            continue
        q = torch.where(d == 0, torch.zeros_like(d), d / (tol[0] + tol[1] * rv.abs()).clamp_min(1e-300))
        worst = max(worst, float(q.max()) if q.numel() else 0.0)
    return worst


def spread_slices(slices, cases: list[str] | None = None,
                  log=lambda s: print(s, file=sys.stderr, flush=True)) -> list[dict]:
    """`dsv4 goldens spread`: every portable cpu case of `slices` (or the named `cases`) under each of
    SIMULATED_HOSTS (one fresh process per host), judged against its stored golden with its own tolerances;
    each slice's result is written to goldens/cpu/_spread/<slice>.json (only for a whole-slice run)."""
    from . import goldens as G
    from .cases import case_hash
    from .verify import load_cases
    todo, missing = [], {}
    for sl in slices:
        for c in load_cases(sl):
            if "cpu" not in c.platforms or c.name not in sl.golden_cases or (cases and c.name not in cases) or \
                    (not cases and c.scope != "portable"):
                continue
            g = G.load_case("cpu", sl.name, c.name, sl.id)
            if g is None:
                missing.setdefault(sl.id, []).append({"case": c.name, "output": "*", "verdict": "missing",
                                                      "detail": "no cpu golden"})
            else:
                todo.append((sl, c, g))
    runs = []
    for i, env in enumerate(SIMULATED_HOSTS):
        log(f"spread: host {i + 1}/{len(SIMULATED_HOSTS)} {env or '(this host as it is)'}: {len(todo)} cases")
        runs.append((env, run_cases_subprocess([(sl.id, c.name) for sl, c, _ in todo], env)["outputs"]))
    docs = []
    for sl in slices:
        checks = list(missing.get(sl.id, []))
        for s2, c, g in todo:
            if s2 is not sl:
                continue
            case_runs = [(env, outs[sl.id][c.name]) for env, outs in runs]
            sp = output_spread(g["outputs"], case_runs)
            for name, ref in g["outputs"].items():
                exact = ref["kind"] == "int" or (ref["kind"] == "tensor" and
                                                 not ref["dtype"].startswith(("float", "bfloat")))
                tol = None if exact or ref["kind"] == "curve" else c.tol.get(name)
                h = headroom(name, ref, case_runs, tol)
                checks.append({"case": c.name, "case_hash": case_hash(c), "output": name, "kind": ref["kind"],
                               "exact": tol is None, "tol": list(tol) if tol is not None else None,
                               "max_abs": sp[name]["max_abs"], "max_rel": sp[name]["max_rel"],
                               "worst_env": sp[name]["env"], "used": h, "verdict": "pass" if h <= 1.0 else "fail"})
        doc = {"slice": sl.id, "hosts": list(SIMULATED_HOSTS), "checks": checks,
               "provenance": G.provenance("cpu", command=f"dsv4 goldens spread --slice {sl.id}")}
        if not cases:
            G.atomic_write_json(G.GOLDENS / "cpu" / "_spread" / f"{sl.name}.json", doc)
        docs.append(doc)
    return docs


def fmt_spread(r: dict) -> str:
    if r["verdict"] == "missing":
        return f"  [MISSING] {r['case']}: {r['detail']}"
    tol = "exact" if r["exact"] else f"atol {r['tol'][0]:g} rtol {r['tol'][1]:g}"
    return (f"  [{r['verdict'].upper():7}] {r['case']}.{r['output']:18} max|abs| {r['max_abs']:.2e} "
            f"max|rel| {r['max_rel']:.2e}  tol {tol}  uses {r['used']:.2g} of it  (worst: {r['worst_env'] or '-'})")


def _main(argv: list[str]) -> int:
    """`python -m dsv4.harness.numerics --out OUT SLICE/CASE ...`: golden cases under the contract, in one
    process -> {"host", "settings", "outputs": {slice: {case: encoded}}}. (Legacy form: SLICE CASE OUT.)"""
    from dsv4.kernels._testing import use_interpreter
    use_interpreter()
    from . import goldens as G
    from .cases import MAX_ELEMS
    from .registry import Registry
    from .verify import load_cases, run_case
    reg = Registry.load()
    legacy = argv[0] != "--out"
    out, specs = (argv[2], [f"{argv[0]}/{argv[1]}"]) if legacy else (argv[1], argv[2:])
    outputs: dict = {}
    for spec in specs:
        sid, case = spec.rsplit("/", 1)
        sl = reg.get(sid)
        c = {c.name: c for c in load_cases(sl)}[case]
        outputs.setdefault(sid, {})[case] = G.encode_outputs(run_case(c, "cpu"), MAX_ELEMS)
    if legacy:
        outputs = outputs[specs[0].rsplit("/", 1)[0]][specs[0].rsplit("/", 1)[1]]
    G.atomic_write_json(Path(out), {"host": host(), "settings": settings(), "outputs": outputs})
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
