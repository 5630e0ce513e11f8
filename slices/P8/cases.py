"""P8 golden cases: seeded mock lengths/tokens and the byte tokenizer (integers compared exactly)."""
import torch

from dsv4.harness.cases import golden_case


@golden_case("mock_varlen", tol={"mean_len": (0, 1e-12)})
def mock_varlen():
    """MockVarlenDataset(500 docs, log-normal mean 64, seed 0): lengths and the tokens of document 3."""
    from dsv4.harness.train.data import MockVarlenDataset
    ds = MockVarlenDataset(num_docs=500, mean_len=64, seed=0)
    return {"lengths": torch.from_numpy(ds.lengths.copy()), "doc3": torch.from_numpy(ds[3]),
            "mean_len": float(ds.lengths.mean())}


@golden_case("byte_tokenizer")
def byte_tokenizer():
    """Byte-level ids of a fixed UTF-8 string (EOD = 0 never produced)."""
    from dsv4.harness.train.data import ByteTokenizer
    return {"ids": torch.from_numpy(ByteTokenizer().encode("def f(x):\n    return 'héllo' ✓\n"))}
