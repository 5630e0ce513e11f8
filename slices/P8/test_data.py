"""P8: byte-level raw-text dataset in Megatron's indexed format; seeded mock variable-length dataset."""
import os

import numpy as np
import pytest

from dsv4.harness.train.data import (EOD, ByteTokenizer, DataError, GPTSamples, IndexedTokens, MockVarlenDataset,
                               build_text_dataset, stdlib_documents, write_indexed)
from dsv4.harness.train.packing import materialize, schedule


def test_megatron_reads_our_files_and_writes_identical_bytes(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
    import torch
    docs = [np.array([1, 2, 3]), np.array([65535, 0]), np.array([7]), np.arange(1, 300) % 251]
    ours = str(tmp_path / "ours")
    write_indexed(ours, docs, dtype=np.uint16)
    ds = IndexedDataset(ours)                                          # Megatron's reader
    assert len(ds) == len(docs)
    for i, d in enumerate(docs):
        assert np.array_equal(ds[i], d.astype(np.uint16))
    assert np.array_equal(ds.sequence_lengths, [3, 2, 1, 299])
    assert np.array_equal(ds.document_indices, [0, 1, 2, 3, 4])
    theirs = str(tmp_path / "theirs")
    b = IndexedDatasetBuilder(theirs + ".bin", dtype=np.uint16)        # Megatron's writer
    for d in docs:
        b.add_document(torch.from_numpy(d.astype(np.int64)), [len(d)])
    b.finalize(theirs + ".idx")
    for ext in (".bin", ".idx"):
        assert open(ours + ext, "rb").read() == open(theirs + ext, "rb").read(), ext
    mine = IndexedTokens(theirs)                                       # our reader on Megatron's files
    assert [mine[i].tolist() for i in range(len(mine))] == [d.tolist() for d in docs]


def test_stdlib_corpus_byte_tokens_roundtrip(tmp_path):
    docs = stdlib_documents()
    assert len(docs) > 300
    lens = sorted(len(d) for d in docs)
    assert lens[0] < 200 < 2000 < lens[-1]                             # real, variable-length documents
    tok = ByteTokenizer()
    for d in docs[:50] + ["héllo wörld ✓\n"]:
        ids = tok.encode(d)
        assert ids.min() > EOD and ids.max() < 256
        assert tok.decode(ids) == d
        assert np.array_equal(ids, np.frombuffer(d.encode("utf-8"), dtype=np.uint8))
    info = build_text_dataset(str(tmp_path / "c"), docs[:40])
    ds = IndexedTokens(str(tmp_path / "c"))
    assert info["documents"] == len(ds) == 40 and info["tokenizer"] == "byte"
    assert all(tok.decode(ds[i]) == docs[i] for i in range(40))
    assert info["tokens"] == sum(len(d.encode()) for d in docs[:40])


def test_gpt_samples_shifted_seeded_and_positional(tmp_path):
    docs = [np.arange(1, 1 + n) for n in (5, 9, 13, 30)]
    write_indexed(str(tmp_path / "s"), docs)
    s = GPTSamples(IndexedTokens(str(tmp_path / "s")), seq_len=7, seed=3)
    stream = np.concatenate([np.append(d, EOD) for d in docs])        # oracle stream
    x, y = s.batch(0, 3)
    assert x.shape == y.shape == (3, 7)
    for row_x, row_y in zip(x, y):
        j = next(k for k in range(s.n) if np.array_equal(stream[k * 7:k * 7 + 7], row_x))
        assert np.array_equal(row_y, stream[j * 7 + 1:j * 7 + 8])
    # the batch at a position is a pure function of (seed, consumed): resuming is exact
    big_x, _ = s.batch(0, 2 * s.n + 3)
    x2, _ = s.batch(s.n + 1, 4)
    assert np.array_equal(big_x[s.n + 1:s.n + 5], x2)
    # every epoch is a permutation of all samples
    assert sorted(s.order(0).tolist()) == list(range(s.n)) and not np.array_equal(s.order(0), s.order(1))
    with pytest.raises(DataError, match="seq_len"):
        GPTSamples(IndexedTokens(str(tmp_path / "s")), seq_len=10_000, seed=0)


def test_mock_varlen_seeded_lengths():
    a = MockVarlenDataset(num_docs=4000, mean_len=64, sigma=0.8, min_len=3, max_len=500, seed=11)
    b = MockVarlenDataset(num_docs=4000, mean_len=64, sigma=0.8, min_len=3, max_len=500, seed=11)
    c = MockVarlenDataset(num_docs=4000, mean_len=64, sigma=0.8, min_len=3, max_len=500, seed=12)
    assert np.array_equal(a.lengths, b.lengths) and not np.array_equal(a.lengths, c.lengths)
    assert np.array_equal(a[17], b[17]) and len(a[17]) == a.lengths[17]
    assert a.lengths.min() >= 3 and a.lengths.max() <= 500
    assert abs(a.lengths.mean() - 64) < 4                              # log-normal with mean 64
    assert len(set(a.lengths.tolist())) > 100                          # truly variable
    assert a[0].min() >= 1 and a[0].max() < 256                        # 0 is EOD
    for kw, f in [(dict(num_docs=0), "num_docs"), (dict(num_docs=3, min_len=5, max_len=4), "min_len")]:
        with pytest.raises(DataError, match=f):
            MockVarlenDataset(**kw)


def test_mock_feeds_the_packer():
    ds = MockVarlenDataset(num_docs=50, mean_len=30, seed=1)
    steps = schedule(ds.lengths, dp_size=2, tokens_per_rank=128, align=2)
    got = sum(materialize(mb, ds)["cu_seqlens"][-1] for r in steps for mb in r)
    assert got == ds.lengths.sum()
