"""NVIDIA's emerging-optimizers 0.3.0 as a second Muon: import its outputs on our cases as goldens (issue 15 §4).

    dsv4 goldens import-muon --python /work/venv-eo/bin/python

runs `harness/muon_nvidia_worker.py` under that interpreter (a venv with `emerging-optimizers==0.3.0`; it needs
Python >= 3.12 or, on 3.11, `pip install --no-deps --ignore-requires-python` + `absl-py triton` + the worker's
`typing.override` shim) on the seeded inputs that CASES below define, and writes
goldens/emerging-optimizers/D9/<case>.json (our golden format) with provenance: package, version, the function
called, its arguments, NVIDIA's Python / torch, the inputs' sha256. `slices/D9/test_muon_nvidia.py` compares ours
(harness/train/optim.py) with them; no NVIDIA venv is needed there. The package's code is never copied here.

NVIDIA is called with the DSv4 recipe: `newton_schulz(x, steps=10, coefficient_type="deepseekv4")` and
`Muon(..., momentum=0.95, weight_decay=0.1, nesterov=True, coefficient_type="deepseekv4", num_ns_steps=10,
scale_mode="spectral", extra_scale_factor=0.18, fp32_matmul_prec="highest")`. NVIDIA's defaults differ
(nesterov=False, fp32_matmul_prec="medium" = bf16 NS, quintic 5 steps, extra_scale_factor 1.0): one case keeps
NVIDIA's nesterov=False to show ours equals it with ours' nesterov=False too. Differences: slices/D9/manifest.toml.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

PLATFORM = "emerging-optimizers"
SLICE = "D9"
PACKAGE = "emerging-optimizers"
VERSION = "0.3.0"
WHEEL = "emerging_optimizers-0.3.0-py3-none-any.whl"
WHEEL_SHA256 = "e993682a8b93b6953b3056b0d4e2714e3a3182b0c85f456bcc78d76cd7b47429"
WORKER = Path(__file__).resolve().parent / "muon_nvidia_worker.py"
DEFAULT_PYTHON = "/work/venv-eo/bin/python"

# the DSv4 recipe (spec §10.4) on NVIDIA's Muon; lr is large so that 3 steps move the weights visibly
LR, MU, WD, RMS = 0.02, 0.95, 0.1, 0.18
NV_MUON = dict(lr=LR, momentum=MU, weight_decay=WD, nesterov=True, weight_decay_method="decoupled",
               fp32_matmul_prec="highest", coefficient_type="deepseekv4", num_ns_steps=10, scale_mode="spectral",
               extra_scale_factor=RMS, use_syrk=False)
WIDE, TALL, BATCH = (24, 40), (40, 24), (3, 16, 24)          # rows < cols, rows > cols, batched [E, n, m]
MUON_STEPS = 3


class MuonImportError(ValueError):
    """One-line failure of the importer (no such interpreter, package missing, wrong version, worker crash)."""


@dataclass
class Case:
    name: str
    kind: str                        # ns | muon | schedule
    doc: str
    dtype: str = "float32"
    shape: tuple = WIDE
    seed: int = 0
    scale: float = 1.0               # G = scale * randn (ns_tiny: below NS's eps)
    kwargs: dict = field(default_factory=dict)


CASES = [
    Case("schedule", "schedule", "the (a, b, c) NVIDIA's deepseekv4 NS iterates, its eps, spectral scales"),
    Case("ns_wide_fp32", "ns", "NS of a 24x40 Gaussian (rows < cols: no transpose)", shape=WIDE, seed=1),
    Case("ns_tall_fp32", "ns", "NS of a 40x24 Gaussian (rows > cols: transposed inside)", shape=TALL, seed=2),
    Case("ns_batched_fp32", "ns", "NS of a 3x16x24 stack (per-matrix, as our stacked experts)", shape=BATCH, seed=3),
    Case("ns_wide_fp64", "ns", "fp64 24x40 input: NVIDIA refuses fp64, runs on its fp32 cast", "float64", WIDE, 4),
    Case("ns_tall_fp64", "ns", "fp64 40x24 input: NVIDIA refuses fp64, runs on its fp32 cast", "float64", TALL, 5),
    Case("ns_tiny_fp32", "ns", "24x40 with ||G||_F ~ 3e-8 < eps 1e-7: where the two eps forms differ", shape=WIDE,
         seed=6, scale=1e-9),
    Case("muon_fp32", "muon", f"{MUON_STEPS} Muon steps on a 24x40 and a 40x24 weight, nesterov=True",
         seed=10, kwargs=NV_MUON),
    Case("muon_fp64", "muon", f"{MUON_STEPS} steps, fp64 weights: NVIDIA refuses fp64, runs on fp32 casts",
         "float64", seed=11, kwargs=NV_MUON),
    Case("muon_fp32_nesterov_off", "muon", f"{MUON_STEPS} steps with NVIDIA's default nesterov=False",
         seed=12, kwargs=dict(NV_MUON, nesterov=False)),
]
SCHEDULE_SHAPES = [WIDE, TALL]


def get(name: str) -> Case:
    for c in CASES:
        if c.name == name:
            return c
    raise KeyError(name)


# ------------------------------------------------------------------------------------------- our inputs
def inputs(c: Case) -> dict:
    """The seeded inputs of a case (ours: NVIDIA gets exactly these values)."""
    import torch
    dt = getattr(torch, c.dtype)
    g = torch.Generator().manual_seed(c.seed)
    if c.kind == "ns":
        return {"G": (c.scale * torch.randn(*c.shape, generator=g, dtype=torch.float64)).to(dt)}
    if c.kind == "muon":
        shapes = [WIDE, TALL]
        out = {f"W{i}_init": torch.randn(*s, generator=g, dtype=torch.float64).to(dt) for i, s in enumerate(shapes)}
        for s in range(MUON_STEPS):
            for i, sh in enumerate(shapes):
                out[f"grad{i}_step{s}"] = torch.randn(*sh, generator=g, dtype=torch.float64).to(dt)
        return out
    return {}


def _enc(t) -> dict:
    return {"dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape),
            "values": t.double().flatten().tolist()}


def inputs_sha256(c: Case) -> str:
    return hashlib.sha256(json.dumps({k: _enc(v) for k, v in inputs(c).items()}, sort_keys=True).encode()).hexdigest()


# ------------------------------------------------------------------------------------------- our side
def ours(c: Case, ns_dtype=None) -> dict:
    """Our outputs for case `c`, named as NVIDIA's. `ns_dtype` None: Muon's / hybrid_newton_schulz's default (fp32)."""
    import math

    import torch

    from . import numerics
    from .train.optim import NS_STEPS, UPDATE_RMS, Muon, hybrid_newton_schulz
    numerics.apply()
    ins = inputs(c)
    kw = {} if ns_dtype is None else {"dtype": ns_dtype}
    if c.kind == "ns":
        return {"X": hybrid_newton_schulz(ins["G"], **kw)}
    if c.kind == "muon":
        n = sum(1 for k in ins if k.endswith("_init"))
        params = [torch.nn.Parameter(ins[f"W{i}_init"].clone()) for i in range(n)]
        a = c.kwargs
        opt = Muon(params, lr=a["lr"], momentum=a["momentum"], weight_decay=a["weight_decay"],
                   nesterov=a["nesterov"], update_rms=a["extra_scale_factor"],
                   **({} if ns_dtype is None else {"ns_dtype": ns_dtype}))
        out = {}
        for s in range(MUON_STEPS):
            for i, p in enumerate(params):
                p.grad = ins[f"grad{i}_step{s}"].clone()
            opt.step()
            for i, p in enumerate(params):
                out[f"W{i}_step{s}"] = p.detach().clone()
        return out
    import inspect
    out = {"coefficients": torch.tensor(NS_STEPS, dtype=torch.float64),
           "eps": float(inspect.signature(hybrid_newton_schulz).parameters["eps"].default)}
    for n, m in SCHEDULE_SHAPES:
        out[f"spectral_scale_{n}x{m}"] = math.sqrt(max(n, m))        # ours: O * sqrt(max(n, m)) * UPDATE_RMS
    assert UPDATE_RMS == RMS
    return out


