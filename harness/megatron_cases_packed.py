"""Megatron-LM dev oracle cases for packed THD and static contiguous CP: dev's DSv4HybridSelfAttention on
PackedSeqParams (three documents in one stream), dev's CP indexer top-k per rank (csa_utils/cp_utils.
compute_cp_indexer_topk, its unfused branch) and dev's CP row positions (cp_utils._thd_cp_position_ids).

Registered into harness/megatron_cases.CASES (imported at its end). What dev's CP path needs that CPU lacks:
`CompressedSparseAttention._forward_thd_cp` compacts the compressor input (cp_layout_kernels.
CompressorInputCompact) and lowers the final indices (cp_layout_kernels.build_attention_indices) in CuTeDSL
kernels that require CUDA tensors (`_require_cute`), so the whole CP layer does not run here; its pure-PyTorch
pieces do, each rank simulated in one process (rank r's rows [r C, (r+1) C) of the packed stream, C = T / cp,
metadata replicated as on every rank).

Top-k ties: ReLU makes indexer scores exactly equal (often 0) and torch.topk's order among equal scores is
unspecified (ours: lower index first). The THD layer case compares outputs only on rows whose top-k SET is not
tie-decided (each side finds its tied rows from its own scores; the masks compare exactly); the CP top-k case
uses 8 indexer heads with positive weights so that no row's k-th score is tied (asserted on our side, and by
harness/tests/test_megatron_dev.py), and compares the picked sets exactly.
"""
from __future__ import annotations

import torch

from dsv4.harness.megatron_cases import _dev_attention, _grads, _layer_tie_outputs, _leaf, _our_layer, mcase

_LENS_CSA = (37, 29, 45)
_LENS_HCA = (160, 96)            # HCA ratio 128: one complete window, and a document with none


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


# =========================================================================================== D6: THD layer
def _thd_layer_inputs(li, lens):
    """slices/D1's seeded DSv4Attention (debug, compress_ratios [0, 4, 128, 0]) layer li on documents `lens`
    packed into one stream: h [1, T, 64] (seed 12)."""
    return {"li": li, "lens": lens, "h": torch.randn(1, sum(lens), 64, generator=torch.Generator().manual_seed(12))}


def _thd_layer_ours(inp):
    from dsv4.model.layout import Layout
    attn, _ = _our_layer({"li": inp["li"], "S": 37})
    L = {"h": _leaf(inp["h"])}
    T = inp["h"].shape[1]
    cap = {}
    if inp["li"] == 1:      # (scores [T, N slots], picks [T, k] slot ids, entry_seg [N], entry_j [N])
        attn.indexer.register_forward_hook(lambda mod, args, out: cap.update(zip(("scores", "picks", "eseg", "ej"), out)))
    out = attn(L["h"], Layout.packed(_cu(inp["lens"]), (1, T))).transpose(0, 1)              # [T, 1, d]
    if inp["li"] != 1:
        return _grads({"out": out}, L)
    res = _layer_tie_outputs(out.detach(), cap["picks"], cap["scores"])
    t = res["topk_untied"][0]
    res["topk_untied"] = torch.where(t >= 0, cap["ej"][t.clamp(min=0)], t)          # slot -> j in its document
    return res


def _thd_layer_dev(inp, M):
    from megatron.core.packed_seq_params import PackedSeqParams

    from dsv4.model.interop import megatron as CV
    names = {o[len("attn."):]: m[len("self_attention."):] for o, m in CV._MEG_ATTN if o.startswith("attn.")}
    attn_ours, _ = _our_layer({"li": inp["li"], "S": 37})
    dev = _dev_attention(M, inp["li"])
    missing, unexpected = dev.load_state_dict({names[k]: v for k, v in attn_ours.state_dict().items()}, strict=False)
    if [k for k in missing if not k.endswith("_extra_state")] or unexpected:
        raise RuntimeError(f"dev attention: missing {missing}, unexpected {unexpected}")
    cu, lens = _cu(inp["lens"]), inp["lens"]
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lens),
                          max_seqlen_kv=max(lens))
    cap = {}
    if inp["li"] == 1:
        ind = dev.core_attention.indexer
        fwd = ind.forward

        def capture(x, qr, mask=None, packed_seq_params=None):
            r = fwd(x, qr, mask=mask, packed_seq_params=packed_seq_params)
            cap["topk"] = r[1]                                  # [T, k] j in its document (THD returns no scores)
            cap["before"] = ind.forward_before_topk(x, qr, packed_seq_params)
            return r
        ind.forward = capture
    L = {"h": _leaf(inp["h"])}
    out = dev(L["h"].transpose(0, 1).contiguous(), None, packed_seq_params=psp)[0]          # [T, 1, d]
    if inp["li"] != 1:
        return _grads({"out": out}, L)
    # dev's scores for the tie test, as _forward_unfused_csa_thd's indexer sees them: fused_qk_topk_naive on
    # the varlen bounds of _build_compressed_thd_indexer_metadata (global segment-major entry ids)
    q, k, w, cu_c = cap["before"]
    T = q.shape[0]
    starts, ends, _, offs = M.csa._build_compressed_thd_indexer_metadata(cu, cu_c, total_q=T, ratio=4)
    scores, _ = M.dsa.fused_qk_topk_naive(q, k, w * ind.softmax_scale, 4, varlen_starts=starts,
                                          varlen_ends=ends)
    picks = torch.where(cap["topk"] >= 0, cap["topk"] + offs[:, None], cap["topk"])       # -> global entry ids
    res = _layer_tie_outputs(out.detach(), picks, scores[0])
    t = res["topk_untied"][0]
    res["topk_untied"] = torch.where(t >= 0, t - offs[:, None], t)
    return res


