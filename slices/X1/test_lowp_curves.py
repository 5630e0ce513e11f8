"""X1: the low-precision loss curves against the fp32 baseline (slices/X1/curves.py `check_curve`): the stored
curves (goldens/cpu/X1/lowp_curves_debug.json) pass; a fresh FP4-QAT run passes; the check fails when the FP8
quantisation is broken (a weight scale off by 2x) and when nothing was quantised; `dsv4 train --precision`
refuses unknown names in one line."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from dsv4.harness.registry import REPO
from dsv4.kernels.quant.naive import QTensor
from dsv4.model.lowp import fp8_linear as L
from dsv4.slices.X1.curves import LOWP, check_curve, lm_curve

GOLDEN = REPO / "goldens" / "cpu" / "X1" / "lowp_curves_debug.json"


def _stored() -> dict:
    out = json.loads(GOLDEN.read_text())["outputs"]
    return {k.removeprefix("lm_loss_"): v["values"] for k, v in out.items()}


def test_stored_curves_pass_the_check():
    c = _stored()
    assert set(c) == {"fp32", *LOWP}
    for name in LOWP:
        ok, msg = check_curve(name, c["fp32"], c[name])
        print(msg)
        assert ok, msg


@pytest.fixture(scope="module")
def fresh_base():
    return lm_curve(None)


def test_fresh_fp4_qat_curve_passes(fresh_base):
    ok, msg = check_curve("fp4_qat", fresh_base, lm_curve("fp4_qat"))
    assert ok, msg


def test_the_check_fails_on_a_broken_quantiser(fresh_base, monkeypatch):
    """Fault injection (test only): FP8Linear's 128x128 weight scales doubled, so every FP8 GEMM reads 2 W."""
    good = L._quant

    def doubled(t, fmt, block, cfg, backend="naive", transpose=False):
        out = good(t, fmt, block, cfg, backend, transpose)
        if block != (128, 128):
            return out
        dbl = lambda q: QTensor(q.values, q.scale * 2, q.fmt, q.block)      # noqa: E731
        return tuple(map(dbl, out)) if transpose else dbl(out)

    monkeypatch.setattr(L, "_quant", doubled)
    ok, msg = check_curve("fp8_block", fresh_base, lm_curve("fp8_block"))
    assert not ok and "OUTSIDE" in msg, msg
    ok, msg = check_curve("fp8_block", fresh_base, list(fresh_base))      # nothing quantised: min gap
    assert not ok, msg


def test_train_refuses_an_unknown_precision(tmp_path):
    from dsv4.harness.train.loop import train_cmd
    r = CliRunner().invoke(train_cmd, ["--recipe", "debug", "--steps", "1", "--out", str(tmp_path / "r"),
                                       "--precision", "fp3"])
    assert r.exit_code == 2 and "train.precision: unknown 'fp3'" in r.output, r.output
    r = CliRunner().invoke(train_cmd, ["--recipe", "debug", "--steps", "1", "--out", str(tmp_path / "s"),
                                       "--indexer-qk-precision", "int8"])
    assert r.exit_code == 2 and "train.indexer_qk_precision: must be bf16|fp8|fp4" in r.output, r.output
    r = CliRunner().invoke(train_cmd, ["--recipe", "debug", "--steps", "1", "--out", str(tmp_path / "t"),
                                       "--indexer-qk-precision", "fp8", "--indexer-qk-rerank", "-0.5"])
    assert r.exit_code == 2 and "train.indexer_qk_rerank: a margin >= 0, got -0.5" in r.output, r.output
