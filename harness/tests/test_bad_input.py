"""Bad input is one line on stderr and exit 2 (never a traceback and exit 1, which CI reads as a regression).

Each test feeds one kind of bad input to the command a user would run: tampered / truncated / pickled
checkpoints to `dsv4 convert` and `dsv4 train --resume`, config.json fields of the wrong type or contradicting
each other, a malformed `--junit`, `bench` / `--backend triton` without CUDA, `verify -n 2` without
pytest-xdist, and a full disk while a checkpoint is written.
"""
from __future__ import annotations

import errno
import json
import os
import shutil

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file as _load_file, save_file

from dsv4.harness.train import checkpoint as ck
from dsv4.harness.cli import main
from dsv4.harness.convert_cli import convert_cmd
from dsv4.harness.train.loop import train_cmd


def load_file(path):                       # a copy, not a memory map of the file the test then overwrites
    return {k: v.clone() for k, v in _load_file(path).items()}


def one_line_exit_2(r, *needles):
    assert r.exit_code == 2, (r.exit_code, r.output, r.exception)
    lines = [x for x in r.stderr.strip().splitlines() if "|" not in x]  # progress bars aside (tqdm, stderr)
    assert len(lines) == 1 and lines[0].startswith("dsv4: error: "), r.stderr
    assert "Traceback" not in r.output
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 2-step debug run with its checkpoint, and a debug model's HF export."""
    from dsv4.model.config import get_config
    from dsv4.model.interop.hf import to_hf
    from dsv4.model.model import DSv4Model
    d = tmp_path_factory.mktemp("bad_input")
    r = CliRunner().invoke(train_cmd, ["--recipe", "debug", "--steps", "2", "--save-interval", "2",
                                       "--out", str(d / "run"), "--json"])
    assert r.exit_code == 0, r.output
    torch.manual_seed(0)
    to_hf(DSv4Model(get_config("debug", shared_expert_clamp=True)), str(d / "hf"))
    return d


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


# ------------------------------------------------------------------------------------------- convert
K = "model.layers.1.self_attn.q_a_proj.weight"


@pytest.mark.parametrize("tamper", ["truncated", "wrong_shape", "missing", "extra", "pickle"])
def test_convert_tampered_safetensors(run, tmp_path, tamper):
    d = _copy(run / "hf", tmp_path / "hf")
    f = d / "model.safetensors"
    sd = load_file(str(f))
    if tamper == "truncated":
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    elif tamper == "pickle":
        f.unlink()
        torch.save(sd, str(d / "pytorch_model.bin"))
    else:
        if tamper == "wrong_shape":
            sd[K] = sd[K][:, :-1].contiguous()
        elif tamper == "missing":
            del sd[K]
        else:
            sd["model.layers.1.self_attn.extra.weight"] = torch.zeros(2)
        save_file(sd, str(f))
    r = CliRunner().invoke(convert_cmd, [str(d), str(tmp_path / "out"), "--from", "hf", "--to", "official"])
    name = "pytorch_model.bin" if tamper == "pickle" else "model.safetensors"
    line = one_line_exit_2(r, str(d / name))
    assert {"truncated": "not a readable safetensors", "wrong_shape": "layers.1.attn.wq_a.weight",
            "missing": "missing tensor layers.1.attn.wq_a.weight", "extra": "self_attn.extra.weight",
            "pickle": "pickle"}[tamper] in line
    assert not (tmp_path / "out").exists()


def test_pickle_named_safetensors_is_never_unpickled(run, tmp_path, monkeypatch):
    d = _copy(run / "hf", tmp_path / "hf")
    torch.save({"x": torch.zeros(1)}, str(d / "model.safetensors"))      # a torch.save file in disguise
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load called on a checkpoint"))
    r = CliRunner().invoke(convert_cmd, [str(d), str(tmp_path / "out"), "--from", "hf"])
    one_line_exit_2(r, "model.safetensors", "pickle", "not loaded")


