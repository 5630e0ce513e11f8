"""DSv4 hybrid attention: sliding window / CSA / HCA (spec §5, §6, §7, §8), one module for every layout (D1, D6).

One layer (kind from `cfg.compress_ratios[layer_idx]`: 0 window, m CSA, m' HCA) on a token stream described by a
`Layout` (model/layout.py: documents, seg / pos per token; a plain [B, S] batch is B documents of S tokens).
h [B,S,d] (already normed) is flattened to the stream x [T,d]; the layout gives the rows the layer sees
(`context`: local tokens, plus a left halo under context parallelism) and completes the compressed entries
(`gather_entries`). Token-major (THD) throughout:

    cQ = q_norm(x @ wq_a^T)                          [T,d_c]     weighted RMSNorm
    q  = RMSNorm_unweighted_per_head(cQ @ wq_b^T)    [T,H,c];    RoPE on the last r dims (query position);
                                                                 one op (RotaryTable.norm_rotate)
    kv = kv_norm(x @ wkv^T)                          [T',c];     RoPE on the last r dims; K = V = kv
    comp = compressor(x)                             [N,c]       CSA / HCA only (§6), per document, static slots
    sel  = indexer(x, cQ) top-k                      [T,k]       CSA only (§7); HCA attends all visible entries
    o  = sparse_attn(q, kv, comp, sel, attn_sink)    [T,H,c]     one softmax over window + compressed + sink (§5.3)
    o[..., c-r:] = RoPE(o[..., c-r:], -t)                        inverse rotation by the query position (§5.4),
                                                                 inside the attention op (`out_rope`)
    out = wo_b(blockdiag_g(wo_a)(o))                 [B,S,d]     grouped low-rank output (§5.5)
Window, compressor, indexer, indexer loss and sparse attention take the document metadata, so every one of
them is document-local by construction; the kernels (kernels/<op>) take the same arguments on every backend.

RoPE table: "main" (plain theta) for window layers, "compress" (YaRN) for CSA / HCA layers (§5.6).

Indexer loss (§10.3, `cfg.indexer_loss_mode`), computed in training mode on a CSA layer:
    "sparse": candidates = the selected entries; the attention uses the top-k (as in inference);
    "dense":  candidates = all visible entries, and the attention attends ALL of them, in training and in eval
              (CSA without top-k = Megatron's `csa_dense_mode` warm-up phase), so the teacher is still the
              attention actually run; the top-k is still computed (recorded as the selection) but not used;
    "off":    no loss.
In sparse mode with the "joint" teacher, the teacher is read off the attention itself: the sparse attention returns
its log-sum-exp and its mass on each listed entry (the Triton forward keeps the picks' logits it formed anyway;
elsewhere `indexer.indexer_teacher_listed` re-scores only the k listed entries, kernel op `entry_probs`), instead of
scoring window, entries and sink a second time in PyTorch.
The loss, coeff * KL(teacher || softmax(I)) (`indexer.indexer_teacher` / `indexer_kl_loss`), and the selection
go to the forward's `AuxLosses` (model/losses.py), not to the module. The indexer sees detached inputs: its
loss trains only the indexer and the LM loss never reaches it.
"""
from __future__ import annotations

import torch
from torch import nn

from dsv4.kernels.sparse_attn import sparse_attn

from .compressor import Compressor
from .config import ConfigError, DSv4Config
from dsv4.kernels.indexer.naive import causal_entry_mask

from .indexer import Indexer, candidates_from_idx, indexer_kl_loss, indexer_teacher, indexer_teacher_listed
from .layout import Layout
from .losses import AuxLosses
from .norm import RMSNorm
from .precision import autocast_operands
from .rope import RotaryTable, rope_table_name


