#!/usr/bin/env bash
# Issue 18 on one H200 (X2 / X4): decode tokens/s and KV-cache memory of `proxy` at 4K and 64K context, and the
# plan of the 64K training step. The 64K curriculum stage itself is `harness/device/final_h200.sh train`'s.
# Self-contained: run from the repo root on a machine with torch 2.11 / triton 3.6 / Python 3.12, no internet;
# results under $OUT:
#   env.txt              versions, GPU
#   gen.json / gen.log   python -m dsv4.harness.bench_generate (decode / prefill tokens/s, cache bytes per token)
#   gen_b8.json          the same at 4K with 8 rows
#   plan.json            dsv4 plan's prediction for the 64K training step (the stored CPU measurement)
# SMOKE=1: the same steps on the CPU with the debug config and tiny sizes (checks the script, measures nothing).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
SHIM=$(mktemp -d)
. harness/device/shim.sh && dsv4_shim "$SHIM"
export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
D="python3 -c 'from dsv4.harness.cli import main; main()'"
run() { local name=$1 t=$2; shift 2; local s=$(date +%s); timeout "$t" bash -c "$*" > "$OUT/$name.out" 2> "$OUT/$name.log"; \
        echo "$name rc=$? $(( $(date +%s) - s ))s"; tail -3 "$OUT/$name.log" | cut -c1-300; }
python3 -c "import torch, triton, sys; print(sys.version.split()[0], torch.__version__, triton.__version__, \
torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')" | tee "$OUT/env.txt"
if [ "${SMOKE:-0}" = 1 ]; then
  run gen 300 "python3 -m dsv4.harness.bench_generate --smoke --out $OUT/gen.json"
  run gen_b8 300 "python3 -m dsv4.harness.bench_generate --smoke --batch 3 --out $OUT/gen_b8.json"
  run plan 300 "$D plan --config debug --tokens 256 --recompute --optimizer none --json"
else
  run gen 420 "python3 -m dsv4.harness.bench_generate --config proxy --contexts 4096,65536 --batch 1 --new 64 --out $OUT/gen.json"
  run gen_b8 240 "python3 -m dsv4.harness.bench_generate --config proxy --contexts 4096 --batch 8 --new 64 --out $OUT/gen_b8.json"
  run plan 120 "$D plan --config proxy --tokens 65536 --recompute --optimizer muon --json"
fi
cp "$OUT/plan.out" "$OUT/plan.json" 2>/dev/null
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.used --format=csv >> "$OUT/env.txt"
ls -la "$OUT"
