"""X4: recipe schedules -- the DSv4 MTP weight 0.3 -> 0.1 when the LR decay starts (spec §10.2) on a
warm-up-stable-decay LR, opt-in (the debug recipe keeps its constant 0.3) -- and the long-context curriculum
(stages raising the row length, dense indexer warm-up then sparse attention): the switch happens at the right
steps, with the right layout and attention mode, and resuming (across a switch too) replays the run exactly."""
import json
import math
from dataclasses import replace

import pytest
import torch

from dsv4.harness.train.curriculum import get_curriculum, stage_at, total_steps
from dsv4.harness.train.schedule import ScheduleError, decay_start, lr_for, mtp_weight_for
from dsv4.harness.train.loop import RECIPES, build_model, train


def _hist(d):
    return [json.loads(line) for line in open(f"{d}/metrics.jsonl")]


def test_wsd_lr_and_mtp_weight_unit():
    r = RECIPES["wsd-debug"]
    lrs = [lr_for(r, s) for s in range(1, r.steps + 1)]
    assert lrs[:2] == [r.lr / 2, r.lr] and all(x == r.lr for x in lrs[1:8]) and lrs[-1] == r.min_lr
    assert all(a > b for a, b in zip(lrs[7:], lrs[8:]))                          # decays after step 8
    assert [mtp_weight_for(r, s, 0.3) for s in (1, 8, 9, 12)] == [0.3, 0.3, 0.1, 0.1]
    c = replace(RECIPES["debug"], mtp_weight_after_decay=0.1)                       # cosine: decay after warm-up
    assert decay_start(c) == c.warmup and mtp_weight_for(c, c.warmup + 1, 0.3) == 0.1
    assert mtp_weight_for(RECIPES["debug"], 12, 0.3) == 0.3                         # opt-in only
    with pytest.raises(ScheduleError, match="decay_start"):
        decay_start(replace(r, decay_start=99))


def test_mtp_weight_schedule_in_training(tmp_path):
    torch.set_num_threads(1)
    r = RECIPES["wsd-debug"]
    train(r, str(tmp_path), seed=7, progress=False)
    h = _hist(tmp_path)
    assert [x["mtp-weight"] for x in h] == [0.3] * 8 + [0.1] * 4
    for x in h:                   # the weight really enters the objective: total = lm + w * mtp + aux terms
        aux = x.get("indexer loss", 0.0) + x.get("moe aux loss", 0.0)
        assert math.isclose(x["total loss"], x["lm loss"] + x["mtp-weight"] * x["mtp_1 loss"] + aux,
                            rel_tol=1e-5, abs_tol=1e-6)
    assert all(x["lr"] == r.lr for x in h[1:8]) and h[8]["lr"] < r.lr


def test_debug_recipe_unchanged():
    r = RECIPES["debug"]
    assert (r.lr_schedule, r.mtp_weight_after_decay, r.curriculum, r.sft, r.init) == ("cosine", None, None,
                                                                                      False, None)
    assert [lr_for(r, s) for s in range(1, 13)] == [__import__("dsv4.harness.train.optim", fromlist=["lr_at"]).lr_at(
        s, r.lr, r.warmup, r.steps, r.min_lr) for s in range(1, 13)]


def test_stage_at():
    st = get_curriculum("debug-long")
    assert total_steps(st) == 10
    got = [(stage_at(st, k)[0], stage_at(st, k)[2]) for k in range(1, 11)]
    assert got == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (3, 0), (3, 1)]
    p = get_curriculum("proxy-long")
    assert [s.seq_len for s in p] == [4096, 16384, 65536, 65536]
    assert [s.indexer_loss_mode for s in p] == ["dense", "dense", "dense", "sparse"]


class _Recorder:
    """model_factory recording (row length, indexer mode) of every training forward."""

    def __init__(self):
        self.seen = []

    def __call__(self, cfg):
        model = build_model(cfg)
        fwd = model.forward
        rec = self.seen

        def forward(ids, *a, **k):
            rec.append((ids.shape[1], model.cfg.indexer_loss_mode))
            return fwd(ids, *a, **k)
        model.forward = forward   # a test spy on one instance (model code is untouched)
        return model


def test_curriculum_switches_and_resumes_exactly(tmp_path):
    torch.set_num_threads(1)
    r = replace(RECIPES["long-debug"], save_interval=3)
    rec = _Recorder()
    train(r, str(tmp_path / "a"), seed=3, progress=False, model_factory=rec)
    h = _hist(tmp_path / "a")
    assert [x["seq-len"] for x in h] == [32.0] * 3 + [64.0] * 3 + [128.0] * 4
    assert rec.seen == [(32, "dense")] * 3 + [(64, "dense")] * 3 + [(128, "dense")] * 2 + [(128, "sparse")] * 2
    assert all("indexer loss" in x for x in h)
    full = [x["lm loss"] for x in h]
    for k in (3, 6, 9):                         # 3 and 6: the last step of a stage; 9: inside the sparse stage
        rec2 = _Recorder()
        res = train(r, str(tmp_path / f"r{k}"), seed=3, progress=False, model_factory=rec2,
                    resume=str(tmp_path / "a" / "checkpoints" / f"step_{k:06d}"))
        assert res["lm loss"] == [round(v, 5) for v in full], k          # history + replayed steps
        assert [x["lm loss"] for x in _hist(tmp_path / f"r{k}")] == full[k:], k
        assert rec2.seen == rec.seen[k:], k
