"""Data for DSv4 training (slice P8): raw text -> byte tokens -> Megatron indexed dataset; a mock varlen set.

Tokenizer: BYTE-LEVEL (token id = UTF-8 byte value, 0..255). Why: it works offline on any machine, is exactly
deterministic, needs no training step and no vocabulary file, round-trips every text losslessly, and fits every
named config (debug has vocab 256, tiny 512; ids >= 256 are simply unused). Token 0 (NUL, which never occurs in
the text files we read: NUL bytes are removed) is the end-of-document marker `EOD`.

Default corpus: text that exists offline wherever Python runs -- a fixed list of pure-Python modules of the
standard library under `sysconfig.get_paths()["stdlib"]`, each file split into documents at its top-level
blank-line pairs (PEP 8 puts two blank lines between top-level definitions), so documents have real,
variable lengths. The corpus sha256 is recorded in provenance (the stdlib text differs between Python versions,
so a golden made from it names the corpus hash).

Storage: Megatron-Core's indexed format (`.bin` tokens + `.idx` index), written by our own writer (documented
below) and read by our own memmap reader, so the training loop never imports megatron; the P8 tests prove
`megatron.core.datasets.indexed_dataset.IndexedDataset` reads our files and that Megatron's
`IndexedDatasetBuilder` writes byte-identical ones.

.idx layout (megatron/core/datasets/indexed_dataset.py, `_IndexWriter`), little-endian:
    b"MMIDIDX\\x00\\x00" | u64 version=1 | u8 dtype code | u64 sequence_count | u64 document_count
    | i32 sequence_lengths[sequence_count] | i64 sequence_pointers[sequence_count] (byte offsets into .bin)
    | i64 document_indices[document_count]  (0, then the end sequence index of each document)
"""
from __future__ import annotations

import hashlib
import os
import struct
import sysconfig
from dataclasses import dataclass

import numpy as np

EOD = 0
INDEX_HEADER = b"MMIDIDX\x00\x00"
DTYPE_CODES = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5, np.float64: 6, np.float32: 7,
               np.uint16: 8}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}

STDLIB_MODULES = ("abc", "argparse", "ast", "base64", "bisect", "calendar", "colorsys", "contextlib", "copy",
                  "csv", "dataclasses", "difflib", "enum", "fnmatch", "fractions", "functools", "glob", "heapq",
                  "hmac", "keyword", "linecache", "numbers", "operator", "pprint", "queue", "random", "shlex",
                  "statistics", "string", "textwrap", "tokenize", "typing")


class DataError(ValueError):
    """Bad data input; one line naming the field."""


# ----------------------------------------------------------------------------------------------- tokenizer
class ByteTokenizer:
    """UTF-8 bytes as tokens; `EOD` (0) ends a document."""
    vocab_size = 256
    eod = EOD

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8").replace(b"\x00", b""), dtype=np.uint8).astype(np.int64)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 < int(i) < 256).decode("utf-8", errors="replace")


# ----------------------------------------------------------------------------------------------- corpus
def stdlib_documents(modules=STDLIB_MODULES) -> list[str]:
    """The default offline corpus: stdlib module sources split at top-level double blank lines."""
    root = sysconfig.get_paths()["stdlib"]
    docs = []
    for m in modules:
        path = os.path.join(root, m + ".py")
        if not os.path.exists(path):
            raise DataError(f"corpus: stdlib module {m!r} not found under {root}")
        with open(path, encoding="utf-8") as f:
            text = f.read()
        docs += [d.strip("\n") + "\n" for d in text.split("\n\n\n") if d.strip()]
    return docs


def text_documents(paths: list[str], errors: str = "strict") -> list[str]:
    """User text files (UTF-8); one document per blank-line-pair separated block. A file that is not UTF-8 is
    refused naming it and the byte offset (errors="strict"), or decoded with U+FFFD (errors="replace")."""
    if errors not in ("strict", "replace"):
        raise DataError(f"corpus.errors: must be strict|replace, got {errors!r}")
    docs = []
    for p in paths:
        if not os.path.isfile(p):
            raise DataError(f"corpus: no such file {p!r}")
        with open(p, "rb") as f:
            raw = f.read()
        try:
            text = raw.decode("utf-8", errors=errors)
        except UnicodeDecodeError as e:
            raise DataError(f"corpus: {p}: not UTF-8 at byte offset {e.start} ({e.reason}: "
                            f"{raw[e.start:e.start + 4]!r}); re-encode it or pass --errors replace") from None
        text = text.replace("\r\n", "\n").replace("\r", "\n")             # as text-mode reading did
        docs += [d.strip("\n") + "\n" for d in text.split("\n\n\n") if d.strip()]
    if not docs:
        raise DataError("corpus: the given files hold no text")
    return docs


# ----------------------------------------------------------------------------------------------- indexed format
def write_indexed(prefix: str, docs: list[np.ndarray], dtype=np.uint16) -> None:
    """Write `prefix.bin` / `prefix.idx` in Megatron's indexed format, one sequence per document."""
    dtype = np.dtype(dtype).type
    if dtype not in DTYPE_CODES:
        raise DataError(f"write_indexed.dtype: unsupported {dtype}")
    lengths = np.array([len(d) for d in docs], dtype=np.int32)
    pointers = np.zeros(len(docs), dtype=np.int64)
    if len(docs) > 1:
        pointers[1:] = np.cumsum(lengths[:-1].astype(np.int64)) * np.dtype(dtype).itemsize
    doc_idx = np.arange(len(docs) + 1, dtype=np.int64)
    with open(prefix + ".bin", "wb") as f:
        for d in docs:
            f.write(np.asarray(d).astype(dtype).tobytes(order="C"))
    with open(prefix + ".idx", "wb") as f:
        f.write(INDEX_HEADER)
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", DTYPE_CODES[dtype]))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(lengths.tobytes(order="C"))
        f.write(pointers.tobytes(order="C"))
        f.write(doc_idx.tobytes(order="C"))


