"""Generation with a DSv4 KV cache (issue 18, extension slice X2): `DSv4Cache`, `forward_step`, `generate`.

The cache of one attention layer, per batch row (rows may have different lengths: padding is never cached):

    window    ring buffer [n_win + 1, c] of the K = V rows (kv_norm + RoPE applied); the token at position p lives
              in slot p % (n_win + 1); a query sees the last n_win - 1 cached rows plus the new ones (spec §5.2);
              the two spare slots let MTP speculation roll back a rejected draft.
    compressor (CSA / HCA) partial state: the PROJECTED rows (wkv(h), wgate(h), [coff*D] each) of the tokens of
              the not-yet-complete group, and for CSA (overlap, coff = 2) also of the previous complete group,
              whose first channel half seeds slots 0..m-1 of the next entry (spec §6.3, §6.5). At most m' - 1 rows
              (HCA) / 2m - 1 rows (CSA).
    entries   the compressed entries [N, c] (RMSNorm + RoPE at the group's first token), appended as each one
              completes ((p + 1) % m == 0).
    indexer   (CSA) its own compressor's partial state and its compressed keys [N, c_I].
The model-level cache also keeps the final mHC streams [n_hc, d] of every cached position (before the
HyperHead), which the MTP head consumes (spec §10.1), and the per-row lengths.

Memory per cached token (elements of the model dtype; partial states are O(m) per layer and not counted):
    n_hc*d                                 final streams (keep_streams=True)
  + sum_CSA (c + c_I) / m  + sum_HCA c / m'  compressed entries and indexer keys
and a constant (n_win + 1) * c per layer for the ring buffers. Flash (d 4096, c 512, c_I 128, m 4, m' 128, 21 CSA,
20 HCA layers): 21 * 640 / 4 + 20 * 512 / 128 = 3440 elements = 6.9 KB/token in bf16 for attention, plus
16384 elements (32 KB/token in bf16) for the streams when they are kept for every position.

Every step runs the same modules and kernel ops as the full forward (kernels/<op>: compress_pool, indexer
scores / top-k, sparse_attn) on a key stream made of the cached rows (left context, `q_offset`) and the new
tokens, so a cached decode gives the full forward's logits (test: slices/X2/test_cache_equals_full.py).
The q / kv projections, the inverse RoPE and the grouped output projection below repeat
`DSv4Attention.forward`'s lines (model/attention.py) on the new tokens only.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch

from dsv4.kernels.compressor import compress_pool
from dsv4.kernels.indexer import indexer_scores, indexer_topk
from dsv4.kernels.sparse_attn import sparse_attn

from .attention import grouped_out_proj
from .mhc import expand_streams, hc_head
from .moe import MoE


class CacheError(ValueError):
    """Bad generation input (one line)."""


class _Rows:
    """A growing [n, D] buffer (capacity doubling) of one batch row."""

    def __init__(self, D: int, dtype, device, cap: int = 16):
        self.buf = torch.zeros(cap, *((D,) if isinstance(D, int) else D), dtype=dtype, device=device)
        self.n = 0

    def append(self, x: torch.Tensor) -> None:
        k = x.shape[0]
        if self.n + k > self.buf.shape[0]:
            cap = max(2 * self.buf.shape[0], self.n + k)
            new = torch.zeros(cap, *self.buf.shape[1:], dtype=self.buf.dtype, device=self.buf.device)
            new[:self.n] = self.buf[:self.n]
            self.buf = new
        self.buf[self.n:self.n + k] = x
        self.n += k

    def view(self) -> torch.Tensor:
        return self.buf[:self.n]

    def nbytes(self) -> int:
        return self.n * self.buf[0].numel() * self.buf.element_size()


@dataclass
class _CompState:
    """One compressor's state of one row: projected rows of tokens [start, L) and the entries so far."""
    kv: torch.Tensor            # [r, coff*D]
    gate: torch.Tensor          # [r, coff*D]
    entries: _Rows              # [N, D]