_THD_MAP = ("our DSv4Attention (slices/D1 seeded weights, debug with compress_ratios [0, 4, 128, 0]) renamed by "
            "model/interop/megatron._MEG_ATTN, loaded into dev's DSv4HybridSelfAttention (as the dsv4_attention_*_"
            "layer cases); h [T, 1, d] with PackedSeqParams(qkv_format 'thd', cu_seqlens_q = cu_seqlens_kv); ours: "
            "DSv4Attention(h [1, T, d], Layout.packed(cu_seqlens)); CSA: rows whose top-k set is tie-decided zeroed on "
            "both sides (dev's scores from fused_qk_topk_naive on _build_compressed_thd_indexer_metadata's bounds), "
            "picks as j inside the document (-1 none, -2 tied)")
mcase("dsv4_attention_csa_thd", "D6", "megatron.core.transformer.experimental_attention_variant.deepseek_v4_hybrid_"
      "attention.DSv4HybridSelfAttention.forward(packed_seq_params THD) -> CompressedSparseAttention._forward_unfused_"
      "csa_thd (Compressor._forward_thd, CSAIndexer THD top-k)", _THD_MAP,
      # measured: untied rows 7.2e-7 (|out| <= 2.1), tie masks and untied picks equal -> 1e-5 abs (x14)
      {"out_untied_rows": (1e-5, 1e-5)}, lambda: _thd_layer_inputs(1, _LENS_CSA))((_thd_layer_ours, _thd_layer_dev))
mcase("dsv4_attention_hca_thd", "D6", "megatron.core.transformer.experimental_attention_variant.deepseek_v4_hybrid_"
      "attention.DSv4HybridSelfAttention.forward(packed_seq_params THD) -> CompressedSparseAttention._forward_unfused_"
      "csa_thd (ratio 128, no indexer)", _THD_MAP,
      # measured: out 4.8e-7, d_h 9.5e-7 (|d_h| <= 4.6) -> 2e-5 abs (x21, as the SBHD HCA layer case)
      {"out": (2e-5, 1e-5), "d_h": (2e-5, 1e-5)}, lambda: _thd_layer_inputs(2, _LENS_HCA))((_thd_layer_ours, _thd_layer_dev))


# =========================================================================================== D7: contiguous CP
_LENS_CP = (37, 29, 46)          # T = 112: divisible by cp 2 and 4; documents cross rank boundaries


