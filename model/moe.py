"""Mixture of experts (spec §9): sqrtsoftplus router, hash routing, ClampedSwiGLU experts, one shared expert.

    s   = sqrt(softplus(x @ W_gate^T))                       [T, E]  router affinities (fp32)
    idx = tid2eid[token_id]         (hash layers, spec §9.3)  [T, K]
        | topk(s + b, K)            (score layers; b = expert bias, selection only)
    w   = rho * s[idx] / sum s[idx]                           [T, K]  (b never enters w)
    y   = sum_k w_k Expert_{idx_k}(x) + Shared(x)

Experts use ClampedSwiGLU silu(min(gate, L)) * clamp(up, -L, L) (slice P5); the shared expert is unclamped as
in DeepSeek's code unless `cfg.shared_expert_clamp` (HF 5.23's variant).

Top-k tie-break: equal (s + b) values are ordered by the LOWER expert index first (a stable descending sort),
so routing is deterministic and independent of E's memory layout.

Routed experts are STACKED parameters (HF layout, so HF conversion is a rename and grouped GEMMs can use them
directly): `experts.w13` [E, 2f, d] = per expert cat(w1, w3) along rows, `experts.w2` [E, d, f]. The official
per-expert `ffn.experts.{e}.w1|w2|w3.weight` are produced / consumed by `model/interop/official.py`.

Load balancing (spec §9.4, training only): auxiliary-loss-free expert bias updated outside the gradient by
`update_expert_bias()` (b_e += gamma * sign(mean_load - load_e), from the token counts accumulated since the
last update), plus the V3 sequence-wise balance loss alpha * sum_e f_e P_e per sequence (score layers only:
hash layers have no learned selection to balance). The loss (coefficient applied) goes to the forward's
`AuxLosses` (model/losses.py). Expert parallelism installs a `dispatcher` (model/ep_dispatch.py) on the layer.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsv4.kernels import KernelUnavailable
from dsv4.kernels.moe_combine import moe_combine
from dsv4.kernels.swiglu import clamped_swiglu, clamped_swiglu_packed
from dsv4.model.precision import autocast_dtype
from dsv4.model.recompute import recomputing

# How the routed experts' GEMMs run (`Experts.gemm`, set for a whole model by `DSv4Model.set_expert_gemm`):
#   "loop"    one F.linear pair per expert over its gathered tokens (host sync for the counts; any device/dtype);
#   "grouped" torch._grouped_mm over the expert-sorted slots (no host sync; bf16 activations and weights);
#   "dense"   every expert on every token, weighted by the (mostly zero) routing weight: static shapes, no host
#             sync, no data-dependent control flow (torch.compile without graph breaks on any device), E/K x the
#             FLOPs: for small models and CPU tests;
#   "auto"    (default) "grouped" for bf16 CUDA tensors when torch has _grouped_mm, else "loop".
# A choice whose capability is missing raises KernelUnavailable naming it (no probe, no silent fallback).
# Under torch.autocast (FP32 master weights, bf16 compute: `dsv4 train --precision bf16`) Experts.forward casts
# w13 and w2 to the autocast dtype once per forward (what every per-expert F.linear under autocast would do) and
# the mode is chosen for the dtype autocast computes x in (`autocast_dtype`), so "auto" is "grouped" on CUDA
# for autocast runs too (it used to see fp32 and fall back to "loop"). x itself is cast only after the
# per-slot gather, so dx still sums a token's K slots in x's dtype (fp32), as before; the output keeps x's dtype.
EXPERT_GEMMS = ("auto", "loop", "grouped", "dense")


def grouped_gemm_missing(x: torch.Tensor, w: torch.Tensor, x_dtype: torch.dtype | None = None) -> str | None:
    """What "grouped" needs and `x` / `w` lack (None: it can run). x_dtype: the dtype the GEMMs see x in
    (`model.precision.autocast_dtype(x)` under autocast; default x.dtype)."""
    xd = x.dtype if x_dtype is None else x_dtype
    if not hasattr(torch, "_grouped_mm"):
        return f"torch._grouped_mm (torch {torch.__version__} has none)"
    if xd != torch.bfloat16 or w.dtype != torch.bfloat16:
        return f"bf16 activations and expert weights (got {xd} / {w.dtype})"
    return None


def expert_gemm(mode: str, x: torch.Tensor, w: torch.Tensor, x_dtype: torch.dtype | None = None) -> str:
    """The concrete GEMM mode ("loop" | "grouped" | "dense") that `mode` means for these tensors (x_dtype: as in
    `grouped_gemm_missing`)."""
    if mode not in EXPERT_GEMMS:
        raise ValueError(f"Experts.gemm: unknown mode {mode!r}; known: {', '.join(EXPERT_GEMMS)}")
    if mode == "auto":
        return "grouped" if x.is_cuda and grouped_gemm_missing(x, w, x_dtype) is None else "loop"
    if mode == "grouped":
        missing = grouped_gemm_missing(x, w, x_dtype)
        if missing is not None:
            raise KernelUnavailable(f"Experts.gemm 'grouped' needs {missing}")
    return mode


def _sort_keys(idx: torch.Tensor, n_experts: int) -> torch.Tensor:
    """idx [T, K] int64 expert ids as the narrowest integer type that holds them, flattened [T*K]: the stable
    argsort's order is the same, and a CUDA radix sort makes one pass per key byte (int16: 2, int64: 8)."""
    flat = idx.reshape(-1)
    return flat.to(torch.int16) if n_experts <= torch.iinfo(torch.int16).max else flat.to(torch.int32)


