"""Recipe schedules (issue 18, slice X4): learning rate (warm-up + cosine, or warm-up-stable-decay) and the
DSv4 MTP loss weight, 0.3 until the LR decay starts and 0.1 from then on (spec §10.2, "same as V3").

    cosine: linear warm-up to the peak over `warmup` steps, then cosine to min_lr at `total` (harness/train/optim.lr_at):
            the decay starts right after the warm-up (decay start D = warmup).
    wsd:    linear warm-up, constant peak until step D = `decay_start`, then cosine to min_lr at `total`.
The MTP weight is opt-in (`mtp_weight_after_decay`, e.g. 0.1): steps <= D use the config's
`mtp_loss_scaling_factor` (0.3), steps > D (the first step whose LR is below the peak) the lower weight.
Recipes without it keep the config's constant weight, so the stored debug / tiny curves do not move.
"""
from __future__ import annotations

import math

from dsv4.harness.train.optim import lr_at


class ScheduleError(ValueError):
    """A bad schedule setting (one line)."""


def decay_start(recipe) -> int:
    if recipe.lr_schedule == "cosine":
        return recipe.warmup
    if recipe.lr_schedule == "wsd":
        if not recipe.warmup <= recipe.decay_start <= recipe.steps:
            raise ScheduleError(f"train.decay_start: must be in [warmup {recipe.warmup}, steps {recipe.steps}] "
                                f"for lr_schedule 'wsd', got {recipe.decay_start}")
        return recipe.decay_start
    raise ScheduleError(f"train.lr_schedule: must be cosine|wsd, got {recipe.lr_schedule!r}")


def lr_for(recipe, step: int) -> float:
    """LR of 1-based `step`."""
    if recipe.lr_schedule == "cosine":
        return lr_at(step, recipe.lr, recipe.warmup, recipe.steps, recipe.min_lr)
    D = decay_start(recipe)
    if step <= recipe.warmup:
        return recipe.lr * step / max(recipe.warmup, 1)
    if step <= D:
        return recipe.lr
    if step >= recipe.steps:
        return recipe.min_lr
    frac = (step - D) / max(recipe.steps - D, 1)
    return recipe.min_lr + 0.5 * (recipe.lr - recipe.min_lr) * (1 + math.cos(math.pi * frac))


def mtp_weight_for(recipe, step: int, base: float) -> float:
    """The MTP loss weight of 1-based `step` (base = the config's mtp_loss_scaling_factor)."""
    if recipe.mtp_weight_after_decay is None:
        return base
    return base if step <= decay_start(recipe) else recipe.mtp_weight_after_decay
