"""Packed THD layout: many documents in one token stream, each attended exactly as if it ran alone (D5, D6).

Megatron's `PackedSeqParams` describe a packed batch `[1, T]` with
  cu_seqlens        [n_docs+1]  cumulative REAL lengths of the documents,
  cu_seqlens_padded [n_docs+1]  cumulative PADDED lengths = the offsets of the documents in the stream
                                (document i occupies tokens cu_padded[i] .. cu_padded[i] + len_i - 1; the rest
                                of its padded slot is padding). Without it, the documents are back to back.
                                [n_docs+2]: a trailing dummy sequence of padding (harness/packing.py's
                                `append_dummy_seq` tail policy, Megatron's thd_tail_padding_policy).
We turn them into two per-token integer vectors, the only metadata the THD kernels below need:
  seg [T]  document id of the token, -1 for padding,
  pos [T]  position of the token inside its document (0 for padding).
Everything DSv4 does across tokens then restarts at document starts (spec §5.2, §6.2-6.3, §7.2; the four
classic THD bugs of peers_matrix §3: window clamped to the stream start, stream-wide RoPE positions,
compressor groups crossing documents, indexer scoring the whole stream):
  * sliding window  : key s visible to query t iff seg_s == seg_t and pos_t - n_win < pos_s <= pos_t;
  * compressor      : entry j of a document pools its tokens with pos in [j m, (j+1) m) (+ the previous
                      window for CSA overlap, empty for j = 0); an entry never pools two documents;
  * entries         : carry (seg, j); query t sees entry (seg, j) iff seg == seg_t and j < (pos_t + 1) // m;
  * indexer         : scores only its own document's causal entries; the same tie-break (lower j first);
  * RoPE            : positions `pos` (restart at 0 for each document).
The same kernels serve context parallelism (model/context_parallel.py): a rank holds a halo of left tokens plus
its chunk, and entries gathered from all ranks -- masks are driven by (seg, pos, j) only, never by array index.

Layout: token-major THD tensors `[T, ...]` (Megatron's `t h d`), fp32 softmaxes, plain PyTorch (differentiable
by autograd), no Python loop over documents.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from .norm import rms_norm


class THDError(ValueError):
    """Bad packed-sequence metadata (one line, naming the field)."""


def _acc(x: torch.Tensor) -> torch.Tensor:
    """Up-cast to the accumulation dtype: fp32 for half types, fp64 stays fp64 (for gradchecks)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


# ---------------------------------------------------------------------------------------------- layout


def _check_cu(name: str, cu: torch.Tensor) -> None:
    if cu.dim() != 1 or cu.numel() < 1 or cu.dtype.is_floating_point:
        raise THDError(f"{name}: must be a 1-D integer tensor [n_docs+1], got {tuple(cu.shape)} {cu.dtype}")
    if int(cu[0]) != 0:
        raise THDError(f"{name}: must start at 0, got {int(cu[0])}")
    if bool((cu[1:] < cu[:-1]).any()):
        raise THDError(f"{name}: must be non-decreasing, got {cu.tolist()}")


