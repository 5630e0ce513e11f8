"""Megatron-LM dev oracle cases: the same inputs and weights run through OUR code and through dev's own functions.

Each `MCase` defines
- `inputs()`: seeded tensors (seeds / shapes taken from our slices' cases.py), built by our code only;
- `ours(inp)`: our kernels / modules on them, outputs already in dev's layout;
- `dev(inp, M)`: dev's function called on the same tensors (runs only in the importer subprocess, where `M` is a
  namespace of dev's modules imported from a Megatron-LM checkout put first on sys.path);
- `function`: the dev function called (recorded in the golden's provenance), `mapping`: how our weights / inputs
  are handed to it (also recorded), `tol`: per floating output (atol, rtol) with its source.

Gradients: `_grads` back-propagates sum_k <out_k, c_k> with seeded cotangents c_k (seed 99, one per output in
name order), so both sides get identical cotangents (outputs have the same shapes by construction).

Tolerances: each is the measured worst case of ours vs dev on this host (fp32, 1 thread; noted beside it;
`dsv4 verify --against megatron-dev` reprints the max |diff| of every output) times a margin >= 10, floored at
1e-6 absolute, so a real discrepancy (a formula change, a transposed matrix: >= 1e-3 here) fails.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch
import torch.nn.functional as F


@dataclasses.dataclass
class MCase:
    name: str
    slice: str                   # slice folder name (goldens/megatron-dev/<slice>/<name>.json)
    inputs: Callable[[], dict]
    ours: Callable[[dict], dict]
    dev: Callable[[dict, object], dict]
    function: str
    mapping: str
    tol: dict
    doc: str = ""


CASES: list[MCase] = []


def mcase(name, slice, function, mapping, tol, inputs):
    def deco(pair):
        ours, dev = pair
        CASES.append(MCase(name, slice, inputs, ours, dev, function, mapping, tol, (ours.__doc__ or "").strip()))
        return pair
    return deco


def _leaf(t):
    return t.detach().clone().requires_grad_(True)


def _grads(outs: dict, leaves: dict) -> dict:
    """Add d<sum_k <out_k, c_k>>/d leaf for every leaf (c_k seeded, seed 99, outputs in name order)."""
    g = torch.Generator().manual_seed(99)
    loss = 0.0
    for k in sorted(outs):
        o = outs[k]
        if isinstance(o, torch.Tensor) and o.dtype.is_floating_point and o.requires_grad:
            c = torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.dtype)
            loss = loss + (o.where(torch.isfinite(o), torch.zeros_like(o)) * c).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
    res = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in outs.items()}
    for (name, leaf), gr in zip(leaves.items(), grads):
        res[f"d_{name}"] = gr if gr is not None else torch.zeros_like(leaf)
    return res


class _NS:
    def __init__(self, **kw):
        self.__dict__.update(kw)


# Our kernels are token-major on a packed stream (kernels/<op>/naive.py: seg / pos per token, entries with
# entry_seg / entry_j). A dev [S, B, ...] (SBHD) case is mapped at the edge: batch row b is one document of S
# tokens (seg 0, pos 0..S-1), run as its own stream, and the per-row results are stacked back on dim 1.
def _one_doc(S):
    """(seg, pos) [S] of one document of S tokens."""
    return torch.zeros(S, dtype=torch.long), torch.arange(S)


def _entries(T):
    """(entry_seg, entry_j) [T] of the T complete entries of one document (entry j = slot j)."""
    return torch.zeros(T, dtype=torch.long), torch.arange(T)


def _indexer_scores_sbhd(qI, kI, w, ratio):
    """Our indexer_scores per batch row: qI [S,B,nI,cI], kI [T,B,cI], w [S,B,nI] -> I [S,B,T] fp32."""
    from dsv4.kernels.indexer import indexer_scores
    S, B = qI.shape[:2]
    seg, pos = _one_doc(S)
    es, ej = _entries(kI.shape[0])
    return torch.stack([indexer_scores(qI[:, b], kI[:, b], w[:, b], ratio, seg, pos, es, ej)
                        for b in range(B)], dim=1)


# =========================================================================================== D1: compressor
def _compressor_inputs(S, B, d, D, ratio, overlap, seed):
    """As slices/D1/cases.py: weights ~ N(0,1)/sqrt(d), ape ~ 0.3 N(0,1), h ~ N(0,1); generator seeds 1 and 2."""
    coff = 2 if overlap else 1
    g = torch.Generator().manual_seed(seed)
    wkv = torch.randn(coff * D, d, generator=g) * d ** -0.5
    wgate = torch.randn(coff * D, d, generator=g) * d ** -0.5
    ape = torch.randn(ratio, coff * D, generator=g) * 0.3
    x = torch.randn(S, B, d, generator=torch.Generator().manual_seed(seed + 1))
    return {"x": x, "wkv": wkv, "wgate": wgate, "ape": ape, "ratio": ratio, "overlap": overlap, "D": D}


def _compressor_sbhd(kv, gate, ape, ratio, overlap):
    """Our compress_pool per batch row: kv / gate [S,B,coff*D] -> [S//ratio, B, D] (dev's entry count). Row b is one
    document; its static slots number ceil(S/ratio), slot j = entry j; the trailing slot of a partial window
    (S % ratio != 0) is empty (seg -1, value 0) and is sliced off here -- dev emits no entry for it."""
    from dsv4.kernels.compressor import compress_pool
    S, B = kv.shape[:2]
    seg, pos = _one_doc(S)
    n = S // ratio
    rows = []
    for b in range(B):
        comp, eseg, ej, _ = compress_pool(kv[:, b], gate[:, b], ape, ratio, overlap, seg, pos)
        assert bool((eseg[:n] == 0).all() and (ej[:n] == torch.arange(n)).all() and (eseg[n:] < 0).all())
        rows.append(comp[:n])
    return torch.stack(rows, dim=1)


def _compressor_ours(inp):
    L = {k: _leaf(inp[k]) for k in ("x", "wkv", "wgate", "ape")}
    out = _compressor_sbhd(F.linear(L["x"], L["wkv"]), F.linear(L["x"], L["wgate"]), L["ape"], inp["ratio"],
                           inp["overlap"])
    return _grads({"out": out}, L)


def _compressor_dev(inp, M):
    L = {k: _leaf(inp[k]) for k in ("x", "wkv", "wgate", "ape")}
    shim = _NS(compress_ratio=inp["ratio"], head_dim=inp["D"], overlap=inp["ratio"] == 4,
               coff=2 if inp["ratio"] == 4 else 1, config=_NS(fp8=None, fp4=None), qk_pos_emb_head_dim=0,
               rotary_pos_emb=None, rotate=False, pg_collection=_NS(cp=None), ape=L["ape"],
               linear_wkv=lambda x: (F.linear(x, L["wkv"]), None),
               linear_wgate=lambda x: (F.linear(x, L["wgate"]), None),
               norm=lambda t: t)
    shim._overlap_transform = lambda t, fill_value=0: M.csa.Compressor._overlap_transform(shim, t, fill_value)
    saved = M.csa._apply_rope
    M.csa._apply_rope = lambda kv, *a, **k: kv            # RoPE of the entries: not part of this comparison
    try:
        out = M.csa.Compressor._forward_sbhd(shim, L["x"])
    finally:
        M.csa._apply_rope = saved
    return _grads({"out": out}, L)


_COMP_MAP = ("dev Compressor._forward_sbhd(self=shim, x): linear_wkv/linear_wgate = F.linear with our wkv/wgate "
             "[coff*D, d], ape = our ape [ratio, coff*D] (same layout: first D channels = previous-window "
             "series), overlap iff ratio == 4 (dev's rule; ours: the caller's flag), norm = identity and "
             "_apply_rope = identity (entry RMSNorm and RoPE are compared elsewhere); ours: "
             "compress_pool(F.linear(x, wkv), F.linear(x, wgate), ape, ratio, overlap)")
# measured ours vs dev (this host): 0 (bit-equal, same op order) for out and every gradient at ratios 4/16/128;
# 1e-6 abs floor (no measured spread to multiply; other hosts may reorder the fp32 sums)
_COMP_TOL = {k: (1e-6, 1e-5) for k in ("out", "d_x", "d_wkv", "d_wgate", "d_ape")}

mcase("compressor_csa_ratio4", "D1", "megatron.core.transformer.experimental_attention_variant.csa."
      "Compressor._forward_sbhd (+ _overlap_transform)", _COMP_MAP, _COMP_TOL,
      lambda: _compressor_inputs(37, 2, 64, 32, 4, True, 1))((_compressor_ours, _compressor_dev))
mcase("compressor_hca_ratio16", "D1", "megatron.core.transformer.experimental_attention_variant.csa."
      "Compressor._forward_sbhd", _COMP_MAP, _COMP_TOL,
      lambda: _compressor_inputs(37, 2, 64, 32, 16, False, 1))((_compressor_ours, _compressor_dev))
mcase("compressor_hca_ratio128", "D1", "megatron.core.transformer.experimental_attention_variant.csa."
      "Compressor._forward_sbhd", _COMP_MAP, _COMP_TOL,
      lambda: _compressor_inputs(261, 1, 32, 16, 128, False, 1))((_compressor_ours, _compressor_dev))


# =========================================================================================== D5: packed compressor
_LENS = (37, 29, 45)      # three documents, packed (the indexer packed probe's lengths)


def _compressor_thd_inputs(ratio, overlap):
    """Three documents (37, 29, 45 tokens) packed, hidden 32, head_dim 16; weights as _compressor_inputs (seed 4)."""
    inp = _compressor_inputs(sum(_LENS), 1, 32, 16, ratio, overlap, 4)
    inp["cu"] = torch.tensor([0, *torch.tensor(_LENS).cumsum(0).tolist()], dtype=torch.int32)
    return inp


def _compressor_thd_ours(inp):
    from dsv4.kernels.compressor import compress_pool
    from dsv4.model.layout import seg_pos_from_cu_seqlens
    L = {k: _leaf(inp[k]) for k in ("x", "wkv", "wgate", "ape")}
    seg, pos = seg_pos_from_cu_seqlens(inp["cu"])
    x = L["x"][:, 0]
    comp, eseg, _, _ = compress_pool(F.linear(x, L["wkv"]), F.linear(x, L["wgate"]), L["ape"], inp["ratio"],
                                     inp["overlap"], seg, pos)
    # static slots (ceil(T/ratio), in token order): the filled ones, in order, are dev's segment-major entries;
    # the empty slots (seg -1: windows a document boundary or the stream end leaves unfilled) are dropped
    return _grads({"out": comp[eseg >= 0].unsqueeze(1)}, L)


def _compressor_thd_dev(inp, M):
    L = {k: _leaf(inp[k]) for k in ("x", "wkv", "wgate", "ape")}
    shim = _NS(compress_ratio=inp["ratio"], head_dim=inp["D"], overlap=inp["ratio"] == 4,
               coff=2 if inp["ratio"] == 4 else 1, config=_NS(fp8=None, fp4=None, apply_rope_fusion=False),
               qk_pos_emb_head_dim=0, rotary_pos_emb=None, rotate=False, pg_collection=_NS(cp=None),
               ape=L["ape"], use_fused_compressor=False,
               linear_wkv=lambda x: (F.linear(x, L["wkv"]), None),
               linear_wgate=lambda x: (F.linear(x, L["wgate"]), None), norm=lambda t: t)
    shim._overlap_transform_thd = lambda t, first, fill_value=0: M.csa.Compressor._overlap_transform_thd(
        shim, t, first, fill_value)
    saved = M.csa._apply_rope
    M.csa._apply_rope = lambda kv, *a, **k: kv
    try:
        out, _ = M.csa.Compressor._forward_thd(shim, L["x"], inp["cu"], max_seqlen_q=max(_LENS))
    finally:
        M.csa._apply_rope = saved
    return _grads({"out": out}, L)


_COMP_THD_MAP = ("dev Compressor._forward_thd(self=shim, x [T, 1, d], cu_seqlens, max_seqlen_q) (eager region, "
                 "use_fused_compressor False), weights as the SBHD compressor cases, norm and _apply_rope = "
                 "identity; ours: model.thd.compress_pool_thd on seg/pos from cu_seqlens; entries segment-major")
# (the mapping string is the golden's recorded provenance: kept verbatim; model.thd.compress_pool_thd is now
# kernels.compressor.compress_pool, whose filled static slots are those entries)
for _r, _ov in ((4, True), (16, False)):
    mcase(f"compressor_thd_ratio{_r}", "D5", "megatron.core.transformer.experimental_attention_variant.csa."
          "Compressor._forward_thd (+ _overlap_transform_thd)", _COMP_THD_MAP,
          # measured: bit-equal (0) for out and gradients -> 1e-6 abs floor
          {k: (1e-6, 1e-5) for k in ("out", "d_x", "d_wkv", "d_wgate", "d_ape")},
          (lambda r=_r, ov=_ov: _compressor_thd_inputs(r, ov)))((_compressor_thd_ours, _compressor_thd_dev))


def _attn_thd_inputs(ratio):
    """Three documents (37, 29, 45) packed: q [111, 4, 32], kv [111, 32], HCA entries [sum L//ratio, 32], sink [4],
    window 8 (seed 6)."""
    g = torch.Generator().manual_seed(6)
    T, H, c = sum(_LENS), 4, 32
    n = [L // ratio for L in _LENS]
    cu = torch.tensor([0, *torch.tensor(_LENS).cumsum(0).tolist()], dtype=torch.int32)
    cu_c = torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32)
    return {"q": torch.randn(T, H, c, generator=g), "kv": torch.randn(T, c, generator=g),
            "comp": torch.randn(sum(n), c, generator=g), "sink": torch.randn(H, generator=g) * 0.3,
            "cu": cu, "cu_c": cu_c, "window": 8, "ratio": ratio, "scale": c ** -0.5}


def _attn_thd_ours(inp):
    from dsv4.kernels.sparse_attn import sparse_attn
    from dsv4.model.layout import seg_pos_from_cu_seqlens
    L = {k: _leaf(inp[k]) for k in ("q", "kv", "comp", "sink")}
    seg, pos = seg_pos_from_cu_seqlens(inp["cu"])
    n = (inp["cu_c"][1:] - inp["cu_c"][:-1]).long()
    eseg = torch.repeat_interleave(torch.arange(n.numel()), n)
    ej = torch.cat([torch.arange(int(k)) for k in n])
    o = sparse_attn(L["q"], L["kv"], L["comp"], None, L["sink"], inp["window"], inp["ratio"], inp["scale"], seg, pos,
                    eseg, ej)
    return _grads({"out": o.reshape(o.shape[0], -1)}, L)


def _attn_thd_dev(inp, M):
    from megatron.core.transformer.experimental_attention_variant.csa_utils.fused_sparse_attention import (
        local_to_global_flat)
    L = {k: _leaf(inp[k]) for k in ("q", "kv", "comp", "sink")}
    cu, cu_c = inp["cu"], inp["cu_c"]
    cu_full = M.csa.build_cu_seqlens_kv_full(cu, cu_c)
    kv_full = M.csa.cat_per_segment(L["kv"], L["comp"], cu, cu_c, cu_full)
    local = torch.cat([M.csa.get_window_topk_idxs_thd(inp["window"], cu),
                       M.csa.get_compress_topk_idxs_thd(inp["ratio"], cu, cu, cu_c)], dim=-1)
    topk = local_to_global_flat(local, 1, cu_seqlens_q=cu, cu_seqlens_kv=cu_full)
    out = M.csa.unfused_compressed_sparse_attn(L["q"], kv_full, L["sink"].float(), topk.int(), inp["scale"])
    return _grads({"out": out}, L)


mcase("sparse_attn_thd_hca_sink", "D5", "megatron.core.transformer.experimental_attention_variant.csa."
      "unfused_compressed_sparse_attn, THD layout (kv_full: cat_per_segment + build_cu_seqlens_kv_full; indices: "
      "get_window_topk_idxs_thd ++ get_compress_topk_idxs_thd -> csa_utils.fused_sparse_attention.local_to_global_flat)",
      "three packed documents (37, 29, 45): q [T, H, c], kv [T, c], entries [N, c] segment-major (N = sum L//16), "
      "sink [H]; ours: model.thd.sparse_attn_thd with seg/pos from cu_seqlens and entry (seg, j); output [T, H*c]",
      # measured: out 3.6e-7, grads <= 1.07e-6 (d_comp) -> 2e-5 abs (x18, as the SBHD attention cases)
      {k: (2e-5, 1e-5) for k in ("out", "d_q", "d_kv", "d_comp", "d_sink")},
      lambda: _attn_thd_inputs(16))((_attn_thd_ours, _attn_thd_dev))


# =========================================================================================== D1: sparse attention
def _attn_inputs(kind):
    """q [37, 2, 4, 32], kv [37, 2, 32], comp [T, 2, 32] (T = 9 CSA ratio 4, 2 HCA ratio 16), sink [4] ~ 0.3 N,
    window 8 (debug config); CSA picks: our indexer top-4 of seeded scores (causal, -1 = none)."""
    from dsv4.kernels.indexer import indexer_topk
    S, B, H, c, win = 37, 2, 4, 32, 8
    ratio = {"window": 4, "csa": 4, "hca": 16}[kind]
    g = torch.Generator().manual_seed(3)
    q = torch.randn(S, B, H, c, generator=g)
    kv = torch.randn(S, B, c, generator=g)
    sink = torch.randn(H, generator=g) * 0.3
    T = S // ratio
    comp = torch.randn(T, B, c, generator=g)
    idx = None
    if kind == "csa":
        qI, kI, w = torch.randn(S, B, 2, 16, generator=g), torch.randn(T, B, 16, generator=g), torch.randn(S, B, 2, generator=g)
        idx = indexer_topk(_indexer_scores_sbhd(qI, kI, w, ratio), 4)        # [S, B, 4]
    return {"q": q, "kv": kv, "sink": sink, "comp": comp if kind != "window" else None, "idx": idx,
            "window": win, "ratio": ratio, "scale": c ** -0.5, "kind": kind}


def _attn_leaves(inp):
    L = {"q": _leaf(inp["q"]), "kv": _leaf(inp["kv"]), "sink": _leaf(inp["sink"])}
    if inp["comp"] is not None:
        L["comp"] = _leaf(inp["comp"])
    return L


def _attn_ours(inp):
    from dsv4.kernels.sparse_attn import sparse_attn
    L = _attn_leaves(inp)
    S, B, H, c = inp["q"].shape
    seg, pos = _one_doc(S)
    comp = L.get("comp")
    es, ej = _entries(comp.shape[0]) if comp is not None else (None, None)
    o = torch.stack([sparse_attn(L["q"][:, b], L["kv"][:, b], None if comp is None else comp[:, b],
                                 None if inp["idx"] is None else inp["idx"][:, b], L["sink"], inp["window"],
                                 inp["ratio"], inp["scale"], seg, pos, es, ej) for b in range(B)], dim=1)
    return _grads({"out": o.reshape(S, B, H * c)}, L)


def _attn_dev(inp, M):
    L = _attn_leaves(inp)
    S, B = inp["q"].shape[:2]
    win = M.csa.get_window_topk_idxs(inp["window"], B, S, torch.device("cpu"))          # [B, S, window]
    parts, kv_full = [win], L["kv"]
    if inp["comp"] is not None:
        kv_full = torch.cat([L["kv"], L["comp"]], dim=0)
        if inp["kind"] == "hca":
            parts.append(M.csa.get_compress_topk_idxs(inp["ratio"], B, S, S, torch.device("cpu")))
        else:   # CSA: the caller-side filter of CompressedSparseAttention._forward_unfused_csa, verbatim
            picks = inp["idx"].permute(1, 0, 2)                                           # [B, S, k]
            n_valid = torch.arange(1, S + 1).unsqueeze(1) // inp["ratio"]
            valid = (picks >= 0) & (picks < n_valid)
            parts.append(torch.where(valid, picks + S, torch.tensor(-1)))
    topk = torch.cat(parts, dim=-1).int()
    out = M.csa.unfused_compressed_sparse_attn(L["q"], kv_full, L["sink"].float(), topk, inp["scale"])
    return _grads({"out": out}, L)


_ATTN_MAP = ("kv_full = cat([kv, comp]) along the sequence (dev's _build_kv_full), topk_indices [B, S, .] = "
             "dev get_window_topk_idxs(window) ++ (HCA: dev get_compress_topk_idxs(ratio, offset=S); CSA: our "
             "indexer's picks [S,B,k] permuted to [B,S,k], filtered j < (t+1)//ratio and offset by S as "
             "_forward_unfused_csa does); attn_sink = our sink [H]; softmax_scale = c^-1/2; output [S, B, H*c]")
# measured ours vs dev: out <= 6.0e-7, grads <= 1.43e-6 (d_comp, d_sink of CSA) -> 2e-5 abs (x14)
_ATTN_TOL = {k: (2e-5, 1e-5) for k in ("out", "d_q", "d_kv", "d_sink", "d_comp")}
for _k in ("window", "csa", "hca"):
    mcase(f"sparse_attn_{_k}_sink", "D1", "megatron.core.transformer.experimental_attention_variant.csa."
          "unfused_compressed_sparse_attn (indices: get_window_topk_idxs, get_compress_topk_idxs)", _ATTN_MAP,
          _ATTN_TOL, (lambda k=_k: _attn_inputs(k)))((_attn_ours, _attn_dev))


# =========================================================================================== D1: the whole layer
_ATTN_RATIOS = [0, 4, 128, 0]     # dev accepts only 0 / 4 / 128 (debug's HCA 16 becomes 128)


def _layer_inputs(li, S):
    """slices/D1/cases.py's seeded DSv4Attention (debug config with compress_ratios [0, 4, 128, 0]), layer li,
    h [1, S, 64] (seed 2)."""
    return {"li": li, "S": S}


def _our_layer(inp):
    import importlib.util

    from dsv4.harness.registry import REPO
    spec = importlib.util.spec_from_file_location("_dsv4_d1_cases_for_mdev", REPO / "slices/D1/cases.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    attn, _ = mod._layer(inp["li"], compress_ratios=_ATTN_RATIOS, hca_ratio=128)
    h = torch.randn(1, inp["S"], 64, generator=torch.Generator().manual_seed(2))
    return attn, h


def _layer_ours(inp):
    attn, h = _our_layer(inp)
    L = {"h": _leaf(h)}
    cap = {}
    if inp["li"] == 1:   # the indexer's (scores [S,N], picks [S,k], entry_seg, entry_j), read by a hook (the
        # model keeps no scores); B = 1: one stream of S tokens, N = ceil(S/4) static entry slots
        attn.indexer.register_forward_hook(lambda mod, args, out: cap.update(scores=out[0], picks=out[1]))
    out = attn(L["h"]).transpose(0, 1)                                   # [S, 1, d]
    if inp["li"] != 1:
        return _grads({"out": out}, L)
    n = inp["S"] // 4        # dev's T = S // ratio entries: the trailing empty slot (score -inf, never picked) is cut
    assert bool((cap["picks"] < n).all())
    return _layer_tie_outputs(out.detach(), cap["picks"], cap["scores"][:, :n])


def _layer_tie_outputs(out, picks, scores):
    """CSA layer: the output on the rows whose top-k SET is not decided by a tie (ReLU zeros tie often; ours
    takes the lower index, dev's torch.topk another), zeros elsewhere; the mask; the tie-aware picks."""
    picks, scores = picks.long(), scores.detach()
    val = torch.where(picks >= 0, scores.gather(-1, picks.clamp(min=0)), torch.tensor(float("-inf")))
    kth = val.min(-1).values                                              # [S] the weakest pick
    unpicked = torch.ones_like(scores, dtype=torch.bool).scatter(-1, picks.clamp(min=0), False)
    tied = torch.isfinite(kth) & ((scores == kth[:, None]) & unpicked).any(-1)   # [S]
    out = out.clone()
    out[tied] = 0.0
    # picked scores are not compared here: dev's layer scores omit c_I^-1/2 (D2 differences), picks are
    return {"out_untied_rows": out, "tied_rows": tied,
            "topk_untied": _topk_outputs(scores[None], picks[None])["topk_untied"]}


def _layer_dev(inp, M):
    attn_ours, h = _our_layer(inp)
    dev = _dev_attention(M, inp["li"])
    from dsv4.model.interop import megatron as CV
    names = {o[len("attn."):]: m[len("self_attention."):] for o, m in CV._MEG_ATTN if o.startswith("attn.")}
    sd = {names[k]: v for k, v in attn_ours.state_dict().items()}        # KeyError = a name convert lacks
    missing, unexpected = dev.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise RuntimeError(f"dev attention: missing {missing}, unexpected {unexpected}")
    L = {"h": _leaf(h)}
    cap = {}
    if inp["li"] == 1:
        ind = dev.core_attention.indexer
        fwd = ind.forward

        def capture(*a, **k):
            r = fwd(*a, **k)
            cap["scores"], cap["topk"] = r
            return r
        ind.forward = capture
    out = dev(L["h"].transpose(0, 1).contiguous(), None)[0]              # [S, 1, d]
    if inp["li"] != 1:
        return _grads({"out": out}, L)
    return _layer_tie_outputs(out.detach(), cap["topk"][0], cap["scores"][0])


def _hadamard_fp32(x):
    """dsa.rotate_activation = fast_hadamard_transform(x, scale=n^-1/2) (a bf16-only CUDA kernel), in fp32."""
    n = x.size(-1)
    Hm = torch.ones(1, 1)
    while Hm.shape[0] < n:
        Hm = torch.cat([torch.cat([Hm, Hm], 1), torch.cat([Hm, -Hm], 1)], 0)
    return (x.float() @ Hm.T * n ** -0.5).to(x.dtype)


def _dev_world(M):
    """Dev on CPU: a gloo world of 1 with Megatron's parallel state, TELinear stood in by a plain y = x W^T module
    (no Transformer Engine here), the Hadamard rotation in fp32. Returns the local (non-TE) backend whose
    linear() is that stand-in."""
    import socket

    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.transformer.experimental_attention_variant import deepseek_v4_hybrid_attention as dha
    if not dist.is_initialized():
        sk = socket.socket()
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
        sk.close()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=1, rank=0)
        parallel_state.initialize_model_parallel()

    class Linear(torch.nn.Module):
        def __init__(self, input_size, output_size, *, config=None, init_method=None, bias=False, **kw):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(output_size, input_size))

        def forward(self, x):
            return F.linear(x, self.weight), None

    class Backend(LocalSpecProvider):
        def linear(self):
            return Linear
    dha.TELinear = Linear
    M.csa.rotate_activation = _hadamard_fp32
    return Backend()


def _dev_config(M, cfg, **extra):
    """Dev's MLATransformerConfig from model/interop/megatron_config.to_megatron_config(cfg) (+ qk_layernorm,
    unfused rope, no mscale, no linear bias) and `extra` fields."""
    from dsv4.model.interop.megatron_config import to_megatron_config
    mc = to_megatron_config(cfg)
    skip = ("experimental_attention_variant", "activation_func", "moe_router_load_balancing_type")
    return M.MLATransformerConfig(**{k: v for k, v in mc.items() if k not in skip},
                                  experimental_attention_variant="dsv4_hybrid", use_cpu_initialization=True,
                                  qk_layernorm=True, apply_rope_fusion=False, mscale=1.0, mscale_all_dim=0.0,
                                  add_bias_linear=False, kv_lora_rank=32, **extra)


def _dev_attention(M, li):
    """Dev's DSv4HybridSelfAttention from get_dsv4_hybrid_module_spec_for_backend on CPU (_dev_world)."""
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_dsv4_hybrid_module_spec_for_backend)
    from megatron.core.transformer.spec_utils import build_module

    from dsv4.model.config import get_config
    backend = _dev_world(M)
    cfg = _dev_config(M, get_config("debug", compress_ratios=_ATTN_RATIOS, hca_ratio=128))
    spec = get_dsv4_hybrid_module_spec_for_backend(cfg, backend)
    return build_module(spec, config=cfg, layer_number=li + 1).eval()