@pytest.mark.parametrize("field,value,needle", [
    ("hidden_size", "64", "'hidden_size' must be int, got str"),
    ("swiglu_limit", [1.0], "'swiglu_limit' must be float, got list"),
    ("layer_types", "sliding_attention", "'layer_types' must be list"),
    ("dsv4_config.num_hash_layers", "1", "dsv4_config: field 'num_hash_layers' must be int"),
])
def test_convert_config_field_of_wrong_type(run, tmp_path, field, value, needle):
    d = _copy(run / "hf", tmp_path / "hf")
    cfg = json.loads((d / "config.json").read_text())
    if field.startswith("dsv4_config."):
        cfg["dsv4_config"][field.split(".", 1)[1]] = value
    else:
        cfg[field] = value
    (d / "config.json").write_text(json.dumps(cfg))
    r = CliRunner().invoke(convert_cmd, [str(d), str(tmp_path / "out"), "--from", "hf"])
    one_line_exit_2(r, "config.json", needle)


def test_convert_dsv4_config_contradicting_hf_fields(run, tmp_path):
    d = _copy(run / "hf", tmp_path / "hf")
    cfg = json.loads((d / "config.json").read_text())
    cfg["dsv4_config"]["moe_intermediate_size"] = 48                     # HF field says 32
    (d / "config.json").write_text(json.dumps(cfg))
    r = CliRunner().invoke(convert_cmd, [str(d), str(tmp_path / "out"), "--from", "hf"])
    one_line_exit_2(r, "dsv4_config.moe_intermediate_size = 48", "moe_intermediate_size = 32")


def test_convert_config_json_not_json(run, tmp_path):
    d = _copy(run / "hf", tmp_path / "hf")
    (d / "config.json").write_text("{\"vocab_size\": 256,")
    r = CliRunner().invoke(convert_cmd, [str(d), str(tmp_path / "out"), "--from", "hf"])
    one_line_exit_2(r, str(d / "config.json"), "not valid JSON")


# ------------------------------------------------------------------------------------------- train --resume
def _step_dir(d):
    return d / "checkpoints" / "step_000002"


@pytest.mark.parametrize("tamper", ["truncated", "wrong_shape", "missing", "extra", "pickle", "optim_extra",
                                    "optim_shape", "meta_type", "pickle_file"])
def test_resume_tampered_checkpoint(run, tmp_path, tamper):
    d = _copy(run / "run", tmp_path / "run")
    s = _step_dir(d)
    f = s / "model.safetensors"
    sd = load_file(str(f))
    k = "layers.1.attn.wq_a.weight"
    target, needle = f, k
    if tamper == "truncated":
        f.write_bytes(f.read_bytes()[:100])
        needle = "not a readable safetensors"
    elif tamper == "pickle":
        torch.save(sd, str(f))
        needle = "pickle"
    elif tamper in ("wrong_shape", "missing", "extra"):
        if tamper == "wrong_shape":
            sd[k] = sd[k][:, :-1].contiguous()
        elif tamper == "missing":
            del sd[k]
        else:
            sd[k := "layers.1.attn.bogus"] = torch.zeros(3)
            needle = k
        save_file(sd, str(f))
    elif tamper in ("optim_extra", "optim_shape"):
        target = s / "optim.safetensors"
        ot = load_file(str(target))
        if tamper == "optim_extra":
            ot["optim.bogus"] = torch.zeros(1)
            needle = "unexpected tensor optim.bogus"
        else:
            key = next(x for x in ot if x.endswith("exp_avg") and ot[x].dim() == 2)
            ot[key] = ot[key][:, :-1].contiguous()
            needle = "exp_avg of"
        save_file(ot, str(target))
    elif tamper == "meta_type":
        target = s / "meta.json"
        meta = json.loads(target.read_text())
        meta["step"] = "2"
        target.write_text(json.dumps(meta))
        needle = "field 'step' must be int"
    else:                                                               # --resume some.pt
        target = tmp_path / "ckpt.pt"
        torch.save(sd, str(target))
        needle = "pickle"
    r = CliRunner().invoke(train_cmd, ["--recipe", "debug", "--steps", "3", "--out", str(d),
                                       "--resume", str(target if tamper == "pickle_file" else d)])
    one_line_exit_2(r, str(target), needle)


