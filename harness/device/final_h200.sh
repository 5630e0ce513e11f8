#!/usr/bin/env bash
# The wave's final H200 runs that train (issues 12, 13, 17, 18), self-contained: run from the repo root, results
# under $OUT (torch 2.11 / triton 3.6 / Python 3.12, no internet; .whl/ holds transformers for the HF peer).
#   OUT=/path DSV4_GIT_SHA=<sha> bash harness/device/final_h200.sh train   # curves + the 64K stage; then ours vs HF at 4K
#   OUT=/path DSV4_GIT_SHA=<sha> bash harness/device/final_h200.sh more    # compile + packed training; then decode
#   OUT=/path DSV4_GIT_SHA=<sha> bash harness/device/final_h200.sh speed   # step times: dsv4 train 20 steps, bench rows
#   ... final_h200.sh train speed : both, one deadline (DEADLINE s from the start; LONG=0 / PEERS=0 drop the 64K
#   stage / bench_peers from train)
#   SMOKE=1 ... : the same steps on a CPU at debug sizes (checks the script, measures nothing)
# `train` (one call): side by side on the one GPU (host-bound steps overlap; their losses are compared, their step
# times are contended and not speed results):
#   curve_<p>/        `dsv4 train --recipe proxy --steps 300 --precision p`, p = bf16 | fp8_block | fp4_qat (X1, D9;
#                     PRECS= a subset, e.g. PRECS=bf16 for the bf16 curve alone)
#   curve_bf16_cg/    CG=1: `dsv4 train --recipe proxy --steps 100 --precision bf16 --cuda-graphs` (CGN steps)
#   train64k/         `dsv4 train --recipe long-proxy --curriculum proxy-64k` (2 dense warm-up + 4 sparse steps of 64K
#                     tokens, recompute; issue 18)
# then alone: bench_train.json, `dsv4 bench train` ours vs hf_eager vs hf_compile at 4K tokens (B=2).
# `more`: compile_train/ (`--compile --steps 12`: torch.compile of every block trains, issue 12) and packed_train/
# (`--packing --steps 4`: packed THD rows on the Triton kernels) side by side. Decode is harness/device/gen_h200.sh.
# `speed` (issue 13): each alone, in order (SPEED= a subset), every step cut to what is left of DEADLINE s (540):
#   gpu_tests.log     `gpu_tests` (not a result): pytest of $GPU_TESTS (TESTS= others, TT= its limit, 240 s): P11's
#                     capture, the indexer backward's capture, the MoE slot lists' GPU race; first in SPEED= after a
#                     change to what a CUDA graph captures (cde260c: every captured row failed at capture)
#   window_bwd_split.json  `window_split` (TW= its limit, 240 s): harness/device/window_bwd_split.py ab, the split
#                     window backward without dKV atomics against the kernel as it is (16K, H 16; issue 14)
#   warm.json         `warm` (not a result): one ours step at 4K and 16K, so that Triton's kernels and autotuning
#                     choices are in the cache before the timed rows (a cold first row spent 126 s of its 170 s in
#                     its 4K warm-up at 8361be7; put `warm` first in SPEED=)
#   train20/          `dsv4 train --recipe proxy --steps 20` (its per-step fwd-bwd time, not contended)
#   bench_train.json  `dsv4 bench train --profile` rows in separate processes (--append): ours 4K+16K B=2 (TOKS=),
#                     hf_eager 4K+16K, ours_cudagraph 4K+16K (TOKSG=, TRG= its limit: 260 s; the 16K row's
#                     first compile takes ~123 s), hf_compile 4K (bench_ours_compile: ours_compile 4K),
#                     bench_head_ce: ours 4K+16K once per head cross-entropy mode (--head-ce recompute,grad_in_forward:
#                     DSv4Model.set_head_ce's A/B, a ratio per tokens), bench_out_rope: the same per output-RoPE
#                     mode (--out-rope fused,separate: DSv4Model.set_out_rope's A/B), bench_all_picked: ours 4K once per
#                     all-visible CSA read (--all-picked contiguous,listed: DSv4Model.set_all_picked's A/B; 4K rows are
#                     2,048-token documents, all picked at k 512),
#                     ours_packed 16K (bench_packed, TR= too: 90 s cut it at ae3e91f), bench_packed_graph: ours_packed and
#                     ours_packed_graph 16K (P11: the whole packed step as one captured CUDA graph), ours 64K + 128K B=1 (bench_long, TL= its limit,
#                     150 s; LONGARGS= the bench flags, default "--recompute-from 131072": 64K without recompute (it
#                     fit an H100 at 64.1 GiB, 93.3K tok/s, session 25), 128K with; LONGARGS="" for recompute from 32K;
#                     LONGIMPLS=ours,ours_cudagraph adds the CUDA-graph rows: not yet run at 64K / 128K; each row
#                     is written before its profile step, which a time limit may cut).
#                     With a cold Triton cache bench_long needs more than 150 s (7298853: cut before its
#                     first row): run it after `warm` / another row, or carry .dcache/ from a CACHES=1 call
# Every run dir keeps golden_values.json, run.json, metrics.jsonl (metrics.jsonl is written per step, so a run cut by
# its time limit keeps its steps). summary.txt: one line per step with its exit code and seconds. All of $OUT is
# also packed into results.tgz (a device call returns at most 8 files).
set -u
WHATS=${*:-train}                  # one or more of: train more speed (run in that order)
FINAL=${OUT:-/tmp/final_h200}       # gets results.tgz (everything) and summary.txt: a device call returns <= 8 files
OUT=$(mktemp -d /tmp/fwork.XXXXXX)
mkdir -p "$FINAL"
export PYTHONUNBUFFERED=1
# Compile caches: with .dcache/ carried in (a previous call's caches.tgz unpacked there) Triton's kernels, its
# autotuning choices and Inductor's graphs are reused (first-step seconds shrink; step times do not change).
# CACHES=1 packs them into $FINAL/caches.tgz for the next call.
# Every call also writes $FINAL/autotune.tgz, the autotuning choices alone (shim.sh `dsv4_pack_autotune`).
SHIM=$(mktemp -d /tmp/fshim.XXXXXX)
. harness/device/shim.sh && dsv4_shim "$SHIM" && dsv4_caches
if [ "$WHATS" != more ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SHIM/site" .whl/*.whl || exit 3
fi
export PYTHONPATH="$SHIM:$SHIM/site${PYTHONPATH:+:$PYTHONPATH}"
# the sha comes from the caller: the device copy's .git can be stale (session 24: it named 357f0d8 for a later tree)
export DSV4_GIT_SHA=${DSV4_GIT_SHA:-unknown}
PY=${PYTHON:-python3}
echo "from dsv4.harness.cli import main; main()" > "$SHIM/dsv4_main.py"
D="$PY $SHIM/dsv4_main.py"
BT="$PY -c 'from dsv4.harness.train.bench import bench_train_cmd; bench_train_cmd()'"
{ $PY -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, triton.__version__, \
torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')"; echo "git $DSV4_GIT_SHA"; } >> "$OUT/env.txt" 2>&1
touch "$OUT/summary.txt"
# SEED_BENCH=<file>: an earlier call's bench_train.json; this call's rows are appended to it (`--append`: the rows
# keep their own provenance, a row of the same (impl, tokens, batch) is replaced, the ratios are recomputed)
# The seed must be of this GPU: bench refuses to append an H100 run to an H200 file (goldens.platform_of), so on
# another GPU the call starts a file of its own.
GPU=$($PY -c "import torch; from dsv4.harness.goldens import platform_of; print(platform_of('cuda' if torch.cuda.is_available() else 'cpu'))" 2>/dev/null)
if [ -n "${SEED_BENCH:-}" ]; then
  case $SEED_BENCH in *"/$GPU/"*) cp "$SEED_BENCH" "$OUT/bench_train.json" ;;
                      *) echo "SEED_BENCH $SEED_BENCH is not of this GPU ($GPU): not seeded" | tee -a "$OUT/summary.txt" ;; esac