def seg_pos_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int | None = None,
                            cu_seqlens_padded: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(seg [T], pos [T]) of a packed stream; T = `total` (default: the last offset); trailing tokens = padding."""
    cu_seqlens = torch.as_tensor(cu_seqlens, dtype=torch.long)
    _check_cu("cu_seqlens", cu_seqlens)
    lens = cu_seqlens[1:] - cu_seqlens[:-1]                                     # [n_docs] real lengths
    if cu_seqlens_padded is None:
        starts = cu_seqlens[:-1]
        end = int(cu_seqlens[-1])
    else:
        cu_seqlens_padded_in = cu_seqlens_padded
        cu_seqlens_padded = torch.as_tensor(cu_seqlens_padded, dtype=torch.long)
        _check_cu("cu_seqlens_padded", cu_seqlens_padded)
        if cu_seqlens_padded.numel() == cu_seqlens.numel() + 1:
            cu_seqlens_padded = cu_seqlens_padded[:-1]                     # a trailing dummy sequence of pad
            end_all = int(torch.as_tensor(cu_seqlens_padded_in)[-1])      # tokens (`append_dummy_seq`)
        elif cu_seqlens_padded.numel() != cu_seqlens.numel():
            raise THDError(f"cu_seqlens_padded: has {cu_seqlens_padded.numel()} entries, cu_seqlens "
                           f"{cu_seqlens.numel()} (or one more: a trailing dummy sequence)")
        else:
            end_all = None
        if bool(((cu_seqlens_padded[1:] - cu_seqlens_padded[:-1]) < lens).any()):
            raise THDError("cu_seqlens_padded: a padded length is shorter than its real length")
        starts = cu_seqlens_padded[:-1]
        end = int(cu_seqlens_padded[-1]) if end_all is None else end_all
    T = end if total is None else int(total)
    if T < end:
        raise THDError(f"total: {T} tokens is shorter than the packed documents ({end})")
    seg = torch.full((T,), -1, dtype=torch.long)
    pos = torch.zeros(T, dtype=torch.long)
    n_docs = lens.numel()
    doc = torch.repeat_interleave(torch.arange(n_docs), lens)                   # [sum len] doc id per real token
    first = torch.repeat_interleave(cu_seqlens[:-1], lens)                      # real-token offset of its doc
    p = torch.arange(int(cu_seqlens[-1])) - first                               # position inside the doc
    idx = starts[doc] + p                                                       # slot in the stream
    seg[idx] = doc
    pos[idx] = p
    return seg, pos


def from_packed_seq_params(psp) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(cu_seqlens, cu_seqlens_padded) of a Megatron-Core `PackedSeqParams` (duck-typed: qkv_format 'thd',
    cu_seqlens_q / cu_seqlens_q_padded; DSv4 attention is self-attention, so q and kv metadata must agree)."""
    if getattr(psp, "qkv_format", "thd") != "thd":
        raise THDError(f"packed_seq_params.qkv_format: must be 'thd', got {psp.qkv_format!r}")
    cu, cup = psp.cu_seqlens_q, getattr(psp, "cu_seqlens_q_padded", None)
    kv, kvp = getattr(psp, "cu_seqlens_kv", None), getattr(psp, "cu_seqlens_kv_padded", None)
    if kv is not None and not torch.equal(torch.as_tensor(kv).cpu(), torch.as_tensor(cu).cpu()):
        raise THDError("packed_seq_params.cu_seqlens_kv: differs from cu_seqlens_q (self-attention only)")
    if kvp is not None and cup is not None and not torch.equal(torch.as_tensor(kvp).cpu(), torch.as_tensor(cup).cpu()):
        raise THDError("packed_seq_params.cu_seqlens_kv_padded: differs from cu_seqlens_q_padded")
    return torch.as_tensor(cu).cpu(), (None if cup is None else torch.as_tensor(cup).cpu())


def positions_from_cu_seqlens(cu_seqlens, total=None, cu_seqlens_padded=None) -> torch.Tensor:
    """RoPE positions [T] restarting at 0 for each document (0 on padding)."""
    return seg_pos_from_cu_seqlens(cu_seqlens, total, cu_seqlens_padded)[1]


# ---------------------------------------------------------------------------------------------- compressor


def entry_ends(seg: torch.Tensor, pos: torch.Tensor, ratio: int) -> torch.Tensor:
    """Token indices [N] where a compression window of `ratio` tokens closes: (pos + 1) % m == 0 (spec §5.2)."""
    return torch.nonzero((seg >= 0) & ((pos + 1) % ratio == 0), as_tuple=False).flatten()


