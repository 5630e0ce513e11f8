"""The key-major CSA-picks backward prototype (harness/device/sparse_bwd_keymajor.py, not used by the model: its GPU
A/B is pending) keeps matching naive and the kernel as it is: fp32 on Triton's interpreter, packed documents, -1 and
invisible picks, H 3 and 16. On a GPU host its `ab` mode checks it instead (bf16, against the kernel as it is)."""
import importlib.util
from pathlib import Path

from dsv4.kernels._testing import CUDA, use_interpreter

use_interpreter()

import pytest  # noqa: E402

pytest.importorskip("triton")


@pytest.mark.skipif(CUDA, reason="CPU tensors on the interpreter; on a GPU host run the script's `ab` mode")
def test_keymajor_picks_backward_matches_naive():
    path = Path(__file__).resolve().parents[2] / "harness" / "device" / "sparse_bwd_keymajor.py"
    spec = importlib.util.spec_from_file_location("sparse_bwd_keymajor", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.check()          # raises on any mismatch (dq / dkv / dcomp vs naive autograd and vs the kernel as it is)