fi
run() { local name=$1 t=$2; shift 2; local s=$(date +%s); timeout "$t" bash -c "$*" > "$OUT/$name.log" 2>&1; local rc=$?
        echo "$name rc=$rc $(( $(date +%s) - s ))s" | tee -a "$OUT/summary.txt"; }
keep() { mkdir -p "$OUT/$1"; for f in golden_values.json run.json metrics.jsonl routing_stats.json; do
           cp "$SHIM/run_$1/$f" "$OUT/$1/" 2>/dev/null; done; }
S=${SMOKE:-0}
if [ "$S" = 1 ]; then R=debug; N=4; RL="long-debug --steps 3"; E="--backend naive"
  SM="--smoke --tokens 256 --batch 2 --steps 2 --warmup 1"; T4=256
else R=proxy; N=300; RL="long-proxy --curriculum proxy-64k --lr-schedule cosine"; E="--backend triton"
  SM="--config proxy --steps 5 --warmup 2"; T4=4096; fi
T0=$(date +%s); DL=${DEADLINE:-540}
# `gpu_tests` (TESTS= other files): the tests that only a GPU runs for the captured steps and the kernels they capture
GPU_TESTS="slices/P11/test_packed_graph.py kernels/indexer/test_indexer.py kernels/moe_combine/test_moe_combine.py"
left() { local l=$(( DL - ($(date +%s) - T0) - 10 )); [ "$1" -lt "$l" ] && l=$1; [ "$l" -lt 1 ] && l=1; echo $l; }
for WHAT in $WHATS; do
if [ "$WHAT" = train ]; then
  # A: side by side on the one GPU (host-bound 4K steps overlap); B: the HF peers at 4K
  for p in ${PRECS:-bf16 fp8_block fp4_qat}; do
    run "curve_$p" $(left ${TA:-330}) "$D train --recipe $R --steps $N --precision $p $E --out $SHIM/run_curve_$p --no-final-checkpoint --json" &
  done
  # CG=1: a 100-step bf16 curve through CUDA graphs (`--cuda-graphs`): the stored 100-step proxy_curve's schedule
  [ "${CG:-0}" = 1 ] && run curve_bf16_cg $(left ${TA:-330}) "$D train --recipe $R --steps ${CGN:-100} --precision bf16 --cuda-graphs $E --out $SHIM/run_curve_bf16_cg --no-final-checkpoint --json" &
  # the 64K stage (6 steps: fewer than long-proxy's warm-up, so the cosine schedule; its WSD decay starts at 65)
  [ "${LONG:-1}" = 1 ] && run train64k ${TA:-330} "$D train --recipe $RL $E --out $SHIM/run_train64k --no-final-checkpoint --json" &
  wait
  [ "${PEERS:-1}" = 1 ] && run bench_peers $(left ${TB:-150}) "$BT $SM --tokens $T4 --batch 2 --impls ours,hf_eager,hf_compile --append --out $OUT/bench_train.json"
  for r in curve_bf16 curve_fp8_block curve_fp4_qat curve_bf16_cg train64k; do keep $r; done