# ------------------------------------------------------------------------------------------- NVIDIA's side
def check_python(python: str) -> dict:
    """The interpreter's emerging-optimizers version and Python; a MuonImportError if it is not 0.3.0."""
    if not Path(python).exists():
        raise MuonImportError(f"--python {python}: no such interpreter (make the emerging-optimizers venv first)")
    code = ("import importlib.metadata as m, platform, json; print(json.dumps({'version': m.version("
            f"{PACKAGE!r}), 'python': platform.python_version()}}))")
    p = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
    if p.returncode != 0:
        raise MuonImportError(f"--python {python}: {PACKAGE} is not installed there "
                              f"({(p.stderr.strip().splitlines() or ['?'])[-1]})")
    info = json.loads(p.stdout.strip().splitlines()[-1])
    if info["version"] != VERSION:
        raise MuonImportError(f"--python {python}: {PACKAGE} {info['version']}, expected {VERSION} (pin it: the "
                              f"index also lists a bogus 999.9.9)")
    return info


def run_nvidia(python: str, cases) -> dict:
    """NVIDIA's side of `cases` in a subprocess under `python`. Returns the worker's document."""
    doc = {"cases": []}
    for c in cases:
        d = {"name": c.name, "kind": c.kind, "inputs": {k: _enc(v) for k, v in inputs(c).items()}}
        if c.kind == "muon":
            d["kwargs"] = c.kwargs
        if c.kind == "schedule":
            d["shapes"] = SCHEDULE_SHAPES
        doc["cases"].append(d)
    with tempfile.TemporaryDirectory(prefix="dsv4-muon-") as td:
        inp, out = Path(td) / "in.json", Path(td) / "out.json"
        inp.write_text(json.dumps(doc))
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        env.pop("PYTHONPATH", None)
        t0 = time.time()
        proc = subprocess.run([python, str(WORKER), str(inp), str(out)], env=env, capture_output=True, text=True,
                              cwd=td, timeout=1800)
        if proc.returncode != 0 or not out.exists():
            tail = [line for line in (proc.stderr or proc.stdout).strip().splitlines() if line.strip()][-1:]
            raise MuonImportError(f"NVIDIA worker failed (exit {proc.returncode}): {' '.join(tail)}")
        res = json.loads(out.read_text())
        res["elapsed_s"] = round(time.time() - t0, 1)
        return res


