"""`parallelize(model, mesh, plan)`: the parallel layouts of DSv4Model, applied from outside (torchtitan style).

Mesh: a `torch.distributed.device_mesh.DeviceMesh` with dims ("pp", "dp", "cp", "ep") (`build_mesh`); the
plan says their sizes, the VPP size, the pipeline schedule and the micro-batch count. Nothing replaces a
module's forward: the step installs engines around the single-device model.

  dp  FSDP2 `fully_shard` per block, then the root (each pipeline chunk is a root). Parameters stay FP32
      (the master copy) and are all-gathered in FP32; bf16 runs compute under autocast as the one-device
      recipe does, so P1's FP32-kept tensors (mHC, sinks, ape, norms, router bias) stay FP32 by construction;
      gradients are reduce-scattered in FP32 (MixedPrecisionPolicy(param_dtype=None, reduce_dtype=fp32)).
      `fsdp_param_dtype=torch.bfloat16` is FSDP2's own mixed precision instead: the sharded FP32 masters are
      all-gathered and computed in bf16 (MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)), and
      P1's FP32-kept parameters (model/precision.fp32_kept_names) are left out of FSDP (`ignored_params`:
      replicated FP32, their gradients averaged over dp in `finish_backward`), since FSDP2 needs one
      parameter dtype per group and those sit directly on each Block. dp only (pp = 1). The forward equals
      the P1 bf16 cast of the same weights (slices/X3). Muon all-gathers each sharded update, one dp rank
      in turn runs Newton–Schulz on it and scatters O (harness/train/optim.py).
  pp  `torch.distributed.pipelining`: one `PipelineStage` per chunk (model/parallel/pipeline.py) and an
      explicit schedule: "gpipe" (ScheduleGPipe), "1f1b" (Schedule1F1B), "interleaved1f1b"
      (ScheduleInterleaved1F1B, vpp >= 2 chunks per rank).
  cp  the layout branch's `CPLayout` on the mesh's cp group: each rank's contiguous chunk of the batch's token
      stream (B documents of S tokens); its loss is its share of the global loss, gradients are summed over cp.
  ep  the layout branch's `EPDispatcher` installed on every MoE layer over the mesh's ep group; each ep rank
      feeds its own rows of the batch. The stacked expert weights become DTensors Shard(0) over ep: rank q
      stores only its E/ep experts (the dispatcher's ownership) and their gradient (divided by ep: the owner
      received every rank's tokens); the other parameters are replicated, their gradients averaged over ep.

Validated (gloo, CPU processes, fp32, slices/X3 and P3 tests; each == one rank in losses, per-parameter
gradients and Muon matrices): dp2, pp2 (gpipe / 1f1b), pp2 x vpp2 (interleaved1f1b), dp2 x pp2, cp2, ep2,
dp2 x cp2, dp2 x ep2, pp2 x ep2 (under dp x ep the expert shards stay outside FSDP, replicated over dp). cp
with pp or ep is refused (`PlanError`). NOT validated: NCCL, GPUs (the CUDA branches of
train_dist / build_mesh never ran), more than 4 processes, bf16 beyond a 3-step CLI smoke run, packed (THD)
micro-batches under pipelining. Every group `build_mesh` creates carries the run's timeout.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from dsv4.model.config import ConfigError
from dsv4.model.model import DSv4Model

MESH_DIMS = ("pp", "dp", "cp", "ep")
SCHEDULES = ("gpipe", "1f1b", "interleaved1f1b")
DEFAULT_TIMEOUT_S = 120.0      # every collective of a gloo / NCCL group: a dead rank is an error, not a hang


class PlanError(ConfigError):
    """A parallel plan the world or the config cannot take; one line."""


@dataclass
class ParallelPlan:
    dp: int = 1
    pp: int = 1
    vpp: int = 1
    cp: int = 1
    ep: int = 1
    schedule: str | None = None          # required with pp > 1: gpipe | 1f1b | interleaved1f1b
    microbatches: int = 1                # per step and dp rank (pipeline micro-batches)
    stages: list | None = None           # pp * vpp layer lists; default: even_stages

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.cp * self.ep

    def validate(self, cfg, world_size: int, batch_size: int | None = None, seq_len: int | None = None) -> None:
        """Raise PlanError (one line) unless this plan fits `world_size` processes, the config and the batch."""
        for k in ("dp", "pp", "vpp", "cp", "ep", "microbatches"):
            if getattr(self, k) < 1:
                raise PlanError(f"parallel.{k}: must be >= 1, got {getattr(self, k)}")
        if self.world != world_size:
            raise PlanError(f"parallel: dp*pp*cp*ep = {self.dp}*{self.pp}*{self.cp}*{self.ep} = {self.world} does "
                            f"not equal the world size {world_size}")
        big = [k for k in ("dp", "cp", "ep") if getattr(self, k) > 1] + (["pp"] if self.pp > 1 else [])
        if self.cp > 1 and (self.pp > 1 or self.ep > 1):
            raise PlanError(f"parallel: {'x'.join(big)}: cp with pp or ep is not implemented "
                            f"(dp x cp is)")
        if self.pp == 1:
            if self.vpp > 1:
                raise PlanError(f"parallel.vpp: {self.vpp} needs pp > 1")
            if self.schedule not in (None, "none"):
                raise PlanError(f"parallel.schedule: {self.schedule!r} needs pp > 1")
        else:
            if self.schedule not in SCHEDULES:
                raise PlanError(f"parallel.schedule: pp={self.pp} needs an explicit schedule, one of "
                                f"{', '.join(SCHEDULES)}; got {self.schedule!r}")
            if (self.schedule == "interleaved1f1b") != (self.vpp > 1):
                raise PlanError(f"parallel.schedule: {self.schedule} with vpp={self.vpp} (interleaved1f1b "
                                f"needs vpp >= 2; gpipe / 1f1b need vpp = 1)")
            n = self.pp * self.vpp
            L = cfg.num_hidden_layers
            if n > L:
                raise PlanError(f"parallel: pp*vpp = {n} stages cannot split num_hidden_layers={L}")
            if self.stages is not None and len(self.stages) != n:
                raise PlanError(f"parallel.stages: {len(self.stages)} layer lists, pp*vpp = {n}")
            M = self.microbatches
            if self.schedule == "1f1b" and M < self.pp:
                raise PlanError(f"parallel.microbatches: 1f1b needs >= pp = {self.pp} micro-batches, got {M}")
            if self.schedule == "interleaved1f1b" and M % max(1, M // self.pp):
                raise PlanError(f"parallel.microbatches: interleaved1f1b needs microbatches % (microbatches // "
                                f"pp) == 0, got {M} with pp={self.pp}")
        if cfg.n_routed_experts % self.ep:
            raise PlanError(f"parallel.ep: n_routed_experts={cfg.n_routed_experts} is not divisible by ep={self.ep}")
        if batch_size is not None:
            rows = self.dp * self.ep * self.microbatches
            if batch_size % rows:
                raise PlanError(f"parallel: batch_size={batch_size} is not divisible by dp*ep*microbatches = {rows}")
            if seq_len is not None and (batch_size // self.dp * seq_len) % self.cp:
                raise PlanError(f"parallel.cp: {batch_size // self.dp}x{seq_len} tokens per dp rank are not "
                                f"divisible by cp={self.cp}")


_TIMEOUT = {"s": DEFAULT_TIMEOUT_S}


def init_distributed(backend: str = "gloo", timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """init_process_group from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT), with a timeout
    (also given to every group `build_mesh` creates)."""
    _TIMEOUT["s"] = timeout_s
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))


def build_mesh(plan: ParallelPlan, device_type: str = "cpu", timeout_s: float | None = None):
    """The DeviceMesh (pp, dp, cp, ep) over the initialised world (rank-major in that order).

    Its per-dim process groups are created here with an explicit timeout (`init_device_mesh` would give them
    torch's 30-minute default whatever the world group's timeout): default, the one `init_distributed` used
    (else DEFAULT_TIMEOUT_S)."""
    import numpy as np
    from torch.distributed.device_mesh import DeviceMesh
    shape = (plan.pp, plan.dp, plan.cp, plan.ep)
    grid = np.arange(dist.get_world_size()).reshape(shape)                    # [pp, dp, cp, ep] ranks
    timeout = datetime.timedelta(seconds=timeout_s if timeout_s is not None else _TIMEOUT["s"])
    me = dist.get_rank()
    mine = []
    for d in range(len(shape)):
        lines = np.moveaxis(grid, d, -1).reshape(-1, shape[d])                # every group along dim d
        own = None
        for line in lines:
            g = dist.new_group(line.tolist(), timeout=timeout)               # collective: every rank, every group
            if me in line:
                own = g
        mine.append(own)
    return DeviceMesh.from_group(mine, device_type, mesh=torch.as_tensor(grid), mesh_dim_names=MESH_DIMS)


# ---------------------------------------------------------------------------------------------- the result

@dataclass(eq=False)
class Parallelized:
    """What `parallelize` installed on this rank. `parts`: the modules this rank trains (the whole model, or
    its pipeline chunks); `forward_backward(ids, labels)` runs one step's forward + backward on this rank's
    share of the global batch [B, S] and returns the global metrics; then `finish_backward()`,
    `clip_grad_norm_`, the optimizer, `sync_router_counts()` + the expert-bias update."""
    model: DSv4Model
    mesh: object
    plan: ParallelPlan
    parts: list
    stages: list = field(default_factory=list)
    schedule: object = None
    embed_group: object = None
    autocast: object = None
    replicated: list = field(default_factory=list)     # params FSDP left out (FP32-kept, ep expert shards):
                                                       # dp-averaged by hand

    # ------------------------------------------------------------------ groups / coordinates
    def group(self, dim: str):
        return self.mesh.get_group(dim)

    def coord(self, dim: str) -> int:
        return self.mesh.get_local_rank(dim)

    def named_parameters(self):
        seen = set()
        for part in self.parts:
            for n, p in part.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield n, p

    def parameters(self):
        return [p for _, p in self.named_parameters()]

    @property
    def is_last_stage(self) -> bool:
        return self.plan.pp == 1 or any(getattr(p, "is_last", False) for p in self.parts)

    # ------------------------------------------------------------------ data
    def local_batch(self, ids: torch.Tensor, labels: torch.Tensor):
        """This rank's rows of the global batch [B, S] (dp and ep split rows; cp splits the token stream)."""
        pl = self.plan
        if pl.dp * pl.ep == 1:
            return ids, labels
        B = ids.shape[0]
        k, n = self.coord("dp") * pl.ep + self.coord("ep"), pl.dp * pl.ep
        rows = slice(k * B // n, (k + 1) * B // n)
        return ids[rows], labels[rows]

    # ------------------------------------------------------------------ one step
    def forward_backward(self, ids: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
        """Forward + backward of the global batch [B, S] (the same tensors on every rank); returns the metrics
        of the whole step (means over the global batch, Megatron's names, plus "loss")."""
        ids, labels = self.local_batch(ids, labels)
        pl = self.plan
        ctx = self.autocast if self.autocast is not None else _null()
        if pl.pp > 1:
            for c in self.parts:
                c.metrics = []
            with ctx:
                kw = dict(input_ids=ids, labels=labels)
                if self.stages[0].is_first:
                    self.schedule.step(ids, target=labels, return_outputs=False, **kw)
                else:
                    self.schedule.step(target=labels, return_outputs=False, **kw)
            return self._pipeline_metrics()
        if pl.cp > 1:
            from dsv4.model.context_parallel import CPLayout, contiguous_chunk
            B, S = ids.shape
            T = B * S
            cu = torch.arange(B + 1) * S                                           # B documents of S tokens
            s, e = contiguous_chunk(T, pl.cp, self.coord("cp"))
            layout = CPLayout(cu, T, None, self.group("cp"), ids.device)
            with ctx:
                out = self.model(ids.reshape(1, T)[:, s:e], labels.reshape(1, T)[:, s:e], layout=layout)
        else:
            with ctx:
                out = self.model(ids, labels)
        out.loss.backward()
        m = {k: float(v) for k, v in out.losses.items()}
        m["loss"] = float(out.loss.detach())
        if pl.cp > 1:                                                              # shares of the global loss
            m = _reduce_dict(m, self.group("cp"), dist.ReduceOp.SUM)
        if pl.ep > 1:
            m = _reduce_dict(m, self.group("ep"), dist.ReduceOp.AVG)
        if pl.dp > 1:
            m = _reduce_dict(m, self.group("dp"), dist.ReduceOp.AVG)
        return m

    def _pipeline_metrics(self) -> dict[str, float]:
        pl, M = self.plan, self.plan.microbatches
        dev = _comm_device(self.group("pp"))
        sums = torch.zeros(len(_METRICS), dtype=torch.float64, device=dev)
        seen = torch.zeros(len(_METRICS), dtype=torch.float64, device=dev)
        for c in self.parts:
            for m in c.metrics:
                for j, k in enumerate(_METRICS):
                    if k in m:
                        sums[j] += float(m[k])
                        seen[j] = 1
        dist.all_reduce(sums, group=self.group("pp"))
        dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=self.group("pp"))
        for d in ("ep", "dp"):
            if getattr(pl, d) > 1:
                dist.all_reduce(sums, op=dist.ReduceOp.AVG, group=self.group(d))
        out = {k: sums[j].item() / M for j, k in enumerate(_METRICS) if seen[j] > 0}
        loss = out["lm loss"] + self.model.cfg.mtp_loss_scaling_factor * out.get("mtp_1 loss", 0.0)
        out["loss"] = loss + out.get("indexer loss", 0.0) + out.get("moe aux loss", 0.0)
        return out

    @torch.no_grad()
    def finish_backward(self) -> None:
        """Gradient reductions the engines do not do: the embedding copies of the first / last pipeline stage
        (summed), cp replicas (summed: each rank's loss is a share), ep replicas (averaged)."""
        pl = self.plan
        if self.replicated and pl.dp > 1:
            for p in self.replicated:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(_local(p.grad), op=dist.ReduceOp.AVG, group=self.group("dp"))
        if self.embed_group is not None:
            for part in self.parts:
                if hasattr(part, "embed"):
                    p = part.embed.weight
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    dist.all_reduce(_local(p.grad), group=self.embed_group)
        for dim, op in (("cp", dist.ReduceOp.SUM), ("ep", dist.ReduceOp.AVG)):
            if getattr(pl, dim) > 1:
                for p in self.parameters():
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    if _mesh_dims(p) == ("ep",):          # an expert shard: its owner summed every rank's
                        p.grad.div_(pl.ep)                # tokens; the mean over ep ranks' losses
                    else:                                 # (an FSDP shard: the same dp shard on each rank)
                        dist.all_reduce(_local(p.grad), op=op, group=self.group(dim))

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> float:
        """Global gradient 2-norm over every rank's parameters (shards summed over dp, stages over pp; the
        embedding copies of the last stage not counted twice), clipped to max_norm; returns the norm."""
        dev = next(iter(self.parameters())).device                                # NCCL reduces on the GPU
        sq = torch.zeros((), dtype=torch.float64, device=dev)                     # FSDP shards (dp)
        rep_sq = torch.zeros((), dtype=torch.float64, device=dev)                 # replicated over dp
        ep_sq = torch.zeros((), dtype=torch.float64, device=dev)                  # expert shards (ep)
        rep = {id(p) for p in self.replicated}
        for part in self.parts:
            for n, p in part.named_parameters():
                if p.grad is None:
                    continue
                if _mesh_dims(p) == ("ep",):
                    ep_sq += _local(p.grad).double().pow(2).sum()
                    continue
                if id(p) in rep:
                    rep_sq += p.grad.double().pow(2).sum()
                    continue
                if n.startswith("embed.") and getattr(part, "is_last", False) and not part.is_first \
                        and self.embed_group is not None:
                    continue                                                       # counted on stage 0
                sq += _local(p.grad).double().pow(2).sum()
        if self.plan.dp > 1:
            dist.all_reduce(sq, group=self.group("dp"))
        sq += rep_sq
        if self.plan.ep > 1:
            dist.all_reduce(ep_sq, group=self.group("ep"))
        sq += ep_sq
        if self.plan.pp > 1:
            dist.all_reduce(sq, group=self.group("pp"))
        norm = float(sq.sqrt())
        coef = max_norm / (norm + 1e-6)
        if coef < 1:
            for p in self.parameters():
                if p.grad is not None:
                    p.grad.mul_(coef)
        return norm

    @torch.no_grad()
    def sync_router_counts(self) -> None:
        """Sum the routers' token counts over the ranks that split the batch (dp, cp, ep), so the auxiliary-
        loss-free bias update is the one-rank update on every rank."""
        from dsv4.model.moe import Gate
        dims = [d for d in ("dp", "cp", "ep") if getattr(self.plan, d) > 1]
        if not dims:
            return
        for part in self.parts:
            for m in part.modules():
                if isinstance(m, Gate):
                    for d in dims:
                        dist.all_reduce(m.tokens_per_expert, group=self.group(d))

    def update_expert_bias(self) -> None:
        from dsv4.model.moe import Gate
        self.sync_router_counts()
        for part in self.parts:
            for m in part.modules():
                if isinstance(m, Gate):
                    m.update_expert_bias()


_METRICS = ("lm loss", "mtp_1 loss", "indexer loss", "moe aux loss")


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _mesh_dims(t: torch.Tensor) -> tuple | None:
    from torch.distributed.tensor import DTensor
    return tuple(t.device_mesh.mesh_dim_names or ()) if isinstance(t, DTensor) else None


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor
    return t._local_tensor if isinstance(t, DTensor) else t


def _comm_device(group) -> torch.device:
    """Where a host-side metric tensor must live for `group`'s collectives: the current GPU under NCCL."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _reduce_dict(m: dict, group, op) -> dict:
    keys = sorted(m)
    t = torch.tensor([m[k] for k in keys], dtype=torch.float64, device=_comm_device(group))
    dist.all_reduce(t, op=op, group=group)
    return dict(zip(keys, t.tolist()))


# ---------------------------------------------------------------------------------------------- the step

def single(model: DSv4Model, dtype: str = "fp32") -> Parallelized:
    """The one-rank `Parallelized` (no process group needed): the same step code on the plain model."""
    device = next(model.parameters()).device
    amp = torch.autocast(device.type, dtype=torch.bfloat16) if dtype == "bf16" else None
    return Parallelized(model, None, ParallelPlan(), [model], autocast=amp)


def parallelize(model: DSv4Model, mesh, plan: ParallelPlan, *, batch_shape: tuple[int, int] | None = None,
                dtype: str = "fp32", fsdp_param_dtype: torch.dtype | None = None) -> Parallelized:
    """Apply `plan` over `mesh` to `model` (built identically on every rank) and return what this rank trains.

    batch_shape (B, S): the global batch per step; needed for pp (the stages' static shapes). dtype "bf16":
    autocast compute with FP32 master parameters; fsdp_param_dtype=torch.bfloat16: FSDP2's bf16 all-gather
    and compute with P1's FP32-kept parameters left out of FSDP (see the module doc).
    """
    pl = plan
    device = next(model.parameters()).device
    ws = dist.get_world_size()
    B = batch_shape[0] if batch_shape else None
    pl.validate(model.cfg, ws, B, batch_shape[1] if batch_shape else None)
    if pl.pp > 1 and batch_shape is None:
        raise PlanError("parallelize: pp > 1 needs batch_shape (static stage shapes)")
    amp = torch.autocast(device.type, dtype=torch.bfloat16) if dtype == "bf16" else None
    if fsdp_param_dtype is not None and (pl.dp == 1 or pl.pp > 1 or amp is not None):
        raise PlanError("parallelize: fsdp_param_dtype needs dp > 1, pp = 1 and no autocast (dtype fp32)")
    res = Parallelized(model, mesh, pl, [model], autocast=amp)

    if pl.ep > 1:
        from dsv4.model.ep_dispatch import parallelize as install_ep
        install_ep(model, ep=mesh.get_group("ep"))
        _shard_experts(model, mesh["ep"])

    if pl.pp > 1:
        from torch.distributed.pipelining import PipelineStage
        from dsv4.model.parallel import pipeline as PP
        experts = [p for n, p in model.named_parameters() if _mesh_dims(p) == ("ep",)]
        n = pl.pp * pl.vpp
        stages = pl.stages or PP.even_stages(model.cfg.num_hidden_layers, n)
        pp_rank = mesh.get_local_rank("pp")
        chunks = PP.rank_chunks(model, [list(s) for s in stages], pp_rank, pl.pp)
        res.parts = chunks
        if pl.dp > 1:
            held = {id(p) for c in chunks for p in c.parameters()}
            mine = [p for p in experts if id(p) in held]
            for c in chunks:
                _fsdp(c, mesh["dp"], None, mine)
            res.replicated = mine
        mb_rows = B // (pl.dp * pl.ep * pl.microbatches)
        pdtype = next(model.parameters()).dtype                                  # FP32 streams (master dtype)
        res.stages = []
        for c in chunks:
            inp, out = PP.stage_io(c, mb_rows, batch_shape[1], pdtype, device)
            res.stages.append(PipelineStage(c, c.chunk_id, n, device, input_args=inp, output_args=out,
                                            group=mesh.get_group("pp")))
        res.schedule = _schedule(pl, res.stages)
        if len(model.mtp):
            res.embed_group = _embedding_group(mesh)
        return res

    if pl.dp > 1:
        experts = [p for n, p in model.named_parameters() if _mesh_dims(p) == ("ep",)]
        res.replicated = _fsdp(model, mesh["dp"], fsdp_param_dtype, experts) + experts
    return res


def _shard_experts(model: nn.Module, ep_mesh) -> None:
    """Each ep rank stores only its experts: the stacked expert weights become DTensors Shard(0) over ep
    (rank q holds experts [q E/ep, (q+1) E/ep), the EP dispatcher's ownership)."""
    from torch.distributed.tensor import Shard, distribute_tensor
    from dsv4.model.moe import Experts
    for m in model.modules():
        if isinstance(m, Experts):
            for name in ("w13", "w2"):
                p = getattr(m, name)
                setattr(m, name, nn.Parameter(distribute_tensor(p.detach(), ep_mesh, [Shard(0)],
                                                                src_data_rank=None)))


def _fsdp(root: nn.Module, dp_mesh, param_dtype: torch.dtype | None = None, also_ignored=()) -> list:
    """FSDP2 per block (and the MTP block), then the root; reduce-scatter in FP32. param_dtype None: FP32
    all-gather; bf16: bf16 all-gather / compute with P1's FP32-kept parameters left out (returned)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from dsv4.model.block import Block
    from dsv4.model.precision import fp32_kept_names
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    kept = []
    if param_dtype is not None:
        names = set(fp32_kept_names(root))
        kept = [p for n, p in root.named_parameters() if n in names]
    ignored = (set(kept) | set(also_ignored)) or None      # also_ignored: ep expert shards (replicated over dp)
    blocks = [m for m in root.modules() if isinstance(m, Block)]
    for b in blocks:
        fully_shard(b, mesh=dp_mesh, mp_policy=mp, ignored_params=ignored)
    fully_shard(root, mesh=dp_mesh, mp_policy=mp, ignored_params=ignored)
    return kept


def _schedule(pl: ParallelPlan, stages: list):
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    def loss_fn(out, target):                                                     # the last stage's objective
        return out
    if pl.schedule == "interleaved1f1b":
        return ScheduleInterleaved1F1B(stages, n_microbatches=pl.microbatches, loss_fn=loss_fn)
    cls = ScheduleGPipe if pl.schedule == "gpipe" else Schedule1F1B
    return cls(stages[0], n_microbatches=pl.microbatches, loss_fn=loss_fn)


def _embedding_group(mesh):
    """The process group of the first and last pipeline rank holding the embedding (same dp/cp/ep coordinate);
    every rank creates every such group (new_group is collective) and keeps its own, or None if not in one."""
    grid = mesh.mesh                                                               # [pp, dp, cp, ep] ranks
    me = dist.get_rank()
    mine = None
    flat_first = grid[0].reshape(-1).tolist()
    flat_last = grid[-1].reshape(-1).tolist()
    for a, b in zip(flat_first, flat_last):
        g = dist.new_group([a, b], timeout=datetime.timedelta(seconds=_TIMEOUT["s"]))
        if me in (a, b):
            mine = g
    return mine


def world_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))
