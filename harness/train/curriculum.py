"""Long-context curriculum (issue 18, slice X4): recipe stages that raise the sequence length, with DSv4's
attention stage change (spec §10.4: 4K -> 16K -> 64K -> 1M; dense attention first, sparse attention from the
64K stage after a short lightning-indexer warm-up).

A stage = (name, steps, seq_len, indexer_loss_mode). Every step of a stage packs whole documents (P7
scheduler, harness/train/packing.py; documents longer than the row are cut into chunks) into one THD row of
`seq_len` tokens; the model's `indexer_loss_mode` is set per step:
    "dense"   CSA attends ALL visible compressed entries (no top-k; Megatron's csa_dense_mode) and the indexer
              is trained by its KL loss against that attention (its warm-up);
    "sparse"  CSA attends the indexer's top-k entries; the KL is restricted to the selected set.
The YaRN settings are fixed by the config (factor 16 over 65536 original positions = 1M).

Determinism / resume: step k of the run belongs to the stage whose cumulative step range holds k; the batch is
the (k - stage start)-th packed row of that stage's own seeded order (seed + 1009 * stage index), a pure
function of (seed, k), and the stage's mode is applied before each step -- resuming at any step, across a
stage switch included, replays the run exactly (slices/X4/test_curriculum.py).

Data per stage (the report does not give it): the same corpus in every stage, re-packed at the stage's row
length; long-document up-sampling is left to the user's corpus (`--text`).

Stages (steps are per run of the named recipe):
    debug-long  CPU test: 32 -> 64 -> 128 (dense) -> 128 (sparse), debug config
    proxy-long  one H200, proxy config, bf16 + recompute: 4K dense, 16K dense, 64K dense (indexer warm-up),
                64K sparse                                                    (not run here: GPU time reserved)
    proxy-64k   the 64K stage alone for a few steps (2 dense + 4 sparse; harness/device/final_h200.sh train)
Plan beyond 64K to 1M (Flash; written, not run): 128K sparse, 256K sparse with context parallelism (CP 4,
model/context_parallel.py: each rank a 64K chunk plus its halo and the gathered compressed entries), 1M sparse
with CP 16 over two nodes (64K tokens per rank, the measured per-rank size of the 64K stage); batch size in
tokens kept near the pretraining value by lowering the number of rows as seq_len grows; the sparse stage's
top-k (512) and the compressed-entry budget per row (1M / 4 = 262144 CSA entries, 8192 HCA entries) fixed by
the config.
"""
from __future__ import annotations

from dataclasses import dataclass


class CurriculumError(ValueError):
    """A bad curriculum (one line)."""


@dataclass(frozen=True)
class Stage:
    name: str
    steps: int
    seq_len: int
    indexer_loss_mode: str = "sparse"


CURRICULA = {
    "debug-long": (Stage("s32-dense", 3, 32, "dense"), Stage("s64-dense", 3, 64, "dense"),
                   Stage("s128-indexer-warmup", 2, 128, "dense"), Stage("s128-sparse", 2, 128, "sparse")),
    "proxy-long": (Stage("4k-dense", 40, 4096, "dense"), Stage("16k-dense", 20, 16384, "dense"),
                   Stage("64k-indexer-warmup", 5, 65536, "dense"), Stage("64k-sparse", 10, 65536, "sparse")),
    # the 64K stage alone, a few steps (harness/device/final_h200.sh train): dense warm-up, then sparse
    "proxy-64k": (Stage("64k-indexer-warmup", 2, 65536, "dense"), Stage("64k-sparse", 4, 65536, "sparse")),
}


def get_curriculum(name: str) -> tuple[Stage, ...]:
    if name not in CURRICULA:
        raise CurriculumError(f"train.curriculum: unknown {name!r}; known: {', '.join(CURRICULA)}")
    for s in CURRICULA[name]:
        if s.steps < 1 or s.seq_len < 1 or s.indexer_loss_mode not in ("dense", "sparse", "off"):
            raise CurriculumError(f"train.curriculum: bad stage {s}")
    return CURRICULA[name]


def total_steps(stages) -> int:
    return sum(s.steps for s in stages)


def stage_at(stages, step: int) -> tuple[int, Stage, int]:
    """1-based run step -> (stage index, stage, 0-based step inside the stage); past the end: the last stage."""
    start = 0
    for i, s in enumerate(stages):
        if step <= start + s.steps:
            return i, s, step - start - 1
        start += s.steps
    i = len(stages) - 1
    return i, stages[i], step - (start - stages[i].steps) - 1


class CurriculumSource:
    """batch(k) (0-based run step) -> the packed row of the stage that step belongs to (harness/train/loop.py's
    PackedSource per stage)."""

    def __init__(self, data, stages, seed: int, packed_source_cls):
        self.stages = stages
        self.sources = [packed_source_cls(data, s.seq_len, seed + 1009 * i) for i, s in enumerate(stages)]

    def stage(self, step: int) -> Stage:
        return stage_at(self.stages, step)[1]

    def batch(self, k: int) -> dict:
        i, _, j = stage_at(self.stages, k + 1)
        return self.sources[i].batch(j)