class IndexedTokens:
    """Memmap reader of Megatron's indexed format (sequences = documents)."""

    def __init__(self, prefix: str):
        with open(prefix + ".idx", "rb") as f:
            if f.read(9) != INDEX_HEADER:
                raise DataError(f"IndexedTokens: bad header in {prefix}.idx")
            (version,) = struct.unpack("<Q", f.read(8))
            (code,) = struct.unpack("<B", f.read(1))
            (n_seq,) = struct.unpack("<Q", f.read(8))
            (n_doc,) = struct.unpack("<Q", f.read(8))
            off = f.tell()
        if version != 1:
            raise DataError(f"IndexedTokens: version {version} in {prefix}.idx, expected 1")
        self.dtype = CODE_DTYPES[code]
        idx = np.memmap(prefix + ".idx", mode="r", dtype=np.uint8)
        self.lengths = np.frombuffer(idx, dtype=np.int32, count=n_seq, offset=off)
        self.pointers = np.frombuffer(idx, dtype=np.int64, count=n_seq, offset=off + 4 * n_seq)
        self.document_indices = np.frombuffer(idx, dtype=np.int64, count=n_doc, offset=off + 12 * n_seq)
        self.bin = np.memmap(prefix + ".bin", mode="r", dtype=self.dtype)

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i: int) -> np.ndarray:
        start = self.pointers[i] // np.dtype(self.dtype).itemsize
        return np.asarray(self.bin[start:start + self.lengths[i]])


def corpus_sha256(docs: list[str]) -> str:
    h = hashlib.sha256()
    for d in docs:
        h.update(d.encode("utf-8"))
        h.update(b"\x00")
    return h.hexdigest()


def build_text_dataset(prefix: str, docs: list[str] | None = None) -> dict:
    """Tokenise `docs` (default: the stdlib corpus) into `prefix.{bin,idx}`; returns a provenance dict."""
    docs = stdlib_documents() if docs is None else docs
    tok = ByteTokenizer()
    ids = [tok.encode(d) for d in docs]
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    write_indexed(prefix, ids, dtype=np.uint16)
    return {"tokenizer": "byte", "documents": len(docs), "tokens": int(sum(len(i) for i in ids)),
            "corpus_sha256": corpus_sha256(docs)}


# ----------------------------------------------------------------------------------------------- GPT samples
class GPTSamples:
    """Fixed-length samples from the EOD-joined token stream, in a seeded shuffled order, epoch after epoch.

    Sample j of an epoch is stream[j*S : j*S + S + 1] (inputs = [:-1], labels = [1:]). The only state is the
    number of consumed samples, so resuming at `consumed` is exact.
    """

    def __init__(self, data: IndexedTokens, seq_len: int, seed: int):
        if seq_len < 1:
            raise DataError(f"GPTSamples.seq_len: must be >= 1, got {seq_len}")
        parts = []
        for i in range(len(data)):
            parts += [data[i].astype(np.int64), np.array([EOD], dtype=np.int64)]
        self.stream = np.concatenate(parts)
        self.seq_len, self.seed = seq_len, seed
        self.n = (len(self.stream) - 1) // seq_len
        if self.n < 1:
            raise DataError(f"GPTSamples.seq_len: {seq_len} longer than the corpus ({len(self.stream)} tokens)")

    def order(self, epoch: int) -> np.ndarray:
        return np.random.RandomState((self.seed * 1_000_003 + epoch) % 2**32).permutation(self.n)

    def batch(self, consumed: int, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
        """Samples consumed .. consumed + batch_size - 1 -> (input_ids [B,S], labels [B,S]) int64."""
        rows = []
        for k in range(consumed, consumed + batch_size):
            j = self.order(k // self.n)[k % self.n]
            rows.append(self.stream[j * self.seq_len: j * self.seq_len + self.seq_len + 1])
        x = np.stack(rows)                                               # [B, S+1]
        return x[:, :-1].copy(), x[:, 1:].copy()


# ----------------------------------------------------------------------------------------------- mock varlen
@dataclass
class MockVarlenDataset:
    """Documents of seeded random lengths (log-normal, clipped to [min_len, max_len]) and random tokens.

    Deterministic: lengths from `seed`, the tokens of document i from (seed, i). Token ids in [1, vocab_size)
    (0 is EOD).
    """
    num_docs: int
    vocab_size: int = 256
    mean_len: float = 64.0
    sigma: float = 0.8
    min_len: int = 1
    max_len: int = 512
    seed: int = 0

    def __post_init__(self):
        if self.num_docs < 1:
            raise DataError(f"MockVarlenDataset.num_docs: must be >= 1, got {self.num_docs}")
        if not 1 <= self.min_len <= self.max_len:
            raise DataError(f"MockVarlenDataset.min_len: need 1 <= min_len <= max_len, got {self.min_len}, "
                            f"{self.max_len}")
        if self.vocab_size < 2:
            raise DataError(f"MockVarlenDataset.vocab_size: must be >= 2, got {self.vocab_size}")
        rng = np.random.default_rng(self.seed)
        mu = np.log(self.mean_len) - self.sigma ** 2 / 2                  # E[lognormal] = mean_len
        raw = rng.lognormal(mu, self.sigma, size=self.num_docs)
        self.lengths = np.clip(np.rint(raw), self.min_len, self.max_len).astype(np.int64)

    def __len__(self):
        return self.num_docs

    def __getitem__(self, i: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, i])
        return rng.integers(1, self.vocab_size, size=int(self.lengths[i]), dtype=np.int64)
