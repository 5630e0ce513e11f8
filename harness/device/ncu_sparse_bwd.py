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

from dsv4.harness.bench import _csa_idx
from dsv4.kernels.sparse_attn.triton import _sparse_attn_bwd, sparse_attn

S = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
H = int(sys.argv[2]) if len(sys.argv) > 2 else 16
mode = sys.argv[3] if len(sys.argv) > 3 else "csa"
c, window = 512, 128
g = torch.Generator(device="cuda").manual_seed(0)
ratio, k = (4, 512) if mode == "csa" else (128, 0)
q = torch.randn(S, H, c, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
kv = torch.randn(S, c, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
sink = torch.randn(H, device="cuda", generator=g).requires_grad_()
comp = idx = None
if mode != "window":
    comp = torch.randn(S // ratio, c, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
if mode == "csa":
    idx = _csa_idx(S, S // ratio, k, ratio, "cuda", g)[:, 0]
N = 0 if comp is None else comp.shape[0]
t = torch.arange(S, device="cuda")
meta = (torch.zeros(S, dtype=torch.long, device="cuda"), t, torch.zeros(N, dtype=torch.long, device="cuda"),
        torch.arange(N, device="cuda"))
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
