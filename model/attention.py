"""DSv4 hybrid attention: sliding window / CSA / HCA (spec §5, §6, §7, §8), unfused SBHD reference (slice D1).

One layer (kind from `cfg.compress_ratios[layer_idx]`: 0 window, m CSA, m' HCA), input h [B,S,d] (already normed):

    cQ = q_norm(h @ wq_a^T)                          [S,B,d_c]   weighted RMSNorm
    q  = RMSNorm_unweighted_per_head(cQ @ wq_b^T)    [S,B,H,c];  RoPE on the last r dims (query position)
    kv = kv_norm(h @ wkv^T)                          [S,B,c];    RoPE on the last r dims; K = V = kv
    comp = compressor(h)                             [T,B,c]     CSA / HCA only (§6)
    sel  = indexer(h, cQ) top-k                      [S,B,k]     CSA only (§7); HCA attends all complete entries
    o  = sparse_attn(q, kv, comp, sel, attn_sink)    [S,B,H,c]   one softmax over window + compressed + sink (§5.3)
    o[..., c-r:] = RoPE(o[..., c-r:], -t)                        inverse rotation by the query position (§5.4)
    out = wo_b(blockdiag_g(wo_a)(o))                 [B,S,d]     grouped low-rank output (§5.5)

RoPE table: "main" (plain theta) for window layers, "compress" (YaRN) for CSA / HCA layers (§5.6).
The masks of the kernels use the index 0..S-1 of a token in the sequence; `positions` only feeds RoPE.

Indexer loss (§10.3, `cfg.indexer_loss_mode`), computed in training mode on a CSA layer:
    "sparse": candidates = the selected entries; the attention uses the top-k (as in inference);
    "dense":  candidates = all complete entries, and the attention attends ALL of them, in training and in eval
              (CSA without top-k = Megatron's `csa_dense_mode` warm-up phase), so the teacher is still the
              attention actually run; the top-k is still computed (`last_topk`) but not used;
    "off":    no loss.
`self.indexer_loss` = coeff * KL(teacher || softmax(I)) (see `indexer.indexer_teacher` / `indexer_kl_loss`),
else None. The indexer sees detached inputs: its loss trains only the indexer and the LM loss never reaches it.
"""
from __future__ import annotations

import torch
from torch import nn

from dsv4.kernels.sparse_attn import sparse_attn

from .compressor import Compressor
from .config import ConfigError, DSv4Config
from .indexer import Indexer, candidates_from_idx, indexer_kl_loss, indexer_teacher
from .norm import RMSNorm, rms_norm
from .rope import RotaryTable, rope_table_name


class DSv4Attention(nn.Module):
    def __init__(self, cfg: DSv4Config, layer_idx: int, backend: str = "naive"):
        super().__init__()
        cfg.validate()                      # head_dim >= rope dims, even rope dims, o_groups | H, top-k >= 1, ...
        if not 0 <= layer_idx < len(cfg.compress_ratios):
            raise ConfigError(f"DSv4Config.compress_ratios: no entry for layer_idx {layer_idx}")
        self.cfg, self.layer_idx, self.backend = cfg, layer_idx, backend
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
        self.indexer_loss: torch.Tensor | None = None
        self.last_topk: torch.Tensor | None = None
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

    def forward(self, h: torch.Tensor, positions: torch.Tensor | None = None,
                backend: str | None = None, cu_seqlens: torch.Tensor | None = None,
                cu_seqlens_padded: torch.Tensor | None = None) -> torch.Tensor:
        """h [B,S,d], positions [S] long (default 0..S-1) -> [B,S,d].

        Packed THD input (slice D6): h [1, T, d] with `cu_seqlens` (+ `cu_seqlens_padded`) runs the
        document-local path of model/thd.py (positions then restart per document and are not used)."""
        if cu_seqlens is not None:
            from .thd import thd_attention_forward
            return thd_attention_forward(self, h, cu_seqlens, cu_seqlens_padded)
        backend = backend or self.backend
        B, S, _ = h.shape
        H, c, g = self.n_heads, self.head_dim, self.o_groups
        if positions is None:
            positions = torch.arange(S, device=h.device)
        if tuple(positions.shape) != (S,):
            raise ValueError(f"DSv4Attention: positions shape {tuple(positions.shape)} != (S,) = {(S,)}")
        x = h.transpose(0, 1)                                                   # [B,S,d] -> [S,B,d] (SBHD)

        cq = self.q_norm(self.wq_a(x))                                          # [S, B, d_c]
        q = self.wq_b(cq).view(S, B, H, c)                                      # [S, B, H, c]
        q = rms_norm(q, None, self.eps)                                         # per-head, unweighted
        q = self.rope(q, positions)
        kv = self.rope(self.kv_norm(self.wkv(x)), positions)                    # [S, B, c]

        comp, sel, scores = None, None, None
        self.indexer_loss, self.last_topk = None, None
        if self.compressor is not None:
            comp = self.compressor(x, positions, backend=backend)               # [T, B, c]
        mode = self.cfg.indexer_loss_mode
        if self.indexer is not None:
            scores, sel = self.indexer(x.detach(), cq.detach(), positions, backend=backend)   # [S,B,T], [S,B,k]
            self.last_topk = sel.transpose(0, 1)                                # [S,B,k] -> [B,S,k]
        use_sel = sel if (self.indexer is not None and mode != "dense") else None   # dense: all entries

        o = sparse_attn(q, kv, comp, use_sel, self.attn_sink, self.window, self.ratio or 1, self.scale,
                        backend=backend)                                        # [S, B, H, c]

        if self.indexer is not None and self.training and mode != "off" and self.cfg.indexer_loss_coeff != 0:
            T = comp.shape[0]
            if use_sel is None:     # dense: all complete entries
                t = torch.arange(S, device=h.device)
                causal = torch.arange(T, device=h.device)[None, :] < torch.div(t + 1, self.ratio,
                                                                                rounding_mode="floor")[:, None]
                cand = causal[:, None, :].expand(S, B, T)                       # [S, B, T]
            else:
                cand = candidates_from_idx(sel, T)                              # [S, B, T]
            target = indexer_teacher(q, kv, comp, cand, self.attn_sink, self.window, self.scale,
                                     self.cfg.indexer_teacher, idx=use_sel)
            self.indexer_loss = self.cfg.indexer_loss_coeff * indexer_kl_loss(scores, target, cand)

        o = self.rope(o, positions, inverse=True)                              # rotate back by query position
        o = o.reshape(S, B, g, H * c // g)                                      # group i = heads i*H/g..
        wo_a = self.wo_a.weight.view(g, -1, H * c // g)                         # [g, d_g, H*c/g]
        z = torch.einsum("sbgi,gri->sbgr", o, wo_a)                             # [S, B, g, d_g]
        out = self.wo_b(z.flatten(2))                                           # [S, B, d]
        return out.transpose(0, 1)                                              # [S,B,d] -> [B,S,d]

    def extra_repr(self) -> str:
        return f"layer={self.layer_idx}, kind={self.kind}, ratio={self.ratio}, backend={self.backend}"
