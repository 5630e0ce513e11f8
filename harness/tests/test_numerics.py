"""The CPU numerics contract (harness/numerics.py): pinned settings hold whatever is exported from outside,
provenance names the host's numerics, same-host goldens are judged only where they were made, and every
portable golden's tolerances cover the cross-host spread stored in goldens/cpu/_spread/."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from dsv4.harness import goldens as G
from dsv4.harness import numerics as N
from dsv4.harness.cases import case_hash
from dsv4.harness.registry import REPO, Registry
from dsv4.harness.testing import fake_slice
from dsv4.harness.verify import load_cases


def test_contract_holds_against_exported_values():
    """OMP/MKL thread counts exported from outside do not change what the contract pins."""
    code = ("from dsv4.harness import numerics as N; import torch, json; s = N.apply(); "
            "print(json.dumps([s, torch.get_num_threads(), N.host()['env']]))")
    env = {**os.environ, "OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2", "ATEN_CPU_CAPABILITY": "avx2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    s, threads, host_env = json.loads(out.stdout.strip().splitlines()[-1])
    assert threads == 1 and s["intra_op_threads"] == 1 and s["deterministic_algorithms"] is True
    assert s["float32_matmul_precision"] == "highest"
    assert host_env["ATEN_CPU_CAPABILITY"] == "avx2" and host_env["OMP_NUM_THREADS"] == "2"   # recorded


def test_provenance_names_host_numerics_seed_and_config():
    p = G.provenance("cpu", seed=N.CASE_SEED, case_hash="abc")
    assert p["seed"] == 0 and p["config_hash"] == "abc"
    h = p["host"]
    assert h["cpu_model"] and h["aten_cpu_capability"] in ("DEFAULT", "AVX2", "AVX512", "ZVECTOR", "VSX")
    assert isinstance(h["isa"], list) and "env" in h and p["numerics"]["intra_op_threads"] >= 1
    assert p["host_fingerprint"] == N.fingerprint(h)
    assert p["host_cpu"] == h["cpu_model"]                     # no longer just "x86_64"


def test_every_stored_cpu_golden_has_seed_and_config_hash():
    missing = []
    for f in sorted((REPO / "goldens" / "cpu").glob("*/*.json")):
        if f.parent.name == "_spread" or f.name.endswith(".provenance.json"):
            continue
        prov = json.loads(f.read_text()).get("provenance", {})
        if prov.get("seed") is None or not prov.get("config_hash") or "host" not in prov:
            missing.append(str(f.relative_to(REPO)))
    assert not missing, missing


SAME_HOST = textwrap.dedent('''
    import torch
    from dsv4.harness.cases import golden_case

    @golden_case("long", tol={"y": (0.0, 0.0)}, scope="same-host")
    def long():
        return {"y": torch.arange(4, dtype=torch.float32) / 3}
''')


def _same_host_golden(sid, tmp_path, monkeypatch):
    """(registry, golden path, golden dict) of a fake slice `sid` whose one same-host golden was made here."""
    from dsv4.harness import verify as V
    monkeypatch.setattr(G, "GOLDENS", tmp_path / "goldens")
    s = fake_slice(sid, tmp_path / "slices" / sid, golden_cases=["long"], cases=SAME_HOST)
    reg = Registry([s])
    V.regen(reg, s, "cpu")
    path = G.case_path("cpu", sid, "long")
    return reg, path, json.loads(path.read_text())


def test_same_host_golden_judged_only_on_its_host(tmp_path, monkeypatch):
    from dsv4.harness import verify as V
    reg, path, g = _same_host_golden("Z2", tmp_path, monkeypatch)
    assert g["scope"] == "same-host" and g["provenance"]["host_fingerprint"] == N.fingerprint()
    doc = V.verify(reg, ["Z2"], "cpu", "deterministic", run_tests=False)
    assert doc["exit_code"] == 0 and doc["slices"][0]["checks"][0]["verdict"] == "pass"     # judged, exact
    g["provenance"]["host_fingerprint"] = "Some Other CPU|AVX512|2.13.0"
    path.write_text(json.dumps(g))
    rec = V.verify(reg, ["Z2"], "cpu", "deterministic", run_tests=False)["slices"][0]
    assert rec["checks"][0]["verdict"] == "skip" and "same-host evidence" in rec["checks"][0]["detail"]
    assert rec["verdict"] == "cannot-judge"          # a slice whose only check was not judged is not a pass


def test_unjudged_same_host_golden_is_flagged_when_model_code_changed_since(tmp_path, monkeypatch):
    """On another host a same-host golden is skipped; the summary says so, and names it as possibly stale when
    model/ or kernels/ changed since the golden's commit (how X1/lowp_curves_debug went stale unseen)."""
    from dsv4.harness import verify as V
    reg, path, g = _same_host_golden("Z3", tmp_path, monkeypatch)
    g["provenance"]["host_fingerprint"] = "Some Other CPU|AVX512|2.13.0"
    g["provenance"]["git_sha"] = "a" * 40
    path.write_text(json.dumps(g))
    seen = []
    monkeypatch.setattr(V, "code_changed_since", lambda sha: seen.append(sha) or ["model/moe.py"])
    doc = V.verify(reg, ["Z3"], "cpu", "deterministic", run_tests=False)
    chk = doc["slices"][0]["checks"][0]
    assert seen == ["a" * 40] and chk["stale"] and "model/moe.py" in chk["detail"] and "may be stale" in chk["detail"]
    lines = V.summary_lines(doc)
    assert any(ln.startswith("NOT JUDGED HERE: 1 same-host") and "Z3/long" in ln for ln in lines), lines
    monkeypatch.setattr(V, "code_changed_since", lambda sha: [])            # nothing changed: skipped, not stale
    doc = V.verify(reg, ["Z3"], "cpu", "deterministic", run_tests=False)
    assert not doc["slices"][0]["checks"][0]["stale"]
    assert [ln for ln in V.summary_lines(doc) if ln.startswith("NOT JUDGED")] == [
        "NOT JUDGED HERE: 1 same-host golden(s) made on another host"]


