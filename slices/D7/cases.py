"""D7 golden cases: the static contiguous CP layout (integers only: compared exactly)."""
import torch

from dsv4.harness.cases import golden_case


@golden_case("cp4_layout_padded")
def cp4_layout_padded():
    """cp = 4 over documents [5, 19, 3, 37, 2, 10] in padded slots (T = 100): per-rank seg / pos with a
    15-token halo, and per-rank cu_seqlens pieces."""
    from dsv4.model import context_parallel as cpl
    cu, cup = torch.tensor([0, 5, 24, 27, 64, 66, 76]), torch.tensor([0, 10, 32, 38, 80, 86, 100])
    out = {}
    for r in range(4):
        seg, pos = cpl.rank_layout(cu, 100, 4, r, 15, cup)
        cu_l, cup_l, docs, first = cpl.rank_cu_seqlens(cu, 100, 4, r, cup)
        out.update({f"seg{r}": seg, f"pos{r}": pos, f"cu{r}": cu_l, f"cu_padded{r}": cup_l, f"docs{r}": docs,
                    f"first_pos{r}": first})
    return out
