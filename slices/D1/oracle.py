"""Independent fp64 per-query loop oracle of one DSv4 attention layer, for the D1 / D2 tests (not a test file).

Written from the spec (§5.1-5.6, §6.2-6.3, §7.2, §8) with explicit Python loops; it shares no code with
`dsv4.model` or `dsv4.kernels`: RoPE through complex numbers, YaRN frequencies from the §5.6 formula in Python
floats, the compressor one window at a time, the indexer one (query, entry, head) at a time, top-k by a Python
sort (score descending, entry index ascending), and one softmax per query over its explicit key list + sink.
Input: the layer's parameters by OFFICIAL name (a state dict of `DSv4Attention`).
"""
from __future__ import annotations

import math

import torch

F64 = torch.float64


def inv_freq64(r: int, base: float, yarn: dict | None) -> torch.Tensor:
    freqs = [base ** (-2.0 * i / r) for i in range(r // 2)]
    if yarn:
        def corr(nrot):
            return r * math.log(yarn["original_max_position_embeddings"] / (nrot * 2 * math.pi)) / (2 * math.log(base))
        low = max(math.floor(corr(yarn["beta_fast"])), 0)
        high = min(math.ceil(corr(yarn["beta_slow"])), r - 1)
        if low == high:
            high += 0.001
        f = yarn["factor"]
        ramps = [min(max((i - low) / (high - low), 0.0), 1.0) for i in range(r // 2)]
        freqs = [fr / f * a + fr * (1 - a) for fr, a in zip(freqs, ramps)]
    return torch.tensor(freqs, dtype=F64)


def rope64(x: torch.Tensor, pos: int, freqs: torch.Tensor, r: int, inverse: bool = False) -> torch.Tensor:
    """Rotate the last r dims of x [..., c] as complex pairs (2i, 2i+1) by angle pos*freq (or its negative)."""
    c = x.shape[-1]
    z = torch.complex(x[..., c - r::2], x[..., c - r + 1::2])
    ang = (-1.0 if inverse else 1.0) * float(pos) * freqs
    z = z * torch.polar(torch.ones_like(ang), ang)
    out = x.clone()
    out[..., c - r::2], out[..., c - r + 1::2] = z.real, z.imag
    return out


def rms(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    return y * w if w is not None else y


def compress_loop(X, P, prefix, m, overlap, D, freqs, r, eps, positions):
    """X [S, d] -> list of entries [D] (spec §6.2 / §6.3), one window at a time."""
    C, Z, ape = X @ P[prefix + "wkv.weight"].T, X @ P[prefix + "wgate.weight"].T, P[prefix + "ape"]
    entries = []
    for w in range(X.shape[0] // m):
        vals, logits = [], []
        if overlap:
            if w > 0:
                for j in range((w - 1) * m, w * m):            # previous window, FIRST half of the channels
                    vals.append(C[j, :D]); logits.append(Z[j, :D] + ape[j - (w - 1) * m, :D])
            for j in range(w * m, (w + 1) * m):                # current window, SECOND half
                vals.append(C[j, D:]); logits.append(Z[j, D:] + ape[j - w * m, D:])
        else:
            for j in range(w * m, (w + 1) * m):
                vals.append(C[j]); logits.append(Z[j] + ape[j - w * m])
        alpha = torch.softmax(torch.stack(logits), dim=0)      # per channel over the slots
        e = (alpha * torch.stack(vals)).sum(0)
        e = rms(e, P[prefix + "norm.weight"], eps)
        entries.append(rope64(e, int(positions[w * m]), freqs, r))
    return entries


def oracle_layer(cfg, layer_idx, state_dict, h, positions=None, dense=False):
    """h [B,S,d] -> dict(out [B,S,d] fp64, sel [B][S] lists, scores [B,S,T] (CSA), attended [B][S] lists of
    compressed entries, probs [B][S] {entry: p[H]} (joint softmax), clogits [B][S] {entry: logits[H]})."""
    P = {k: v.detach().to(F64) for k, v in state_dict.items()}
    h = h.detach().to(F64)
    B, S, d = h.shape
    kind, m = cfg.layer_kind(layer_idx), cfg.compress_ratios[layer_idx]
    H, c, r, g, eps = cfg.num_attention_heads, cfg.head_dim, cfg.qk_rope_head_dim, cfg.o_groups, cfg.rms_norm_eps
    nI, cI, win = cfg.index_n_heads, cfg.index_head_dim, cfg.sliding_window
    pos = list(range(S)) if positions is None else [int(p) for p in positions]
    freqs = (inv_freq64(r, cfg.rope_theta, None) if kind == "window"
             else inv_freq64(r, cfg.compress_rope_theta, cfg.rope_scaling))
    dg = cfg.o_lora_rank
    res = {"out": torch.zeros(B, S, d, dtype=F64), "sel": [], "attended": [], "probs": [], "clogits": [],
           "scores": None}
    T = S // m if m else 0
    if kind == "csa":
        res["scores"] = torch.full((B, S, T), float("-inf"), dtype=F64)
    for b in range(B):
        X = h[b]
        cq = rms(X @ P["wq_a.weight"].T, P["q_norm.weight"], eps)
        q = rms((cq @ P["wq_b.weight"].T).view(S, H, c), None, eps)
        kv = rms(X @ P["wkv.weight"].T, P["kv_norm.weight"], eps)
        q = torch.stack([rope64(q[t], pos[t], freqs, r) for t in range(S)])
        kv = torch.stack([rope64(kv[t], pos[t], freqs, r) for t in range(S)])
        comp = compress_loop(X, P, "compressor.", m, kind == "csa", c, freqs, r, eps, pos) if kind != "window" else []
        if kind == "csa":
            kI = compress_loop(X, P, "indexer.compressor.", cfg.csa_ratio, True, cI, freqs, r, eps, pos)
            qI = (cq @ P["indexer.wq_b.weight"].T).view(S, nI, cI)
            qI = torch.stack([rope64(qI[t], pos[t], freqs, r) for t in range(S)])
            wI = X @ P["indexer.weights_proj.weight"].T
        sel_b, att_b, prob_b, cl_b = [], [], [], []
        for t in range(S):
            n_complete = (t + 1) // m if m else 0
            sel = []
            if kind == "csa":
                for j in range(n_complete):
                    s = 0.0
                    for hh in range(nI):
                        s += float(wI[t, hh]) / math.sqrt(nI) * max(float(qI[t, hh] @ kI[j]), 0.0) / math.sqrt(cI)
                    res["scores"][b, t, j] = s
                order = sorted(range(n_complete), key=lambda j: (-float(res["scores"][b, t, j]), j))
                sel = order[: min(cfg.index_topk, T)]
            entries = list(range(n_complete)) if (kind == "hca" or (kind == "csa" and dense)) else sel
            keys = [kv[s] for s in range(max(0, t - win + 1), t + 1)] + [comp[j] for j in entries]
            K = torch.stack(keys)                                          # [n, c]
            logits = (q[t] @ K.T) / math.sqrt(c)                           # [H, n]
            p = torch.softmax(torch.cat([logits, P["attn_sink"].view(H, 1)], dim=1), dim=1)[:, :-1]
            o = rope64(p @ K, pos[t], freqs, r, inverse=True)              # [H, c]
            og = o.reshape(g, H * c // g)
            z = torch.cat([og[i] @ P["wo_a.weight"][i * dg:(i + 1) * dg].T for i in range(g)])
            res["out"][b, t] = z @ P["wo_b.weight"].T
            nw = len(keys) - len(entries)
            sel_b.append(sel); att_b.append(entries)
            prob_b.append({j: p[:, nw + i] for i, j in enumerate(entries)})
            cl_b.append({j: logits[:, nw + i] for i, j in enumerate(entries)})
        res["sel"].append(sel_b); res["attended"].append(att_b); res["probs"].append(prob_b); res["clogits"].append(cl_b)
    return res