class LayerCache:
    """The cache of one attention layer for B rows."""

    def __init__(self, attn, B: int, dtype, device):
        self.kind, self.window = attn.kind, attn.window
        c = attn.head_dim
        self.slots = attn.window + 1            # n_win - 1 rows a query needs, + 2: a one-token rollback re-runs
        self.ring = torch.zeros(B, self.slots, c, dtype=dtype, device=device)   # the rolled-back position
        self.comp: list[_CompState] | None = None
        self.index: list[_CompState] | None = None

        def states(cmp):
            W = cmp.wkv.out_features
            return [_CompState(torch.zeros(0, W, dtype=dtype, device=device),
                               torch.zeros(0, W, dtype=dtype, device=device),
                               _Rows(cmp.head_dim, dtype, device)) for _ in range(B)]
        if attn.compressor is not None:
            self.comp = states(attn.compressor)
        if attn.indexer is not None:
            self.index = states(attn.indexer.compressor)

    def nbytes(self) -> int:
        n = self.ring.numel() * self.ring.element_size()
        for sts in (self.comp or []), (self.index or []):
            for s in sts:
                n += s.entries.nbytes() + (s.kv.numel() + s.gate.numel()) * s.kv.element_size()
        return n


class DSv4Cache:
    """KV cache of a DSv4Model for B rows: one LayerCache per main layer (+ the MTP layer), lengths, streams."""

    def __init__(self, model, batch_size: int, keep_streams: bool = True):
        p = next(model.parameters())
        dtype = model.embed.weight.dtype
        self.B = batch_size
        self.lengths = [0] * batch_size
        self.layers = [LayerCache(layer.attn, batch_size, dtype, p.device) for layer in model.layers]
        self.mtp_layers = [LayerCache(m.attn, batch_size, dtype, p.device) for m in model.mtp]
        cfg = model.cfg
        self.keep_streams = keep_streams
        self.streams = [_Rows((cfg.hc_mult, cfg.hidden_size), dtype, p.device) for _ in range(batch_size)] \
            if keep_streams else None
        self.last_streams = torch.zeros(batch_size, cfg.hc_mult, cfg.hidden_size, dtype=dtype, device=p.device)
        self.mtp_lengths = [0] * batch_size

    def snapshot(self):
        """The small state that one more step changes (lengths, compressor partial states, entry counts,
        stream counts); `restore` rolls the cache back to it. The window ring keeps n_win + 1 slots for the
        n_win - 1 rows a query needs, so a rollback of a TWO-token step followed by a re-run of its first token
        never reads an overwritten row."""
        def comp(sts):
            return None if sts is None else [(s.kv, s.gate, s.entries.n) for s in sts]
        return (list(self.lengths), list(self.mtp_lengths), self.last_streams.clone(),
                None if self.streams is None else [r.n for r in self.streams],
                [(comp(lc.comp), comp(lc.index)) for lc in self.layers + self.mtp_layers])

    def restore(self, snap, rows=None) -> None:
        """Roll the cache back to `snap` (from `snapshot`): every row, or only the batch rows in `rows`."""
        lengths, mtp_lengths, last, sn, layers = snap
        rows = range(self.B) if rows is None else rows
        for b in rows:
            self.lengths[b], self.mtp_lengths[b] = lengths[b], mtp_lengths[b]
            self.last_streams[b] = last[b]
            if sn is not None:
                self.streams[b].n = sn[b]
        for lc, (c, i) in zip(self.layers + self.mtp_layers, layers):
            for sts, saved in ((lc.comp, c), (lc.index, i)):
                if sts is None:
                    continue
                for b in rows:
                    kv, gate, n = saved[b]
                    sts[b].kv, sts[b].gate, sts[b].entries.n = kv, gate, n

    def nbytes(self) -> int:
        n = sum(lc.nbytes() for lc in self.layers)
        if self.streams is not None:
            n += sum(s.nbytes() for s in self.streams)
        return n


