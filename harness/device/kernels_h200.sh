#!/usr/bin/env bash
# Issue 14, bandwidth-bound kernels, on one H200 (run from the repo root; self-contained: no internet, nothing
# installed; needs torch + triton + pytest + click on the image, e.g. torch 2.11 / triton 3.6 / Python 3.12):
#   0. `dsv4 bench kernels --smoke` (seconds: catches a Python error before the long runs),
#   1. the GPU tests of the compressor, mHC and the custom ops (DSv4-size bf16 cases included), one process each,
#   2. `dsv4 bench kernels --only compressor,mhc` at 16K and 64K tokens (naive peers, bytes formulas, the configs
#      the autotuner picked), one process per op.
# Everything lands under $OUT: env.txt, bench_smoke.{json,log}, pytest_<file>.log, bench_kernels.json (+ D3/ and
# P2/ bench_kernels.json for goldens/h200/), bench.log, summary.txt. Knobs: SKIP_TESTS=1, SKIP_BENCH=1, TOKENS,
# TEST_TIMEOUT, BENCH_TIMEOUT, SKIP_SMOKE=1, TESTS (test files), ONLY (bench ops), SEQS (the indexer / sparse-attention lengths, no
# dense peer); DSV4_GIT_SHA names the commit when the copy has no .git.
# Example: run(command="DSV4_GIT_SHA=<sha> bash harness/device/kernels_h200.sh")
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
ROOT=$PWD
SHIM=$(mktemp -d)
. harness/device/shim.sh && dsv4_shim "$SHIM"      # the checkout is not pip-installed there: dsv4.* -> the folders
export PYTHONPATH=$SHIM
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$ROOT/build/triton_cache}   # build/ is git-ignored: kept between calls
# the sha comes from the caller: the device copy's .git can be stale (session 24: it named 357f0d8 for a later tree)
export DSV4_GIT_SHA=${DSV4_GIT_SHA:-unknown}
BENCH="python3 -c 'from dsv4.harness.bench import bench_cmd; bench_cmd()'"
{
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv
  python3 -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, triton.__version__, torch.cuda.get_device_name())"
  echo "git $DSV4_GIT_SHA"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
: > "$OUT/summary.txt"
note() { echo "$*" | tee -a "$OUT/summary.txt"; }

if [ "${SKIP_SMOKE:-0}" != 1 ]; then
  timeout 120 bash -c "$BENCH --smoke --only compressor,mhc --out $OUT/bench_smoke.json" > /dev/null 2> "$OUT/bench_smoke.log"
  note "bench smoke rc=$?"
fi

if [ "${SKIP_TESTS:-0}" != 1 ]; then
  for t in ${TESTS:-kernels/compressor/test_compressor.py kernels/mhc/test_mhc.py kernels/test_custom_ops.py}; do
    log="$OUT/pytest_$(basename "$t" .py).log"
    s=$(date +%s)
    timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -q -p no:cacheprovider --durations=5 "$t" > "$log" 2>&1
    note "$t rc=$? $(( $(date +%s) - s ))s: $(tail -1 "$log")"
  done
fi

if [ "${SKIP_BENCH:-0}" != 1 ]; then
  s=$(date +%s)
  timeout "${BENCH_TIMEOUT:-420}" bash -c "$BENCH --only ${ONLY:-compressor,mhc} --tokens ${TOKENS:-16384,65536} --isolate \
    ${SEQS:+--seqs $SEQS --no-dense-peer} --out $OUT/bench_kernels.json --out-dir $OUT" > /dev/null 2> "$OUT/bench.log"
  note "bench rc=$? $(( $(date +%s) - s ))s"
  python3 - "$OUT/bench_kernels.json" <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
try:
    ops = json.load(open(sys.argv[1]))["ops"]
except Exception as e:  # noqa: BLE001
    sys.exit(f"no bench JSON: {e!r}")
for r in ops.get("compressor", {}).get("rows", []):
    t, n = r.get("triton", {}), r.get("naive", {})
    print(f"compressor {r['case']:12s} S={r['S']:6d} triton fwd {t.get('fwd_tbps', float('nan')):.2f} TB/s "
          f"bwd {t.get('bwd_tbps', float('nan')):.2f} TB/s graph fwd {t.get('graph_fwd_tbps', float('nan')):.2f} "
          f"bwd {t.get('graph_bwd_tbps', float('nan')):.2f} | slots graph {t.get('graph_slots_ms', float('nan')):.4f} ms "
          f"fwd+slots graph {t.get('graph_fwd_total_tbps', float('nan')):.2f} TB/s "
          f"| naive fwd {n.get('fwd_ms', float('nan')):.3f} ms "
          f"bwd {n.get('bwd_ms', float('nan')):.3f} ms {t.get('error', '')}{t.get('graph_error', '')}"
          f"{t.get('graph_slots_error', '')}")
    for k in t.get("kernels_fwd_bwd", []):
        print(f"    {k['name'][:60]:60s} {k['ms']:.3f} ms x{k['count']}")
for r in ops.get("mhc", {}).get("rows", []):
    for op in ("hc_pre", "hc_post"):
        v = r.get(op, {})
        print(f"mhc {r['backend']:6s} N={r['N']:6d} {op}: fwd {v.get('fwd_tbps', float('nan')):.2f} TB/s "
              f"({v.get('fwd_ms', float('nan')):.3f} ms) bwd {v.get('bwd_tbps', float('nan')):.2f} TB/s "
              f"({v.get('bwd_ms', float('nan')):.3f} ms) graph fwd {v.get('graph_fwd_tbps', float('nan')):.2f} "
              f"bwd {v.get('graph_bwd_tbps', float('nan')):.2f} {v.get('error', '')}{v.get('graph_error', '')}")
        for k in v.get("kernels_fwd_bwd", []):
            print(f"    {k['name'][:60]:60s} {k['ms']:.3f} ms x{k['count']}")
PY
  grep -i -E "error|Traceback" "$OUT/bench.log" | head -5
fi