_LAYER_MAP = ("our DSv4Attention state dict renamed by model/convert._MEG_ATTN (the to_megatron names, "
              "'self_attention.' stripped) and loaded strictly into dev's DSv4HybridSelfAttention (local backend, "
              "TELinear -> y = x W^T stand-in, rotate_activation -> fp32 Hadamard, config from "
              "to_megatron_config(debug, compress_ratios [0, 4, 128, 0]) + qk_layernorm, unfused rope), eval mode; "
              "hidden [S, 1, d]; CSA: rows whose top-k set hinges on a tie are zeroed on both sides")
for _li, _S, _kind in ((0, 37, "window"), (1, 37, "csa"), (2, 256, "hca")):
    mcase(f"dsv4_attention_{_kind}_layer", "D1", "megatron.core.transformer.experimental_attention_variant."
          "deepseek_v4_hybrid_attention.DSv4HybridSelfAttention.forward (spec get_dsv4_hybrid_module_spec_for_"
          "backend: CompressedSparseAttention, Compressor, CSAIndexer)", _LAYER_MAP,
          # measured: window out 4.8e-7, d_h 9.5e-7; HCA (S 256) out 6.0e-7, d_h 2.1e-6; CSA untied rows 4.5e-7
          # (5 of 37 rows tied, zeroed) -> 2e-5 abs (x9 on the worst, d_h of HCA)
          {k: (2e-5, 1e-5) for k in ("out", "d_h", "out_untied_rows")},
          (lambda li=_li, S=_S: _layer_inputs(li, S)))((_layer_ours, _layer_dev))