def compress_pool_thd(kv: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, ratio: int, overlap: bool,
                      seg: torch.Tensor, pos: torch.Tensor, ends: torch.Tensor | None = None):
    """Softmax-gated pooling per document (spec §6.2 / §6.3), packed.

    kv, gate [T, coff*D] (the projections of every token; coff = 2 with overlap), ape [m, coff*D].
    Returns (comp [N, D], entry_seg [N], entry_j [N], ends [N]) for the entries that close at the token indices
    `ends` (default: all closing in the stream). Entry j pools its document's tokens j m .. (j+1) m - 1 (second
    half of the channels, "current window") and, with overlap, j m - m .. j m - 1 (first half, "previous
    window"; empty for j = 0). The rows needed must be present in the stream (a CP halo provides them).
    """
    m = ratio
    T, CD = kv.shape
    coff = 2 if overlap else 1
    if CD % coff:
        raise THDError(f"kv: last dim {CD} not divisible by coff {coff}")
    if ape.shape != (m, CD):
        raise THDError(f"ape: expected shape {(m, CD)}, got {tuple(ape.shape)}")
    D = CD // coff
    if ends is None:
        ends = entry_ends(seg, pos, m)
    j = (pos[ends] + 1) // m - 1                                                # [N] entry index in its doc
    need_rows = torch.where(j > 0, coff * m, m) if overlap else torch.full_like(j, m)
    first = ends - need_rows + 1                                                # first row the entry pools
    if ends.numel() and bool((first < 0).any() or (seg[first.clamp(min=0)] != seg[ends]).any()):
        raise THDError(f"kv: a compression window starts before the stream (halo shorter than {coff * m - 1})")
    cur = ends[:, None] - (m - 1) + torch.arange(m, device=kv.device)                          # [N, m] token idx, window j
    zc = _acc(gate[cur]) + _acc(ape[None])                                   # [N, m, coff*D]
    vc = kv[cur]
    if not overlap:
        logits, vals = zc, vc                                                    # [N, m, D]
    else:
        prev = (cur - m).clamp(min=0)                                           # [N, m] token idx, window j-1
        has_prev = (j > 0)[:, None, None]                                        # [N, 1, 1]
        zp = torch.where(has_prev, _acc(gate[prev])[..., :D] + _acc(ape[None, :, :D]),
                         torch.full((), float("-inf"), device=kv.device))         # [N, m, D] empty -> -inf
        vp = torch.where(has_prev, kv[prev][..., :D], torch.zeros((), dtype=kv.dtype, device=kv.device))
        logits = torch.cat([zp, zc[..., D:]], dim=1)                             # [N, 2m, D] slots
        vals = torch.cat([vp, vc[..., D:]], dim=1)                               # [N, 2m, D]
    alpha = torch.softmax(logits, dim=1)                                         # per channel over slots
    comp = (alpha * _acc(vals)).sum(1).to(kv.dtype)                           # [N, D]
    return comp, seg[ends], j, ends


# ---------------------------------------------------------------------------------------------- indexer


