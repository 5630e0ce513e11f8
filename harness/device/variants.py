"""`module_variant`: a kernel module re-built from edited source (an A/B of one change, its own Triton autotuner and
cache entries), for the device scripts' A/Bs (sparse_bwd_parts.py, sparse_bwd_dkt_ab.py). Never used by the model."""
import importlib
from pathlib import Path
from types import ModuleType


def module_variant(base: ModuleType, src: str, tag: str) -> ModuleType:
    """Import `src` as a sibling module of `base` named `_<tag>` (so its relative imports resolve), then delete the
    file: Triton keeps the kernels' source once they are defined, and no file is left behind in the checkout."""
    p = Path(base.__file__).with_name(f"_{tag}.py")
    p.write_text(src)
    try:
        return importlib.import_module(f"{base.__package__}._{tag}")
    finally:
        p.unlink()