elif [ "$WHAT" = more ]; then
  run compile_train ${TA:-300} "$D train --recipe $R --steps 12 --compile $E --out $SHIM/run_compile_train --no-final-checkpoint --json" &
  run packed_train ${TA:-300} "$D train --recipe $R --steps 4 --packing $E --out $SHIM/run_packed_train --no-final-checkpoint --json" &
  wait
  for r in compile_train packed_train; do keep $r; done
elif [ "$WHAT" = speed ]; then
  T16=$(( T4 * 4 ))
  for st in ${SPEED:-train20 bench_ours bench_hf_eager bench_ours_cudagraph bench_hf_compile bench_packed bench_long}; do
  case $st in
    warm)    run warm $(left 260) "$BT $SM --steps 1 --warmup 1 --tokens $T4,$T16 --batch 2 --impls ours --out $OUT/warm.json" ;;
    train20) run train20 $(left 120) "$D train --recipe $R --steps 20 $E --out $SHIM/run_train20 --no-final-checkpoint --json"
             keep train20 ;;
    bench_ours|bench_hf_eager) run $st $(left ${TR:-170}) "$BT $SM --tokens ${TOKS:-$T4,$T16} --batch 2 --impls ${st#bench_} --profile --append --out $OUT/bench_train.json" ;;
    bench_ours_cudagraph) run $st $(left ${TRG:-260}) "$BT $SM --warmup 3 --tokens ${TOKSG:-$T4,$T16} --batch 2 --impls ours_cudagraph --profile --append --out $OUT/bench_train.json" ;;
    gpu_tests) [ "$S" = 1 ] || run $st $(left ${TT:-240}) "python3 -m pytest -q -rs -p no:cacheprovider ${TESTS:-$GPU_TESTS}" ;;
    window_split) [ "$S" = 1 ] || run $st $(left ${TW:-240}) "OUT=$OUT $PY harness/device/window_bwd_split.py ab" ;;
    bench_head_ce) run $st $(left ${TR:-170}) "$BT $SM --tokens ${TOKS:-$T4,$T16} --batch 2 --impls ours --head-ce recompute,grad_in_forward --append --out $OUT/bench_train.json" ;;
    bench_all_picked) run $st $(left ${TR:-170}) "$BT $SM --tokens ${TOKS:-$T4} --batch 2 --impls ours --all-picked contiguous,listed --append --out $OUT/bench_train.json" ;;
    bench_out_rope) run $st $(left ${TR:-170}) "$BT $SM --tokens ${TOKS:-$T4,$T16} --batch 2 --impls ours --out-rope fused,separate --append --out $OUT/bench_train.json" ;;
    bench_packed) run $st $(left ${TR:-170}) "$BT $SM --tokens $T16 --batch 2 --impls ours_packed --profile --append --out $OUT/bench_train.json" ;;
    bench_packed_graph) run $st $(left ${TR:-170}) "$BT $SM --tokens $T16 --batch 2 --impls ours_packed,ours_packed_graph --profile --append --out $OUT/bench_train.json" ;;
    bench_long) run $st $(left ${TL:-150}) "$BT $SM --steps 3 --warmup 1 --tokens $(( T16 * 4 )),$(( T16 * 8 )) --batch 1 --impls ${LONGIMPLS:-ours} ${LONGARGS---recompute-from 131072} --profile --append --out $OUT/bench_train.json" ;;
    bench_*) run $st $(left 240) "$BT $SM --tokens $T4 --batch 2 --impls ${st#bench_} --profile --append --out $OUT/bench_train.json" ;;
  esac; done
fi
done
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.used --format=csv >> "$OUT/env.txt"
rm -rf "$SHIM"
cat "$OUT/summary.txt"
tar czf "$FINAL/results.tgz" -C "$OUT" . && cp "$OUT/summary.txt" "$FINAL/summary.txt"
dsv4_pack_autotune "$FINAL"
[ "${CACHES:-0}" = 1 ] && tar czf "$FINAL/caches.tgz" -C .dcache . && ls -la "$FINAL"
