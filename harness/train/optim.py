"""The DSv4 optimiser recipe: Muon (hybrid Newton–Schulz) for matrices, AdamW for the rest, warm-up + cosine.

Spec `dsv4_architecture.md` §10.4 (DeepSeek-V4 report, Algorithm 1):

    M_t = mu * M_{t-1} + G_t                      (mu = 0.95)
    O'  = HybridNS(mu * M_t + G_t)                (Nesterov; input normalised by its Frobenius norm)
    O   = O' * sqrt(max(n, m)) * 0.18             (update RMS 0.18)
    W  <- W * (1 - lr * wd) - lr * O              (decoupled weight decay, wd = 0.1)

HybridNS = 10 iterations of X <- aX + b(XX^T)X + c(XX^T)^2 X: 8 with (3.4445, -4.7750, 2.0315), then 2 with
(2, -1.5, 0.5). `kernels_perf.md` §3.2-3.3 describes the same recipe in NVIDIA's Emerging-Optimizers
(`coefficient_type="deepseekv4"`, `scale_mode="spectral"`, `extra_scale_factor=0.18`); this is our own code.

Parameter assignment (the report: "AdamW for the embedding module, the prediction head module, the static
biases and gating factors of mHC modules, and the weights of all RMSNorm modules. All other modules are
updated with Muon"). Our choices where the report is silent, stated here and in `param_group_of`:
  * mHC `fn` projections (`hc_*_fn`, also `hc_head_fn`) are matrices -> Muon (they are "other modules");
  * attention sinks, compressor `ape`, the router's `e_score_correction_bias` (if it is a Parameter) and any
    other 1-D tensor -> AdamW without weight decay (they are biases / positional offsets, not linear maps);
  * stacked routed experts [E, out, in] -> Muon, orthogonalised per expert (batched NS over the first axis);
    a fused `w13` ([E, 2f, d] = w1 over w3) is orthogonalised as its two matrices w1 and w3 separately.

Sharded parameters (FSDP2 / EP DTensors, model/parallel): Newton–Schulz needs whole matrices. Stacked
experts [E, n, m] split along E hold whole matrices: NS runs on the local shard. Any other sharded update is
all-gathered (`full_tensor`); the ranks of the mesh take the matrices in turn (Megatron's layer-wise
distribution): the owner runs NS on the whole matrix and scatters the shards of O (`distribute_tensor` from
it), so each NS runs once per mesh. The momentum stays sharded (a DTensor, so DCP reshards it).
"""
from __future__ import annotations

import math

import torch

NS_STEPS = [(3.4445, -4.7750, 2.0315)] * 8 + [(2.0, -1.5, 0.5)] * 2   # §10.4 hybrid Newton–Schulz
UPDATE_RMS = 0.18