def _to_outputs(raw: dict) -> dict:
    """The worker's encoding -> our golden encoding (encode_outputs of the decoded tensors / floats)."""
    import torch

    from . import goldens as G
    from .cases import MAX_ELEMS
    dec = {}
    for k, e in raw.items():
        if "float" in e:
            dec[k] = float(e["float"])
        else:
            dec[k] = torch.tensor(e["values"], dtype=torch.float64).reshape(e["shape"]).to(getattr(torch, e["dtype"]))
    return G.encode_outputs(dec, MAX_ELEMS)


def import_muon(python: str = DEFAULT_PYTHON, log=print) -> list[dict]:
    from . import goldens as G
    info = check_python(python)
    res = run_nvidia(python, CASES)
    written = []
    for c in CASES:
        r = res["cases"][c.name]
        enc = _to_outputs(r["outputs"])
        old = G.load_case(PLATFORM, SLICE, c.name)
        prov = G.provenance(PLATFORM, config={"case": c.name, "kind": c.kind, "dtype": c.dtype, "shape": c.shape,
                                              "seed": c.seed, "scale": c.scale, "kwargs": c.kwargs},
                            seed=c.seed, command=f"dsv4 goldens import-muon --python {python}")
        prov.update({"package": PACKAGE, "package_version": res["version"], "wheel": WHEEL,
                     "wheel_sha256": WHEEL_SHA256, "package_module_file": res["module_file"],
                     "function": r["call"]["function"], "call": r["call"],
                     "package_python": res["python"], "package_python_executable": res["python_executable"],
                     "package_torch": res["torch"], "shims": res["shims"],
                     "install_route": ("Python 3.11 venv: torch==2.13.0 CPU wheel, then pip install --no-deps "
                                       "--ignore-requires-python the 0.3.0 wheel, absl-py, triton (imported "
                                       "unconditionally); the worker's typing.override shim")
                     if tuple(map(int, info["python"].split(".")[:2])) < (3, 12) else "Python >= 3.12 venv: pip install emerging-optimizers==0.3.0",
                     "case_inputs": c.doc, "inputs_sha256": inputs_sha256(c),
                     "ours": f"dsv4.harness.muon_import.ours({c.name!r})"})
        gdoc = {"format": G.FORMAT, "slice": SLICE, "case": c.name, "platform": PLATFORM, "provenance": prov,
                "outputs": enc}
        p = G.case_path(PLATFORM, SLICE, c.name)
        G.atomic_write_json(p, gdoc)
        log(G._rel(p))
        lines = G.diff_outputs(old["outputs"] if old else None, enc)
        for line in lines:
            log(line)
        written.append({"case": c.name, "path": G._rel(p), "diff": lines})
    log(f"{PACKAGE} {res['version']} (Python {res['python']}): {len(written)} goldens in {res['elapsed_s']}s")
    return written
