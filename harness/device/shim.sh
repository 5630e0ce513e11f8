# Sourced by the device scripts (run from the repo root): `dsv4_shim DIR` makes DIR/dsv4 the checkout as the `dsv4`
# package without installing it (the device copy is not pip-installed): dsv4.{model,kernels,harness,slices} -> the
# folders, dsv4/__init__.py = harness/_root/__init__.py. The caller puts DIR on PYTHONPATH.
dsv4_shim() {
  mkdir -p "$1/dsv4"
  cp harness/_root/__init__.py "$1/dsv4/__init__.py"
  for d in model kernels harness slices; do ln -sfn "$PWD/$d" "$1/dsv4/$d"; done
}

# `dsv4_caches`: Triton's kernels, its autotuning choices (TRITON_CACHE_AUTOTUNING=1: `<kernel>.autotune.json`, keyed
# by triton, the sm_90 target, the kernel's source, the configs and the tuning key, so one file serves the H100 and
# the H200) and Inductor's graphs go to .dcache/. A fresh machine spent 170 s in the first 4K step at c7824ba, most
# of it compiling and timing every autotune config. `dsv4_pack_autotune DIR` writes DIR/autotune.tgz with the
# choices alone (a few kB; the compiled kernels are tens of MB): unpack it into .dcache/triton here and carry
# `.dcache` in the next call, so that only the chosen configs compile there.
dsv4_caches() {
  mkdir -p .dcache/triton .dcache/inductor
  export TRITON_CACHE_DIR=$PWD/.dcache/triton TORCHINDUCTOR_CACHE_DIR=$PWD/.dcache/inductor TRITON_CACHE_AUTOTUNING=1
}
dsv4_pack_autotune() {
  local dst; dst=$(cd "$1" && pwd) || return 1                     # absolute: the tar runs inside .dcache/triton
  (cd .dcache/triton && find . -name '*.autotune.json' -print0 | tar czf "$dst/autotune.tgz" --null -T -) &&
    echo "autotune.tgz: $(tar tzf "$dst/autotune.tgz" | wc -l) choices"
}
