"""The device prototypes of the sparse-attention backward (not used by the model; their GPU A/Bs decide) keep
matching naive autograd and the kernel as it is, fp32 on Triton's interpreter:
  harness/device/sparse_bwd_keymajor.py  the CSA picks' backward with the keys as M (packed documents, -1 and
                                         invisible picks, H 3 and 16): dq / dkv / dcomp;
  harness/device/window_bwd_split.py     the window backward as a dq pass + a key-centric dKV pass without atomics
                                         (packed documents with padding, H 2, 3 and 16, a window longer than a
                                         document, one and two queries a dq program): dq / dkv.
On a GPU host each script's `ab` mode checks it instead (bf16, against the kernel as it is)."""
import importlib.util
from pathlib import Path

from dsv4.kernels._testing import CUDA, use_interpreter

use_interpreter()

import pytest  # noqa: E402

pytest.importorskip("triton")


@pytest.mark.skipif(CUDA, reason="CPU tensors on the interpreter; on a GPU host run the script's `ab` mode")
@pytest.mark.parametrize("script", ["sparse_bwd_keymajor", "window_bwd_split"])
def test_prototype_backward_matches_naive(script):
    path = Path(__file__).resolve().parents[2] / "harness" / "device" / f"{script}.py"
    spec = importlib.util.spec_from_file_location(script, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.check()          # raises on any mismatch against naive autograd and against the kernel as it is
