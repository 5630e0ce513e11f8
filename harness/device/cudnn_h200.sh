#!/usr/bin/env bash
# NVIDIA cudnn-frontend's DSA backward on the H200, for backend "triton+flashmla+cudnn" (kernels/sparse_attn/cudnn_bwd.py,
# issue 14), and its SM90 indexer forward for the indexer's backend "triton+cudnn" (kernels/indexer/cudnn_fwd.py; the
# same wheels). Nothing of it is committed: its wheels travel in ignored folders, carried into device calls.
# The packages: nvidia-cudnn-frontend 1.32.0 (CuTe DSL kernels), nvidia-cutlass-dsl 4.8.1 with its libs-core / -base /
# -cu13 (the cu13 one holds the 193 MB MLIR library: 92 MB as a wheel, 61 MiB as xz), apache-tvm-ffi. One call carries
# 64 MiB with the repo, so they travel in two calls to the same warm machine:
#
#   bash harness/device/cudnn_h200.sh pack        # here: .cudnn1/ (the first 40 MiB of cu13.tar.xz) and .cudnn2/ (the
#                                                 # rest + the other wheels); pip download needs PyPI
#   bash harness/device/cudnn_h200.sh stage       # the H200, call 1 (carry .cudnn1): part 1 -> /tmp/cudnn_stage
#   bash harness/device/cudnn_h200.sh install     # the H200, call 2 on the same machine (carry .cudnn2): joins the
#                                                 # parts, installs into python3's site-packages, imports it
set -euo pipefail
what=${1:-install}
case $what in
pack)
  py=${PY:-python3}
  d=$(mktemp -d); trap 'rm -rf "$d"' EXIT
  plat="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64"
  $py -m pip download -q --no-deps $plat -d "$d" nvidia-cudnn-frontend==1.32.0 nvidia-cutlass-dsl==4.8.1 \
    nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 \
    apache-tvm-ffi==0.1.15.post2
  mkdir -p "$d/cu13" && (cd "$d/cu13" && unzip -q "$d"/nvidia_cutlass_dsl_libs_cu13-*.whl)
  tar cf - -C "$d/cu13" . | xz -9 -T2 > "$d/cu13.tar.xz"
  rm -rf .cudnn1 .cudnn2 && mkdir -p .cudnn1 .cudnn2
  split -b 40M -d "$d/cu13.tar.xz" "$d/cu13.tar.xz.part"
  mv "$d/cu13.tar.xz.part00" .cudnn1/ && mv "$d"/cu13.tar.xz.part0[1-9] .cudnn2/
  find "$d" -maxdepth 1 -name '*.whl' ! -name 'nvidia_cutlass_dsl_libs_cu13-*' -exec mv {} .cudnn2/ \;
  (cd "$d" && sha256sum cu13.tar.xz) > .cudnn2/cu13.tar.xz.sha256
  du -sh .cudnn1 .cudnn2; ls -la .cudnn1 .cudnn2 ;;
stage)
  mkdir -p /tmp/cudnn_stage && cp .cudnn1/cu13.tar.xz.part00 /tmp/cudnn_stage/ && ls -la /tmp/cudnn_stage ;;
install)
  p0=/tmp/cudnn_stage/cu13.tar.xz.part00; [ -f "$p0" ] || p0=.cudnn1/cu13.tar.xz.part00
  [ -f "$p0" ] || { echo "cudnn_h200.sh: part 1 missing (the machine went back since 'stage'?)" >&2; exit 2; }
  cat "$p0" .cudnn2/cu13.tar.xz.part0[1-9] > /tmp/cu13.tar.xz
  (cd /tmp && sed 's#  .*#  cu13.tar.xz#' "$OLDPWD/.cudnn2/cu13.tar.xz.sha256" | sha256sum -c -)
  sp=$(python3 -c 'import site; print(site.getsitepackages()[0])')
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .cudnn2/*.whl
  tar xJf /tmp/cu13.tar.xz -C "$sp"
  python3 -c 'import cudnn, cutlass; from cudnn.deepseek_sparse_attention.sparse_attention_backward.api import sparse_attention_backward_wrapper; from cudnn.deepseek_sparse_attention.indexer_forward import indexer_forward_wrapper; print("cudnn-frontend", cudnn.__version__, "cutlass-dsl ok")' ;;
*) echo "cudnn_h200.sh: unknown step '$what' (pack | stage | install)" >&2; exit 2 ;;
esac
