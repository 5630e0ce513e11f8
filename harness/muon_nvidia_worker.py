"""The NVIDIA side of `dsv4 goldens import-muon`: runs under the emerging-optimizers venv, by file path.

    /path/to/venv-eo/bin/python harness/muon_nvidia_worker.py IN.json OUT.json

Standalone on purpose: it imports nothing from dsv4 (that venv has neither dsv4 nor our dependencies), only torch
and emerging_optimizers. IN.json holds our cases with their inputs (tensors as float64 value lists, exact for fp32
and fp64); OUT.json gets, per case, NVIDIA's outputs in the same encoding and the exact calls made.

On Python < 3.12 the package needs one shim, `typing.override` (3.12+) as the identity decorator; it is recorded
in the output. Nothing else of the package is patched.
"""
import importlib.metadata as md
import inspect
import json
import platform
import sys
import typing

SHIMS = []
if not hasattr(typing, "override"):
    typing.override = lambda f: f
    SHIMS.append("typing.override = identity decorator (Python < 3.12; the package declares >= 3.12)")

import torch  # noqa: E402

torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)

from emerging_optimizers.orthogonalized_optimizers import muon_utils  # noqa: E402
from emerging_optimizers.orthogonalized_optimizers.muon import Muon, get_muon_scale_factor  # noqa: E402

NS_CALL = dict(steps=10, coefficient_type="deepseekv4")


def dec(e):
    return torch.tensor(e["values"], dtype=torch.float64).reshape(e["shape"]).to(getattr(torch, e["dtype"]))


def enc(t):
    t = t.detach()
    return {"dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape), "values": t.double().flatten().tolist()}


def _refusal(fn):
    """The error NVIDIA raises for a call (fp64 input), or None if it runs."""
    try:
        fn()
    except (TypeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def run_ns(case):
    x = dec(case["inputs"]["G"])
    note = {}
    torch.set_float32_matmul_precision(case.get("fp32_matmul_precision", "highest"))
    if x.dtype != torch.float32:
        note["refused_" + str(x.dtype).replace("torch.", "")] = _refusal(lambda: muon_utils.newton_schulz(x, **NS_CALL))
        x = x.float()
        note["ran_on"] = "the float32 cast of the input"
    out = muon_utils.newton_schulz(x, **NS_CALL)
    torch.set_float32_matmul_precision("highest")
    call = {"function": "emerging_optimizers.orthogonalized_optimizers.muon_utils.newton_schulz",
            "arguments": dict(NS_CALL, eps="default (1e-7)", transpose="default (None: rows > cols)",
                              use_syrk=False, tp_group=None),
            "float32_matmul_precision": case.get("fp32_matmul_precision", "highest")}
    return {"X": enc(out)}, dict(call, **note)


def run_muon(case):
    ins = case["inputs"]
    kw = case["kwargs"]
    n_par = sum(1 for k in ins if k.startswith("W") and k.endswith("_init"))
    n_steps = sum(1 for k in ins if k.startswith("grad0_"))
    W0 = [dec(ins[f"W{i}_init"]) for i in range(n_par)]
    note = {}
    if W0[0].dtype != torch.float32:
        def try64():
            ps = [torch.nn.Parameter(w.clone()) for w in W0]
            o = Muon(ps, **kw)
            for i, p in enumerate(ps):
                p.grad = dec(ins[f"grad{i}_step0"])
            o.step()
        note["refused_" + str(W0[0].dtype).replace("torch.", "")] = _refusal(try64)
        note["ran_on"] = "float32 casts of the parameters and gradients"
    params = [torch.nn.Parameter(w.float().clone()) for w in W0]
    opt = Muon(params, **kw)
    out = {}
    for s in range(n_steps):
        for i, p in enumerate(params):
            p.grad = dec(ins[f"grad{i}_step{s}"]).float()
        opt.step()
        for i, p in enumerate(params):
            out[f"W{i}_step{s}"] = enc(p)
    call = {"function": "emerging_optimizers.orthogonalized_optimizers.muon.Muon(params, **arguments).step()",
            "arguments": kw, "steps": n_steps, "params": [list(w.shape) for w in W0]}
    return out, dict(call, **note)


def run_schedule(case):
    """What NVIDIA's deepseekv4 NS actually iterates (every (a, b, c) its step function is called with), its eps
    default, its spectral scale factors, and Muon's defaults."""
    seen = []
    step2d = muon_utils.newton_schulz_step

    def spy(X, a, b, c, tp_group=None):
        seen.append((a, b, c))
        return step2d(X, a, b, c, tp_group=tp_group)
    muon_utils.newton_schulz_step = spy
    try:
        muon_utils.newton_schulz(torch.randn(4, 6), **NS_CALL)
    finally:
        muon_utils.newton_schulz_step = step2d
    eps = inspect.signature(muon_utils.newton_schulz).parameters["eps"].default
    out = {"coefficients": enc(torch.tensor(seen, dtype=torch.float64)), "eps": eps}
    for n, m in case["shapes"]:
        out[f"spectral_scale_{n}x{m}"] = float(get_muon_scale_factor(n, m, mode="spectral"))
    defaults = {k: v.default for k, v in inspect.signature(Muon.__init__).parameters.items()
                if v.default is not inspect.Parameter.empty}
    call = {"function": "muon_utils.newton_schulz(randn(4, 6), steps=10, coefficient_type='deepseekv4') with its "
                        "newton_schulz_step spied; get_muon_scale_factor(n, m, 'spectral'); inspect.signature",
            "muon_defaults": defaults}
    return {k: (v if isinstance(v, dict) else {"float": v}) for k, v in out.items()}, call


RUN = {"ns": run_ns, "muon": run_muon, "schedule": run_schedule}


def main(inp, outp):
    doc = json.load(open(inp))
    res = {"package": "emerging-optimizers", "version": md.version("emerging-optimizers"),
           "module_file": muon_utils.__file__, "python": platform.python_version(),
           "python_executable": sys.executable, "torch": torch.__version__, "shims": SHIMS,
           "float32_matmul_precision": "highest unless a case says otherwise", "cases": {}}
    for c in doc["cases"]:
        outputs, call = RUN[c["kind"]](c)
        res["cases"][c["name"]] = {"outputs": outputs, "call": call}
    with open(outp, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
