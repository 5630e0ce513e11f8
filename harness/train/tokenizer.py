"""Tokenizers for generation and SFT: the project's byte-level tokenizer (default; harness/train/data.py) or one
built from a file the user gives (no hub access): a Hugging Face `tokenizers` JSON file (tokenizer.json).

Both expose encode(text) -> np.int64 ids, decode(ids) -> str, vocab_size, eod (the end-of-document id).
"""
from __future__ import annotations

import os

import numpy as np

from dsv4.harness.train.data import ByteTokenizer, DataError


class FileTokenizer:
    """A `tokenizers` JSON file. eod: the id of `eod_token` (default: the first of </s>, <|endoftext|>,
    <｜end▁of▁sentence｜> found in the vocabulary, else 0)."""

    def __init__(self, path: str, eod_token: str | None = None):
        try:
            from tokenizers import Tokenizer
        except ImportError as e:                                            # pragma: no cover
            raise DataError(f"tokenizer: {path!r} needs the `tokenizers` package ({e})") from None
        if not os.path.isfile(path):
            raise DataError(f"tokenizer: no such file {path!r}")
        try:
            self.tok = Tokenizer.from_file(path)
        except Exception as e:  # noqa: BLE001 - any parse failure is bad input
            raise DataError(f"tokenizer: cannot read {path!r}: {str(e).splitlines()[0]}") from None
        self.vocab_size = self.tok.get_vocab_size()
        cands = [eod_token] if eod_token else ["</s>", "<|endoftext|>", "<｜end▁of▁sentence｜>"]
        ids = [self.tok.token_to_id(t) for t in cands if t is not None]
        ids = [i for i in ids if i is not None]
        if eod_token and not ids:
            raise DataError(f"tokenizer: eod token {eod_token!r} is not in {path!r}")
        self.eod = ids[0] if ids else 0

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids])


def load_tokenizer(path: str | None = None, eod_token: str | None = None):
    """None -> ByteTokenizer (ids 0..255, EOD 0); a tokenizer.json path -> FileTokenizer."""
    return ByteTokenizer() if not path else FileTokenizer(path, eod_token)
