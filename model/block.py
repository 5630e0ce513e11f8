"""One DSv4 block = mHC(attention) + mHC(FFN) on n_hc residual streams (spec §3, §4).

    u, post, comb = hc_pre(X; hc_attn_*);   X = hc_post(X, attn(attn_norm(u), pos), post, comb)
    u, post, comb = hc_pre(X; hc_ffn_*);    X = hc_post(X, ffn(ffn_norm(u), ids), post, comb)

Official names: `attn`, `ffn`, `attn_norm`, `ffn_norm`, `hc_attn_{fn,base,scale}`, `hc_ffn_{fn,base,scale}`.
The FFN is an MoE (`E`, spec §9) or a dense SwiGLU MLP (`-`, HybridModel patterns; width cfg.dense_ffn_size).

hc_post reads X through hc_pre's `Xr` (the same tensor; on the Triton backend its gradient is added to hc_pre's
inside hc_pre's backward kernel instead of by the autograd engine in a pass of its own).

With `recompute_mhc = True` (Megatron `recompute_modules=["mhc"]`, slice ext_4531) hc_pre's outputs
(u, post, comb) are not kept between forward and backward: they are discarded after hc_post consumed them and
recomputed from X when the gradient reaches the sublayer's output streams.
"""
from __future__ import annotations

import torch
from torch import nn

from dsv4.model.mhc import CheckpointWithoutOutput, hc_post, hc_pre, mhc_parameters
from dsv4.model.moe import MLP, MoE
from dsv4.model.norm import RMSNorm


def _attention_cls():
    from dsv4.model.attention import DSv4Attention   # written by the attention helper; imported lazily
    return DSv4Attention


class Block(nn.Module):
    def __init__(self, cfg, layer_idx: int):
        super().__init__()
        self.cfg, self.layer_idx = cfg, layer_idx
        self.attn = _attention_cls()(cfg, layer_idx)
        self.ffn = MoE(cfg, layer_idx) if cfg.is_moe(layer_idx) else MLP(cfg, cfg.dense_ffn_size, None)
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale = mhc_parameters(cfg)
        self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale = mhc_parameters(cfg)
        self.recompute_mhc = False       # set per block (ext_4531); no config field
        self.backend = "naive"

    def _pre(self, X, fn, base, scale):
        return hc_pre(X, fn, base, scale, self.cfg, self.backend)

    def _sublayer(self, X, fn, base, scale, norm, f):
        """X' = hc_post(X, f(norm(u)), post, comb) with (u, post, comb) = hc_pre(X)."""
        if self.recompute_mhc and torch.is_grad_enabled():
            ckpt = CheckpointWithoutOutput()
            u, post, comb = ckpt.checkpoint(self._pre, X, fn, base, scale)
            Xn = hc_post(X, f(norm(u)), post, comb, self.backend)
            ckpt.discard_output_and_register_recompute(Xn)
            return Xn
        u, post, comb, Xr = hc_pre(X, fn, base, scale, self.cfg, self.backend, residual=True)   # Xr: X (a view)
        return hc_post(Xr, f(norm(u)), post, comb, self.backend)

    def forward(self, X: torch.Tensor, input_ids: torch.Tensor, layout=None, aux=None):
        """X [B, S, n, d], input_ids [B, S] (hash routing), layout (model/layout.py; default: B documents of S
        tokens), aux (model/losses.AuxLosses, collects this forward's auxiliary losses) -> X' [B, S, n, d]."""
        X = self._sublayer(X, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale, self.attn_norm,
                           lambda h: self.attn(h, layout, aux))
        if isinstance(self.ffn, MoE):
            ffn = lambda h: self.ffn(h, input_ids, aux)   # noqa: E731
        else:
            ffn = self.ffn
        return self._sublayer(X, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale, self.ffn_norm, ffn)
