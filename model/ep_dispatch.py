"""Expert-parallel token dispatch with a variable number of tokens per rank (#5008 padding primitive, P10).

Under THD packing every rank holds a different number of real tokens n_r. Megatron's HybridEP dispatcher
wants a STATIC shape, so (#5008) the tokens are padded to a static count N (>= every n_r; e.g. the THD
`max_seqlen_per_dp_cp_rank`) with a validity mask, and padded rows are never routed: they are not sent to any
expert, do not count in the expert load, and get a zero output.

Dispatch (one all_to_all each way over the EP group; gloo supports all_to_all, checked on torch 2.13):
  experts are split contiguously: rank q owns experts [q E/ep, (q+1) E/ep);
  every (token, k) slot goes to the owner of its expert. The send buffer is static: [ep, N*K, d] (a rank may
  send all its slots to one owner), with the local expert id of each row (-1 = empty row);
  the owner runs its experts on the rows it received, sends the results back with the same all_to_all;
  the source combines y[t] = sum_k w[t,k] * expert_out[t,k] (accumulated in fp32, as model/moe.py does).
Routing is computed on the source rank by the layer's own Gate on its real tokens only, so it is identical to
the single-rank run token by token. Both all_to_alls are autograd-aware (the backward of an equal-split
all_to_all is the same all_to_all), so expert-weight gradients land on the owner rank.

Process group: Megatron-Core's `parallel_state.get_expert_model_parallel_group()` when initialised, else WORLD.
Installed by `parallelize(model, ep=group)`: each MoE layer gets an `EPDispatcher` attribute that its own
forward calls (model/moe.py); no forward is replaced.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dsv4.kernels.swiglu import clamped_swiglu_packed


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor
    return isinstance(t, DTensor)


def ep_group():
    try:
        from megatron.core import parallel_state as ps
        if ps.model_parallel_is_initialized():
            return ps.get_expert_model_parallel_group()
    except ImportError:
        pass
    return dist.group.WORLD


# ---------------------------------------------------------------------------------------------- padding (#5008)


def static_token_count(n_local: int, group=None, static: int | None = None, device=None) -> int:
    """The static token count N: `static` if given (must be >= every rank's count), else the max over ranks."""
    group = group or dist.group.WORLD
    n = torch.tensor([n_local], dtype=torch.long, device=device)
    dist.all_reduce(n, op=dist.ReduceOp.MAX, group=group)
    if static is None:
        return int(n)
    if int(n) > static:
        raise ValueError(f"static_tokens: {static} < the largest per-rank token count {int(n)}")
    return static


def pad_routed_tokens(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, N: int):
    """Pad routed tokens x [n, d], w / idx [n, K] to N rows: (x [N, d], w [N, K], idx [N, K] with -1 = not
    routed, valid [N] bool)."""
    n = x.shape[0]
    if n > N:
        raise ValueError(f"static_tokens: {N} < local token count {n}")
    pad = N - n
    valid = torch.arange(N, device=x.device) < n                               # [N] real rows first
    return (torch.cat([x, x.new_zeros(pad, x.shape[1])]), torch.cat([w, w.new_zeros(pad, w.shape[1])]),
            torch.cat([idx, idx.new_full((pad, idx.shape[1]), -1)]), valid)


# ---------------------------------------------------------------------------------------------- all_to_all


class _AllToAll(torch.autograd.Function):
    """Equal-split all_to_all on dim 0 ([ep * n, ...]); its backward is the same all_to_all."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        out = torch.empty_like(g)
        dist.all_to_all_single(out, g.contiguous(), group=ctx.group)
        return out, None


def all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    if x.is_floating_point():
        return _AllToAll.apply(x, group)
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x.contiguous(), group=group)
    return out


# ---------------------------------------------------------------------------------------------- dispatch


def ep_experts_forward(experts, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, group=None,
                       static_tokens: int | None = None, capacity: int | None = None) -> torch.Tensor:
    """sum_k w_k Expert_{idx_k}(x) with the experts spread over the EP group -> [n, d] (x's dtype).

    experts: `model.moe.Experts` (stacked w13 [E, 2f, d], w2 [E, d, f]); this rank uses only its own experts'
    rows of w13 / w2 (replicated tensors, or DTensors sharded Shard(0) over the ep group by model/parallel:
    then each rank stores only its E/ep experts). x [n, d], w / idx [n, K] are this rank's real tokens and their routing (n may differ
    between ranks). `capacity`: static rows per (source, destination) pair; default N*K (never exceeded);
    a smaller one bounds the buffers [ep * capacity, d] and is checked (an overflow raises, nothing dropped).
    """
    group = group or ep_group()
    ep, rank = dist.get_world_size(group), dist.get_rank(group)
    E = experts.w13.shape[0]
    if E % ep:
        raise ValueError(f"n_routed_experts: {E} not divisible by the expert-parallel size {ep}")
    E_loc = E // ep
    n, d = x.shape
    K = idx.shape[1]
    N = static_token_count(n, group, static_tokens, x.device)
    dev = x.device
    xp, wp, ip, _ = pad_routed_tokens(x, w, idx, N)                           # [N, d], [N, K], [N, K]
    cap = N * K if capacity is None else int(capacity)                         # static rows per destination
    slot_e = ip.reshape(-1)                                                    # [N*K] global expert, -1 = pad
    slot_tok = torch.arange(N * K, device=dev) // K                                        # [N*K] token of each slot
    dest = torch.where(slot_e >= 0, torch.div(slot_e, E_loc, rounding_mode="floor"), torch.full_like(slot_e, -1))
    # row of each slot in its destination's block: rank of the slot among the slots with the same destination
    row = torch.zeros_like(slot_e)
    for q in range(ep):
        sel = dest == q
        row[sel] = torch.arange(int(sel.sum()), device=dev)
    live = dest >= 0
    if capacity is not None:                                                   # every rank raises together
        need = torch.tensor([int(row[live].max()) + 1 if live.any() else 0], device=dev)
        dist.all_reduce(need, op=dist.ReduceOp.MAX, group=group)
        if int(need) > cap:
            raise ValueError(f"capacity: {cap} rows per destination rank, a rank needs {int(need)}")
    flat_pos = dest[live] * cap + row[live]                                    # [n_live] row in the send buffer
    send_x = xp.new_zeros(ep * cap, d).index_copy(0, flat_pos, xp[slot_tok[live]])   # [ep*cap, d]
    send_e = torch.full((ep * cap,), -1, dtype=torch.long, device=dev)
    send_e[flat_pos] = slot_e[live] - dest[live] * E_loc                       # local expert id at the owner

    recv_x = all_to_all(send_x, group)                                         # [ep*cap, d] rows for my experts
    recv_e = all_to_all(send_e, group)
    recv_y = torch.zeros(ep * cap, d, dtype=torch.promote_types(x.dtype, torch.float32), device=dev)
    w13, w2 = experts.w13, experts.w2
    sharded = _is_dtensor(w13)                      # model/parallel: expert weights Shard(0) over the ep group
    if sharded:
        w13, w2 = w13.to_local(), w2.to_local()                                # [E_loc, ...] my experts only
    for e in range(E_loc):                                                     # my experts
        rows = torch.nonzero(recv_e == e).flatten()
        if rows.numel() == 0:
            continue
        ge = e if sharded else rank * E_loc + e
        gu = F.linear(recv_x[rows], w13[ge])                                   # [c, 2f]: gate | up
        h = clamped_swiglu_packed(gu, experts.limit, backend=experts.backend)
        recv_y = recv_y.index_copy(0, rows, F.linear(h, w2[ge]).to(recv_y.dtype))
    back = all_to_all(recv_y, group)                                           # [ep*cap, d] results, my slots

    # combine in ascending expert order (the accumulation order of model.moe.Experts, so sums match bitwise)
    out = torch.zeros(N, d, dtype=recv_y.dtype, device=dev)
    y_slot = back[flat_pos] * wp.reshape(-1)[live].to(out.dtype)[:, None]     # [n_live, d] weighted outputs
    e_live, t_live = slot_e[live], slot_tok[live]
    order = torch.argsort(e_live, stable=True)
    for e in torch.unique(e_live).tolist():
        sel = order[e_live[order] == e]
        out = out.index_add(0, t_live[sel], y_slot[sel])
    return out[:n].to(x.dtype)


class EPDispatcher:
    """The routed-experts step of an MoE layer over the EP group: `moe.dispatcher = EPDispatcher(group)` (or
    `parallelize(model, ep=group)`) makes `model.moe.MoE.forward` -- the one MoE forward, gate, shared expert
    and auxiliary loss unchanged -- call `ep_experts_forward` instead of the local experts."""

    def __init__(self, group=None, static_tokens: int | None = None, capacity: int | None = None):
        self.group, self.static_tokens, self.capacity = group, static_tokens, capacity

    def __call__(self, experts, x, w, idx):
        return ep_experts_forward(experts, x, w, idx, self.group, self.static_tokens, self.capacity)

    def __repr__(self) -> str:
        return f"EPDispatcher(static_tokens={self.static_tokens}, capacity={self.capacity})"


def parallelize(model, ep: object = None, static_tokens: int | None = None, capacity: int | None = None):
    """Install expert parallelism on every MoE layer of `model` (an attribute set, nothing replaced): its routed
    experts dispatch over the process group `ep` (default: Megatron's EP group, else WORLD); ranks may feed
    batches of different sizes (e.g. packed THD micro-batches of different lengths). `ep=False` removes it.
    Context parallelism is a layout (model/context_parallel.CPLayout) passed to the forward instead."""
    from .moe import MoE
    for m in model.modules():
        if isinstance(m, MoE):
            m.dispatcher = None if ep is False else EPDispatcher(ep or ep_group(), static_tokens, capacity)
    return model
