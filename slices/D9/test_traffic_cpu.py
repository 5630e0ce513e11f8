"""harness/train/traffic_cpu: the Triton-backend step walked on CPU with the kernels stubbed (analysis only)."""
from dsv4.kernels._testing import CUDA, use_interpreter

use_interpreter()

import pytest  # noqa: E402

pytest.importorskip("triton")


@pytest.mark.skipif(CUDA, reason="a CPU analysis; on a GPU profile_step --traffic counts the real step")
def test_census_of_the_debug_step_restores_the_launchers():
    """`census` on `debug` (2 x 32 tokens): rows on model/ lines in both phases, the grouped expert GEMM forced on,
    the SwiGLU's halves not copied (the packed op), the head's dW not zero-filled; after it Triton launches run
    again (a kernel computes)."""
    import torch
    import triton.runtime.jit as J

    from dsv4.harness.train.traffic_cpu import census
    from dsv4.kernels.swiglu import clamped_swiglu
    run = J.JITFunction.run
    r = census("debug", 64, 2, top=400)
    assert J.JITFunction.run is run
    srcs = {(x["phase"], x["source"].split(":")[0]) for x in r["rows"]}
    assert ("fwd", "model/attention.py") in srcs and ("bwd", "model/attention.py") in srcs
    assert any(x["op"] == "_grouped_mm" for x in r["rows"])
    assert not any(x["op"] == "clone" and "swiglu" in x["source"] for x in r["rows"])
    V, d = 256, 64                                                          # debug's head [V, d]
    assert not any(x["op"] == "zeros" and "model/model.py" in x["source"] and x["bytes"] >= V * d * 4
                   for x in r["rows"])
    assert r["total"] > 0 and r["kernels"] == "stubbed (CPU)"
    g = torch.tensor([1.0, 2.0])
    assert torch.equal(clamped_swiglu(g, g, None, backend="triton"), clamped_swiglu(g, g, None, backend="naive"))
