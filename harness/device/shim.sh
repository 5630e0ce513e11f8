# Sourced by the device scripts (run from the repo root): `dsv4_shim DIR` makes DIR/dsv4 the checkout as the `dsv4`
# package without installing it (the device copy is not pip-installed): dsv4.{model,kernels,harness,slices} -> the
# folders, dsv4/__init__.py = harness/_root/__init__.py. The caller puts DIR on PYTHONPATH.
dsv4_shim() {
  mkdir -p "$1/dsv4"
  cp harness/_root/__init__.py "$1/dsv4/__init__.py"
  for d in model kernels harness slices; do ln -sfn "$PWD/$d" "$1/dsv4/$d"; done
}
