#!/usr/bin/env bash
# Slice X1 (issue 17) on one H200, self-contained: run from the repo root, results as JSON under $OUT.
#   OUT=/path bash harness/device/lowp_h200.sh            # the GPU run (torch 2.11 / triton 3.6, no internet)
#   PYTHON=.venv/bin/python bash harness/device/lowp_h200.sh --smoke   # the same Python parts on a CPU, debug sizes
# Writes: env.txt; test_quant_gpu.log (the fused quantiser == the exact one, bit for bit, on CUDA tensors);
# lowp_bench.json (harness/train/lowp_bench.py: FP8 / FP4-QAT step time ratio vs bf16 on proxy at 4K tokens with the
# fused quantiser, exact vs fused quantiser ms and GB/s, 50-step loss curves of bf16 / fp8_tensor / fp8_block /
# fp4_qat and their gaps to bf16); summary.json (the ratios and gaps in one place).
set -u
SMOKE=0
[ "${1:-}" = "--smoke" ] && SMOKE=1
OUT=${OUT:-$(mktemp -d /tmp/x1_lowp.XXXXXX)}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# the checkout as the `dsv4` package without installing it (as scratch/h200_final.sh does)
SHIM=$(mktemp -d /tmp/x1shim.XXXXXX)
mkdir -p "$SHIM/dsv4"; cp harness/_root/__init__.py "$SHIM/dsv4/__init__.py"
for d in model kernels harness slices; do ln -sfn "$PWD/$d" "$SHIM/dsv4/$d"; done
export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
$PY -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, triton.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')" | tee "$OUT/env.txt"
git rev-parse HEAD >> "$OUT/env.txt" 2>/dev/null || true
run() { local name=$1 t=$2; shift 2; local s=$(date +%s); timeout "$t" "$@" > "$OUT/$name.out" 2> "$OUT/$name.log"; local rc=$?; echo "$name rc=$rc $(( $(date +%s) - s ))s"; tail -3 "$OUT/$name.log" | cut -c1-300; return $rc; }
RC=0
if [ $SMOKE = 1 ]; then
  run lowp_bench 900 $PY -m dsv4.harness.train.lowp_bench --smoke --loss-steps 4 --recipes bf16,fp8_block,fp4_qat \
      --out "$OUT/lowp_bench.json" || RC=$?
else
  if $PY -c "import pytest" 2>/dev/null; then
    run test_quant_gpu 240 $PY -m pytest -q -p no:cacheprovider kernels/quant/test_quant.py slices/X1/test_gpu_fp8.py \
      || RC=$?
    cp "$OUT/test_quant_gpu.out" "$OUT/test_quant_gpu.log.txt" 2>/dev/null
  else
    echo "pytest not installed: test_quant_gpu skipped" | tee "$OUT/test_quant_gpu.log"
  fi
  run lowp_bench 480 $PY -m dsv4.harness.train.lowp_bench --config proxy --tokens 4096 --batch 1 --steps 5 --warmup 2 \
      --loss-steps 50 --loss-tokens 4096 --recipes bf16,fp8_tensor,fp8_block,fp4_qat --backend triton \
      --out "$OUT/lowp_bench.json" || RC=$?
fi
$PY - "$OUT" <<'PYEOF'
import json, os, sys
out = sys.argv[1]
p = os.path.join(out, "lowp_bench.json")
doc = json.load(open(p)) if os.path.exists(p) else {}
keys = ("step_time_ratio_vs_bf16", "speed_ratio_vs_bf16", "max_abs_loss_delta_vs_bf16", "windowed_loss_gap_vs_bf16",
        "final_loss")
s = {k: doc.get(k) for k in keys}
s["quantizer"] = [{k: q.get(k) for k in ("shape", "block", "backend", "ms", "gb_per_s", "speedup_vs_exact", "error")}
                  for q in doc.get("quantizer", [])]
s["errors"] = [r for r in doc.get("speed", []) if "error" in r]
tmp = os.path.join(out, "summary.json.tmp")
json.dump(s, open(tmp, "w"), indent=1)
os.replace(tmp, os.path.join(out, "summary.json"))
print(json.dumps(s, indent=1))
PYEOF
rm -rf "$SHIM"
echo "results in $OUT (exit $RC)"
exit $RC
