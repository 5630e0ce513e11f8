"""Parallel layouts applied from outside the model: `parallelize(model, mesh, plan)` (model/parallel/parallelize.py)
over a DeviceMesh (pp, dp, cp, ep) on FSDP2, torch.distributed.pipelining, the CP layout and the EP dispatcher."""
from dsv4.model.parallel.parallelize import (MESH_DIMS, SCHEDULES, Parallelized, ParallelPlan, PlanError, single,
                                             build_mesh, init_distributed, parallelize)

__all__ = ["MESH_DIMS", "SCHEDULES", "Parallelized", "ParallelPlan", "PlanError", "build_mesh",
           "init_distributed", "parallelize", "single"]
