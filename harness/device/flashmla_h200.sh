#!/usr/bin/env bash
# FlashMLA's SM90 sparse prefill forward as a peer of our sparse attention (issue 14; harness/flashmla_peer.py).
# Nothing of FlashMLA is committed: its source travels as an archive in .flashmla/ (ignored by git, carried into a
# device call with carry=[".flashmla"]), is built on the H200 (nvcc is there, no internet) outside the repo, and the
# built package comes back once, to be carried into later calls instead of rebuilding.
#
#   bash harness/device/flashmla_h200.sh pack FLASHMLA_GIT_DIR CUTLASS_GIT_DIR   # here: .flashmla/flashmla_src.tgz
#        (git dirs as `fetch` leaves them, /work/.mirror/<owner>+<name>/repo; cutlass at FlashMLA's submodule commit)
#   OUT=... bash harness/device/flashmla_h200.sh build     # the H200, one call: $OUT/flashmla_sm90.tgz, build log,
#        flashmla_smoke.json (FlashMLA vs the gathered attention of our mapping at H 64, c 512); TB= build limit (s)
#   bash harness/device/flashmla_h200.sh use               # unpack .flashmla/flashmla_sm90.tgz into .flashmla/pkg;
#        then PYTHONPATH=$PWD/.flashmla/pkg:... makes `dsv4 bench kernels --only sparse_attn` time it (H = 64 rows)
set -euo pipefail
what=${1:-build}
mkdir -p .flashmla
case $what in
pack)
  fm=$2; cu=$3
  sha=$(git -C "$fm" rev-parse HEAD)
  cut=$(git -C "$fm" ls-tree HEAD csrc/cutlass | awk '{print $3}')
  tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
  git -C "$fm" archive HEAD | tar x -C "$tmp"
  mkdir -p "$tmp/csrc/cutlass"
  git -C "$cu" archive "$cut" include tools/util/include | tar x -C "$tmp/csrc/cutlass"
  tar czf .flashmla/flashmla_src.tgz.tmp -C "$tmp" . && mv .flashmla/flashmla_src.tgz.tmp .flashmla/flashmla_src.tgz
  printf 'FlashMLA %s\ncutlass %s (include, tools/util/include)\npacked %s\n' "$sha" "$cut" "$(date -u +%FT%TZ)" \
    > .flashmla/SOURCE.txt
  cat .flashmla/SOURCE.txt; ls -la .flashmla/flashmla_src.tgz ;;
build)
  OUT=${OUT:?OUT= the results dir}; mkdir -p "$OUT"
  [ -f .flashmla/flashmla_src.tgz ] || { echo "flashmla_h200.sh: .flashmla/flashmla_src.tgz missing (run pack, carry .flashmla)" >&2; exit 2; }
  b=$(mktemp -d /tmp/flashmla.XXXXXX)
  tar xzf .flashmla/flashmla_src.tgz -C "$b"
  cp .flashmla/SOURCE.txt "$OUT/flashmla_SOURCE.txt" 2>/dev/null || true
  log="$OUT/flashmla_build.log"
  { nvcc --version || "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" --version; python3 -c "import torch; print(torch.__version__)"; } > "$log" 2>&1 || true
  # CUDA 13 keeps libcu++ (cuda/std/...) under include/cccl: nvcc finds it, the g++ of api.cpp does not
  cccl="${CUDA_HOME:-/usr/local/cuda}/include/cccl"
  [ -d "$cccl" ] && export CPLUS_INCLUDE_PATH="$cccl${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}"
  s=$(date +%s)
  # SM90 only (FlashMLA's documented switch; its SM100 kernels compile to empty stubs); ptxas -v output is long:
  # the log keeps its last 4 MB
  ( cd "$b" && FLASH_MLA_DISABLE_SM100=1 MAX_JOBS=${MAX_JOBS:-16} NVCC_THREADS=${NVCC_THREADS:-2} \
      timeout "${TB:-500}" python3 setup.py build_ext --inplace ) > "$b/build.log" 2>&1 && rc=0 || rc=$?
  tail -c 4000000 "$b/build.log" >> "$log"
  echo "build rc=$rc $(( $(date +%s) - s ))s" | tee -a "$log"
  [ "$rc" = 0 ] || exit 1
  so=$(ls "$b"/flash_mla/cuda*.so)
  strip --strip-debug "$so" || true
  mkdir -p "$b/pkg" && cp -r "$b/flash_mla" "$b/pkg/"
  tar czf "$OUT/flashmla_sm90.tgz" -C "$b/pkg" flash_mla
  ls -la "$so" "$OUT/flashmla_sm90.tgz" | tee -a "$log"
  shim=$(mktemp -d); . harness/device/shim.sh && dsv4_shim "$shim"                                  # dsv4.* = the checkout
  PYTHONPATH="$b/pkg:$shim${PYTHONPATH:+:$PYTHONPATH}" python3 - "$OUT/flashmla_smoke.json" <<'EOF' 2>&1 | tail -5 | tee -a "$log"
import json, sys, torch
from dsv4.harness import flashmla_peer as FM
fn, why = FM.load()
assert fn is not None, why
g = torch.Generator(device="cuda").manual_seed(0)
S, H, c, N, k, W = 1024, 64, 512, 256, 128, 128
q = torch.randn(S, H, c, device="cuda", generator=g).bfloat16()
kv = torch.randn(S, c, device="cuda", generator=g).bfloat16()
comp = torch.randn(N, c, device="cuda", generator=g).bfloat16()
sink = torch.randn(H, device="cuda", generator=g)
idx = torch.stack([torch.randperm(N, device="cuda", generator=g)[:k] for _ in range(S)])
ix, kva = FM.indices(S, W, 4, idx, N, "cuda"), FM.kv_all(kv, comp)
theirs = fn(q, kva, ix, c ** -0.5, c, sink)[0].float()
ref = FM.gathered_attention(q.float(), kva.float(), ix, sink, c ** -0.5)
res = {"S": S, "H": H, "c": c, "slots": ix.shape[-1], "max_abs_diff_vs_fp32_gather": (theirs - ref).abs().max().item(),
       "out_max_abs": ref.abs().max().item()}
json.dump(res, open(sys.argv[1], "w"), indent=1)
print(res)
EOF
  ;;
use)
  [ -f .flashmla/flashmla_sm90.tgz ] || { echo "flashmla_h200.sh: .flashmla/flashmla_sm90.tgz missing (copy a build call's)" >&2; exit 2; }
  rm -rf .flashmla/pkg && mkdir -p .flashmla/pkg && tar xzf .flashmla/flashmla_sm90.tgz -C .flashmla/pkg
  echo "PYTHONPATH=$PWD/.flashmla/pkg" ;;
*) echo "flashmla_h200.sh: pack | build | use, got '$what'" >&2; exit 2 ;;
esac