def _cp_topk_inputs():
    """Indexer q [112, 8, 16], w = |N| + 0.1 [112, 8] (8 heads, positive weights: no tied k-th score), keys of
    the complete entries (ratio 4) of each document, segment-major [sum L // 4, 16] (seed 13); top-4; cp 2 and 4."""
    g = torch.Generator().manual_seed(13)
    T, N = sum(_LENS_CP), sum(L // 4 for L in _LENS_CP)
    return {"qI": torch.randn(T, 8, 16, generator=g), "w": torch.randn(T, 8, generator=g).abs() + 0.1,
            "kI": torch.randn(N, 16, generator=g), "ratio": 4, "k": 4}


def _cp_topk_ours(inp):
    from dsv4.kernels.indexer import indexer_scores, indexer_topk
    from dsv4.model.context_parallel import contiguous_chunk, rank_layout
    T = inp["qI"].shape[0]
    n = [L // inp["ratio"] for L in _LENS_CP]
    eseg = torch.repeat_interleave(torch.arange(len(n)), torch.tensor(n))       # the gathered entries of all ranks
    ej = torch.cat([torch.arange(c) for c in n])
    out = {}
    for cp in (2, 4):
        rows, tied = [], []
        for r in range(cp):
            s, e = contiguous_chunk(T, cp, r)
            seg, pos = rank_layout(_cu(_LENS_CP), T, cp, r)
            I = indexer_scores(inp["qI"][s:e], inp["kI"], inp["w"][s:e], inp["ratio"], seg, pos, eseg, ej)   # [C, N]
            p = indexer_topk(I, inp["k"])                                                                     # [C, k]
            kth = torch.where(p >= 0, I.gather(-1, p.clamp(min=0)), torch.tensor(float("inf"))).min(-1).values
            unpicked = torch.ones_like(I, dtype=torch.bool).scatter(-1, p.clamp(min=0), False)
            tied.append((torch.isfinite(kth) & ((I == kth[:, None]) & unpicked).any(-1)).any())
            rows.append(torch.where(p >= 0, ej[p.clamp(min=0)], p))
        assert not any(tied), "a tied k-th score: the exact comparison would hinge on tie order"
        out[f"picks_cp{cp}"] = torch.cat(rows).sort(-1, descending=True).values      # sets: -1 (none) last
    return out


def _cp_topk_dev_m(inp, M):
    from megatron.core.transformer.experimental_attention_variant.csa_utils import cp_utils
    T, nI, cI = inp["qI"].shape
    cu = _cu(_LENS_CP)
    cu_c = _cu([L // inp["ratio"] for L in _LENS_CP])
    out = {}
    for cp in (2, 4):
        C = T // cp
        rows = []
        for r in range(cp):
            sl = slice(r * C, (r + 1) * C)
            p, _ = cp_utils.compute_cp_indexer_topk(inp["qI"][sl], inp["w"][sl] * nI ** -0.5, inp["kI"], cu, cu_c,
                                                    r * C, inp["ratio"], inp["k"], cI ** -0.5, max(_LENS_CP), False)
            rows.append(p.long())
        out[f"picks_cp{cp}"] = torch.cat(rows).sort(-1, descending=True).values
    return out


mcase("cp_indexer_topk", "D7", "megatron.core.transformer.experimental_attention_variant.csa_utils.cp_utils."
      "compute_cp_indexer_topk (use_fused False; _build_cp_indexer_layout eager under TORCHDYNAMO_DISABLE)",
      "per simulated rank r of cp 2 and 4: q_indexer_local = qI[rC:(r+1)C], weights = w * nI^-1/2 (CSAIndexer's "
      "head scale), k_indexer_seq_major = the segment-major entry keys, cu_seqlens_q / cu_seqlens_compressed of the "
      "three documents, global_start rC, indexer_softmax_scale cI^-1/2, max_seqlen_q max L; ours: kernels.indexer "
      "indexer_scores + indexer_topk on the rank's rows (seg / pos from context_parallel.rank_layout) against every "
      "entry (what CPLayout.gather_entries hands the indexer), slot -> j; picks [T, k] as j in the document, each "
      "row's set sorted descending (-1 = none last), compared exactly",
      {}, _cp_topk_inputs)((_cp_topk_ours, _cp_topk_dev_m))


def _cp_pos_inputs():
    """The CP documents with padding: cu_seqlens (37, 29, 46) padded to multiples of 8 (40, 32, 48: T = 120),
    cp 3 and 4 (C = 40, 30): which document position every rank row holds."""
    return {"cu": _cu(_LENS_CP), "cup": _cu((40, 32, 48))}


def _real_rows(cu, cup):
    """[T] True on the real tokens of the padded stream (document d: rows [cup[d], cup[d] + len d))."""
    T = int(cup[-1])
    lens = (cu[1:] - cu[:-1]).long()
    rows = torch.arange(T)
    d = torch.bucketize(rows, cup[1:].long(), right=True).clamp(max=lens.numel() - 1)
    return rows - cup[d].long() < lens[d]


def _cp_pos_ours(inp):
    from dsv4.model.context_parallel import rank_layout
    T = int(inp["cup"][-1])
    real = _real_rows(inp["cu"], inp["cup"])
    return {f"pos_cp{cp}": torch.cat([rank_layout(inp["cu"], T, cp, r, 0, inp["cup"])[1] for r in range(cp)])[real]
            for cp in (3, 4)}


def _cp_pos_dev(inp, M):
    from megatron.core.transformer.experimental_attention_variant.csa_utils import cp_utils
    T = int(inp["cup"][-1])
    real = _real_rows(inp["cu"], inp["cup"])
    return {f"pos_cp{cp}": torch.cat([cp_utils._thd_cp_position_ids(inp["cup"], r * (T // cp), T // cp).long()
                                      for r in range(cp)])[real] for cp in (3, 4)}


mcase("cp_row_positions", "D7", "megatron.core.transformer.experimental_attention_variant.csa_utils.cp_utils."
      "_thd_cp_position_ids (the RoPE positions of a rank's rows, apply_thd_cp_local_rope_*)",
      "cu_seqlens_padded (40, 32, 48), global_start r * T/cp, local_rows T/cp for cp 3 and 4; ours: "
      "context_parallel.rank_layout(cu_seqlens, T, cp, r, 0, cu_seqlens_padded) positions; real rows only (padding "
      "rows: dev counts on inside the padded document, ours gives 0 with seg -1; unused by both, D7 differences)",
      {}, _cp_pos_inputs)((_cp_pos_ours, _cp_pos_dev))
