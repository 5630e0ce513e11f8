"""P9 golden cases: the contiguous-CP MTP roll, ranks emulated in one process (exact ints)."""
import torch

from dsv4.harness.cases import golden_case


@golden_case("mtp_roll_cp4")
def mtp_roll_cp4():
    """cp = 4 over padded documents (T = 100): each rank's chunk + row 0 of the next rank, rolled per doc."""
    from dsv4.model import context_parallel as cpl
    from dsv4.model.mtp_roll import roll_chunk
    cu, cup = torch.tensor([0, 5, 24, 27, 64, 66, 76]), torch.tensor([0, 10, 32, 38, 80, 86, 100])
    ids = (torch.arange(100) * 7 + 3) % 97
    out, val = [], []
    for r in range(4):
        s, e = cpl.contiguous_chunk(100, 4, r)
        seg, _ = cpl.rank_layout(cu, 100, 4, r, 0, cup)
        nxt_seg = cpl.rank_layout(cu, 100, 4, r + 1, 0, cup)[0][:1] if r < 3 else torch.tensor([-1])
        y, v = roll_chunk(ids[s:e], seg, ids[e:e + 1] if r < 3 else ids[:1], nxt_seg, fill=0)
        out.append(y); val.append(v)
    return {"ids_next": torch.cat(out), "valid": torch.cat(val)}