# ------------------------------------------------------------------------------------------- full disk
def test_full_disk_while_checkpointing(tmp_path, monkeypatch):
    real = ck.save_file

    def fill_disk(tensors, path):
        if "step_000003" in path and path.endswith("optim.safetensors"):
            with open(path, "wb") as fh:
                fh.write(b"half")                                        # a partial file, then the disk is full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        real(tensors, path)

    monkeypatch.setattr(ck, "save_file", fill_disk)
    out = tmp_path / "o"
    r = CliRunner().invoke(train_cmd, ["--recipe", "debug", "--steps", "3", "--save-interval", "2", "--out", str(out)])
    one_line_exit_2(r, "step_000003", "No space left on device", "previous checkpoint is intact")
    cdir = out / "checkpoints"
    assert sorted(os.listdir(cdir)) == ["latest", "step_000002"]       # no temp dir, no half checkpoint
    assert (cdir / "latest").read_text() == "step_000002"
    assert ck.load_checkpoint(str(out))[3]["step"] == 2


def test_full_disk_elsewhere_in_train(tmp_path, monkeypatch):
    from dsv4.harness import goldens as G

    def full(path, text):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    monkeypatch.setattr(G, "atomic_write_text", full)
    r = CliRunner().invoke(train_cmd, ["--recipe", "debug", "--steps", "2", "--out", str(tmp_path / "o")])
    one_line_exit_2(r, "No space left on device", "provenance.json")


# ------------------------------------------------------------------------------------------- verify / bench
def test_verify_malformed_junit(tmp_path):
    bad = tmp_path / "j.xml"
    bad.write_text("<testsuite><testcase name='x'")
    r = CliRunner().invoke(main, ["verify", "--slice", "D9", "--junit", str(bad)])
    one_line_exit_2(r, str(bad), "not a readable junit xml")
    bad.write_text("<html><body/></html>")
    r = CliRunner().invoke(main, ["verify", "--slice", "D9", "--junit", str(bad)])
    one_line_exit_2(r, str(bad), "<html>")


def test_verify_workers_without_xdist(monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "xdist" else real(name, *a))
    r = CliRunner().invoke(main, ["verify", "--slice", "D9", "-n", "2"])
    one_line_exit_2(r, "-n 2", "pytest-xdist is not installed")


needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")


@needs_no_cuda
@pytest.mark.parametrize("args", [["bench", "kernels"], ["bench", "train"]])
def test_bench_without_cuda(args):
    r = CliRunner().invoke(main, args)
    one_line_exit_2(r, f"dsv4 {' '.join(args)} needs a CUDA GPU", "torch.cuda.is_available() is False")


@needs_no_cuda
def test_train_triton_backend_without_cuda(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)                # a user's shell, not the test session
    r = CliRunner().invoke(train_cmd, ["--recipe", "debug", "--steps", "2", "--backend", "triton",
                                       "--out", str(tmp_path / "o")])
    one_line_exit_2(r, "train.backend: triton needs a CUDA GPU")


def test_full_disk_in_any_command_is_one_line(tmp_path, monkeypatch):
    from dsv4.harness import goldens as G

    def full(path, text):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    monkeypatch.setattr(G, "atomic_write_text", full)
    out = tmp_path / "g.dot"
    r = CliRunner().invoke(main, ["graph", "--format", "dot", "--out", str(out)])
    one_line_exit_2(r, "No space left on device", str(out))
