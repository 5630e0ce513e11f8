"""P7 golden case: the packing schedule of a seeded mock dataset (integers compared exactly)."""
import torch

from dsv4.harness.cases import golden_case


@golden_case("dp_balanced_schedule", tol={"worst_excl_last": (0, 1e-12), "fill_excl_last": (0, 1e-12)})
def dp_balanced_schedule():
    """300 log-normal documents -> 4 ranks x 512 tokens (align 8): cu_seqlens of every micro-batch, balance."""
    from dsv4.harness.train.data import MockVarlenDataset
    from dsv4.harness.train.packing import imbalance, schedule
    ds = MockVarlenDataset(num_docs=300, mean_len=60, max_len=700, seed=5)
    steps = schedule(ds.lengths, dp_size=4, tokens_per_rank=512, align=8)
    cu = [int(x) for r in steps for mb in r for x in mb.cu_seqlens.tolist() + [-1]]
    cup = [int(x) for r in steps for mb in r for x in mb.cu_seqlens_padded.tolist() + [-1]]
    docs = [s.doc for r in steps for mb in r for s in mb.segments]
    im = imbalance(steps)
    return {"cu_seqlens": torch.tensor(cu), "cu_seqlens_padded": torch.tensor(cup), "docs": torch.tensor(docs),
            "steps": len(steps), "worst_excl_last": float(im["worst_excl_last"]),
            "fill_excl_last": float(im["fill_excl_last"])}
