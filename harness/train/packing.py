"""Fixed, dp-balanced THD packing scheduler (slice P7; Megatron `sequence_packing_scheduler=dp_balanced`).

Variable-length documents are packed, for every step, into one fixed-size THD micro-batch per data-parallel
rank (`tokens_per_rank` slots, Megatron's `max_seqlen_per_dp_cp_rank`). Each packed micro-batch carries
`cu_seqlens` (real lengths) and `cu_seqlens_padded` (each sequence padded to `align`, Megatron's
`pad_packed_seq_alignment`; the tail up to the fixed size is either given to the last sequence,
`extend_last`, or to a dummy sequence, `append_dummy_seq` -- Megatron's `thd_tail_padding_policy`).

Algorithm (deterministic; no randomness at all):
  1. Documents longer than `tokens_per_rank` are cut into chunks of at most that many tokens (nothing is
     dropped: every chunk is a sequence of its own, positions restart at 0).
  2. Queue = chunks in document order. For a step, a look-ahead window takes queue entries from the front until
     their padded lengths sum to `lookahead` x the step's capacity (dp_size * tokens_per_rank).
  3. Longest-processing-time first: the window is sorted by (-padded length, queue position) and each sequence
     goes to the least-loaded rank (ties: lowest rank) where it fits; sequences that fit nowhere stay in the
     queue, in their original order, for the next step.
  Progress: with all ranks empty the longest window entry always fits (chunks <= tokens_per_rank).

Balance is reported as max / mean real tokens per rank (1.0 = perfect) per step.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


class PackingError(ValueError):
    """Bad packing input; one line naming the field."""


@dataclass(frozen=True)
class Seq:
    doc: int        # document index
    start: int      # first token of the chunk inside the document
    length: int     # real tokens


@dataclass
class PackedMicroBatch:
    step: int
    rank: int
    capacity: int
    segments: list = field(default_factory=list)       # [Seq]
    cu_seqlens: np.ndarray | None = None                # int32 [n+1], real lengths
    cu_seqlens_padded: np.ndarray | None = None         # int32 [n(+1)+1], padded; last entry == capacity
    max_seqlen: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(s.length for s in self.segments)


def _pad(n: int, align: int) -> int:
    return -(-n // align) * align


def schedule(lengths, dp_size: int, tokens_per_rank: int, align: int = 1, lookahead: float = 2.0,
             tail: str = "extend_last") -> list[list[PackedMicroBatch]]:
    """Pack documents of `lengths` into steps x dp_size fixed micro-batches (see module docstring)."""
    lengths = [int(x) for x in lengths]
    if dp_size < 1:
        raise PackingError(f"schedule.dp_size: must be >= 1, got {dp_size}")
    if align < 1:
        raise PackingError(f"schedule.align: must be >= 1, got {align}")
    if tokens_per_rank < align or tokens_per_rank % align:
        raise PackingError(f"schedule.tokens_per_rank: must be a positive multiple of align {align}, "
                           f"got {tokens_per_rank}")
    if tail not in ("extend_last", "append_dummy_seq"):
        raise PackingError(f"schedule.tail: must be extend_last|append_dummy_seq, got {tail!r}")
    if any(x < 0 for x in lengths):
        raise PackingError("schedule.lengths: negative document length")
    if lookahead < 1:
        raise PackingError(f"schedule.lookahead: must be >= 1, got {lookahead}")

    queue: list[Seq] = []
    for d, n in enumerate(lengths):                                       # 1. chunk long documents
        for s in range(0, n, tokens_per_rank):
            queue.append(Seq(d, s, min(tokens_per_rank, n - s)))
    cap_step = dp_size * tokens_per_rank
    steps: list[list[PackedMicroBatch]] = []
    while queue:
        window, total = [], 0                                             # 2. look-ahead window
        for q in queue:
            if total >= lookahead * cap_step:
                break
            window.append(q)
            total += _pad(q.length, align)
        order = sorted(range(len(window)), key=lambda i: (-_pad(window[i].length, align), i))
        loads = [0] * dp_size
        bins: list[list[tuple[int, Seq]]] = [[] for _ in range(dp_size)]
        placed = set()
        for i in order:                                                   # 3. LPT onto least-loaded rank
            need = _pad(window[i].length, align)
            for r in sorted(range(dp_size), key=lambda r: (loads[r], r)):
                if loads[r] + need <= tokens_per_rank:
                    loads[r] += need
                    bins[r].append((i, window[i]))
                    placed.add(i)
                    break
        if not placed:                                                    # cannot happen (see docstring)
            raise PackingError("schedule: no progress (internal error)")
        queue = [q for i, q in enumerate(window) if i not in placed] + queue[len(window):]
        step = len(steps)
        steps.append([_finish(step, r, sorted(bins[r]), tokens_per_rank, align, tail) for r in range(dp_size)])
    return steps


def _finish(step, rank, placed, capacity, align, tail) -> PackedMicroBatch:
    segs = [s for _, s in placed]                                         # queue order inside the rank
    real = np.array([0] + [s.length for s in segs], dtype=np.int64)
    padded = np.array([0] + [_pad(s.length, align) for s in segs], dtype=np.int64)
    cu = np.cumsum(real).astype(np.int32)
    cup = np.cumsum(padded)
    if cup[-1] < capacity:
        if tail == "extend_last" and len(segs):
            cup[-1] = capacity
        else:
            cup = np.append(cup, capacity)                               # a dummy sequence of pad tokens
    mb = PackedMicroBatch(step, rank, capacity, segs, cu, cup.astype(np.int32),
                          int(max([s.length for s in segs], default=0)))
    return mb


def materialize(mb: PackedMicroBatch, dataset, pad_id: int = 0, ignore_index: int = -100) -> dict:
    """Token tensors of one packed micro-batch: tokens / labels / position_ids [capacity] (numpy int64).

    Sequence i occupies slots [cu_seqlens_padded[i], cu_seqlens_padded[i] + len_i); labels are the next token
    inside the sequence, `ignore_index` on each sequence's last token and on padding.
    """
    tokens = np.full(mb.capacity, pad_id, dtype=np.int64)
    labels = np.full(mb.capacity, ignore_index, dtype=np.int64)
    pos = np.zeros(mb.capacity, dtype=np.int64)
    for i, s in enumerate(mb.segments):
        o = int(mb.cu_seqlens_padded[i])
        t = np.asarray(dataset[s.doc])[s.start:s.start + s.length]
        tokens[o:o + s.length] = t
        labels[o:o + s.length - 1] = t[1:]
        pos[o:o + s.length] = np.arange(s.length)
    return {"tokens": tokens, "labels": labels, "position_ids": pos, "cu_seqlens": mb.cu_seqlens,
            "cu_seqlens_padded": mb.cu_seqlens_padded, "max_seqlen": mb.max_seqlen}


class EpochSchedule:
    """Packed steps over shuffled epochs, one rank (the training sources of dsv4 train and the SFT recipe):
    epoch e orders the n items by a permutation seeded from (seed, salt, e) and packs their lengths into rows of
    `capacity` tokens (`schedule`); step k (0-based) walks the epochs in turn. Only the current epoch's schedule
    is kept. `step(k)` -> (order, micro-batch); a segment's `doc` indexes `order`."""

    def __init__(self, lengths, capacity: int, seed: int, salt: int):
        self.lengths = [int(n) for n in lengths]
        self.capacity, self.seed, self.salt = capacity, seed, salt
        self._epoch: tuple | None = None                 # (e, order, steps)

    def epoch(self, e: int) -> tuple[np.ndarray, list]:
        if self._epoch is None or self._epoch[0] != e:
            rs = np.random.RandomState((self.seed * 1_000_003 + 7919 * e + self.salt) % 2**32)
            order = rs.permutation(len(self.lengths))
            steps = schedule([self.lengths[i] for i in order], dp_size=1, tokens_per_rank=self.capacity)
            self._epoch = (e, order, steps)
        return self._epoch[1], self._epoch[2]

    def step(self, k: int) -> tuple[np.ndarray, PackedMicroBatch]:
        e = 0
        while True:
            order, steps = self.epoch(e)
            if k < len(steps):
                return order, steps[k][0]
            k -= len(steps)
            e += 1


def imbalance(steps: list[list[PackedMicroBatch]]) -> dict:
    """max / mean real tokens per rank, per step; summary over all steps and over all but the last step."""
    per_step = []
    for ranks in steps:
        loads = [mb.num_tokens for mb in ranks]
        mean = sum(loads) / len(loads)
        per_step.append(max(loads) / mean if mean else 1.0)
    body = per_step[:-1] or per_step
    fill = [sum(mb.num_tokens for mb in ranks) / sum(mb.capacity for mb in ranks) for ranks in steps]
    return {"steps": len(steps), "max_over_mean": per_step, "worst": max(per_step),
            "worst_excl_last": max(body), "mean_excl_last": sum(body) / len(body),
            "fill_excl_last": sum(fill[:-1] or fill) / len(fill[:-1] or fill)}