# DSv4Attention.attn_fwd (DSv4Model.set_attn_fwd) -> the sparse attention's kernel backend on the "triton" backend
ATTN_FWDS = {"triton": "triton", "flashmla": "triton+flashmla", "flashmla+cudnn": "triton+flashmla+cudnn"}
# DSv4Attention.out_rope (DSv4Model.set_out_rope): where o's inverse RoPE (spec §5.4) runs
OUT_ROPES = ("fused", "separate")
# DSv4Attention.all_picked (DSv4Model.set_all_picked): how the Triton attention reads a CSA selection that lists every
# entry each query can see (`_lists_every_visible`): "contiguous" (default: each query's visible range, MODE_ALL) |
# "listed" (the listed rows, gathered)
ALL_PICKED = ("contiguous", "listed")


class _GroupedOutProj(torch.autograd.Function):
    """z[t, k] = o[t, k] @ w[k]^T for each of the g groups (spec §5.5's block-diagonal wo_a; Megatron's BatchedLinear,
    #7971): one GEMM a group on the strided group slices, written into z's / do's group columns in place, so no
    [T, g, i] permuted copy forms either way (einsum's bmm needs the group-major layout and copies)."""

    @staticmethod
    def forward(ctx, o, w):
        T, g, i = o.shape                                                       # o [T, g, i], w [g, r, i]
        z = o.new_empty(T, g, w.shape[1])                                       # [T, g, r]
        for k in range(g):
            torch.mm(o[:, k], w[k].t(), out=z[:, k])                            # [T, i] @ [i, r], row stride g*r
        ctx.save_for_backward(o, w)
        return z

    @staticmethod
    def backward(ctx, dz):
        o, w = ctx.saved_tensors
        g = o.shape[1]
        do = torch.empty_like(o) if ctx.needs_input_grad[0] else None          # [T, g, i]
        dw = torch.empty_like(w) if ctx.needs_input_grad[1] else None          # [g, r, i]
        for k in range(g):
            if do is not None:
                torch.mm(dz[:, k], w[k], out=do[:, k])                          # [T, r] @ [r, i]
            if dw is not None:
                torch.mm(dz[:, k].t(), o[:, k], out=dw[k])                      # [r, T] @ [T, i]
        return do, dw


