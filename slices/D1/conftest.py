"""Select Triton's CPU interpreter (no GPU) before any test module of this folder imports transformers, which
imports triton: `TRITON_INTERPRET` is read when triton is first imported (see kernels/_testing.py)."""
from dsv4.kernels._testing import use_interpreter

use_interpreter()
