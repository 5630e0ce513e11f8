"""Probes of the differences between Megatron-LM dev and ours (numbers quoted in the slices' manifests).

    TORCHDYNAMO_DISABLE=1 python -m dsv4.harness.megatron_probes /path/to/Megatron-LM

Prints, for the checkout's dev functions: the mHC mapping-norm difference vs stream RMS (and with our formula
swapped into dev), bf16 rounding of mHC / compressor weights, the compressor at S < ratio, the sparse kernel
on duplicate / future indices, and dev's packed-THD vs per-sequence indexer top-k (are the differences tie
flips?). Nothing is written; goldens come from `dsv4 goldens import-megatron`.
"""
from __future__ import annotations

import sys

import torch


def main(path: str) -> None:
    torch.set_num_threads(1)
    from dsv4.harness import megatron_cases as MC
    from dsv4.harness import megatron_import as MI
    M = MI._dev_modules(path)
    hc = MC.get("hyper_connection_module")
    keys = ("aggregated", "h_post", "h_res", "x_new")
    for sc in (1.0, 1e-1, 1e-2, 1e-3):
        inp = MC._hc_inputs(sc)
        o, d = hc.ours(inp), hc.dev(inp, M)
        print(f"mHC stream RMS {sc:g}: ours vs dev max|diff| " + ", ".join(f"{k} {float((o[k] - d[k]).abs().max()):.2e}" for k in keys))
    old_init = M.hc.HyperConnectionModule.__init__

    def ours_rms(x, w, eps=1e-6):
        return torch.matmul(x, w.t()), torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    def init(self, *a, **k):
        old_init(self, *a, **k)
        self._proj_rms_op = ours_rms
    M.hc.HyperConnectionModule.__init__ = init
    inp = MC._hc_inputs(1e-3)
    o, d = hc.ours(inp), hc.dev(inp, M)
    M.hc.HyperConnectionModule.__init__ = old_init
    print("mHC stream RMS 1e-3, rsqrt(mean x^2 + eps) swapped into dev: " + ", ".join(f"{k} {float((o[k] - d[k]).abs().max()):.2e}" for k in keys))
    inp = MC._hc_inputs(1.0)
    inpb = dict(inp, x=inp["x"].bfloat16(), f=inp["f"].bfloat16())
    o, d = hc.ours(inpb), hc.dev(inpb, M)
    print("mHC bf16 streams: " + ", ".join(f"{k} ours {o[k].dtype} dev {d[k].dtype} {float((o[k].float() - d[k].float()).abs().max()):.2e}" for k in keys))
    ci = MC._compressor_inputs(37, 2, 64, 32, 4, True, 1)
    cib = dict(ci, x=ci["x"].bfloat16(), wkv=ci["wkv"].bfloat16(), wgate=ci["wgate"].bfloat16())
    o, d = MC._compressor_ours(cib), MC._compressor_dev(cib, M)
    print(f"compressor bf16 (softmax weights rounded to bf16 in dev): max|diff| {float((o['out'].float() - d['out'].float()).abs().max()):.2e}"
          f", max|out| {float(d['out'].float().abs().max()):.2f}")
    ci = MC._compressor_inputs(3, 1, 64, 32, 4, True, 1)
    shim_out = _dev_compressor_raw(ci, M)
    print(f"compressor S=3 < ratio 4: dev returns {shim_out!r}; ours "
          f"{tuple(MC._compressor_sbhd(ci['x'] @ ci['wkv'].T, ci['x'] @ ci['wgate'].T, ci['ape'], 4, True).shape)}")
    from dsv4.kernels.sparse_attn import sparse_attn
    ai = MC._attn_inputs("hca")
    S, B = ai["q"].shape[:2]
    win = M.csa.get_window_topk_idxs(8, B, S, torch.device("cpu"))
    seg, pos = MC._one_doc(S)          # each batch row one document (our kernels are token-major)
    oo = torch.stack([sparse_attn(ai["q"][:, b], ai["kv"][:, b], None, None, ai["sink"], 8, 16, ai["scale"], seg, pos)
                      for b in range(B)], dim=1).reshape(S, B, -1)
    dup = torch.cat([win, win[..., -1:]], -1).int()
    od = M.csa.unfused_compressed_sparse_attn(ai["q"], ai["kv"], ai["sink"], dup, ai["scale"])
    fut = win.clone()
    fut[..., 0] = (torch.arange(S) + 1).clamp(max=S - 1)
    of = M.csa.unfused_compressed_sparse_attn(ai["q"], ai["kv"], ai["sink"], fut.int(), ai["scale"])
    print(f"sparse kernel, diagonal key listed twice: dev vs ours {float((od - oo).abs().max()):.2e}; "
          f"a future key listed: {float((of - oo).abs().max()):.2e} (ours masks both; dev trusts the caller)")
    packed_probe(M)
    packed_layer_probe(M)


def _dev_compressor_raw(ci, M):
    from dsv4.harness.megatron_cases import _NS
    import torch.nn.functional as F
    shim = _NS(compress_ratio=4, head_dim=ci["D"], overlap=True, coff=2, config=_NS(), qk_pos_emb_head_dim=0,
               rotary_pos_emb=None, rotate=False, pg_collection=_NS(cp=None), ape=ci["ape"],
               linear_wkv=lambda x: (F.linear(x, ci["wkv"]), None), linear_wgate=lambda x: (F.linear(x, ci["wgate"]), None),
               norm=lambda t: t)
    return M.csa.Compressor._forward_sbhd(shim, ci["x"])