class _PermuteSlots(torch.autograd.Function):
    """xs = x[tok]: the expert-sorted slots' rows [T*K, d] of x [T, d] (each token in exactly K slots). Backward
    dx[t] = sum of its K slots' rows, as the MoE combine with unit weights (kernels/moe_combine: a gather of each
    token's K slots summed in fp32, no atomics), instead of the indexing backward (a sort of the T*K slot
    indices, then a scatter-add that walks each token's duplicates: `indexing_backward_kernel`, 1.7 ms over the
    5 MoE layers of the proxy's 16K eager step at b72c407). The `indexing_backward_kernel_stride_1<long>` of the
    CUDA-graph steps (2.7 ms in 5 calls at 16K) is int64 data: `expert_counts`' index_add as Inductor lowered it."""

    @staticmethod
    def forward(ctx, x, tok, backend):
        ctx.save_for_backward(tok)
        ctx.T, ctx.backend = x.shape[0], backend
        return x.index_select(0, tok)                                          # [T*K, d]

    @staticmethod
    def backward(ctx, g):
        tok, = ctx.saved_tensors
        ones = torch.ones(tok.shape, dtype=torch.promote_types(g.dtype, torch.float32), device=g.device)
        return moe_combine(g.contiguous(), ones, tok, ctx.T, g.dtype, backend=ctx.backend), None, None


