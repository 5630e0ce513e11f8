"""D5 golden cases: packed THD compressor / indexer / sparse attention kernels on odd documents (fp32)."""
import torch

from dsv4.harness.cases import golden_case

# Tolerances: the cross-host spread stored in goldens/cpu/_spread/D5.json (`dsv4 goldens spread --slice D5`,
# worst over harness/numerics.py's simulated hosts and the host that made the golden) x the margin named.
# THD kernels: worst use 0.04 of TOL (scores, 25x); segments, entries and picks exact on every host.
TOL = (1e-5, 1e-4)


@golden_case("thd_kernels_csa", tol={"comp": TOL, "scores_finite": TOL, "out": TOL})
def thd_kernels_csa():
    """Documents [3, 13, 1, 22] packed with padding; CSA (m=4, overlap) entries, indexer top-3, attention."""
    from dsv4.kernels.compressor.naive import compress_pool
    from dsv4.kernels.indexer.naive import indexer_scores, indexer_topk
    from dsv4.kernels.sparse_attn.naive import sparse_attn
    from dsv4.model.layout import seg_pos_from_cu_seqlens
    g = torch.Generator().manual_seed(0)
    cu, cup = torch.tensor([0, 3, 16, 17, 39]), torch.tensor([0, 4, 20, 21, 44])
    seg, pos = seg_pos_from_cu_seqlens(cu, 44, cup)
    T, H, c, D, nI, cI = 44, 2, 8, 8, 2, 6
    q, kv = torch.randn(T, H, c, generator=g), torch.randn(T, c, generator=g)
    ckv, cg, ape = torch.randn(T, 2 * D, generator=g), torch.randn(T, 2 * D, generator=g), torch.randn(4, 2 * D, generator=g)
    qI, wI = torch.randn(T, nI, cI, generator=g), torch.randn(T, nI, generator=g)
    kIs, gIs, apeI = torch.randn(T, 2 * cI, generator=g), torch.randn(T, 2 * cI, generator=g), torch.randn(4, 2 * cI, generator=g)
    sink = torch.randn(H, generator=g)
    comp, eseg, ej, _ = compress_pool(ckv, cg, ape, 4, True, seg, pos)
    kI, iseg, ij, _ = compress_pool(kIs, gIs, apeI, 4, True, seg, pos)
    I = indexer_scores(qI, kI, wI, 4, seg, pos, iseg, ij)
    idx = indexer_topk(I, 3)
    out = sparse_attn(q, kv, comp, idx, sink, 8, 4, c ** -0.5, seg, pos, eseg, ej)
    # the golden stores the entries compacted (stream order, empty static slots dropped) and the selection as
    # indices into that list
    v, vi = eseg >= 0, iseg >= 0
    rank = torch.cumsum(vi.long(), 0) - 1
    sel = torch.where(idx >= 0, rank[idx.clamp(min=0)], torch.full_like(idx, -1))
    return {"seg": seg, "pos": pos, "comp": comp[v], "entry_seg": eseg[v], "entry_j": ej[v], "selected": sel,
            "scores_finite": torch.where(torch.isfinite(I), I, torch.zeros(()))[:, vi], "out": out}