def packed_probe(M, lens=(37, 29, 45), ratio=4, topk=4, seed=7):
    """Dev's packed THD indexer top-k (CSAIndexer.forward's THD branch: varlen bounds over the concatenated
    compressed keys) vs dev's SBHD top-k per sequence, on the same q / k / weights."""
    g = torch.Generator().manual_seed(seed)
    nI, cI = 2, 16
    qs = [torch.randn(L, 1, nI, cI, generator=g) for L in lens]
    ks = [torch.randn(L // ratio, 1, cI, generator=g) for L in lens]
    ws = [torch.randn(L, 1, nI, generator=g) for L in lens]
    per, per_scores = [], []
    for q, k, w in zip(qs, ks, ws):
        L, T = q.shape[0], k.shape[0]
        cm = torch.arange(T).unsqueeze(0).expand(L, -1)
        cm = torch.where(cm >= torch.arange(1, L + 1).unsqueeze(1) // ratio, float("-inf"), 0.0).unsqueeze(0)
        sc, idx = M.dsa.fused_qk_topk_naive(q, k, w, topk, cm)
        per.append(idx[0])
        per_scores.append(sc[0])
    cu_q = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    cu_c = torch.tensor([0] + list(torch.tensor([L // ratio for L in lens]).cumsum(0)), dtype=torch.int32)
    q, k, w = torch.cat(qs).squeeze(1), torch.cat(ks).squeeze(1), torch.cat(ws).squeeze(1)
    starts, ends, _, offs = M.csa._build_compressed_thd_indexer_metadata(cu_q, cu_c, total_q=q.shape[0], ratio=ratio)
    _, gidx = M.dsa.fused_qk_topk_naive(q.unsqueeze(1), k.unsqueeze(1), w.unsqueeze(1), min(topk, k.shape[0]),
                                        varlen_starts=starts, varlen_ends=ends)
    packed = M.csa._compressed_thd_topk_to_local(gidx, offs)
    per_all = torch.cat(per)
    rows = (torch.sort(packed, -1).values != torch.sort(per_all, -1).values).any(-1)
    scores = torch.cat([torch.nn.functional.pad(s, (0, max(x.shape[-1] for x in per_scores) - s.shape[-1]),
                                                value=float("-inf")) for s in per_scores])
    def picked(idx):
        return torch.where(idx >= 0, scores.gather(-1, idx.clamp(min=0).long()), torch.tensor(float("-inf")))
    same_scores = torch.equal(torch.sort(picked(packed), -1).values, torch.sort(picked(per_all), -1).values)
    print(f"dev packed THD vs per-sequence indexer top-{topk} ({len(lens)} docs {lens}, ratio {ratio}): "
          f"{int(rows.sum())}/{rows.numel()} rows pick a different set; multiset of picked scores identical: "
          f"{same_scores} (so every difference is a choice among tied scores)")




def packed_layer_probe(M, lens=(37, 29, 45)):
    """Dev's whole CSA layer (DSv4HybridSelfAttention, our seeded debug weights) on 3 packed documents (THD,
    PackedSeqParams) vs each document alone: which rows differ, and are they the rows whose top-k is tie-decided?"""
    from megatron.core.packed_seq_params import PackedSeqParams

    from dsv4.harness import megatron_cases as MC
    attn_ours, _ = MC._our_layer({"li": 1, "S": 37})
    dev = MC._dev_attention(M, 1)
    from dsv4.model.interop import megatron as CV
    names = {o[len("attn."):]: m[len("self_attention."):] for o, m in CV._MEG_ATTN if o.startswith("attn.")}
    dev.load_state_dict({names[k]: v for k, v in attn_ours.state_dict().items()}, strict=False)
    g = torch.Generator().manual_seed(11)
    docs = [torch.randn(L, 1, 64, generator=g) for L in lens]
    ind = dev.core_attention.indexer
    fwd, cap = ind.forward, {}

    def capture(*a, **k):
        r = fwd(*a, **k)
        cap.setdefault("topk", []).append(r[1])
        cap.setdefault("scores", []).append(r[0])
        return r
    ind.forward = capture
    with torch.no_grad():
        per = [dev(d, None)[0] for d in docs]
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lens),
                              max_seqlen_kv=max(lens))
        packed = dev(torch.cat(docs), None, packed_seq_params=psp)[0]
    tied = []
    for s, p in zip(cap["scores"][:3], cap["topk"][:3]):
        t = MC._layer_tie_outputs(torch.zeros(p.shape[1], 1), p[0], s[0])["tied_rows"]
        tied.append(t)
    tied = torch.cat(tied)
    diff = (packed - torch.cat(per)).abs().amax(-1)[:, 0]
    bad = diff > 1e-5
    print(f"dev whole CSA layer, packed THD vs per-document ({lens}): max|diff| {float(diff.max()):.2e} on "
          f"{int(bad.sum())} rows; all of them tie-decided rows: {bool((bad <= tied).all())} "
          f"({int(tied.sum())} tie-decided rows); max|diff| on the other rows {float(diff[~tied].max()):.2e}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/work/megatron-dev")
