"""One hardware-counter profile of the sparse-attention backward at the proxy's shape (issue 14; H 16, c 512, window
128, CSA ratio 4, top-k 512, S tokens of one document; the `dsv4 bench kernels` inputs of sparse_bwd_parts.py): a
forward and backward first (the autotuner picks its configs and compiles), then one more backward between
cudaProfilerStart / Stop, so that `ncu --profile-from-start off` records only that launch. Run on a GPU with the
shim on PYTHONPATH (harness/device/shim.sh):
  ncu --profile-from-start off --kernel-name regex:_sparse_attn_bwd --set full -o $OUT/sparse_bwd \\
      python3 harness/device/ncu_sparse_bwd.py [S] [H] [csa|hca|window]
  ncu --import $OUT/sparse_bwd.ncu-rep --page details --csv > $OUT/sparse_bwd_details.csv
What to read: sm__throughput / l1tex / lts__t_bytes (the gathers' L2 traffic), lts__t_sectors_op_red (the dKV
atomics), smsp__inst_executed_pipe_tensor (the M = 16 mma.sync products), launch__registers_per_thread and
local-memory spills, and the warp stall reasons."""
import sys

import torch

from dsv4.harness.bench import sparse_case
from dsv4.kernels.sparse_attn.triton import _sparse_attn_bwd, sparse_attn

S = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
H = int(sys.argv[2]) if len(sys.argv) > 2 else 16
mode = sys.argv[3] if len(sys.argv) > 3 else "csa"
c, window = 512, 128
q, kv, comp, idx, sink, meta, ratio = sparse_case(S, H, mode, c, window)
ins = [x for x in (q, kv, comp, sink) if x is not None]
o = sparse_attn(q, kv, comp, idx, sink, window, ratio, c ** -0.5, *meta)
do = torch.randn_like(o)
torch.autograd.grad(o, ins, do, retain_graph=True)             # autotune + compile outside the profiled range
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
torch.autograd.grad(o, ins, do, retain_graph=True)
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
print(f"S {S} H {H} {mode}: config {_sparse_attn_bwd.best_config}")
