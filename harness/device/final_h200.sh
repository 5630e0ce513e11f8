#!/usr/bin/env bash
# The wave's final H200 runs that train (issues 12, 13, 17, 18), self-contained: run from the repo root, results
# under $OUT (torch 2.11 / triton 3.6 / Python 3.12, no internet; .whl/ holds transformers for the HF peer).
#   OUT=/path DSV4_GIT_SHA=<sha> bash harness/device/final_h200.sh train   # A: curves + compile + packed; B: 64K stage; C: decode
#   OUT=/path DSV4_GIT_SHA=<sha> bash harness/device/final_h200.sh bench   # `dsv4 bench train` rows, ours vs HF
#   SMOKE=1 ... : the same steps on a CPU at debug sizes (checks the script, measures nothing)
# A runs side by side on the one GPU (each step is host-bound at 4K, so they overlap; their losses are compared,
# their step times are contended and not speed results):
#   curve_<p>/        `dsv4 train --recipe proxy --steps 300 --precision p`, p = bf16 | fp8_block | fp4_qat (X1, D9)
#   compile_train/    `dsv4 train --recipe proxy --compile --steps 12` (torch.compile of every block trains, issue 12)
#   packed_train/     `dsv4 train --recipe proxy --packing --steps 4` (packed THD rows, Triton kernels, issue 12)
# B: train64k/       `dsv4 train --recipe long-proxy --curriculum proxy-64k` (2 dense warm-up + 4 sparse steps, 64K
#                    tokens, recompute; issue 18), alone on the GPU.
# C: gen.json        python -m dsv4.harness.bench_generate (decode tok/s and cache bytes / token at 4K and 64K), alone.
# Every run dir keeps golden_values.json, run.json, metrics.jsonl (metrics.jsonl is written per step, so a run cut by
# its time limit keeps its steps). summary.txt: one line per step with its exit code and seconds.
set -u
WHAT=${1:-train}
OUT=${OUT:-/tmp/final_h200}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
SHIM=$(mktemp -d /tmp/fshim.XXXXXX)
mkdir -p "$SHIM/dsv4"; cp harness/_root/__init__.py "$SHIM/dsv4/__init__.py"
for d in model kernels harness slices; do ln -sfn "$PWD/$d" "$SHIM/dsv4/$d"; done
if [ "$WHAT" = bench ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SHIM/site" .whl/*.whl || exit 3
fi
export PYTHONPATH="$SHIM:$SHIM/site${PYTHONPATH:+:$PYTHONPATH}"
export DSV4_GIT_SHA=${DSV4_GIT_SHA:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
PY=${PYTHON:-python3}
echo "from dsv4.harness.cli import main; main()" > "$SHIM/dsv4_main.py"
D="$PY $SHIM/dsv4_main.py"
BT="$PY -c 'from dsv4.harness.train.bench import bench_train_cmd; bench_train_cmd()'"
{ $PY -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, triton.__version__, \
torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')"; echo "git $DSV4_GIT_SHA"; } >> "$OUT/env.txt" 2>&1
touch "$OUT/summary.txt"
run() { local name=$1 t=$2; shift 2; local s=$(date +%s); timeout "$t" bash -c "$*" > "$OUT/$name.log" 2>&1; local rc=$?
        echo "$name rc=$rc $(( $(date +%s) - s ))s" | tee -a "$OUT/summary.txt"; }
keep() { mkdir -p "$OUT/$1"; for f in golden_values.json run.json metrics.jsonl routing_stats.json; do
           cp "$SHIM/run_$1/$f" "$OUT/$1/" 2>/dev/null; done; }
S=${SMOKE:-0}
if [ "$WHAT" = train ]; then
  if [ "$S" = 1 ]; then R=debug; N=4; RL="long-debug --steps 3"; GEN="--smoke"; E="--backend naive"
  else R=proxy; N=300; RL="long-proxy --curriculum proxy-64k"; GEN="--config proxy --contexts 4096,65536 --new 32"; E="--backend triton"; fi
  for p in bf16 fp8_block fp4_qat; do
    run "curve_$p" ${TA:-300} "$D train --recipe $R --steps $N --precision $p $E --out $SHIM/run_curve_$p --no-final-checkpoint --json" &
  done
  run compile_train ${TA:-300} "$D train --recipe $R --steps 12 --compile $E --out $SHIM/run_compile_train --no-final-checkpoint --json" &
  run packed_train ${TA:-300} "$D train --recipe $R --steps 4 --packing $E --out $SHIM/run_packed_train --no-final-checkpoint --json" &
  wait
  run train64k ${TB:-120} "$D train --recipe $RL $E --out $SHIM/run_train64k --no-final-checkpoint --json"
  run gen ${TC:-130} "$PY -m dsv4.harness.bench_generate $GEN --out $OUT/gen.json"
  for r in curve_bf16 curve_fp8_block curve_fp4_qat compile_train packed_train train64k; do keep $r; done
else
  if [ "$S" = 1 ]; then SM="--smoke --tokens 256 --batch 2 --steps 2 --warmup 1"; T4=256; T16=512
  else SM="--config proxy --steps 5 --warmup 2"; T4=4096; T16=16384; fi
  J=$OUT/bench_train.json
  run bench_eager ${TA:-150} "$BT $SM --tokens $T4,$T16 --batch 2 --impls ours,ours_packed,hf_eager --profile --append --out $J"
  run bench_hf_compile ${TB:-170} "$BT $SM --tokens $T4 --batch 2 --impls hf_compile --append --out $J"
  run bench_ours_compile ${TC:-200} "$BT $SM --tokens $T4 --batch 2 --impls ours_compile --profile --append --out $J"
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.used --format=csv >> "$OUT/env.txt"
rm -rf "$SHIM"
cat "$OUT/summary.txt"