def causal_entry_mask(seg_q: torch.Tensor, pos_q: torch.Tensor, entry_seg: torch.Tensor, entry_j: torch.Tensor,
                      ratio: int) -> torch.Tensor:
    """[Tq, N] bool: entry (seg, j) is visible to query (seg_q, pos_q) iff same doc and j < (pos_q+1)//m."""
    same = (entry_seg[None, :] == seg_q[:, None]) & (seg_q[:, None] >= 0)
    return same & (entry_j[None, :] < ((pos_q + 1) // ratio)[:, None])


def indexer_scores_thd(qI: torch.Tensor, kI: torch.Tensor, w: torch.Tensor, ratio: int,
                       seg_q: torch.Tensor, pos_q: torch.Tensor, entry_seg: torch.Tensor,
                       entry_j: torch.Tensor) -> torch.Tensor:
    """I [Tq, N] fp32 (spec §7.2): sum_h w_h nI^-1/2 relu(qI_h . kI_s) cI^-1/2, -inf outside doc/causality.

    qI [Tq, nI, cI], kI [N, cI], w [Tq, nI].
    """
    nI, cI = qI.shape[-2:]
    dots = torch.einsum("thc,nc->thn", _acc(qI), _acc(kI))                 # [Tq, nI, N]
    I = torch.einsum("thn,th->tn", F.relu(dots), _acc(w) * nI ** -0.5) * cI ** -0.5
    mask = causal_entry_mask(seg_q, pos_q, entry_seg, entry_j, ratio)
    return I.masked_fill(~mask, float("-inf"))


def indexer_topk_thd(I: torch.Tensor, k: int) -> torch.Tensor:
    """idx [Tq, min(k, N)] long of the k best entries, ties -> lower entry index first; -1 where not visible."""
    k_eff = min(k, I.shape[-1])
    vals, order = torch.sort(I, dim=-1, descending=True, stable=True)            # stable: lower index first
    vals, order = vals[..., :k_eff], order[..., :k_eff]
    return torch.where(torch.isinf(vals) & (vals < 0), torch.full_like(order, -1), order)


# ---------------------------------------------------------------------------------------------- attention


def sparse_attn_thd(q: torch.Tensor, kv: torch.Tensor, q_index: torch.Tensor,
                    seg_k: torch.Tensor, pos_k: torch.Tensor, seg_q: torch.Tensor, pos_q: torch.Tensor,
                    comp: torch.Tensor | None, comp_idx: torch.Tensor | None,
                    entry_seg: torch.Tensor | None, entry_j: torch.Tensor | None,
                    sink: torch.Tensor, window: int, ratio: int, scale: float) -> torch.Tensor:
    """One softmax per (t, h) over window keys + compressed entries + the sink logit (spec §5.2-5.3), packed.

    q [Tq, H, c]; kv [Tk, c] (K = V) with metadata seg_k/pos_k [Tk]; query t is key q_index[t] (the window
    ends there: candidates q_index[t] - n_win + 1 .. q_index[t], kept when in the same document and within
    n_win positions). comp [N, c] with entry_seg/entry_j [N]; comp_idx [Tq, k] (CSA: indices into comp, -1 =
    none) or None (HCA: every visible entry). Returns o [Tq, H, c] in q's dtype.
    """
    Tq, H, c = q.shape
    offs = torch.arange(-(window - 1), 1, device=q.device)
    widx = q_index[:, None] + offs                                              # [Tq, W] candidate keys
    inb = widx >= 0
    widx_c = widx.clamp(min=0)
    wvalid = inb & (seg_k[widx_c] == seg_q[:, None]) & (seg_q[:, None] >= 0) \
        & (pos_k[widx_c] <= pos_q[:, None]) & (pos_k[widx_c] > (pos_q - window)[:, None])
    wkeys = kv[widx_c]                                                          # [Tq, W, c]
    qf = _acc(q)
    lw = torch.einsum("thc,twc->thw", qf, _acc(wkeys)) * scale                  # [Tq, H, W]
    lw = lw.masked_fill(~wvalid[:, None, :], float("-inf"))
    lc, cvals = None, None
    if comp is not None and comp.shape[0] > 0:
        if comp_idx is not None:                                                # CSA: listed entries
            cidx = comp_idx.clamp(min=0)
            cvalid = (comp_idx >= 0) & (entry_seg[cidx] == seg_q[:, None]) \
                & (entry_j[cidx] < ((pos_q + 1) // ratio)[:, None])
            cvals = _acc(comp[cidx])                                            # [Tq, k, c]
            lc = torch.einsum("thc,tkc->thk", qf, cvals) * scale                # [Tq, H, k]
        else:                                                                   # HCA: all visible entries
            cvalid = causal_entry_mask(seg_q, pos_q, entry_seg, entry_j, ratio)  # [Tq, N]
            lc = torch.einsum("thc,nc->thn", qf, _acc(comp)) * scale            # [Tq, H, N]
        lc = lc.masked_fill(~cvalid[:, None, :], float("-inf"))
    # one softmax over window + compressed + sink (spec §5.3); the values are applied per branch, so the
    # [Tq, W + K, c] key/value concatenation is never built
    ls = _acc(sink).view(1, H, 1).expand(Tq, H, 1)
    lse = torch.logsumexp(torch.cat([lw, ls] if lc is None else [lw, lc, ls], dim=2), dim=2, keepdim=True)
    o = torch.einsum("thw,twc->thc", torch.exp(lw - lse), _acc(wkeys))
    if lc is not None:
        pc = torch.exp(lc - lse)
        o = o + (torch.einsum("thk,tkc->thc", pc, cvals) if cvals is not None
                 else torch.einsum("thn,nc->thc", pc, _acc(comp)))
    return o.to(q.dtype)


@torch.no_grad()
def indexer_teacher_thd(q: torch.Tensor, kv: torch.Tensor, q_index: torch.Tensor, seg_k: torch.Tensor,
                        pos_k: torch.Tensor, seg_q: torch.Tensor, pos_q: torch.Tensor, comp: torch.Tensor,
                        cand: torch.Tensor, sink: torch.Tensor, window: int, scale: float,
                        teacher: str) -> torch.Tensor:
    """Target P [Tq, N] of the indexer KL loss (spec §10.3; same definition as model/indexer.py's
    `indexer_teacher`), packed: the window part of the "joint" denominator uses only keys of the query's own
    document (same masks as `sparse_attn_thd`); cand [Tq, N] bool = the candidate entries. Detached."""
    Tq, H, c = q.shape
    qf = _acc(q.detach())
    lc = torch.einsum("thc,nc->thn", qf, _acc(comp.detach())) * scale             # [Tq, H, N]
    lc = lc.masked_fill(~cand[:, None, :], float("-inf"))
    if teacher == "joint":
        widx = q_index[:, None] + torch.arange(-(window - 1), 1, device=q.device)  # [Tq, W]
        wc = widx.clamp(min=0)
        wvalid = (widx >= 0) & (seg_k[wc] == seg_q[:, None]) & (seg_q[:, None] >= 0) \
            & (pos_k[wc] <= pos_q[:, None]) & (pos_k[wc] > (pos_q - window)[:, None])
        lw = torch.einsum("thc,twc->thw", qf, _acc(kv.detach()[wc])) * scale      # [Tq, H, W]
        lw = lw.masked_fill(~wvalid[:, None, :], float("-inf"))
        ls = _acc(sink.detach()).view(1, H, 1).expand(Tq, H, 1)
        lse = torch.logsumexp(torch.cat([lw, lc, ls], dim=-1), dim=-1, keepdim=True)   # [Tq, H, 1]
        p = torch.exp(lc - lse)
    elif teacher == "renormalized":
        lse = torch.logsumexp(lc, dim=-1, keepdim=True)
        p = torch.where(cand[:, None, :], torch.exp(lc - lse), torch.zeros_like(lc))
    else:
        raise THDError(f"indexer_teacher: must be joint|renormalized, got {teacher!r}")
    P = p.sum(dim=1)                                                                # [Tq, N]
    total = P.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, P / total.clamp_min(torch.finfo(P.dtype).tiny), torch.zeros_like(P))


# ---------------------------------------------------------------------------------------------- orchestration (D6)


def _compress_entries(comp_mod, x: torch.Tensor, seg: torch.Tensor, pos: torch.Tensor, first_local: int):
    """A `model.compressor.Compressor` on a THD stream: entries closing at local tokens (index >= first_local).

    Same math as Compressor.forward (projections -> pooling -> norm -> RoPE at the entry's first token, which
    is position j*m of its document). Returns (comp [N, D], entry_seg [N], entry_j [N]).
    """
    m = comp_mod.ratio
    ends = entry_ends(seg, pos, m)
    ends = ends[ends >= first_local]
    pooled, eseg, ej, _ = compress_pool_thd(comp_mod.wkv(x), comp_mod.wgate(x), comp_mod.ape, m,
                                            comp_mod.overlap, seg, pos, ends)            # [N, D]
    comp = comp_mod.norm(pooled)
    if comp.shape[0]:
        comp = comp_mod.rope(comp, ej * m)                                               # first token of entry
    return comp, eseg, ej


def attention_on_layout(attn, x: torch.Tensor, seg: torch.Tensor, pos: torch.Tensor, halo: int = 0,
                        gather_entries=None) -> torch.Tensor:
    """One DSv4Attention layer (spec §5.7) on a token stream with document metadata -> [T - halo, d].

    x [T, d] (normed attention input); seg/pos [T]; the first `halo` rows are left context only (a CP halo:
    keys of the window and rows of compression windows that close in the local part) and get no output.
    `gather_entries(comp, entry_seg, entry_j) -> (comp, entry_seg, entry_j)` completes the locally closed
    compressed entries with those of other ranks (CP, model/context_parallel.py); None = all entries are local.
    Uses `attn`'s parameters and RoPE tables (model/attention.py); masks come from (seg, pos) only.
    """
    H, c, g = attn.n_heads, attn.head_dim, attn.o_groups
    xl, seg_l, pos_l = x[halo:], seg[halo:], pos[halo:]
    Tl = xl.shape[0]
    cq = attn.q_norm(attn.wq_a(xl))                                             # [Tl, d_c]
    q = attn.wq_b(cq).view(Tl, H, c)                                            # [Tl, H, c]
    q = attn.rope(rms_norm(q, None, attn.eps), pos_l)                           # per-head unweighted norm
    kv = attn.rope(attn.kv_norm(attn.wkv(x)), pos)                              # [T, c] halo + local keys

    comp = eseg = ej = idx = None
    attn.indexer_loss, attn.last_topk = None, None
    if attn.compressor is not None:
        comp, eseg, ej = _compress_entries(attn.compressor, x, seg, pos, halo)  # [N, c]
        if gather_entries is not None:
            comp, eseg, ej = gather_entries(comp, eseg, ej)
    if attn.indexer is not None:
        ind = attn.indexer
        kI, iseg, ij = _compress_entries(ind.compressor, x.detach(), seg, pos, halo)   # [N, c_I], detached
        if gather_entries is not None:
            kI, iseg, ij = gather_entries(kI, iseg, ij)
        qI = ind.wq_b(cq.detach()).view(Tl, ind.n_heads, ind.head_dim)           # [Tl, n_I, c_I]
        qI = ind.rope(qI, pos_l)
        w = ind.weights_proj(xl.detach())                                       # [Tl, n_I]
        scores = indexer_scores_thd(qI, kI, w, ind.ratio, seg_l, pos_l, iseg, ij)   # [Tl, N]
        idx = indexer_topk_thd(scores, ind.topk)                                # [Tl, k]
        attn.last_topk = idx
        attn.last_entries = (iseg, ij)                                          # to map idx -> (doc, j)
        if attn.cfg.indexer_loss_mode == "dense":
            idx = None                                                          # dense phase: all entries
    q_index = torch.arange(Tl, device=x.device) + halo
    o = sparse_attn_thd(q, kv, q_index, seg, pos, seg_l, pos_l,
                        comp, idx, eseg, ej, attn.attn_sink, attn.window, attn.ratio or 1, attn.scale)
    cfg = attn.cfg
    if attn.indexer is not None and attn.training and cfg.indexer_loss_mode != "off" and cfg.indexer_loss_coeff:
        from .indexer import indexer_kl_loss
        N = comp.shape[0]
        if idx is None:                                                         # dense: all visible entries
            cand = causal_entry_mask(seg_l, pos_l, eseg, ej, attn.ratio)
        else:                                                                   # sparse: the selected ones
            cand = torch.zeros(Tl, N + 1, dtype=torch.bool, device=x.device)
            cand.scatter_(1, torch.where(idx < 0, torch.full_like(idx, N), idx), True)
            cand = cand[:, :N]
        target = indexer_teacher_thd(q, kv, q_index, seg, pos, seg_l, pos_l, comp, cand, attn.attn_sink,
                                     attn.window, attn.scale, cfg.indexer_teacher)
        attn.indexer_loss = cfg.indexer_loss_coeff * indexer_kl_loss(scores[:, None], target[:, None],
                                                                     cand[:, None])   # [Tq, 1, N] = SBT
        attn.indexer_loss_queries = int(cand.any(-1).sum())                     # the mean's count (CP sums)
    o = attn.rope(o, pos_l, inverse=True)                                       # back by the query position
    o = o.reshape(Tl, g, H * c // g)                                            # group i = heads i*H/g..
    wo_a = attn.wo_a.weight.view(g, -1, H * c // g)                             # [g, d_g, H*c/g]
    z = torch.einsum("tgi,gri->tgr", o, wo_a)                                   # [Tl, g, d_g]
    return attn.wo_b(z.flatten(1))                                              # [Tl, d]


def thd_attention_forward(attn, h: torch.Tensor, cu_seqlens: torch.Tensor,
                          cu_seqlens_padded: torch.Tensor | None = None) -> torch.Tensor:
    """Packed DSv4 attention: h [1, T, d] (THD as B = 1) with cu_seqlens (+ padded offsets) -> [1, T, d].

    Each document's output equals DSv4Attention.forward on that document alone (positions 0..L-1); padding
    rows attend only the sink (output = wo_b(wo_a(0)) = 0). In training mode the indexer KL loss is the mean
    over all packed queries that have a candidate (= the per-document losses weighted by those counts).
    """
    if h.dim() != 3 or h.shape[0] != 1:
        raise THDError(f"h: packed input must be [1, T, d], got {tuple(h.shape)}")
    seg, pos = seg_pos_from_cu_seqlens(cu_seqlens, h.shape[1], cu_seqlens_padded)
    seg, pos = seg.to(h.device), pos.to(h.device)
    return attention_on_layout(attn, h[0], seg, pos)[None]                      # [T, d] -> [1, T, d]


# ---------------------------------------------------------------------------------------------- full model (D6)


@contextlib.contextmanager
def packed(model, cu_seqlens, cu_seqlens_padded=None):
    """Run a `DSv4Model` on a packed stream [1, T]: inside the context every DSv4Attention layer runs
    `thd_attention_forward` (document-local windows, compression, indexer, RoPE positions) and the MTP block
    reads ids_next rolled inside each document (model/mtp_roll.py). Everything else in the model is per token.
    The packed path runs the naive THD kernels of this file whatever the modules' `backend` is.
    Whole-block recompute (`model.set_recompute`) is switched off inside the context: its backward re-run would
    happen after the context has restored the SBHD forwards (recompute_mhc, which re-runs only hc_pre, stays).
    """
    from .mtp_roll import roll_packed
    attns = [m for m in model.modules() if type(m).__name__ == "DSv4Attention"]
    mtps = list(getattr(model, "mtp", []))

    def attn_fwd(attn):
        def fwd(h, positions=None, backend=None):
            return thd_attention_forward(attn, h, cu_seqlens, cu_seqlens_padded)
        return fwd

    def mtp_fwd(blk, orig):
        def fwd(X, e_next, ids_next, positions=None):
            # the model passes ids_next[t] = ids[t+1] of the whole stream: keep it only inside a document
            seg, _ = seg_pos_from_cu_seqlens(cu_seqlens, ids_next.shape[1], cu_seqlens_padded)
            _, valid = roll_packed(seg, seg)                                # t+1 in t's document
            ids_roll = torch.where(valid.to(ids_next.device)[None], ids_next, torch.zeros_like(ids_next))
            return orig(X, model.embed(ids_roll), ids_roll, positions)
        return fwd

    saved = {id(m): m.__dict__.get("forward") for m in attns + mtps}       # restore earlier instance patches
    recompute = getattr(model, "recompute", False)
    try:
        if recompute:
            model.recompute = False
        for a in attns:
            a.forward = attn_fwd(a)
        for blk in mtps:
            blk.forward = mtp_fwd(blk, blk.__dict__.get("forward") or type(blk).forward.__get__(blk))
        yield model
    finally:
        for m in attns + mtps:
            m.__dict__.pop("forward", None)
            if saved[id(m)] is not None:
                m.forward = saved[id(m)]
        if recompute:
            model.recompute = recompute


def packed_model_forward(model, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                         cu_seqlens=None, cu_seqlens_padded=None):
    """DSv4Model on packed input_ids [1, T] (+ labels [1, T], already shifted inside each document, -100 =
    ignored) -> the model's output; logits / mtp_logits of every document equal running it alone. The loss:
    lm CE over labels + mtp_loss_scaling_factor * CE over the labels rolled once inside each document
    (model/mtp_roll.py; a document's last token has no MTP target) + the indexer KL losses (training) + the
    MoE auxiliary losses (NOTE: the sequence-wise balance loss of model/moe.py sees the packed row as ONE
    sequence, not per document)."""
    from .mtp_roll import mtp_inputs
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise THDError(f"input_ids: packed input must be [1, T], got {tuple(input_ids.shape)}")
    if cu_seqlens is None:
        raise THDError("cu_seqlens: required for a packed forward")
    with packed(model, cu_seqlens, cu_seqlens_padded):
        out = model(input_ids)
    if labels is None:
        return out
    mtp_labels = mtp_inputs(input_ids, labels, cu_seqlens, cu_seqlens_padded)[1] if out.mtp_logits is not None \
        else None                                                                # rolled inside each document
    out.loss, out.losses = model._losses(out.logits, out.mtp_logits, labels, mtp_labels=mtp_labels)
    return out