def expert_counts(idx: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Tokens per expert [E] int64 (= bincount(idx, minlength=E) for idx < E, with a static output shape), summed
    in int32: Inductor has no int64 atomic add, so an int64 index_add falls back to ATen's sort-based index_put
    (`indexing_backward_kernel_stride_1<long>`, 0.67 ms in 5 calls in the proxy's 4K CUDA-graph step at 69c89cb)."""
    flat = idx.reshape(-1)
    ones = torch.ones(flat.shape, dtype=torch.int32, device=idx.device)
    return torch.zeros(n_experts, dtype=torch.int32, device=idx.device).index_add_(0, flat, ones).long()


def hash_table(cfg) -> torch.Tensor:
    """Fixed token-id -> experts table [V, K] int64: K DISTINCT experts per token, seeded by cfg.hash_seed.

    Generated on the CPU (the same table on every device), then moved to the default device; on the meta
    device only the shape is made. Row v = the K smallest of E seeded uniforms, in ascending order.
    """
    V, E, K = cfg.vocab_size, cfg.n_routed_experts, cfg.num_experts_per_tok
    target = torch.empty(0).device
    if target.type == "meta":
        return torch.empty(V, K, dtype=torch.long, device="meta")
    g = torch.Generator(device="cpu").manual_seed(cfg.hash_seed)
    keys = torch.rand(V, E, generator=g, device="cpu")                               # [V, E]
    return keys.topk(K, dim=-1, largest=False).indices.contiguous().to(target)    # a random K-subset per token


class Gate(nn.Module):
    """Router (official name `ffn.gate`): weight [E, d]; `bias` [E] fp32 buffer (score layers) or `tid2eid`
    [V, K] int64 buffer (hash layers), both persistent (saved in checkpoints)."""

    def __init__(self, cfg, layer_idx: int):
        super().__init__()
        self.cfg = cfg
        self.hash = cfg.is_hash(layer_idx)
        self.topk, self.n_experts = cfg.num_experts_per_tok, cfg.n_routed_experts
        self.weight = nn.Parameter(torch.randn(cfg.n_routed_experts, cfg.hidden_size) * cfg.initializer_range)
        if self.hash:
            self.register_buffer("tid2eid", hash_table(cfg), persistent=True)
        else:
            self.register_buffer("bias", torch.zeros(cfg.n_routed_experts, dtype=torch.float32), persistent=True)
        self.register_buffer("tokens_per_expert", torch.zeros(cfg.n_routed_experts, dtype=torch.long),
                             persistent=False)                                 # int: survives dtype casts

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor | None):
        """x [T, d] -> (weights [T, K] fp32, idx [T, K] int64, scores [T, E] fp32)."""
        dt = torch.promote_types(x.dtype, torch.float32)                              # fp32 (fp64 stays fp64)
        with torch.autocast(device_type=x.device.type, enabled=False):                # router in fp32 (official)
            scores = torch.sqrt(F.softplus(F.linear(x.to(dt), self.weight.to(dt))))  # [T, E]
        if self.hash:
            if input_ids is None:
                raise ValueError("Gate: hash-routed layer needs input_ids")
            idx = self.tid2eid[input_ids.reshape(-1)].long()                          # [T, K]
        else:
            biased = (scores + self.bias.float()).detach()
            idx = torch.sort(biased, dim=-1, descending=True, stable=True).indices[:, :self.topk]   # [T, K]
        w = scores.gather(1, idx)
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20) * self.cfg.routed_scaling_factor
        if self.training and not recomputing():         # counted once per step, not again in a recompute
            with torch.no_grad():
                self.tokens_per_expert += expert_counts(idx, self.n_experts)
        return w, idx, scores

    @torch.no_grad()
    def update_expert_bias(self) -> None:
        """b_e += gamma * sign(mean_load - load_e) from the counts since the last call; resets the counts."""
        load = self.tokens_per_expert.float()
        # no `load.sum() > 0` test (a host sync per gate per step): with no tokens every load is 0, so
        # sign(mean - load) = +0 and b + 0 = b bit for bit (b never holds -0: it is a sum of +-gamma from +0)
        if not self.hash:
            self.bias += self.cfg.expert_bias_update_rate * torch.sign(load.mean() - load)
        self.tokens_per_expert.zero_()


class Experts(nn.Module):
    """E routed experts, stacked: w13 [E, 2f, d] (rows 0..f-1 = w1 "gate", f..2f-1 = w3 "up"), w2 [E, d, f]."""

    def __init__(self, cfg):
        super().__init__()
        E, f, d, std = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size, cfg.initializer_range
        self.limit = cfg.swiglu_limit
        self.w13 = nn.Parameter(torch.randn(E, 2 * f, d) * std)
        self.w2 = nn.Parameter(torch.randn(E, d, f) * std)
        self.backend = "naive"
        self.gemm = "auto"                                                     # EXPERT_GEMMS

    def forward(self, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """x [T, d], w [T, K], idx [T, K] -> [T, d] = sum_k w_k Expert_{idx_k}(x) (accumulated in fp32)."""
        adt = autocast_dtype(x)                                                # the module comment's autocast rule
        w13, w2 = (self.w13, self.w2) if adt is None else (self.w13.to(adt), self.w2.to(adt))
        order = torch.argsort(_sort_keys(idx, w13.shape[0]), stable=True)     # token-slots grouped by expert
        tok = order // idx.shape[1]                                            # [T*K] token of each slot
        wk = w.reshape(-1).gather(0, order)                                    # [T*K] its routing weight
        mode = expert_gemm(self.gemm, x, w13, adt)
        if mode == "grouped":
            # one grouped GEMM per projection over the expert-sorted slots; no host sync
            counts = expert_counts(idx, w13.shape[0])
            offs = torch.cumsum(counts, 0).to(torch.int32)                     # [E] end of each group
            xs = _PermuteSlots.apply(x, tok, self.backend)                     # [T*K, d] = x[tok]
            xs = xs if adt is None else xs.to(adt)                             # cast after the gather
            gu = torch._grouped_mm(xs, w13.transpose(-2, -1), offs=offs)       # [T*K, 2f]: gate | up
            h = clamped_swiglu_packed(gu, self.limit, backend=self.backend)    # [T*K, f]
            y = torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)          # [T*K, d]
            return moe_combine(y, wk, tok, x.shape[0], x.dtype, backend=self.backend)   # sum_k w_k y_k in fp32
        out = torch.zeros(x.shape, dtype=torch.promote_types(x.dtype, torch.float32), device=x.device)
        if mode == "dense":
            E = w13.shape[0]
            wt = torch.zeros(x.shape[0], E, dtype=w.dtype, device=x.device).scatter_add_(1, idx, w)   # [T, E]
            for e in range(E):
                gu = F.linear(x, w13[e])                                       # [T, 2f]: gate | up
                y = F.linear(clamped_swiglu_packed(gu, self.limit, backend=self.backend), w2[e])
                out = out + y.to(out.dtype) * wt[:, e, None].to(out.dtype)
            return out.to(x.dtype)
        counts = expert_counts(idx, w13.shape[0]).tolist()
        start = 0
        for e, c in enumerate(counts):
            if c == 0:
                continue
            t = tok[start:start + c]
            gu = F.linear(x[t], w13[e])                                        # [c, 2f]: gate | up
            h = clamped_swiglu_packed(gu, self.limit, backend=self.backend)
            y = F.linear(h, w2[e])                                             # [c, d]
            out.index_add_(0, t, y.to(out.dtype) * wk[start:start + c, None].to(out.dtype))
            start += c
        return out.to(x.dtype)


