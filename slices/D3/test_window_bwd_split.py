"""The split window backward prototype (harness/device/window_bwd_split.py, not used by the model: its GPU A/B is
pending) keeps matching naive and the kernel as it is: a dq pass (one query a program) and a key-centric dKV pass
(no atomics), fp32 on Triton's interpreter, packed documents with padding, H 2, 3 and 16, a window longer than a
document. On a GPU host its `ab` mode checks it instead (bf16, against the kernel as it is)."""
import importlib.util
from pathlib import Path

from dsv4.kernels._testing import CUDA, use_interpreter

use_interpreter()

import pytest  # noqa: E402

pytest.importorskip("triton")


@pytest.mark.skipif(CUDA, reason="CPU tensors on the interpreter; on a GPU host run the script's `ab` mode")
def test_split_window_backward_matches_naive():
    path = Path(__file__).resolve().parents[2] / "harness" / "device" / "window_bwd_split.py"
    spec = importlib.util.spec_from_file_location("window_bwd_split", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.check()          # raises on any mismatch (dq / dkv vs naive autograd and vs the kernel as it is)