def test_code_changed_since_reads_git():
    """Against this checkout's own HEAD nothing under model/ kernels/ differs unless the tree is dirty there; an
    unknown sha gives None (cannot tell), never a list."""
    from dsv4.harness import verify as V
    assert V.code_changed_since("f" * 40) is None and V.code_changed_since(None) is None
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    if len(head) != 40:
        pytest.skip("no git history in this checkout")
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "model", "kernels"], cwd=REPO,
                           capture_output=True, text=True).stdout.strip()
    got = V.code_changed_since(head)
    assert got is not None and (got == [] or dirty)


def _portable_cases():
    reg = Registry.load()
    for sid in reg.order():
        sl = reg.get(sid)
        if sl.status.get("cpu") not in ("implemented", "verified"):
            continue
        for c in load_cases(sl):
            if "cpu" in c.platforms and c.name in sl.golden_cases and c.scope == "portable":
                yield sl, c


def _covered(check: dict, tol) -> bool:
    """Sufficient: |d| <= max_abs <= atol, or |d| <= max_rel |ref| <= rtol |ref|; else the recorded use of the
    same tolerance."""
    if check["exact"]:
        return check["max_abs"] == 0.0
    atol, rtol = tol
    return check["max_abs"] <= atol or check["max_rel"] <= rtol or \
        (list(tol) == check["tol"] and check["used"] <= 1.0)


@pytest.mark.parametrize("sl,case", [pytest.param(s, c, id=f"{s.name}-{c.name}") for s, c in _portable_cases()])
def test_portable_golden_tolerance_covers_measured_spread(sl, case):
    """goldens/cpu/_spread/<slice>.json (dsv4 goldens spread) holds, for the case as it is now (same case hash),
    the worst difference over the simulated hosts; the case's tolerances must cover it."""
    f = REPO / "goldens" / "cpu" / "_spread" / f"{sl.name}.json"
    assert f.exists(), f"no spread measured for {sl.id}: run dsv4 goldens spread --slice {sl.id}"
    checks = [c for c in json.loads(f.read_text())["checks"] if c["case"] == case.name]
    assert checks, f"{sl.id}/{case.name}: no spread record (dsv4 goldens spread --slice {sl.id})"
    assert all(c["case_hash"] == case_hash(case) for c in checks), \
        f"{sl.id}/{case.name}: the case changed since its spread was measured (rerun dsv4 goldens spread)"
    bad = [f"{c['output']}: max|abs| {c['max_abs']:.2e} max|rel| {c['max_rel']:.2e} (worst {c['worst_env']}) "
           f"vs tol {case.tol.get(c['output'])}" for c in checks
           if not _covered(c, case.tol.get(c["output"], (0.0, 0.0)))]
    assert not bad, f"{sl.id}/{case.name}: " + "; ".join(bad)


def test_fp64_model_keeps_fp64_everywhere():
    """Under an fp64 cast the FP32-kept tensors (P1) become fp64: fp32 never lowers an fp64 run."""
    from dsv4.model.config import get_config
    from dsv4.model.model import DSv4Model
    m = DSv4Model(get_config("debug")).to(torch.float64)
    assert {p.dtype for p in m.parameters()} == {torch.float64}
    m16 = DSv4Model(get_config("debug")).to(torch.bfloat16)
    assert {p.dtype for p in m16.parameters()} == {torch.bfloat16, torch.float32}
