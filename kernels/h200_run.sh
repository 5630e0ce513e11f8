#!/usr/bin/env bash
# One device call on the H200 (run from the repo root): the kernel tests at DSv4 shapes, then
# `dsv4 bench kernels` (SKIP_BENCH=1: tests only), logs and JSON under $OUT (copied to goldens/h200/<slice>/ afterwards).
# The checkout is not pip-installed there: a shim package dir maps dsv4.* onto the folders. Set DSV4_GIT_SHA=<sha>
# (the device copy's .git need not be the commit sent: at 8361be7 it reported debb304).
set -u
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
. harness/device/shim.sh && dsv4_shim /tmp/shim
export PYTHONPATH=/tmp/shim
# FlashMLA as the sparse-attention peer when a build was carried in (.flashmla/flashmla_sm90.tgz from
# harness/device/flashmla_h200.sh build): unpacked and put on the path; otherwise its rows say why not
if [ -f .flashmla/flashmla_sm90.tgz ]; then bash harness/device/flashmla_h200.sh use >/dev/null && export PYTHONPATH=$PYTHONPATH:$PWD/.flashmla/pkg; fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  for t in ${TESTS:-kernels/sparse_attn/test_sparse_attn.py kernels/compressor/test_compressor.py kernels/indexer/test_indexer.py kernels/mhc/test_mhc.py kernels/swiglu/test_swiglu.py}; do
    # one process per file: a CUDA fault in one op does not poison the others
    timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q --durations=5 -p no:cacheprovider $t >> "$OUT/pytest_gpu.log" 2>&1
    echo "$t: $(tail -1 "$OUT/pytest_gpu.log")"
  done
fi
[ "${SKIP_BENCH:-0}" = 1 ] && exit 0
timeout ${BENCH_TIMEOUT:-420} python3 -c "from dsv4.harness.bench import bench_cmd; bench_cmd()" \
  --isolate --out "$OUT/bench_kernels.json" --out-dir "$OUT" ${BENCH_ARGS:-} 2> "$OUT/bench.log"
echo "bench rc=$?"; grep -v '^ *$' "$OUT/bench.log" | cut -c1-400 | tail -40
