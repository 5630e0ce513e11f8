#!/usr/bin/env bash
# Slice X1 (issue 17) on one H200, self-contained: run from the repo root, results under $OUT.
#   OUT=/path DSV4_GIT_SHA=<sha> bash harness/device/lowp_h200.sh   # the GPU run (torch 2.11 / triton 3.6, no internet)
#   SMOKE=1 bash harness/device/lowp_h200.sh                        # the same steps on a CPU, debug sizes, a few steps
# Writes:
#   env.txt                 versions, GPU, commit
#   fp8_gemm_check.json     kernels/lowp_gpu_check.py: emulated FP8 GEMM vs torch._scaled_mm (slices/X1/logs/)
#   test_quant_gpu.log      kernels/quant + slices/X1/test_gpu_fp8.py on CUDA tensors (fused quantiser == exact one,
#                           bit for bit; FP8 GEMM / FP8Linear vs the CPU emulation within the stored tolerances)
#   lowp_bench.json         harness/train/lowp_bench.py: FP8 / FP4-QAT fwd+bwd tokens/s vs bf16 on proxy at 4K and
#                           16K tokens (the fused quantiser), exact vs fused quantiser ms and GB/s
#   summary.txt             one line per step with its exit code and seconds
# Knobs: GT / QT / LB (seconds per step), QTESTS (test files), RECIPES (lowp_bench recipes).
# The 300-step bf16 / fp8_block / fp4_qat proxy curves are `harness/device/final_h200.sh train`'s.
set -u
OUT=${OUT:-/tmp/x1_lowp}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
SHIM=$(mktemp -d /tmp/x1shim.XXXXXX)         # the checkout as the `dsv4` package without installing it
. harness/device/shim.sh && dsv4_shim "$SHIM"
export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
# the sha comes from the caller: the device copy's .git can be stale (session 24: it named 357f0d8 for a later tree)
export DSV4_GIT_SHA=${DSV4_GIT_SHA:-unknown}
PY=${PYTHON:-python3}
{ $PY -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, triton.__version__, \
torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')"; echo "git $DSV4_GIT_SHA"; } > "$OUT/env.txt" 2>&1
: > "$OUT/summary.txt"
run() { local name=$1 t=$2; shift 2; local s=$(date +%s); timeout "$t" bash -c "$*" > "$OUT/$name.log" 2>&1; local rc=$?
        echo "$name rc=$rc $(( $(date +%s) - s ))s" | tee -a "$OUT/summary.txt"; tail -2 "$OUT/$name.log" | cut -c1-300; }
if [ "${SMOKE:-0}" = 1 ]; then
  run lowp_bench 600 "$PY -m dsv4.harness.train.lowp_bench --smoke --loss-steps 0 --recipes bf16,fp8_block,fp4_qat --out $OUT/lowp_bench.json"
else
  run fp8_gemm_check ${GT:-120} "$PY -m dsv4.kernels.lowp_gpu_check --out $OUT/fp8_gemm_check.json"
  run test_quant_gpu ${QT:-300} "$PY -m pytest -q -p no:cacheprovider ${QTESTS:-kernels/quant/test_quant.py slices/X1/test_gpu_fp8.py}"
  run lowp_bench ${LB:-170} "$PY -m dsv4.harness.train.lowp_bench --config proxy --tokens 4096,16384 --batch 1 --steps 5 \
      --warmup 2 --loss-steps 0 --recipes ${RECIPES:-bf16,fp8_tensor,fp8_block,fp4_qat} --backend triton --out $OUT/lowp_bench.json"
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.used --format=csv >> "$OUT/env.txt"
rm -rf "$SHIM"
cat "$OUT/summary.txt"
