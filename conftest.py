"""Root pytest configuration: on a machine without CUDA, select Triton's CPU interpreter before anything
(transformers included) imports triton -- TRITON_INTERPRET is read at triton's first import -- then pin the CPU
numerics contract (harness/numerics.py: 1 intra-op thread, deterministic algorithms, fp32 matmuls in full
precision), the same settings `dsv4 verify` and `dsv4 goldens regen` run golden cases under."""
from dsv4.kernels._testing import use_interpreter

use_interpreter()

from dsv4.harness import numerics  # noqa: E402  (after the interpreter is selected)

numerics.apply()