class MLP(nn.Module):
    """SwiGLU MLP with official names w1 (gate), w3 (up), w2 (down): the shared expert and dense `-` layers."""

    def __init__(self, cfg, width: int, limit: float | None):
        super().__init__()
        self.w1 = nn.Linear(cfg.hidden_size, width, bias=False)
        self.w2 = nn.Linear(width, cfg.hidden_size, bias=False)
        self.w3 = nn.Linear(cfg.hidden_size, width, bias=False)
        for lin in (self.w1, self.w2, self.w3):
            nn.init.normal_(lin.weight, std=cfg.initializer_range)
        self.limit = limit
        self.backend = "naive"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(clamped_swiglu(self.w1(x), self.w3(x), self.limit, backend=self.backend))


class MoE(nn.Module):
    """One MoE FFN (official prefix `layers.{i}.ffn`): gate, experts, shared_experts (spec §9)."""

    def __init__(self, cfg, layer_idx: int):
        super().__init__()
        self.cfg = cfg
        self.gate = Gate(cfg, layer_idx)
        self.experts = Experts(cfg)
        self.shared_experts = MLP(cfg, cfg.moe_intermediate_size * cfg.n_shared_experts,
                                  cfg.swiglu_limit if cfg.shared_expert_clamp else None)
        self.dispatcher = None       # None: the local experts; an EP dispatcher (model/ep_dispatch.py) if installed

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor | None = None, aux=None) -> torch.Tensor:
        """x [B, S, d], input_ids [B, S], aux (model/losses.AuxLosses: receives the sequence-wise balance loss
        in training) -> [B, S, d]."""
        B, S, d = x.shape
        flat = x.reshape(B * S, d)                                             # [T, d]
        w, idx, scores = self.gate(flat, input_ids)
        routed = self.experts(flat, w, idx) if self.dispatcher is None else self.dispatcher(self.experts, flat, w, idx)
        y = routed + self.shared_experts(flat)
        if aux is not None and self.training and self.cfg.seq_aux_loss_coeff > 0 and not self.gate.hash:
            aux.add_moe(self.cfg.seq_aux_loss_coeff * seq_aux_loss(scores.view(B, S, -1), idx.view(B, S, -1)))
        return y.view(B, S, d)


def seq_aux_loss(scores: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """V3 sequence-wise balance loss without its coefficient (spec §9.4), averaged over the B sequences.

    scores [B, S, E] (s, before bias), idx [B, S, K]:  f_e = E/(K S) * #{t: e in TopK_t},
    P_e = mean_t s_{t,e} / sum_e' s_{t,e'},  loss = mean_b sum_e f_e P_e.
    """
    B, S, E = scores.shape
    K = idx.shape[-1]
    counts = torch.zeros(B, E, device=scores.device).scatter_add_(
        1, idx.reshape(B, -1), torch.ones(B, S * K, device=scores.device))      # [B, E]
    f = counts * (E / (K * S))
    P = (scores / scores.sum(-1, keepdim=True)).mean(1)                         # [B, E]
    return (f * P).sum(-1).mean()