# =========================================================================================== D2: indexer
def _indexer_inputs():
    """qI [37, 2, 2, 16], kI [9, 2, 16], w [37, 2, 2] (debug indexer: 2 heads x 16, ratio 4, top-4), seed 5."""
    g = torch.Generator().manual_seed(5)
    return {"qI": torch.randn(37, 2, 2, 16, generator=g), "kI": torch.randn(9, 2, 16, generator=g),
            "w": torch.randn(37, 2, 2, generator=g), "ratio": 4, "k": 4}


def _indexer_ours(inp):
    from dsv4.kernels.indexer import indexer_topk
    L = {k: _leaf(inp[k]) for k in ("qI", "kI", "w")}
    I = _indexer_scores_sbhd(L["qI"], L["kI"], L["w"], inp["ratio"])               # [S, B, T]
    picks = indexer_topk(I, inp["k"])                                                # [S, B, k]
    res = _grads({"scores": I.transpose(0, 1)}, L)
    res.update(_topk_outputs(res["scores"], picks.transpose(0, 1)))
    return res


def _topk_outputs(scores: torch.Tensor, picks: torch.Tensor) -> dict:
    """Tie-aware top-k outputs, [B, S, k]: the score of every pick (-inf for -1) and the picks themselves where
    the picked score is unique in its row (-2 where another entry has the same score: ReLU makes many scores
    exactly 0, and which of the tied entries is picked is an order convention -- ours lower index first, dev's
    torch.topk unspecified)."""
    scores = scores.detach()
    val = torch.where(picks >= 0, scores.gather(-1, picks.clamp(min=0).long()), torch.tensor(float("-inf")))
    n_same = (scores.unsqueeze(-2) == val.unsqueeze(-1)).sum(-1)                    # [B, S, k]
    return {"topk_scores": val, "topk_untied": torch.where((n_same == 1) | (picks < 0), picks.long(),
                                                           torch.full_like(picks.long(), -2))}