def hybrid_newton_schulz(G: torch.Tensor, steps=NS_STEPS, eps: float = 1e-7,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Approximate the orthogonal polar factor U V^T of G (SVD G = U S V^T); G is [..., n, m].

    Works on the smaller Gram matrix: transposes so rows <= cols. Batched over leading axes.
    """
    X = G.to(dtype)
    transpose = X.shape[-2] > X.shape[-1]
    if transpose:
        X = X.mT                                                          # [..., m, n] with m <= n
    X = X / (torch.linalg.matrix_norm(X, keepdim=True) + eps)            # spectral norm <= Frobenius <= 1
    for a, b, c in steps:
        A = X @ X.mT                                                      # [..., m, m]
        B = b * A + c * (A @ A)
        X = a * X + B @ X
    if transpose:
        X = X.mT
    return X.to(G.dtype)


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor
    return isinstance(t, DTensor)


def _batch_sharded(t) -> bool:
    """A DTensor split only along leading (batch) axes, e.g. stacked experts [E, n, m] Shard(0): each rank
    holds whole matrices, so Newton–Schulz runs on its shard alone (per-matrix, the same result)."""
    from torch.distributed.tensor import Replicate, Shard
    return t.ndim > 2 and all(isinstance(pl, Replicate) or (isinstance(pl, Shard) and pl.dim < t.ndim - 2)
                              for pl in t.placements)


class Muon(torch.optim.Optimizer):
    """Muon with Nesterov momentum, hybrid NS, update-RMS matching and decoupled weight decay (spec §10.4)."""

    def __init__(self, params, lr: float = 2.7e-4, momentum: float = 0.95, weight_decay: float = 0.1,
                 nesterov: bool = True, update_rms: float = UPDATE_RMS, ns_dtype: torch.dtype = torch.float32):
        if lr < 0:
            raise ValueError(f"Muon.lr: must be >= 0, got {lr}")
        if not 0 <= momentum < 1:
            raise ValueError(f"Muon.momentum: must be in [0, 1), got {momentum}")
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov,
                                      update_rms=update_rms))
        self.ns_dtype = ns_dtype
        self.split: dict = {}                                             # param -> number of fused matrices
        for g in self.param_groups:
            for p in g["params"]:
                if p.ndim < 2:
                    raise ValueError(f"Muon.params: needs matrices (ndim >= 2), got shape {tuple(p.shape)}")

    def load_state_dict(self, state_dict: dict) -> None:
        """As torch's, but the momentum keeps its saved dtype: torch casts floating state to the parameter's
        dtype, and Muon's momentum is FP32 whatever the parameter's (a bf16 matrix has an FP32 momentum)."""
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        saved = [i for g in state_dict["param_groups"] for i in g["params"]]
        for p, i in zip(params, saved):
            buf = state_dict["state"].get(i, {}).get("momentum_buffer")
            if isinstance(buf, torch.Tensor):
                self.state[p]["momentum_buffer"] = buf.detach().clone().to(p.device)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for g in self.param_groups:
            lr, mu, wd = g["lr"], g["momentum"], g["weight_decay"]
            todo = []                                                     # (param, [matrices [b, n, m]])
            turns: dict = {}                                              # mesh -> next owner of a gathered NS
            for p in g["params"]:
                if p.grad is None:
                    continue
                grad = p.grad.float()
                st = self.state[p]
                if "momentum_buffer" not in st:
                    st["momentum_buffer"] = torch.zeros_like(grad)
                buf = st["momentum_buffer"]
                buf.mul_(mu).add_(grad)                                   # M_t = mu M_{t-1} + G_t
                upd = grad.add(buf, alpha=mu) if g["nesterov"] else buf  # mu M_t + G_t
                local, owner = False, None
                if _is_dtensor(upd):
                    if _batch_sharded(upd):                               # whole matrices on every rank
                        upd, local = upd.to_local(), True                 # (experts split over dp / ep)
                    else:                                                 # a split matrix: NS needs it
                        upd = upd.full_tensor()                           # whole (all-gather the update)
                        mesh = p.device_mesh                              # one rank of the mesh runs its
                        owner = turns.get(id(mesh), 0) % mesh.size()      # NS, in turn (layer-wise), and
                        turns[id(mesh)] = owner + 1                       # scatters the shards of O
                k = self.split.get(p, 1)                                  # fused [.., k*n, m] -> k matrices
                n, m = p.shape[-2] // k, p.shape[-1]
                mine = owner is None or owner == p.device_mesh.get_local_rank()
                mats = [u.reshape(-1, n, m) for u in upd.split(n, dim=-2)] if mine else []
                todo.append((p, mats, tuple(upd.shape), local, owner, (n, m), k))
            # batch the Newton–Schulz iterations over all matrices of one shape (same math, fewer kernels)
            by_shape: dict = {}
            for i, (_, mats, *_rest) in enumerate(todo):
                for j, u in enumerate(mats):
                    by_shape.setdefault(tuple(u.shape[-2:]), []).append((i, j, u))
            out: dict = {}
            for items in by_shape.values():
                O = hybrid_newton_schulz(torch.cat([u for _, _, u in items]), dtype=self.ns_dtype)
                for (i, j, u), o in zip(items, O.split([u.shape[0] for _, _, u in items])):
                    out[i, j] = o
            for i, (p, mats, shape, local, owner, (n, m), k) in enumerate(todo):
                if mats:
                    O = torch.cat([out[i, j].reshape(*shape[:-2], n, m) for j in range(k)], dim=-2)
                    O = O * (math.sqrt(max(n, m)) * g["update_rms"])
                else:                                                     # another rank's turn: receive
                    O = torch.empty(shape, dtype=torch.float32, device=p.device)
                if local:                                                 # this rank's whole matrices
                    from torch.distributed.tensor import DTensor
                    O = DTensor.from_local(O, p.device_mesh, p.placements, run_check=False,
                                           shape=p.shape, stride=p.stride())
                elif owner is not None:                                   # the owner's whole O, scattered
                    from torch.distributed.tensor import distribute_tensor
                    O = distribute_tensor(O, p.device_mesh, p.placements, src_data_rank=owner)
                p.mul_(1 - lr * wd)
                p.add_(O.to(p.dtype), alpha=-lr)
        return loss


# ------------------------------------------------------------------------------------------- groups
# AdamW groups (name -> weight decay applies?) ; every parameter lands in exactly one group.
ADAMW_GROUPS = ("adamw_matrices", "adamw_embedding", "adamw_head", "adamw_norm", "adamw_mhc_base_scale", "adamw_attn_sink",
                "adamw_compressor_ape", "adamw_router_bias", "adamw_other")
NO_DECAY = {"adamw_norm", "adamw_mhc_base_scale", "adamw_attn_sink", "adamw_compressor_ape",
            "adamw_router_bias", "adamw_other"}


def param_group_of(name: str, p: torch.Tensor) -> str:
    """The optimiser group of one parameter, from its official DeepSeek name (spec §11.3) and its shape."""
    leaf = name.rsplit(".", 1)[-1]
    if name == "embed.weight" or name.endswith(".embed.weight") or name.startswith("embed."):
        return "adamw_embedding"
    if name == "head.weight" or name.endswith(".head.weight"):
        return "adamw_head"
    module = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else name
    if "norm" in module:
        return "adamw_norm"                           # attn_norm, ffn_norm, q_norm, kv_norm, enorm, hnorm, norm
    if ("hc_" in leaf or "hc_" in name) and (leaf.endswith("base") or leaf.endswith("scale")):
        return "adamw_mhc_base_scale"
    if "sink" in leaf:
        return "adamw_attn_sink"
    if leaf == "ape":
        return "adamw_compressor_ape"
    if "bias" in leaf and ("gate" in name or "router" in name):
        return "adamw_router_bias"
    if p.ndim >= 2:
        return "muon"                                 # all other matrices: attention, experts, mHC fn, MTP projs
    return "adamw_other"


class DSv4Optimizer:
    """Muon + AdamW behind one object; `param_groups` carry a `name`. step / zero_grad / state_dict."""

    def __init__(self, muon: Muon | None, adamw: torch.optim.AdamW | None, names: dict):
        self.muon, self.adamw, self.names = muon, adamw, names   # names: group name -> [param names]
        self.optimizers = [o for o in (muon, adamw) if o is not None]

    @property
    def param_groups(self):
        return [g for o in self.optimizers for g in o.param_groups]

    def set_lr(self, lr: float):
        for g in self.param_groups:
            g["lr"] = lr

    def step(self):
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True):
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"muon": self.muon.state_dict() if self.muon else None,
                "adamw": self.adamw.state_dict() if self.adamw else None}

    def load_state_dict(self, sd: dict):
        if self.muon:
            self.muon.load_state_dict(sd["muon"])
        if self.adamw:
            self.adamw.load_state_dict(sd["adamw"])


def _plain_name(n: str) -> str:
    """The module's own name of a parametrized tensor (torch.nn.utils.parametrize stores `a.w13` as
    `a.parametrizations.w13.original`; X1's expert QAT): the optimiser treats the FP32 master as the weight."""
    return n.replace(".parametrizations.", ".").removesuffix(".original")


def build_optimizer(model: torch.nn.Module, lr: float, weight_decay: float = 0.1, momentum: float = 0.95,
                    betas=(0.9, 0.95), eps: float = 1e-8, update_rms: float = UPDATE_RMS,
                    ns_dtype: torch.dtype = torch.float32, muon: bool = True) -> DSv4Optimizer:
    """Muon for matrices, AdamW for embedding / head / norms / mHC base+scale / sinks / ape / router bias.
    muon=False: AdamW for everything (the matrices in group "adamw_matrices", with weight decay)."""
    buckets: dict[str, list] = {}
    names: dict[str, list] = {}
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        g = param_group_of(_plain_name(n), p)
        if g == "muon" and not muon:
            g = "adamw_matrices"
        buckets.setdefault(g, []).append(p)
        names.setdefault(g, []).append(n)
    muon = None
    if buckets.get("muon"):
        muon = Muon(buckets["muon"], lr=lr, momentum=momentum, weight_decay=weight_decay,
                    update_rms=update_rms, ns_dtype=ns_dtype)
        muon.param_groups[0]["name"] = "muon"
        for n, p in model.named_parameters():                            # experts.w13 = [E, w1;w3]: 2 matrices
            if _plain_name(n).endswith("w13") and p.requires_grad:
                muon.split[p] = 2
    groups = [dict(params=buckets[g], name=g, weight_decay=0.0 if g in NO_DECAY else weight_decay)
              for g in ADAMW_GROUPS if buckets.get(g)]
    adamw = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, foreach=False) if groups else None
    return DSv4Optimizer(muon, adamw, names)


# ------------------------------------------------------------------------------------------- schedule
def lr_at(step: int, peak: float, warmup: int, total: int, min_lr: float) -> float:
    """LR for 1-based `step`: linear warm-up to `peak` over `warmup` steps, then cosine to `min_lr` at `total`.

    §10.4: warm-up 2000 steps, peak 2.7e-4 -> 2.7e-5 (Flash); recipes scale `warmup` / `total` down.
    """
    if step <= warmup:
        return peak * step / max(warmup, 1)
    if step >= total:
        return min_lr
    frac = (step - warmup) / max(total - warmup, 1)
    return min_lr + 0.5 * (peak - min_lr) * (1 + math.cos(math.pi * frac))
