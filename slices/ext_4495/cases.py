"""ext #4495 golden cases: MTP inputs / labels rolled inside each document with padded offsets (exact ints)."""
import torch

from dsv4.harness.cases import golden_case


@golden_case("mtp_roll_padded_thd")
def mtp_roll_padded_thd():
    """Documents [5, 1, 7, 2, 4] in padded slots [8, 4, 8, 2, 6] (+2 trailing pad tokens)."""
    from dsv4.model import mtp_roll
    cu, cup = torch.tensor([0, 5, 6, 13, 15, 19]), torch.tensor([0, 8, 12, 20, 22, 28])
    ids = (torch.arange(30) * 37 + 11) % 251
    labels = torch.where(torch.arange(30) % 5 == 4, torch.tensor(-100), (torch.arange(30) * 13 + 5) % 251)
    ids_next, mtp_labels = mtp_roll.mtp_inputs(ids[None], labels[None], cu, cup)
    return {"ids_next": ids_next, "mtp_labels": mtp_labels}