def grouped_out_proj(o: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """o [T, g, i], w [g, r, i] (wo_a's weight viewed per group) -> z [T, g, r], z[:, k] = o[:, k] @ w[k]^T; computed
    in the autocast dtype under autocast, as the einsum it replaces (which torch.compile traces instead: the same
    product, its layout left to inductor)."""
    if torch.compiler.is_compiling():                  # dynamo takes no strided out=; inductor plans the layout
        return torch.einsum("tgi,gri->tgr", o, w)
    o, w = autocast_operands(o, w)
    return _GroupedOutProj.apply(o, w)


def attention_halo(cfg: DSv4Config, layer_idx: int) -> int:
    """Left context of a layer's local tokens: max(n_win - 1, coff m - 1 of its compressors)."""
    need = cfg.sliding_window - 1
    kind = cfg.layer_kind(layer_idx)
    if kind == "hca":
        need = max(need, cfg.hca_ratio - 1)
    if kind == "csa":
        need = max(need, 2 * cfg.csa_ratio - 1)            # main and indexer compressors, overlapping windows
    return need


def _cat_selections(sels):
    """Per-row selections (idx into that row's entries) -> one selection over the rows' concatenated entries."""
    if sels[0] is None:
        return None
    idx, es, ej, off = [], [], [], 0
    for i, s, j in sels:
        idx.append(torch.where(i >= 0, i + off, i))
        es.append(s)
        ej.append(j)
        off += s.shape[0]
    return torch.cat(idx), torch.cat(es), torch.cat(ej)


def _combine_losses(losses):
    """Per-row (mean, count) -> the mean over all rows' queries with a candidate, and the total count."""
    if losses[0] is None:
        return None
    n = torch.stack([c for _, c in losses]).sum()
    total = torch.stack([l * c for l, c in losses]).sum()
    return total / n.clamp_min(1), n


class DSv4Attention(nn.Module):
    def __init__(self, cfg: DSv4Config, layer_idx: int, backend: str = "naive"):
        super().__init__()
        cfg.validate()                      # head_dim >= rope dims, even rope dims, o_groups | H, top-k >= 1, ...
        if not 0 <= layer_idx < len(cfg.compress_ratios):
            raise ConfigError(f"DSv4Config.compress_ratios: no entry for layer_idx {layer_idx}")
        self.cfg, self.layer_idx, self.backend = cfg, layer_idx, backend
        # the sparse attention's forward on the "triton" backend: "triton" (default) | "flashmla" (FlashMLA's SM90
        # sparse prefill forward + our Triton backward where it qualifies, kernels/sparse_attn/flashmla.py) |
        # "flashmla+cudnn" (the same forward + cuDNN's SM90 DSA backward, kernels/sparse_attn/cudnn_bwd.py);
        # set by DSv4Model.set_attn_fwd; no effect on the "naive" backend
        self.attn_fwd = "triton"
        # the output's inverse RoPE (OUT_ROPES, DSv4Model.set_out_rope): "fused" (default) in the attention op
        # (backend "triton": in its kernels, only the rotated output kept) | "separate" (a RoPE op after it)
        self.out_rope = "fused"
        self.all_picked = "contiguous"     # ALL_PICKED (DSv4Model.set_all_picked)
        self.kind = cfg.layer_kind(layer_idx)                  # 'window' | 'csa' | 'hca'
        self.ratio = cfg.compress_ratios[layer_idx]
        d, H, c, r = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.qk_rope_head_dim
        g, dg = cfg.o_groups, cfg.o_lora_rank
        self.n_heads, self.head_dim, self.rope_dim, self.o_groups = H, c, r, g
        self.window, self.eps, self.scale = cfg.sliding_window, cfg.rms_norm_eps, c ** -0.5

        self.rope = RotaryTable(cfg, rope_table_name(cfg, layer_idx))
        self.wq_a = nn.Linear(d, cfg.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = nn.Linear(cfg.q_lora_rank, H * c, bias=False)
        self.wkv = nn.Linear(d, c, bias=False)
        self.kv_norm = RMSNorm(c, cfg.rms_norm_eps)
        self.wo_a = nn.Linear(H * c // g, g * dg, bias=False)  # weight [g*d_g, H*c/g]: block-diagonal per group
        self.wo_b = nn.Linear(g * dg, d, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(H, dtype=torch.float32))      # fp32-kept
        self.compressor = None
        self.indexer = None
        if self.kind != "window":
            self.compressor = Compressor(d, c, self.ratio, overlap=(self.kind == "csa"), rope=self.rope,
                                         eps=cfg.rms_norm_eps)
        if self.kind == "csa":
            self.indexer = Indexer(cfg, self.rope)
        self.halo = attention_halo(cfg, layer_idx)       # left context a context-parallel rank needs
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """HF / spec §13.16 init: linear weights N(0, initializer_range); sink and ape 0; norm weights 1."""
        for mod in self.modules():
            if isinstance(mod, nn.Linear):
                nn.init.normal_(mod.weight, mean=0.0, std=self.cfg.initializer_range)
            elif isinstance(mod, RMSNorm):
                nn.init.ones_(mod.weight)
            elif isinstance(mod, Compressor):
                nn.init.zeros_(mod.ape)
        nn.init.zeros_(self.attn_sink)

    def forward(self, h: torch.Tensor, layout: Layout | None = None, aux: AuxLosses | None = None,
                positions: torch.Tensor | None = None, backend: str | None = None) -> torch.Tensor:
        """h [B,S,d] -> [B,S,d] on `layout` (default: B documents of S tokens, RoPE at `positions` [S]).

        The projections and the sparse attention run on all B*S tokens at once (the layout's documents keep
        the rows apart); the compressors, the indexer and its loss run per row of the batch (a document never
        crosses a row, model/layout.py), so the indexer's scores are [S, S/m] per row, not [B*S, B*S/m]; the
        rows' entries are concatenated and their selections offset into them (`_merge`)."""
        backend = backend or self.backend
        B, S, d = h.shape
        if isinstance(layout, torch.Tensor):
            raise TypeError("DSv4Attention: the second argument is a Layout; pass RoPE positions as positions=...")
        if layout is None:
            layout = Layout.batch(B, S, h.device, positions)
        elif positions is not None:
            raise ValueError("DSv4Attention: positions come from the layout (rope_pos) when a layout is given")
        if layout.shape != (B, S):
            raise ValueError(f"DSv4Attention: h [B, S] = {(B, S)} but the layout describes {layout.shape}")
        H, c, g = self.n_heads, self.head_dim, self.o_groups
        x, seg, pos, rope_pos, q0 = layout.context(h.reshape(B * S, d), self.halo)     # [T', d], q0 halo rows
        xl, rq = (x, rope_pos) if q0 == 0 else (x[q0:], rope_pos[q0:])    # (a full slice's backward fills zeros)
        T = xl.shape[0]
        cq = self.q_norm(self.wq_a(xl))                                         # [T, d_c]
        q = self.wq_b(cq).view(T, H, c)                                         # [T, H, c]
        q = self.rope.norm_rotate(q, rq, self.eps, backend)                     # per-head unweighted RMSNorm, RoPE
        kv = self.rope(self.kv_norm(self.wkv(x)), rope_pos)                     # [T', c] halo + local keys

        if q0 and B > 1:
            raise ValueError("DSv4Attention: a layout with a halo (context parallel) must describe one row [1, C]")
        # entries and selection per batch row (a row's indexer scores are [S, S/m], not [B*S, B*S/m]); the
        # attention then runs once over the whole stream (the layout's documents keep the rows apart)
        ctxs = [(seg, pos, rope_pos, q0)] if B == 1 else [tuple(t[r * S:(r + 1) * S] for t in (seg, pos, rope_pos))
                                                          + (0,) for r in range(B)]
        cut = (lambda t, r: t) if B == 1 else (lambda t, r: t[r * S:(r + 1) * S])
        xr = [x] if B == 1 else x.split(S)              # one SplitBackward (a cat), not B zero-filled slices
        picks = [self._select(xr[r], cut(cq, r), ctxs[r], layout, backend, None if B == 1 else r)
                 for r in range(B)]
        comp, eseg, ej, use_sel, want_loss, listed = self._merge(picks)
        sa_backend = ATTN_FWDS[self.attn_fwd] if backend == "triton" else backend
        fused = self.out_rope == "fused"            # the inverse RoPE of o inside the attention (OUT_ROPES)
        contiguous = sa_backend == "triton" and self.all_picked == "contiguous"
        attn_sel = None if contiguous and self._lists_every_visible(layout, use_sel) else use_sel
        o = sparse_attn(q, kv, comp, attn_sel, self.attn_sink, self.window, self.ratio or 1, self.scale,
                        seg, pos, eseg, ej, q0, return_lse=listed, return_probs=listed, backend=sa_backend,
                        out_rope=self.rope.tables(rq, q.dtype) if fused else None,
                        probs_idx=use_sel if attn_sel is None else None)          # [T, H, c]
        lse = probs = None
        if listed:
            o, lse, probs = o             # lse [T, H]; probs [T, k]: the teacher's mass on the picks, or None
            # (read contiguously, `_lists_every_visible`: the same mass, stored by each entry's index in its document)
        sel = None
        if self.indexer is not None:
            rows = [p["selection"] for p in picks]
            if B > 1 and use_sel is not None and all(p["eseg"].shape == r[1].shape for p, r in zip(picks, rows)):
                sel = (use_sel, torch.cat([r[1] for r in rows]), torch.cat([r[2] for r in rows]))   # same offsets
            else:
                sel = _cat_selections(rows)
        loss = None
        if want_loss:
            losses = [self._loss(p, cut(q, r), cut(kv, r), None if lse is None else cut(lse, r), ctxs[r], backend,
                                 None if probs is None else cut(probs, r)) for r, p in enumerate(picks)]
            loss = losses[0] if B == 1 else _combine_losses(losses)
        if aux is not None and sel is not None:
            aux.add_selection(*sel)
        if aux is not None and loss is not None:
            aux.add_indexer(*loss)

        if not fused:
            o = self.rope(o, rq, inverse=True)                                  # rotate back by query position
        o = o.reshape(T, g, H * c // g)                                         # group i = heads i*H/g..
        z = grouped_out_proj(o, self.wo_a.weight.view(g, -1, H * c // g))      # [T, g, d_g]
        return self.wo_b(z.flatten(1)).view(B, S, -1)                           # [T, d] -> [B, S, d]

    def forward_megatron(self, hidden_states: torch.Tensor, packed_seq_params=None, aux: AuxLosses | None = None,
                         backend: str | None = None) -> torch.Tensor:
        """Megatron's layout: hidden_states [s, b, d] (+ a `PackedSeqParams`, duck-typed: qkv_format 'thd' with
        hidden_states [t, 1, d], or 'sbhd') -> [s, b, d]. Converts at the edge: the same forward on the [b, s, d]
        view and the one Layout (Layout.from_packed_seq_params); Megatron's (output, bias) pair is not mimicked."""
        if hidden_states.dim() != 3:
            raise ValueError(f"DSv4Attention.forward_megatron: hidden_states must be [s, b, d], got "
                             f"{tuple(hidden_states.shape)}")
        s, b, _ = hidden_states.shape
        layout = Layout.from_packed_seq_params(packed_seq_params, (b, s), hidden_states.device)
        out = self(hidden_states.transpose(0, 1), layout, aux, backend=backend)   # [b, s, d]
        return out.transpose(0, 1)                                              # [s, b, d]

    def _compressors(self):
        return [c for c in (self.compressor, self.indexer.compressor if self.indexer is not None else None)
                if c is not None]

    def _slots(self, layout: Layout, comp: Compressor, row: int | None, backend: str):
        """The slot metadata of `comp` on the rows this layer sees (`layout.context(., self.halo)`, batch row
        `row`; None: the whole stream), from the layout's memo: shared by every layer of the kind."""
        return layout.compress_slots(comp.ratio, comp.overlap, self.halo, row, backend)

    def prepare_layout(self, layout: Layout, backend: str | None = None) -> None:
        """Compute this layer's compressor slot metadata on `layout` now (eagerly, before compiled blocks run;
        a memo hit when an earlier layer of the kind did): `forward` then only reads it."""
        B = layout.shape[0]
        for comp in self._compressors():
            for row in ([None] if B == 1 else range(B)):
                self._slots(layout, comp, row, backend or self.backend)

    def _select(self, x, cq, ctx, layout, backend, row=None) -> dict:
        """Entries and selection of one stream: x [T',d] (halo + local rows), cq [T,d_c] (local), ctx = (seg, pos,
        rope_pos [T'], q_offset), the stream's batch row (None: the whole stream) -> the compressed entries
        (comp [N,c], entry_seg, entry_j; None for a window layer), the indexer's selection (idx [T,k] into comp,
        entry_seg, entry_j) and what the indexer loss needs (its features, the mode)."""
        seg, pos, rope_pos, q0 = ctx
        cfg = self.cfg
        out = dict(comp=None, eseg=None, ej=None, selection=None, feats=None, scores=None, use_sel=None)
        if self.compressor is not None:
            slots = self._slots(layout, self.compressor, row, backend)
            out["comp"], out["eseg"], out["ej"] = layout.gather_entries(
                *self.compressor(x, seg, pos, rope_pos, q0, backend=backend, slots=slots))
        mode = cfg.indexer_loss_mode
        out["want_loss"] = (self.indexer is not None and self.training and mode != "off"
                            and cfg.indexer_loss_coeff != 0)
        if self.indexer is not None:
            islots = self._slots(layout, self.indexer.compressor, row, backend)   # = slots (memo) if same ratio/overlap
            scores, sel, iseg, ij, feats = self.indexer(x.detach(), cq.detach(), ctx, layout, backend=backend,
                                                        dense_grad=out["want_loss"] and mode == "dense",
                                                        return_feats=True, slots=islots)         # [T, N]
            out.update(selection=(sel, iseg, ij), feats=feats, scores=scores,
                       use_sel=sel if mode != "dense" else None)                  # dense: all entries
        out["listed"] = out["want_loss"] and out["use_sel"] is not None and cfg.indexer_teacher == "joint"
        return out

    def _lists_every_visible(self, layout: Layout, use_sel: torch.Tensor | None) -> bool:
        """True when the top-k lists every entry each query can see: no document is longer than ratio x (k' + 1)
        - 1 tokens (k' = the selection's width; a query at position p sees floor((p + 1) / m) entries, spec
        §6.2), so every visible entry has a finite score and is among the k' listed. The Triton attention then
        streams each query's contiguous visible range (MODE_ALL, as in HCA: queries of a program share the key
        tiles, 4x fewer tiles and dKV atomics at H = 16) instead of gathering the listed rows one query at a time:
        the same keys in another summation order. A host decision from the layout's host offsets (no sync);
        unknown lengths (device offsets) keep the listed path."""
        L = layout.longest_document
        return use_sel is not None and L is not None and L // max(self.ratio, 1) <= use_sel.shape[-1]

    @staticmethod
    def _merge(picks):
        """The rows' entries and selections as one stream's (the selection offset into the concatenated entries;
        one row: as is) -> (comp, entry_seg, entry_j, selection used by the attention, want_loss, listed)."""
        p0 = picks[0]
        if len(picks) == 1 or p0["comp"] is None:
            return p0["comp"], p0["eseg"], p0["ej"], p0["use_sel"], p0["want_loss"], p0["listed"]
        comp = torch.cat([p["comp"] for p in picks])
        if p0["use_sel"] is not None:
            use_sel, eseg, ej = _cat_selections([(p["use_sel"], p["eseg"], p["ej"]) for p in picks])
        else:
            use_sel, eseg, ej = None, torch.cat([p["eseg"] for p in picks]), torch.cat([p["ej"] for p in picks])
        return comp, eseg, ej, use_sel, p0["want_loss"], p0["listed"]

    def _loss(self, part, q, kv, lse, ctx, backend, probs=None):
        """The indexer loss of one stream (`_select`'s record `part`, its queries q [T,H,c], keys kv [T',c], the
        attention's lse [T,H] of those queries when the teacher is read off it, and its mass on the picks [T,k]
        when the attention kernel formed it) -> (mean, query count)."""
        seg, pos, _, q0 = ctx
        cfg = self.cfg
        comp, eseg, ej, use_sel = part["comp"], part["eseg"], part["ej"], part["use_sel"]
        N = comp.shape[0]
        if use_sel is None:         # dense: all visible entries, the [T, N] scores
            cand = causal_entry_mask(seg[q0:], pos[q0:], eseg, ej, self.ratio)    # [T, N]
            target = indexer_teacher(q, kv, comp, cand, self.attn_sink, self.window, self.scale,
                                     cfg.indexer_teacher, seg, pos, q0)
            scores = part["scores"]
        else:                       # sparse: the k listed entries, their scores re-formed ([T, k])
            cand = use_sel >= 0                                                 # [T, k]
            if part["listed"]:      # joint: the attention's own probabilities of its listed entries
                target = indexer_teacher_listed(q, comp, use_sel, lse, self.ratio, self.scale, seg, pos, eseg,
                                                ej, q0, backend=backend, probs=probs)
            else:
                target = indexer_teacher(q, kv, comp, candidates_from_idx(use_sel, N), self.attn_sink,
                                         self.window, self.scale, cfg.indexer_teacher, seg, pos, q0,
                                         idx=use_sel).gather(-1, torch.where(cand, use_sel, 0)) * cand
            scores = self.indexer.listed_scores(part["feats"], use_sel, backend=backend)   # [T, k]
        kl = cfg.indexer_loss_coeff * indexer_kl_loss(scores, target, cand)
        return kl, cand.any(-1).sum().to(kl.dtype)                          # the mean and its query count

    def extra_repr(self) -> str:
        return f"layer={self.layer_idx}, kind={self.kind}, ratio={self.ratio}, backend={self.backend}" + (
            f", attn_fwd={self.attn_fwd}" if self.attn_fwd != "triton" else "") + (
            f", out_rope={self.out_rope}" if self.out_rope != "fused" else "") + (
            f", all_picked={self.all_picked}" if self.all_picked != "contiguous" else "")