def _indexer_dev(inp, M):
    L = {k: _leaf(inp[k]) for k in ("qI", "kI", "w")}
    S, B, nI, cI = inp["qI"].shape
    T = inp["kI"].shape[0]
    # the causal mask of CompressedSparseAttention._forward_unfused_csa, verbatim
    cm = torch.arange(T).unsqueeze(0).expand(S, -1)
    pos = torch.arange(1, S + 1).unsqueeze(1)
    cm = torch.where(cm >= pos // inp["ratio"], float("-inf"), 0.0).unsqueeze(0).expand(B, -1, -1)
    w_dev = L["w"] * nI ** -0.5 * cI ** -0.5
    scores, topk = M.dsa.fused_qk_topk_naive(L["qI"], L["kI"], w_dev, inp["k"], cm)
    res = _grads({"scores": scores}, L)
    res.update(_topk_outputs(res["scores"], topk))
    return res


mcase("indexer_scores_topk", "D2", "megatron.core.transformer.experimental_attention_variant.dsa."
      "fused_qk_topk_naive (mask: CompressedSparseAttention._forward_unfused_csa's causal mask)",
      "q = our qI [S,B,nI,cI], k = our kI [T,B,cI], weights = our w * nI^-1/2 * cI^-1/2 (dev multiplies by "
      "nI^-1/2 in CSAIndexer.forward_before_topk and by the indexer softmax_scale cI^-1/2 for the loss; ours "
      "folds both into indexer_scores); scores [B,S,T] (-inf where not causal); top-k compared tie-aware: the "
      "picked scores, and the picks whose score is unique in the row (-1 = none, -2 = tied)",
      # measured: scores, picked scores and grads 0 (bit-equal); 1e-6 abs floor
      {"scores": (1e-6, 1e-5), "topk_scores": (1e-6, 1e-5), "d_qI": (1e-6, 1e-5), "d_kI": (1e-6, 1e-5),
       "d_w": (1e-6, 1e-5)},
      _indexer_inputs)((_indexer_ours, _indexer_dev))


def _iloss_inputs(sparse):
    """The indexer loss with its joint teacher (window + compressed + sink share the denominator), debug-like
    shapes: main attention q [37, 2, 4, 32], kv [37, 2, 32], entries [9, 2, 32], sink [4], window 8, ratio 4;
    indexer qI [37, 2, 8, 16], kI [9, 2, 16], w = |N| + 0.1 [37, 2, 8] (8 heads and positive weights make exact
    score ties, which flip top-k picks between implementations, unlikely), top-4; seed 8."""
    g = torch.Generator().manual_seed(8)
    S, B, H, c, T = 37, 2, 4, 32, 9
    return {"q": torch.randn(S, B, H, c, generator=g), "kv": torch.randn(S, B, c, generator=g),
            "comp": torch.randn(T, B, c, generator=g), "sink": torch.randn(H, generator=g) * 0.3,
            "qI": torch.randn(S, B, 8, 16, generator=g), "kI": torch.randn(T, B, 16, generator=g),
            "w": torch.randn(S, B, 8, generator=g).abs() + 0.1, "window": 8, "ratio": 4, "k": 4,
            "scale": c ** -0.5, "sparse": sparse}


def _iloss_ours(inp):
    from dsv4.kernels.indexer import indexer_topk
    from dsv4.kernels.indexer.naive import causal_entry_mask
    from dsv4.model.indexer import candidates_from_idx, indexer_kl_loss, indexer_teacher
    L = {k: _leaf(inp[k]) for k in ("qI", "kI", "w")}
    S, B = inp["q"].shape[:2]
    T = inp["comp"].shape[0]
    I = _indexer_scores_sbhd(L["qI"], L["kI"], L["w"], inp["ratio"])                  # [S, B, T]
    picks = indexer_topk(I, inp["k"])
    seg, pos = _one_doc(S)
    if inp["sparse"]:
        cand, idx = candidates_from_idx(picks, T), picks
    else:
        cand = causal_entry_mask(seg, pos, *_entries(T), inp["ratio"])[:, None, :].expand(S, B, T)
        idx = None
    target = torch.stack([indexer_teacher(inp["q"][:, b], inp["kv"][:, b], inp["comp"][:, b], cand[:, b], inp["sink"],
                                          inp["window"], inp["scale"], "joint", seg, pos,
                                          idx=None if idx is None else idx[:, b]) for b in range(B)], dim=1)
    loss = indexer_kl_loss(I, target, cand)
    rows = cand.any(-1).sum()
    res = _grads({"loss": (loss * rows / (S * B)).reshape(1)}, L)   # dev's mean is over ALL S*B rows (manifest)
    res["target"] = target.transpose(0, 1)
    res.update({f"pick_{k}": v for k, v in _topk_outputs(I.transpose(0, 1), picks.transpose(0, 1)).items()})
    return res


def _iloss_dev(inp, M):
    L = {k: _leaf(inp[k]) for k in ("qI", "kI", "w")}
    q, kv, comp, sink = inp["q"], inp["kv"], inp["comp"], inp["sink"]
    S, B, H, c = q.shape
    T, nI, cI = comp.shape[0], inp["qI"].shape[2], inp["qI"].shape[3]
    win = M.csa.get_window_topk_idxs(inp["window"], B, S, torch.device("cpu"))
    nc_lse = M.csa._compute_unfused_csa_non_compressed_lse(q, kv, sink, win, inp["scale"])
    cm = torch.arange(T).unsqueeze(0).expand(S, -1)          # _forward_unfused_csa's causal mask, verbatim
    cm = torch.where(cm >= torch.arange(1, S + 1).unsqueeze(1) // inp["ratio"], float("-inf"), 0.0)
    cm = cm.unsqueeze(0).expand(B, -1, -1)
    pg = _NS(tp=_NS(size=lambda: 1))
    key = comp.unsqueeze(2).expand(-1, -1, H, -1)
    topk, loss = M.dsa.FusedDSAIndexerLoss.apply(L["qI"], L["w"] * nI ** -0.5 * cI ** -0.5, L["kI"], q, key,
                                                 inp["scale"], min(inp["k"], T), 1.0, cm, inp["sparse"], pg, None,
                                                 None, None, None, False, True, nc_lse)
    res = _grads({"loss": loss.reshape(1)}, L)
    # the teacher target itself, from dev's compute function (same inputs as the loss above)
    scores, _ = M.dsa.fused_qk_topk_naive(inp["qI"], inp["kI"], inp["w"] * nI ** -0.5 * cI ** -0.5, inp["k"], cm)
    res["target"] = _dev_target(M, q, key, inp["scale"], cm, topk, inp["sparse"], nc_lse)
    res.update({f"pick_{k}": v for k, v in _topk_outputs(scores, topk).items()})
    return res


def _dev_target(M, query, key, scale, mask, topk, sparse, nc_lse):
    """Dev's teacher target [B, S, T], built from compute_dsa_indexer_loss's own helpers in its order."""
    dm = M.dsa_masking
    S, B, H, c = query.shape
    T = key.shape[0]
    att = torch.einsum("sbhc,tbhc->bhst", query.float(), key.float()) * scale
    _, amask, _, base = dm.prepare_additive_mask(mask, sq=S, sk=T, b=B, device=att.device)
    att = att + amask
    imask = torch.full((B, S, T), float("-inf"))
    dm.scatter_topk_into_index_mask(imask, topk, seq_chunk_size=256)
    valid = base & (imask == 0) if sparse else base
    if sparse:
        att = att + imask.view(B, 1, S, T)
    p = M.dsa._compute_indexer_teacher_probabilities(att, valid, non_compressed_lse=nc_lse).sum(1)
    return M.dsa._normalize_indexer_teacher_target(p, nc_lse)


for _sp in (True, False):
    mcase(f"indexer_loss_joint_{'sparse' if _sp else 'dense'}", "D2",
          "megatron.core.transformer.experimental_attention_variant.dsa.FusedDSAIndexerLoss (fwd/bwd_fused_indexer_"
          "loss_naive; teacher: csa._compute_unfused_csa_non_compressed_lse + _compute_indexer_teacher_probabilities "
          "+ _normalize_indexer_teacher_target)",
          "as _forward_unfused_csa calls it: q_indexer = qI, weights = w * nI^-1/2 * cI^-1/2, k = kI, query = main q, "
          "key = entries expanded over heads, mask = its causal mask, sparse_loss as named, loss_coeff 1, "
          "non_compressed_lse from the window keys + sink; ours: indexer_scores, indexer_topk, indexer_teacher("
          "'joint'), indexer_kl_loss; our loss (mean over rows with >= 1 candidate) is multiplied by rows-with-"
          "candidates / (S*B) to dev's mean over all rows; target [B, S, T]; picks tie-aware",
          # measured (|loss| 0.19-0.25, |grad| <= 1.4e-2): loss 3.0e-8 -> 3e-7; target 1.2e-7 -> 1.2e-6;
          # grads <= 2.8e-9 -> 3e-8 abs (x10; NOT the 1e-6 floor, which would be 1e-4 of the gradients)
          {"loss": (3e-7, 0.0), "target": (1.2e-6, 0.0), "pick_topk_scores": (1e-6, 1e-5), "d_qI": (3e-8, 0.0),
           "d_kI": (3e-8, 0.0), "d_w": (3e-8, 0.0)},
          (lambda sp=_sp: _iloss_inputs(sp)))((_iloss_ours, _iloss_dev))


# =========================================================================================== ext_4531 / P2: mHC
def _sinkhorn_inputs():
    """comb logits [7, 4, 4] ~ 2 N(0,1) (mhc_ops_debug's token count and n = 4), 20 iterations, eps 1e-6."""
    return {"logits": torch.randn(7, 4, 4, generator=torch.Generator().manual_seed(0)) * 2, "iters": 20, "eps": 1e-6}


def _sinkhorn_ours(inp):
    from dsv4.kernels.mhc import sinkhorn
    L = {"logits": _leaf(inp["logits"])}
    return _grads({"comb": sinkhorn(L["logits"], inp["iters"], inp["eps"])}, L)


def _sinkhorn_dev(inp, M):
    L = {"logits": _leaf(inp["logits"])}
    return _grads({"comb": M.hc.native_sinkhorn(L["logits"], inp["iters"], inp["eps"])}, L)


mcase("sinkhorn", "ext_4531", "megatron.core.transformer.hyper_connection.native_sinkhorn (SinkhornKnopp)",
      "input_logits = our comb logits [N, n(j), n(k)] (softmax over the last axis on both sides)",
      # measured: comb 0, d_logits 0 (bit-equal, same op order) -> 1e-6 abs floor
      {"comb": (1e-6, 1e-5), "d_logits": (1e-6, 1e-5)}, _sinkhorn_inputs)((_sinkhorn_ours, _sinkhorn_dev))


def _hc_inputs(x_scale=1.0):
    """mhc_ops_debug's shapes (seed 0): streams x [S=7, B=1, n=4, C=16], fn [24, 64] ~ 0.3 N, base ~ N,
    scale ~ U(0.5, 1.5); the sublayer output f [7, 1, 16] ~ N."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 1, 4, 16, generator=g) * x_scale
    fn, base = torch.randn(24, 64, generator=g) * 0.3, torch.randn(24, generator=g)
    scale = torch.rand(3, generator=g) + 0.5
    f = torch.randn(7, 1, 16, generator=g)
    return {"x": x, "fn": fn, "base": base, "scale": scale, "f": f, "iters": 20}


def _hc_module_ours(inp):
    from dsv4.kernels.mhc import hc_post, hc_pre
    L = {k: _leaf(inp[k]) for k in ("x", "fn", "base", "scale", "f")}
    S, B, n, C = inp["x"].shape
    X = L["x"].reshape(S * B, n, C)
    u, post, comb = hc_pre(X, L["fn"], L["base"], L["scale"], inp["iters"], 1e-6, 1e-6)
    new = hc_post(X, L["f"].reshape(S * B, C), post, comb)
    return _grads({"aggregated": u.view(S, B, C), "h_post": post.view(S, B, n), "h_res": comb.view(S, B, n, n),
                   "x_new": new.view(S, B, n * C)}, L)


def _hc_module_dev(inp, M):
    L = {k: _leaf(inp[k]) for k in ("x", "fn", "base", "scale", "f")}
    S, B, n, C = inp["x"].shape
    cfg = M.TransformerConfig(num_layers=1, hidden_size=C, num_attention_heads=1, enable_hyper_connections=True,
                              num_residual_streams=n, mhc_sinkhorn_iterations=inp["iters"])
    mod = M.hc.HyperConnectionModule(cfg, layer_number=1)
    # our parameters become the module's (functional: gradients flow back to our leaves)
    params = {"mapping_proj.weight": L["fn"], "bias": L["base"], "alpha_pre": L["scale"][0:1],
              "alpha_post": L["scale"][1:2], "alpha_res": L["scale"][2:3]}
    def run(x):
        agg, h_res, h_post, residual = mod(x)
        new = M.hc.native_h_post_bda(h_res, residual.view(S, B, n, C), h_post, L["f"], None)
        return agg, h_post, h_res, new
    agg, h_post, h_res, new = _call_with(mod, params, run, L["x"].reshape(S, B, n * C))
    return _grads({"aggregated": agg, "h_post": h_post, "h_res": h_res, "x_new": new.reshape(S, B, n * C)}, L)


def _call_with(mod, params, fn, *args):
    """Run fn(*args) with mod's parameters replaced by `params` (tensors that carry our autograd graph)."""
    from torch.nn.utils import stateless
    with stateless._reparametrize_module(mod, params):
        return fn(*args)


_HC_MAP = ("HyperConnectionModule(TransformerConfig(num_residual_streams=4, mhc_sinkhorn_iterations=20), "
           "layer_number=1), eager (use_fused_mhc False): mapping_proj.weight = our hc_*_fn [(2+n)n, n*C] (rows "
           "pre | post | res, res row-major [j][k], same order), bias = our hc_*_base, alpha_pre/post/res = our "
           "hc_*_scale[0/1/2]; streams [S, B, n*C] stream-major; post: native_h_post_bda(h_res, residual, h_post, "
           "f) = H_res^T X + h_post f (our hc_post); ours: kernels.mhc hc_pre + hc_post (naive)")
# measured at stream RMS 1: aggregated 9.5e-7, h_post 9.5e-7, h_res 4.2e-7, x_new 2.4e-6 -> 3e-5 abs (x12);
# grads <= 8.6e-6 (d_fn; d_base 3.3e-6, d_x 3.1e-6) -> 1e-4 abs (x12). Part of it is the mapping norm
# 1/(|x|/sqrt(K) + eps) (dev) vs rsqrt(mean x^2 + eps) (ours): ~eps/rms = 1e-6 relative at RMS 1 (see manifest).
_HC_TOL = {k: (3e-5, 1e-5) for k in ("aggregated", "h_post", "h_res", "x_new")}
_HC_TOL.update({k: (1e-4, 1e-5) for k in ("d_x", "d_fn", "d_base", "d_scale", "d_f")})
mcase("hyper_connection_module", "ext_4531", "megatron.core.transformer.hyper_connection.HyperConnectionModule."
      "forward (compute_mappings: native_proj_rms, _compute_h, native_sinkhorn; aggregate) + native_h_post_bda",
      _HC_MAP, _HC_TOL, _hc_inputs)((_hc_module_ours, _hc_module_dev))


def _head_ours(inp):
    from dsv4.kernels.mhc import hc_head
    L = {k: _leaf(inp[k]) for k in ("x", "fn", "base", "scale")}
    S, B, n, C = inp["x"].shape
    y = hc_head(L["x"].reshape(S * B, n, C), L["fn"][:n], L["base"][:n], L["scale"][:1], 1e-6, 1e-6)
    return _grads({"y": y.view(S, B, C)}, L)


def _head_dev(inp, M):
    L = {k: _leaf(inp[k]) for k in ("x", "fn", "base", "scale")}
    S, B, n, C = inp["x"].shape
    y = M.hc.learned_output_contract(L["x"].reshape(S, B, n * C), L["fn"][:n], L["base"][:n], L["scale"][:1], n, 1e-6)
    return _grads({"y": y}, L)


mcase("hyper_head", "P2", "megatron.core.transformer.hyper_connection.learned_output_contract (the n-stream -> 1 "
      "head contraction, hc_head_fn / hc_head_base / hc_head_scale)",
      "head_fn = our hc_head_fn [n, n*C] (here the first n rows of the mHC case's fn), base = hc_head_base [n], "
      "scale = hc_head_scale [1], eps 1e-6 for both the sigmoid offset and the RMS; streams [S, B, n*C]; ours: "
      "kernels.mhc hc_head(x, fn, base, scale, hc_eps, rms_norm_eps)",
      # measured: y 4.8e-7, grads <= 9.5e-7 (d_fn) -> 1e-5 abs (x10)
      {k: (1e-5, 1e-5) for k in ("y", "d_x", "d_fn", "d_base", "d_scale")}, _hc_inputs)((_head_ours, _head_dev))


# =========================================================================================== P6: RoPE
class _CP1:
    """A one-rank context-parallel group (dev's rope helpers ask it for size / rank)."""
    size = staticmethod(lambda: 1)
    rank = staticmethod(lambda: 0)


def _rope_inputs(table):
    """debug config (r = 8 of c = 32; compress table: theta 160000, YaRN factor 16 over 64 positions, beta 32/1;
    main table: theta 10000): compress -> 9 entries [9, 2, 32] at positions 4w (ratio 4); main -> q [37, 2, 4, 32]
    at positions 0..36 (seed 9)."""
    g = torch.Generator().manual_seed(9)
    if table == "compress":
        return {"x": torch.randn(9, 2, 32, generator=g), "table": table, "ratio": 4, "n": 9}
    return {"x": torch.randn(37, 2, 4, 32, generator=g), "table": table, "ratio": 1, "n": 37}


def _rope_ours(inp):
    from dsv4.model.config import get_config
    from dsv4.model.rope import RotaryTable
    L = {"x": _leaf(inp["x"])}
    rt = RotaryTable(get_config("debug"), inp["table"])
    pos = torch.arange(inp["n"]) * inp["ratio"]
    return _grads({"rotated": rt(L["x"], pos), "inverse": rt(L["x"], pos, inverse=True)}, L)


def _rope_dev(inp, M):
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding

    from dsv4.model.config import get_config
    from dsv4.model.interop.megatron_config import to_megatron_config
    mc = to_megatron_config(get_config("debug"))               # the config map feeds dev's rope modules
    r = mc["qk_pos_emb_head_dim"]
    cfg = M.MLATransformerConfig(num_layers=1, hidden_size=mc["hidden_size"], num_attention_heads=4,
                                 multi_latent_attention=True, qk_pos_emb_head_dim=r, apply_rope_fusion=False,
                                 rotary_scaling_factor=mc["rotary_scaling_factor"], beta_fast=mc["beta_fast"],
                                 original_max_position_embeddings=mc["original_max_position_embeddings"],
                                 beta_slow=mc["beta_slow"], mscale=1.0, mscale_all_dim=0.0,
                                 use_cpu_initialization=True)
    if inp["table"] == "compress":        # DSv4HybridSelfAttention.__init__: YaRN for ratio > 1 layers
        emb = YarnRotaryEmbedding(r, rotary_base=mc["csa_compress_rotary_base"], scaling_factor=cfg.rotary_scaling_factor,
                                  original_max_position_embeddings=cfg.original_max_position_embeddings,
                                  beta_fast=cfg.beta_fast, beta_slow=cfg.beta_slow, mscale=cfg.mscale,
                                  mscale_all_dim=cfg.mscale_all_dim, use_cpu_initialization=True)
    else:                                 # window-only layers: plain RoPE at rotary_base
        emb = RotaryEmbedding(r, rotary_percent=1.0, rotary_base=mc["rotary_base"], use_cpu_initialization=True)
    L = {"x": _leaf(inp["x"])}
    c = inp["x"].shape[-1]
    rotated = M.csa._apply_rope(L["x"], c - r, r, emb, cfg, inp["n"], ratio=inp["ratio"], cp_group=_CP1)
    # the inverse rotation of the attention output, as DSv4HybridSelfAttention.forward applies it (unfused path)
    table = emb(inp["n"] * inp["ratio"], packed_seq=False)
    table = (table[0] if isinstance(table, tuple) else table)[::inp["ratio"]][: inp["n"]]
    x4 = L["x"] if L["x"].dim() == 4 else L["x"].unsqueeze(-2)
    nope, rot = torch.split(x4, [c - r, r], dim=-1)
    inv = apply_rotary_pos_emb(rot, table, cfg, mscale=1.0, cp_group=_CP1, mla_rotary_interleaved=True, inverse=True,
                               mla_output_remove_interleaving=True)
    inv = torch.cat([nope, inv], dim=-1)
    return _grads({"rotated": rotated, "inverse": inv if L["x"].dim() == 4 else inv.squeeze(-2)}, L)


for _t in ("compress", "main"):
    mcase(f"rope_{_t}", "P6", "megatron.core.transformer.experimental_attention_variant.csa._apply_rope with "
          f"{'YarnRotaryEmbedding' if _t == 'compress' else 'RotaryEmbedding'} (unfused; interleaved + "
          "remove_interleaving) and rope_utils.apply_rotary_pos_emb(inverse=True) as DSv4HybridSelfAttention.forward",
          "dev's rope module and config built from model/megatron_config.to_megatron_config(debug) (qk_pos_emb_head_dim, "
          "csa_compress_rotary_base / rotary_base, rotary_scaling_factor, original_max_position_embeddings, beta_fast/"
          "slow; mscale 1); last r dims of each head rotated, positions = entry index * ratio; ours: RotaryTable("
          f"debug, {_t!r}) forward and inverse",
          # measured: rotated / inverse / gradient bit-equal (0) -> 1e-6 abs floor
          {k: (1e-6, 1e-5) for k in ("rotated", "inverse", "d_x")}, (lambda t=_t: _rope_inputs(t)))((_rope_ours, _rope_dev))


# =========================================================================================== P4: hash routing
def _hash_inputs():
    """debug config (V 256, E 8, K 2, routed_scaling_factor 1.5): our seeded hash_table, gate weight ~ N/8,
    hidden [S=7, B=2, 64] ~ N, ids [B, S] (seed 1 as hash_and_score_routing_debug)."""
    from dsv4.model.config import get_config
    from dsv4.model.moe import hash_table
    cfg = get_config("debug")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 2, cfg.hidden_size, generator=g)
    ids = torch.randint(0, cfg.vocab_size, (2, 7), generator=g)
    W = torch.randn(cfg.n_routed_experts, cfg.hidden_size, generator=g) / 8
    return {"x": x, "ids": ids, "W": W, "tid2eid": hash_table(cfg), "scale": cfg.routed_scaling_factor}


def _hash_ours(inp):
    from dsv4.model.config import get_config
    from dsv4.model.moe import Gate
    gate = Gate(get_config("debug"), 0)
    assert gate.hash
    L = {"W": _leaf(inp["W"])}
    x = inp["x"].reshape(-1, inp["x"].shape[-1])                  # s-major tokens, as dev flattens [s, b, h]
    ids = inp["ids"].T.reshape(-1)                                 # the same order
    with _swap_param(gate, "weight", L["W"]):
        gate.tid2eid.copy_(inp["tid2eid"])
        w, idx, _ = gate.eval()(x, ids)
    probs = torch.zeros(x.shape[0], gate.n_experts).scatter(1, idx, w)
    res = _grads({"probs": probs}, L)
    res["routing_map"] = torch.zeros_like(probs, dtype=torch.int32).scatter(1, idx, 1).bool()
    return res


class _swap_param:
    def __init__(self, mod, name, t):
        self.mod, self.name, self.t = mod, name, t

    def __enter__(self):
        self.old = self.mod._parameters.pop(self.name)
        setattr(self.mod, self.name, self.t)

    def __exit__(self, *a):
        delattr(self.mod, self.name)
        self.mod._parameters[self.name] = self.old


def _hash_dev(inp, M):
    L = {"W": _leaf(inp["W"])}
    logits = F.linear(inp["x"].reshape(-1, inp["x"].shape[-1]), L["W"])
    shim = _NS(score_function="sqrtsoftplus", tid2eid=inp["tid2eid"].to(torch.int32),
               config=_NS(moe_router_force_load_balancing=False, moe_router_force_biased=None,
                          moe_router_topk_scaling_factor=inp["scale"]))
    probs, rmap = M.router.TopKRouter._hash_routing(shim, logits, inp["ids"])
    res = _grads({"probs": probs}, L)
    res["routing_map"] = rmap
    return res


mcase("hash_routing", "P4", "megatron.core.transformer.moe.router.TopKRouter._hash_routing",
      "logits = x @ W^T (our gate weight), self.tid2eid = our hash_table(cfg) cast to int32 (dev's dtype), "
      "score_function sqrtsoftplus, moe_router_topk_scaling_factor = routed_scaling_factor 1.5; input_ids "
      "[B, S] (dev transposes to s-major); ours: Gate(layer 0) on the same s-major tokens, (w, idx) scattered "
      "to [T, E]",
      # measured: probs 0, d_W 0 (bit-equal) -> 1e-6 abs floor; routing_map exact
      {"probs": (1e-6, 1e-5), "d_W": (1e-6, 1e-5)}, _hash_inputs)((_hash_ours, _hash_dev))


def _hash_layers_inputs():
    """flash config (43 layers, 3 hash layers): which routers are hash-routed, hybrid and GPT numbering."""
    return {"name": "flash"}


def _hash_layers_ours(inp):
    from dsv4.model.config import get_config
    cfg = get_config(inp["name"])
    ours = torch.tensor([int(cfg.is_hash(i)) for i in range(cfg.num_hidden_layers)])
    return {"hybrid_ffn_sublayers": ours, "gpt_layers": ours.clone()}


def _hash_layers_dev(inp, M):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.router import TopKRouter

    from dsv4.model.config import get_config
    from dsv4.model.interop.megatron_config import to_megatron_config
    _dev_world(M)                                               # initialises the gloo world of one (once)
    cfg = get_config(inp["name"])
    pg = ProcessGroupCollection.use_mpu_process_groups()
    out = {}
    for layout, key, number in (("hybrid", "hybrid_ffn_sublayers", lambda i: 2 * i + 2), ("gpt", "gpt_layers",
                                                                                          lambda i: i + 1)):
        mc = to_megatron_config(cfg, layout)
        c = M.TransformerConfig(num_layers=cfg.num_hidden_layers, hidden_size=64, num_attention_heads=4,
                                num_moe_experts=8, moe_router_topk=2, moe_n_hash_layers=mc["moe_n_hash_layers"],
                                actual_vocab_size=256, moe_router_score_function="sqrtsoftplus",
                                moe_router_enable_expert_bias=True, add_bias_linear=False,
                                use_cpu_initialization=True, moe_router_load_balancing_type="seq_aux_loss",
                                moe_aux_loss_coeff=0.0)
        out[key] = torch.tensor([int(TopKRouter(config=c, pg_collection=pg, layer_number=number(i)).is_hash_layer)
                                 for i in range(cfg.num_hidden_layers)])
    return out


mcase("hash_layer_selection", "P4", "megatron.core.transformer.moe.router.TopKRouter.__init__ (is_hash_layer = "
      "layer_number <= moe_n_hash_layers)",
      "dev's real TopKRouter built at the layer number of each of our layers' FFN: hybrid path 2i+2 (every pattern "
      "symbol is one number), GPT path i+1, with moe_n_hash_layers from model/megatron_config.to_megatron_config("
      "flash, layout) (6 hybrid, 3 gpt); ours: cfg.is_hash(i)",
      {}, _hash_layers_inputs)((_hash_layers_ours, _hash_layers_dev))


# =========================================================================================== P5: clamped SwiGLU
def _swiglu_inputs(limit):
    """clamped_swiglu_debug's gate/up [3, 17] ~ 4 N(0,1) (seed 0)."""
    g = torch.Generator().manual_seed(0)
    return {"gate": torch.randn(3, 17, generator=g) * 4, "up": torch.randn(3, 17, generator=g) * 4, "limit": limit}


def _swiglu_ours(inp):
    from dsv4.kernels.swiglu import clamped_swiglu
    L = {k: _leaf(inp[k]) for k in ("gate", "up")}
    return _grads({"y": clamped_swiglu(L["gate"], L["up"], inp["limit"])}, L)


def _swiglu_dev(inp, M):
    L = {k: _leaf(inp[k]) for k in ("gate", "up")}
    y = M.swiglu.bias_swiglu_impl(torch.cat([L["gate"], L["up"]], dim=-1), None, clamp_value=inp["limit"])
    return _grads({"y": y}, L)


for _lim in (0.5, 10.0):
    mcase(f"clamped_swiglu_limit{_lim:g}", "P5", "megatron.core.fusions.fused_bias_swiglu.bias_swiglu_impl"
          "(clamp_value=L) (SwiGLUFunction: clamped_swiglu / clamped_swiglu_back)",
          "input = cat([gate, up], -1) (dev chunks: first half = glu/gate, clamped above; second = linear/up, "
          "clamped both sides); activation_func_clamp_value = our swiglu_limit",
          # measured: y 0, d_up 0, d_gate <= 9.5e-7 (limit 10; dev's hand-written backward vs autograd) -> 1e-5
          {"y": (1e-6, 1e-5), "d_gate": (1e-5, 1e-5), "d_up": (1e-6, 1e-5)},
          (lambda lim=_lim: _swiglu_inputs(lim)))((_swiglu_ours, _swiglu_dev))


# =========================================================================================== documented differences
# Dev's outputs where we deliberately DIFFER (a [[differences]] entry): imported like the others, not part of
# `verify --against` (which judges agreement); harness/tests/test_megatron_dev.py checks that the difference is
# the documented one (ours is off by what the manifest says, and the formula the manifest names for dev
# reproduces dev's golden).
DIFF_CASES: list[MCase] = []


def _hc_small_dev(inp, M):
    res = _hc_module_dev(inp, M)
    return {k: res[k] for k in ("aggregated", "h_post", "h_res", "x_new")}


def _hc_small_ours(inp):
    res = _hc_module_ours(inp)
    return {k: res[k] for k in ("aggregated", "h_post", "h_res", "x_new")}


DIFF_CASES.append(MCase(
    "mhc_mapping_norm_rms1e-3", "ext_4531", lambda: _hc_inputs(1e-3), _hc_small_ours,
    _hc_small_dev, "megatron.core.transformer.hyper_connection.HyperConnectionModule.forward (native_proj_rms: "
    "1 / (|x| / sqrt(K) + eps)) + native_h_post_bda", _HC_MAP + "; streams scaled to RMS 1e-3",
    {k: (1e-6, 1e-5) for k in ("aggregated", "h_post", "h_res", "x_new")},
    "hyper_connection_module's inputs with the streams scaled by 1e-3 (RMS 1e-3 = sqrt(eps))"))


def _hc_bf16_inputs():
    inp = _hc_inputs(1.0)
    return dict(inp, x=inp["x"].bfloat16(), f=inp["f"].bfloat16())


DIFF_CASES.append(MCase(
    "mhc_bf16_mixing_weights", "ext_4531", _hc_bf16_inputs, _hc_small_ours, _hc_small_dev,
    "megatron.core.transformer.hyper_connection.HyperConnectionModule.compute_mappings (returns h_pre, h_post, "
    "h_res cast to the activation dtype) + native_h_post_bda", _HC_MAP + "; bf16 streams and sublayer output",
    {k: (1e-2, 1e-2) for k in ("aggregated", "h_post", "h_res", "x_new")},
    "hyper_connection_module's inputs with x and f in bf16 (parameters fp32)"))


# whole-layer (MoE, MTP) and packed / context-parallel cases register themselves into CASES
from dsv4.harness import megatron_cases_layers, megatron_cases_packed  # noqa: E402,F401


def by_slice() -> dict[str, list[MCase]]:
    out: dict[str, list[MCase]] = {}
    for c in CASES:
        out.setdefault(c.slice, []).append(c)
    return out


def get(name: str) -> MCase:
    for c in CASES + DIFF_CASES:
        if c.name == name:
            return c
    raise KeyError(name)
