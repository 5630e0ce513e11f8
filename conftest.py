"""Root pytest configuration: on a machine without CUDA, select Triton's CPU interpreter before anything
(transformers included) imports triton -- TRITON_INTERPRET is read at triton's first import."""
from dsv4.kernels._testing import use_interpreter

use_interpreter()
