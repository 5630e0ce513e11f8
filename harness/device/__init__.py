"""Scripts for the lent GPU machine (run from the repo root with the shim of shim.sh on PYTHONPATH); `variants` is
their one shared helper."""