def cache_elements_per_token(cfg, keep_streams: bool = True) -> float:
    """Elements of the model dtype the cache grows by per token (module docstring formula)."""
    n = 0.0
    for i in range(cfg.num_hidden_layers):
        kind = cfg.layer_kind(i)
        if kind == "csa":
            n += (cfg.head_dim + cfg.index_head_dim) / cfg.csa_ratio
        elif kind == "hca":
            n += cfg.head_dim / cfg.hca_ratio
    if keep_streams:
        n += cfg.hc_mult * cfg.hidden_size
    return n


# --------------------------------------------------------------------------------------------- one layer
def _compress_step(cmp, st: _CompState, kvp: torch.Tensor, gp: torch.Tensor, L: int, backend: str):
    """Feed the projected rows of new tokens at positions L.. into one compressor's state; append the entries
    that complete; keep the rows the next entries need. Returns the state's entries [N, D]."""
    m, ov = cmp.ratio, cmp.overlap
    r0 = st.kv.shape[0]
    kvs, gs = torch.cat([st.kv, kvp]), torch.cat([st.gate, gp])                 # [r0 + t, coff*D]
    t = kvp.shape[0]
    pos = torch.arange(L - r0, L + t, device=kvp.device)
    seg = torch.zeros_like(pos)
    pooled, eseg, ej, ends = compress_pool(kvs, gs, cmp.ape, m, ov, seg, pos, r0, backend=backend)
    if pooled.shape[0]:
        valid = eseg >= 0
        if bool(valid.any()):
            ent = cmp.norm(pooled[valid])
            ent = cmp.rope(ent, pos[ends[valid] - (m - 1)])                     # at the group's first token
            if int(ej[valid][0]) != st.entries.n:
                raise CacheError(f"cache: compressor entry {int(ej[valid][0])} follows {st.entries.n} entries")
            st.entries.append(ent)
    Ln = L + t
    keep_from = max(0, (Ln // m - (1 if ov else 0)) * m)                        # incomplete group (+ previous)
    a = keep_from - (L - r0)
    st.kv, st.gate = kvs[a:].clone(), gs[a:].clone()
    return st.entries.view()


def attention_step(attn, h: torch.Tensor, lc: LayerCache, rows, backend: str | None = None) -> torch.Tensor:
    """h [B, n, d] (attention input, normed) of n new token slots per row -> [B, n, d]; updates `lc`.

    rows[b] = (idx [t_b] long: the real slots of row b, L_b: its cached length). Padding slots get output 0.
    """
    backend = backend or attn.backend
    B, n, d = h.shape
    H, c, g, r_ = attn.n_heads, attn.head_dim, attn.o_groups, attn.rope_dim
    x = h.reshape(B * n, d)
    pos_all = torch.zeros(B * n, dtype=torch.long, device=h.device)
    for b, (idx, L) in enumerate(rows):
        pos_all[b * n + idx] = torch.arange(L, L + idx.numel(), device=h.device)
    # --- the projections of DSv4Attention.forward, on the new tokens
    cq = attn.q_norm(attn.wq_a(x))
    q = attn.wq_b(cq).view(B * n, H, c)
    q = attn.rope.norm_rotate(q, pos_all, attn.eps)
    kv = attn.rope(attn.kv_norm(attn.wkv(x)), pos_all)
    if attn.compressor is not None:
        ckv, cg = attn.compressor.wkv(x), attn.compressor.wgate(x)
    if attn.indexer is not None:
        ix = attn.indexer
        ikv, ig = ix.compressor.wkv(x), ix.compressor.wgate(x)
        iq = ix.rope(ix.wq_b(cq).view(B * n, ix.n_heads, ix.head_dim), pos_all)
        iw = ix.weights_proj(x)
    o = torch.zeros(B * n, H, c, dtype=q.dtype, device=h.device)
    W = attn.window
    mode = attn.cfg.indexer_loss_mode
    for b, (idx, L) in enumerate(rows):
        t = idx.numel()
        if t == 0:
            continue
        tok = b * n + idx
        w0 = min(L, W - 1)
        R = lc.slots
        ring_rows = lc.ring[b, torch.arange(L - w0, L, device=h.device) % R]
        keys = torch.cat([ring_rows, kv[tok]])                                  # [w0 + t, c]
        kpos = torch.arange(L - w0, L + t, device=h.device)
        kseg = torch.zeros_like(kpos)
        comp = eseg = ej = sel = None
        if attn.compressor is not None:
            comp = _compress_step(attn.compressor, lc.comp[b], ckv[tok], cg[tok], L, backend)
            eseg = torch.zeros(comp.shape[0], dtype=torch.long, device=h.device)
            ej = torch.arange(comp.shape[0], device=h.device)
        if attn.indexer is not None:
            kI = _compress_step(ix.compressor, lc.index[b], ikv[tok], ig[tok], L, backend)
            iseg = torch.zeros(kI.shape[0], dtype=torch.long, device=h.device)
            scores = indexer_scores(iq[tok], kI, iw[tok], ix.ratio, kseg[w0:], kpos[w0:], iseg,
                                    torch.arange(kI.shape[0], device=h.device), backend=backend)
            sel = indexer_topk(scores, ix.topk, backend=backend)
            if mode == "dense":
                sel = None                                                      # CSA without top-k
        o[tok] = sparse_attn(q[tok], keys, comp, sel, attn.attn_sink, W, attn.ratio or 1, attn.scale, kseg, kpos,
                             eseg, ej, w0, backend=backend)
        keep = min(t, R)                                                        # the ring holds the last R rows
        lc.ring[b, kpos[-keep:] % R] = kv[tok[-keep:]]
    # --- inverse RoPE and grouped low-rank output (DSv4Attention.forward)
    o = attn.rope(o, pos_all, inverse=True).reshape(B * n, g, H * c // g)
    z = grouped_out_proj(o, attn.wo_a.weight.view(g, -1, H * c // g))        # [B*n, g, d_g]
    return attn.wo_b(z.flatten(1)).view(B, n, -1)


def _block_step(block, X, ids, lc, rows):
    """Block.forward (model/block.py) with the attention replaced by its cached step."""
    X = block._sublayer(X, block.hc_attn_fn, block.hc_attn_base, block.hc_attn_scale, block.attn_norm,
                        lambda h: attention_step(block.attn, h, lc, rows))
    ffn = (lambda h: block.ffn(h, ids, None)) if isinstance(block.ffn, MoE) else block.ffn
    return block._sublayer(X, block.hc_ffn_fn, block.hc_ffn_base, block.hc_ffn_scale, block.ffn_norm, ffn)


def _rows(mask: torch.Tensor, lengths):
    return [(torch.nonzero(mask[b], as_tuple=False).flatten(), lengths[b]) for b in range(mask.shape[0])]


@torch.no_grad()
def forward_step(model, cache: DSv4Cache, input_ids: torch.Tensor, mask: torch.Tensor | None = None,
                 return_streams: bool = False):
    """Run n new token slots per row through the model with the cache: input_ids [B, n], mask [B, n] bool
    (True = real token; padding slots are neither attended nor cached) -> logits [B, n, V] (fp32 slots of
    padding are meaningless). The real tokens of row b get positions lengths[b], lengths[b] + 1, ..."""
    B, n = input_ids.shape
    if B != cache.B:
        raise CacheError(f"forward_step: input_ids has {B} rows, the cache {cache.B}")
    if mask is None:
        mask = torch.ones(B, n, dtype=torch.bool, device=input_ids.device)
    cfg = model.cfg
    rows = _rows(mask, cache.lengths)
    X = expand_streams(model.embed(input_ids), cfg.hc_mult)                    # [B, n, hc, d]
    for layer, lc in zip(model.layers, cache.layers):
        X = _block_step(layer, X, input_ids, lc, rows)
    y = model.norm(hc_head(X, model.hc_head_fn, model.hc_head_base, model.hc_head_scale, cfg, model.backend))
    for b, (idx, _) in enumerate(rows):
        if idx.numel():
            if cache.streams is not None:
                cache.streams[b].append(X[b, idx])
            cache.last_streams[b] = X[b, idx[-1]]
            cache.lengths[b] += idx.numel()
    logits = model.head(y)
    return (logits, X) if return_streams else logits


@torch.no_grad()
def mtp_step(model, cache: DSv4Cache, streams: torch.Tensor, next_ids: torch.Tensor,
             mask: torch.Tensor | None = None) -> torch.Tensor:
    """The MTP head (spec §10.1) on n new MTP positions per row: streams [B, n, hc, d] = the main model's final
    streams X_L at those positions, next_ids [B, n] = the token AFTER each position -> MTP logits [B, n, V]
    (position t predicts token t+2). The MTP block's own window cache is cache.mtp_layers[0]."""
    if not len(model.mtp):
        raise CacheError("mtp_step: the model has no MTP layer")
    B, n = next_ids.shape
    if mask is None:
        mask = torch.ones(B, n, dtype=torch.bool, device=next_ids.device)
    mtp = model.mtp[0]
    rows = _rows(mask, cache.mtp_lengths)
    e = model.embed(next_ids)
    X0 = mtp.e_proj(mtp.enorm(e)).unsqueeze(2) + mtp.h_proj(mtp.hnorm(streams))   # MTPBlock.forward
    X1 = _block_step(mtp, X0, next_ids, cache.mtp_layers[0], rows)
    y = mtp.norm(hc_head(X1, mtp.hc_head_fn, mtp.hc_head_base, mtp.hc_head_scale, model.cfg, mtp.backend))
    for b, (idx, _) in enumerate(rows):
        cache.mtp_lengths[b] += idx.numel()
    return model.head(y)


def _last_slot(mask: torch.Tensor) -> torch.Tensor:
    """mask [B, n] bool -> [B] index of each row's last real slot (0 for a row without one)."""
    return (mask.long() * torch.arange(mask.shape[1], device=mask.device)).argmax(-1)


@torch.no_grad()
def speculative_generate(model, input_ids: torch.Tensor, max_new_tokens: int = 16,
                         eos_token_id: int | None = None, attention_mask: torch.Tensor | None = None,
                         pad_token_id: int = 0) -> tuple[torch.Tensor, dict]:
    """Greedy decoding with MTP self-speculation (depth 1) for B rows, each accepting or rejecting on its own.

    Per row: the MTP head drafts token t+2 from the streams of position t and token t+1; the main model verifies
    [t+1, draft] in one 2-token step of every live row. A row whose draft equals the main model's token keeps
    two tokens (the draft and the bonus prediction); a row that rejects is rolled back one token (its rows of
    the cache restored from the snapshot, `DSv4Cache.restore(snap, rows)`), re-runs its token alone (the other
    rows' slots are padding) and keeps the main model's token. One MTP step then advances every row (two MTP
    positions for accepting rows, one for rejecting rows). input_ids [B, S] with attention_mask [B, S] (left /
    right padding as in `generate`) -> (new tokens [B, n], pad_token_id after a row's eos or end; stats) -- row
    by row the same tokens as greedy `generate` on that row alone (slices/X2/test_speculative.py)."""
    if input_ids.dim() != 2:
        raise CacheError(f"speculative_generate: input_ids must be [B, S], got {tuple(input_ids.shape)}")
    if max_new_tokens < 1:
        raise CacheError(f"speculative_generate: max_new_tokens must be >= 1, got {max_new_tokens}")
    B, S = input_ids.shape
    dev = input_ids.device
    mask = torch.ones(B, S, dtype=torch.bool, device=dev) if attention_mask is None else attention_mask.to(torch.bool)
    if not bool(mask.any(-1).all()):
        raise CacheError("speculative_generate: a row of the prompt has no real token")
    was = model.training
    model.eval()
    try:
        cache = DSv4Cache(model, B)
        ids = torch.where(mask, input_ids, torch.full_like(input_ids, pad_token_id))
        lg, X = forward_step(model, cache, ids, mask, return_streams=True)
        rows_ = torch.arange(B, device=dev)
        last = _last_slot(mask)
        nxt = lg[rows_, last].argmax(-1)                                        # [B]
        # MTP over the prompt: each real slot gets the next real token of its row (the last one: nxt)
        nid = torch.full_like(ids, pad_token_id)
        for b in range(B):
            idx = torch.nonzero(mask[b], as_tuple=False).flatten()
            nid[b, idx] = torch.cat([ids[b, idx[1:]], nxt[b:b + 1]])
        d = mtp_step(model, cache, X, nid, mask)[rows_, last].argmax(-1)        # [B] drafts
        out = [[int(nxt[b])] for b in range(B)]
        stats = {"main_steps": 1, "accepted": 0, "rejected": 0, "accepted_per_row": [0] * B,
                 "rejected_per_row": [0] * B}

        def finished(b):
            return len(out[b]) >= max_new_tokens or (eos_token_id is not None and eos_token_id in out[b])

        live = torch.tensor([not finished(b) for b in range(B)], dtype=torch.bool, device=dev)
        while bool(live.any()):
            snap = cache.snapshot()
            lg, X = forward_step(model, cache, torch.stack([nxt, d], 1), live[:, None].expand(B, 2).contiguous(),
                                 return_streams=True)
            stats["main_steps"] += 1
            a = lg[:, 0].argmax(-1)
            acc = live & (a == d)
            rej = live & ~acc
            bonus = lg[:, 1].argmax(-1)
            # MTP inputs: accepting rows [d, bonus] at their two verified positions, rejecting rows [a] at one
            mids = torch.stack([torch.where(acc, d, a), bonus], 1)
            mmask = torch.stack([live, acc], 1)
            streams = X.clone()
            if bool(rej.any()):
                rr = [b for b in range(B) if bool(rej[b])]
                cache.restore(snap, rr)                                         # roll back the draft token
                lr, Xr = forward_step(model, cache, nxt[:, None], rej[:, None], return_streams=True)
                a = torch.where(rej, lr[:, 0].argmax(-1), a)
                mids[:, 0] = torch.where(acc, d, a)
                streams[rej, 0] = Xr[rej, 0]
            for b in range(B):
                if bool(acc[b]):
                    out[b] += [int(d[b]), int(bonus[b])]
                    stats["accepted"] += 1
                    stats["accepted_per_row"][b] += 1
                elif bool(rej[b]):
                    out[b].append(int(a[b]))
                    stats["rejected"] += 1
                    stats["rejected_per_row"][b] += 1
            mt = mtp_step(model, cache, streams, mids, mmask)
            nxt = torch.where(acc, bonus, torch.where(rej, a, nxt))
            d = torch.where(live, mt[rows_, acc.long()].argmax(-1), d)
            live = torch.tensor([not finished(b) for b in range(B)], dtype=torch.bool, device=dev)
        res = []
        for o in out:
            if eos_token_id is not None and eos_token_id in o:
                o = o[:o.index(eos_token_id) + 1]
            res.append(o[:max_new_tokens])
        n = max(len(o) for o in res)
        toks = torch.full((B, n), pad_token_id, dtype=input_ids.dtype, device=dev)
        for b, o in enumerate(res):
            toks[b, :len(o)] = torch.tensor(o, dtype=input_ids.dtype, device=dev)
        return toks, stats
    finally:
        model.train(was)


# --------------------------------------------------------------------------------------------- sampling
def sample_next(logits: torch.Tensor, do_sample: bool = False, temperature: float = 1.0, top_p: float = 1.0,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [B, V] -> next ids [B]: argmax (greedy) or a draw from softmax(logits / T) restricted to the
    smallest set of top tokens whose probability reaches top_p (nucleus; at least one token kept)."""
    if not do_sample or temperature == 0:
        return logits.argmax(-1)
    if temperature < 0 or not 0 < top_p <= 1:
        raise CacheError(f"sample: need temperature >= 0 and 0 < top_p <= 1, got {temperature}, {top_p}")
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1:
        sp, si = probs.sort(dim=-1, descending=True, stable=True)
        before = sp.cumsum(-1) - sp                                            # mass of the better tokens
        sp = sp.masked_fill(before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, si, sp)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@dataclass
class GenerationOutput:
    sequences: torch.Tensor                    # [B, S + new]: the prompt as given, then the new tokens
    new_tokens: torch.Tensor                   # [B, new] (pad_token_id after a row's eos)
    logits: list = field(default_factory=list)  # per step [B, V] fp32: the logits each new token was drawn from
    cache: DSv4Cache | None = None


@torch.no_grad()
def generate(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, max_new_tokens: int = 16,
             do_sample: bool = False, temperature: float = 1.0, top_p: float = 1.0,
             generator: torch.Generator | None = None, eos_token_id: int | None = None, pad_token_id: int = 0,
             prefill_chunk: int | None = None, keep_streams: bool = True, output_logits: bool = False,
             progress=None) -> GenerationOutput:
    """Greedy or sampled decoding of a batch with a DSv4Cache.

    input_ids [B, S] with attention_mask [B, S] (1 = real token; left or right padding, or any mask: each row's
    real tokens are taken in order) -> GenerationOutput. `prefill_chunk`: prefill in chunks of that many slots
    (same result). `progress(i, n)` is called after each new token."""
    if input_ids.dim() != 2:
        raise CacheError(f"generate: input_ids must be [B, S], got {tuple(input_ids.shape)}")
    if max_new_tokens < 0:
        raise CacheError(f"generate: max_new_tokens must be >= 0, got {max_new_tokens}")
    B, S = input_ids.shape
    if attention_mask is None:
        mask = torch.ones(B, S, dtype=torch.bool, device=input_ids.device)
    else:
        mask = attention_mask.to(torch.bool)
    if not bool(mask.any(-1).all()):
        raise CacheError("generate: a row of the prompt has no real token")
    was_training = model.training
    model.eval()
    try:
        cache = DSv4Cache(model, B, keep_streams=keep_streams)
        ids = torch.where(mask, input_ids, torch.full_like(input_ids, pad_token_id))
        last = torch.zeros(B, model.cfg.vocab_size, dtype=torch.float32, device=input_ids.device)
        chunk = prefill_chunk or S
        for a in range(0, S, chunk):
            lg = forward_step(model, cache, ids[:, a:a + chunk], mask[:, a:a + chunk]).float()
            m = mask[:, a:a + chunk]
            has = m.any(-1)
            lastpos = (m.long() * torch.arange(m.shape[1], device=m.device)).argmax(-1)   # last real slot
            last = torch.where(has[:, None], lg[torch.arange(B), lastpos], last)
        out, logits = [], []
        done = torch.zeros(B, dtype=torch.bool, device=input_ids.device)
        for i in range(max_new_tokens):
            if output_logits:
                logits.append(last.clone())
            nxt = sample_next(last, do_sample, temperature, top_p, generator)
            nxt = torch.where(done, torch.full_like(nxt, pad_token_id), nxt)
            out.append(nxt)
            if eos_token_id is not None:
                done = done | (nxt == eos_token_id)
            if progress is not None:
                progress(i + 1, max_new_tokens)
            if i + 1 == max_new_tokens or bool(done.all()):
                break
            lg = forward_step(model, cache, nxt[:, None], (~done)[:, None]).float()
            last = torch.where(done[:, None], last, lg[:, 0])
        new = torch.stack(out, 1) if out else input_ids.new_zeros(B, 0)
        return GenerationOutput(torch.cat([input_ids, new], 1), new, logits, cache)
    finally:
        model.train(was_training)


def tqdm_progress(desc: str = "generate"):
    """A progress(i, n) callback drawing a bar on stderr."""
    from tqdm import tqdm
    bar = {}

    def cb(i, n):
        if "b" not in bar:
            bar["b"] = tqdm(total=n, file=sys.stderr, desc=desc, dynamic_ncols=True)
        bar["b"].update(1)
        if i == n:
            bar["b"].close()
    return cb
