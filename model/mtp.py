"""Multi-token prediction, depth 1, with mHC (spec §10.1; official `MTPBlock`, Megatron MTP + e_proj/h_proj).

    e  = enorm(Embed(ids_next))                    ids_next[t] = token t+1 (shared embedding)
    x  = hnorm(X_L)                                X_L: the main model's final streams [B, S, n, d], per stream
    X0 = e_proj(e)[:, :, None] + h_proj(x)         [B, S, n, d]
    X1 = Block_L(X0)                               a full block: mHC + attention (compress_ratios[L]) + FFN
    y  = norm(HyperHead(X1))                       own hc_head_{fn,base,scale} and norm; shared output head

Official names under `mtp.0.`: e_proj, h_proj, enorm, hnorm, norm, hc_head_{fn,base,scale} and every block
name (attn.*, ffn.*, attn_norm, ffn_norm, hc_attn_*, hc_ffn_*). The MTP layer is never hash-routed.
"""
from __future__ import annotations

import torch
from torch import nn

from dsv4.model.block import Block
from dsv4.model.mhc import hc_head, mhc_parameters
from dsv4.model.norm import RMSNorm


class MTPBlock(Block):
    def __init__(self, cfg, layer_idx: int):
        super().__init__(cfg, layer_idx)
        d = cfg.hidden_size
        self.e_proj = nn.Linear(d, d, bias=False)
        self.h_proj = nn.Linear(d, d, bias=False)
        for lin in (self.e_proj, self.h_proj):
            nn.init.normal_(lin.weight, std=cfg.initializer_range)
        self.enorm = RMSNorm(d, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(d, cfg.rms_norm_eps)
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.hc_head_fn, self.hc_head_base, self.hc_head_scale = mhc_parameters(cfg, head=True)

    def forward(self, X: torch.Tensor, e_next: torch.Tensor, ids_next: torch.Tensor, layout=None,
                aux=None) -> torch.Tensor:
        """X [B, S, n, d] main streams, e_next [B, S, d] = Embed(ids_next) (ids_next = `layout.roll_next(ids, 0)`:
        token t+1 inside t's document) -> y [B, S, d] (before the head)."""
        X0 = self.e_proj(self.enorm(e_next)).unsqueeze(2) + self.h_proj(self.hnorm(X))   # [B, S, n, d]
        X1 = super().forward(X0, ids_next, layout, aux)
        return self.norm(hc_head(X1, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, self.cfg,
                                 self.backend))
