"""Supervised fine-tuning data (issue 18, extension slice X5): chat JSONL -> token ids + assistant-only loss
mask -> packed THD rows from the P7 scheduler (harness/train/packing.py). Recipe layer only: the model and the loop
are the pretraining ones (`dsv4 train --recipe sft-debug [--sft-data chats.jsonl] [--tokenizer tok.json]
[--init CKPT]`, harness/train/loop.py).

Input: one conversation per line, `{"messages": [{"role": "system"|"user"|"assistant", "content": "..."}]}`.
Chat format (plain text, so the byte-level tokenizer needs no special ids; a user tokenizer file tokenises the
same text):
    <|system|>\\n{content}<|end|>\\n  <|user|>\\n{content}<|end|>\\n  <|assistant|>\\n{content}<|end|>\\n ... EOD
Loss mask: the TARGETS that are assistant content, the assistant's `<|end|>\\n` (so the model learns to stop)
and the final EOD after an assistant turn. Labels follow Megatron (labels[t] = target of position t = token
t+1, model/model.py's IGNORE = -100 elsewhere): labels[t] = ids[t+1] if token t+1 is trained, else -100.
Role headers, system and user turns are inputs only.

Packing: conversations are shuffled per epoch from (seed, epoch) and packed whole (a conversation longer than
the row is cut into chunks, each its own document, as P7 does) into rows of `capacity` tokens with
cu_seqlens / cu_seqlens_padded; the model is document-local on that layout, so a packed row trains exactly
as its conversations run one by one (slices/X5/test_sft.py). Step k is a pure function of (seed, k): resume
is exact.
"""
from __future__ import annotations

import json
import os

import numpy as np

from dsv4.harness.train.data import DataError
from dsv4.harness.train.packing import EpochSchedule

IGNORE = -100
ROLES = ("system", "user", "assistant")
END = "<|end|>\n"


def header(role: str) -> str:
    return f"<|{role}|>\n"


def encode_chat(messages: list[dict], tok) -> tuple[np.ndarray, np.ndarray]:
    """-> (ids [n] int64, trained [n] bool: the token is a target the loss sees)."""
    ids, train = [], []
    for m in messages:
        for text, t in ((header(m["role"]), False), (m["content"] + END, m["role"] == "assistant")):
            e = tok.encode(text)
            ids.append(e)
            train.append(np.full(len(e), t))
    last_assistant = bool(messages) and messages[-1]["role"] == "assistant"
    ids.append(np.array([tok.eod], dtype=np.int64))
    train.append(np.array([last_assistant]))
    return np.concatenate(ids).astype(np.int64), np.concatenate(train).astype(bool)


def labels_for(ids: np.ndarray, trained: np.ndarray) -> np.ndarray:
    """labels[t] = ids[t+1] where token t+1 is trained, IGNORE elsewhere (and on the last token)."""
    lab = np.full(len(ids), IGNORE, dtype=np.int64)
    lab[:-1] = np.where(trained[1:], ids[1:], IGNORE)
    return lab


def _check(messages, where: str) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: 'messages' must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: message {i} needs role in {'|'.join(ROLES)} and a string content")
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: no assistant turn (nothing to train on)")
    return messages


def read_chat_jsonl(path: str) -> list[list[dict]]:
    if not os.path.isfile(path):
        raise DataError(f"sft_data: no such file {path!r}")
    convs = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"sft_data: {path}:{n}: not JSON ({e.msg})") from None
            convs.append(_check(doc.get("messages") if isinstance(doc, dict) else None, f"sft_data: {path}:{n}"))
    if not convs:
        raise DataError(f"sft_data: {path!r} holds no conversation")
    return convs


def synthetic_chats(n: int = 256, seed: int = 0) -> list[list[dict]]:
    """The default offline SFT set: arithmetic questions with exact answers (learnable, deterministic)."""
    rs = np.random.RandomState(seed)
    out = []
    for _ in range(n):
        a, b = int(rs.randint(0, 100)), int(rs.randint(0, 100))
        op = "+-"[int(rs.randint(0, 2))]
        r = a + b if op == "+" else a - b
        conv = [{"role": "user", "content": f"What is {a} {op} {b}?"},
                {"role": "assistant", "content": f"{a} {op} {b} = {r}."}]
        if rs.rand() < 0.3:
            conv = [{"role": "system", "content": "Answer briefly."}] + conv
        if rs.rand() < 0.3:
            c = int(rs.randint(0, 10))
            conv += [{"role": "user", "content": f"And times {c}?"},
                     {"role": "assistant", "content": f"{r} * {c} = {r * c}."}]
        out.append(conv)
    return out


class SFTSource:
    """Packed SFT rows: batch(k) -> the dict harness/train/packing.materialize returns (tokens, labels, cu_seqlens,
    cu_seqlens_padded, position_ids), with the assistant-only labels."""

    def __init__(self, convs: list[list[dict]], tok, capacity: int, seed: int):
        self.enc = [encode_chat(c, tok) for c in convs]
        self.capacity = capacity
        self.epochs = EpochSchedule([len(ids) for ids, _ in self.enc], capacity, seed, salt=3)

    def batch(self, k: int) -> dict:
        order, mb = self.epochs.step(k)
        return self.materialize(mb, order)

    def materialize(self, mb, order) -> dict:
        tokens = np.zeros(mb.capacity, dtype=np.int64)
        labels = np.full(mb.capacity, IGNORE, dtype=np.int64)
        pos = np.zeros(mb.capacity, dtype=np.int64)
        for i, s in enumerate(mb.segments):
            o = int(mb.cu_seqlens_padded[i])
            ids, trained = self.enc[int(order[s.doc])]
            ids, trained = ids[s.start:s.start + s.length], trained[s.start:s.start + s.length]
            tokens[o:o + s.length] = ids
            labels[o:o + s.length] = labels_for(ids, trained)                 # a chunk's last token: IGNORE
            pos[o:o + s.length] = np.arange(s.length)
        return {"tokens": tokens, "labels": labels, "position_ids": pos, "cu_seqlens": mb.cu_seqlens,
                "cu_seqlens_padded": mb.cu_seqlens_padded, "max_seqlen": mb.max_seqlen}
