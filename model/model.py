"""The DSv4 network (spec §3): embedding -> n_hc streams -> L blocks -> HyperHead -> norm -> head, + MTP.

    e = Embed(ids); X = [e]*n_hc                       [B, S, n, d]
    X = Block_l(X) for l < L                           mHC(attention) + mHC(FFN)   (model/block.py)
    logits = head(norm(HyperHead(X)))                  [B, S, V]
    mtp_logits = head(MTP(X, Embed(ids_next)))         depth 1 (model/mtp.py)

Labels follow Megatron: `labels[:, t]` is the target of position t (already shifted), -100 = ignored. The MTP
input at position t is token t+1 (`ids_next` = ids shifted left; the last position gets id 0) and its target is
`labels[:, t+1]` (the last position is ignored).

loss = lm + mtp_loss_scaling_factor * mtp_1 + indexer + moe aux; `losses` holds detached scalars under
Megatron's metric names ("lm loss", "mtp_1 loss" (unscaled CE), "indexer loss", "moe aux loss").
Parameter names follow DeepSeek's official checkpoint (`embed.weight`, `layers.{i}.*`, `norm.weight`,
`hc_head_*`, `head.weight`, `mtp.0.*`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from dsv4.model.block import Block
from dsv4.model.config import ConfigError, DSv4Config
from dsv4.model.mhc import expand_streams, hc_head, mhc_parameters
from dsv4.model.moe import Gate, MoE
from dsv4.model.mtp import MTPBlock
from dsv4.model.norm import RMSNorm
from dsv4.model.precision import cast_model

IGNORE = -100


@dataclass
class DSv4Output:
    logits: torch.Tensor                         # [B, S, V]
    mtp_logits: torch.Tensor | None = None       # [B, S, V] (position t predicts token t+2)
    loss: torch.Tensor | None = None             # scalar, with graph
    losses: dict = field(default_factory=dict)   # Megatron metric name -> detached scalar


class DSv4Model(nn.Module):
    def __init__(self, cfg: DSv4Config):
        super().__init__()
        if cfg.num_nextn_predict_layers not in (0, 1):
            raise ConfigError(f"DSv4Config.num_nextn_predict_layers: only 0 or 1 supported, got "
                              f"{cfg.num_nextn_predict_layers}")
        self.cfg = cfg
        d = cfg.hidden_size
        self.embed = nn.Embedding(cfg.vocab_size, d)
        nn.init.normal_(self.embed.weight, std=cfg.initializer_range)
        self.layers = nn.ModuleList([Block(cfg, i) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.hc_head_fn, self.hc_head_base, self.hc_head_scale = mhc_parameters(cfg, head=True)
        self.head = nn.Linear(d, cfg.vocab_size, bias=False)
        nn.init.normal_(self.head.weight, std=cfg.initializer_range)
        self.mtp = nn.ModuleList([MTPBlock(cfg, cfg.num_hidden_layers + k)
                                  for k in range(cfg.num_nextn_predict_layers)])
        self.backend = "naive"

    # ------------------------------------------------------------------ forward
    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> DSv4Output:
        """input_ids [B, S] (int), labels [B, S] or None -> DSv4Output."""
        B, S = input_ids.shape
        cfg = self.cfg
        positions = torch.arange(S, device=input_ids.device)
        e = self.embed(input_ids)                                               # [B, S, d]
        X = expand_streams(e, cfg.hc_mult)                                      # [B, S, n, d]
        for layer in self.layers:
            X = layer(X, input_ids, positions)
        y = self.norm(hc_head(X, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, cfg, self.backend))
        logits = self.head(y)                                                   # [B, S, V]

        mtp_logits = None
        if len(self.mtp):
            ids_next = F.pad(input_ids[:, 1:], (0, 1), value=0)                 # [B, S]: token t+1
            mtp_logits = self.head(self.mtp[0](X, self.embed(ids_next), ids_next, positions))

        out = DSv4Output(logits=logits, mtp_logits=mtp_logits)
        if labels is not None:
            out.loss, out.losses = self._losses(logits, mtp_logits, labels)
        return out

    def _losses(self, logits, mtp_logits, labels):
        V = self.cfg.vocab_size
        lm = F.cross_entropy(logits.float().reshape(-1, V), labels.reshape(-1), ignore_index=IGNORE)
        loss, losses = lm, {"lm loss": lm.detach()}
        if mtp_logits is not None:
            mtp_labels = F.pad(labels[:, 1:], (0, 1), value=IGNORE)            # target of t is labels[t+1]
            mtp = F.cross_entropy(mtp_logits.float().reshape(-1, V), mtp_labels.reshape(-1), ignore_index=IGNORE)
            loss = loss + self.cfg.mtp_loss_scaling_factor * mtp
            losses["mtp_1 loss"] = mtp.detach()
        idx_loss = [a.indexer_loss for a in self._attns() if getattr(a, "indexer_loss", None) is not None]
        if idx_loss:
            il = torch.stack([t.float() for t in idx_loss]).sum()
            loss, losses["indexer loss"] = loss + il, il.detach()
        aux = [m.aux_loss for m in self.modules() if isinstance(m, MoE) and m.aux_loss is not None]
        if aux:
            al = torch.stack([t.float() for t in aux]).sum()
            loss, losses["moe aux loss"] = loss + al, al.detach()
        return loss, losses

    def _attns(self):
        return [b.attn for b in list(self.layers) + list(self.mtp)]

    # ------------------------------------------------------------------ training helpers
    def update_expert_bias(self) -> None:
        """Auxiliary-loss-free balancing step for every score-routed MoE layer (call after optimizer.step())."""
        for m in self.modules():
            if isinstance(m, Gate):
                m.update_expert_bias()

    def set_kernel_backend(self, backend: str) -> "DSv4Model":
        """Choose the kernel backend ("naive" | "triton") of every module that has one."""
        for m in self.modules():
            if hasattr(m, "backend") and isinstance(m.backend, str):
                m.backend = backend
        return self

    def set_recompute_mhc(self, on: bool = True) -> "DSv4Model":
        for b in list(self.layers) + list(self.mtp):
            b.recompute_mhc = on
        return self

    # ------------------------------------------------------------------ selective FP32 (P1)
    def to(self, *args, **kwargs):
        device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
        if device is not None:
            super().to(device=device, non_blocking=non_blocking)
        if dtype is not None:
            cast_model(self, dtype)
        return self

    def to_bf16(self) -> "DSv4Model":
        return cast_model(self, torch.bfloat16)

    def bfloat16(self):
        return cast_model(self, torch.bfloat16)

    def half(self):
        return cast_model(self, torch.float16)

    def float(self):
        return cast_model(self, torch.float32)


def build_model(cfg: DSv4Config | str, device: str | torch.device | None = None, **overrides) -> DSv4Model:
    """DSv4Model from a config or a named config (`get_config` names); device="meta" builds without memory."""
    from dsv4.model.config import get_config
    if isinstance(cfg, str):
        cfg = get_config(cfg, **overrides)
    elif overrides:
        cfg = cfg.replace(**overrides)
    if device is None:
        return DSv4Model(cfg)
    with torch.device(device):
        return DSv4Model(cfg)
