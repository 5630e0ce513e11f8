"""Kernel ops, one folder per op: `naive.py` (plain PyTorch, the reference and the CPU fallback), `triton.py`
(the Triton kernels and their launch code) and `op.py` (the Triton kernels registered as `torch.library`
custom ops `dsv4::*`, with fake implementations and autograd, so `torch.compile` sees one opaque node; eager calls
run the same bodies through one `autograd.Function`, skipping the dispatcher: `_custom_op.py`).

The one dispatch mechanism: `get_op(name, backend, device)` returns op `name`'s implementation for `backend`
("naive" | "triton") from the table `OPS`, after a capability check that raises `KernelUnavailable` with one
line naming what is missing. `kernels/<op>/__init__.py` (the functions model/ calls, with `backend=`) are thin
calls of `get_op`. Triton is imported only when the "triton" backend is first asked for.

One op has a third, optional backend: `sparse_attn` "triton+flashmla" = FlashMLA's SM90 sparse prefill forward
(deepseek-ai/FlashMLA, imported at run time when installed, never vendored) + our Triton backward, falling back
to the Triton forward when flash_mla is missing or the call does not qualify (kernels/sparse_attn/flashmla.py).
A fourth, "triton+flashmla+cudnn", pairs FlashMLA's forward with NVIDIA cudnn-frontend's SM90 DSA backward
(kernels/sparse_attn/cudnn_bwd.py; installed at run time, never vendored), falling back to "triton+flashmla".
Both are chosen per attention layer (`DSv4Model.set_attn_fwd("flashmla" | "flashmla+cudnn")`), never by
`set_kernel_backend`.
Op `indexer_scores` has one too: "triton+cudnn" = NVIDIA cudnn-frontend's SM90 DSA indexer forward (bf16 or FP8 E4M3)
+ our Triton backward, falling back to "triton" (kernels/indexer/cudnn_fwd.py); chosen per indexer
(`DSv4Model.set_indexer_fwd("cudnn")`); the top-k stays ours.

Which Triton config / precision a launch uses is decided at call time from the tensors' device (CPU tensors
run on Triton's interpreter: small blocks, exact fp32 products; `_triton_util.on_cpu`), never at import time.
"""
from __future__ import annotations

import importlib
import importlib.util

BACKENDS = ("naive", "triton")

# op -> backend -> "module:function" (under dsv4.kernels). Ops without a Triton kernel name their reference
# (or a plain-PyTorch variant) under "triton" explicitly: mhc's sinkhorn.
OPS: dict[str, dict[str, str]] = {
    "sparse_attn": {"naive": "sparse_attn.naive:sparse_attn", "triton": "sparse_attn.op:sparse_attn",
                    "triton+flashmla": "sparse_attn.op:sparse_attn_flashmla",
                    "triton+flashmla+cudnn": "sparse_attn.op:sparse_attn_flashmla_cudnn"},
    "sparse_attn_entry_probs": {"naive": "sparse_attn.naive:entry_probs", "triton": "sparse_attn.op:entry_probs"},
    "compress_pool": {"naive": "compressor.naive:compress_pool", "triton": "compressor.op:compress_pool"},
    "compress_slots": {"naive": "compressor.naive:compress_slots", "triton": "compressor.op:compress_slots"},
    "indexer_scores": {"naive": "indexer.naive:indexer_scores", "triton": "indexer.op:indexer_scores",
                       "triton+cudnn": "indexer.op:indexer_scores_cudnn"},
    "indexer_scores_listed": {"naive": "indexer.naive:indexer_scores_listed", "triton": "indexer.op:indexer_scores_listed"},
    "indexer_topk": {"naive": "indexer.naive:indexer_topk", "triton": "indexer.op:indexer_topk"},
    "sinkhorn": {"naive": "mhc.naive:sinkhorn", "triton": "mhc.naive:sinkhorn"},
    "hc_pre": {"naive": "mhc.naive:hc_pre", "triton": "mhc.op:hc_pre"},
    "hc_pre_residual": {"naive": "mhc.naive:hc_pre_residual", "triton": "mhc.op:hc_pre_residual"},
    "hc_post": {"naive": "mhc.naive:hc_post", "triton": "mhc.op:hc_post"},
    "hc_head": {"naive": "mhc.naive:hc_head", "triton": "mhc.op:hc_head"},
    "clamped_swiglu": {"naive": "swiglu.naive:clamped_swiglu", "triton": "swiglu.op:clamped_swiglu"},
    "clamped_swiglu_packed": {"naive": "swiglu.naive:clamped_swiglu_packed",
                              "triton": "swiglu.op:clamped_swiglu_packed"},
    "fp8_quantize": {"naive": "quant.naive:fp8_quantize", "triton": "quant.op:fp8_quantize"},
    "rms_norm": {"naive": "rmsnorm.naive:rms_norm", "triton": "rmsnorm.op:rms_norm"},
    "rope_rows": {"naive": "rope.naive:rope_rows", "triton": "rope.op:rope_rows"},
    "norm_rope_rows": {"naive": "norm_rope.naive:norm_rope_rows", "triton": "norm_rope.op:norm_rope_rows"},
    "moe_combine": {"naive": "moe_combine.naive:moe_combine", "triton": "moe_combine.op:moe_combine"},
    "ce_lse": {"naive": "cross_entropy.naive:ce_lse", "triton": "cross_entropy.op:ce_lse"},
    "ce_dlogits": {"naive": "cross_entropy.naive:ce_dlogits", "triton": "cross_entropy.op:ce_dlogits"},
}


class KernelUnavailable(RuntimeError):
    """A kernel backend cannot run here; the message is one line naming what is missing."""


_RESOLVED: dict[tuple[str, str], object] = {}
_TRITON = {"on_cpu": False}         # whether the loaded Triton kernels run on Triton's CPU interpreter


def _resolve(name: str, backend: str):
    if name not in OPS:
        raise ValueError(f"kernels: unknown op {name!r}; known: {', '.join(OPS)}")
    if backend not in OPS[name]:
        raise ValueError(f"{name}: unknown backend {backend!r}; known: {', '.join(OPS[name])}")
    if backend.startswith("triton"):
        if importlib.util.find_spec("triton") is None:
            raise KernelUnavailable(f"{name}: backend '{backend}' needs the triton package (pip install triton)")
        from dsv4.kernels import _triton_util
        _TRITON["on_cpu"] = _triton_util.interpreted()
    mod, fn = OPS[name][backend].split(":")
    _RESOLVED[(name, backend)] = getattr(importlib.import_module(f"{__name__}.{mod}"), fn)
    if backend == "triton+flashmla":                 # flash_mla's import and the device's capability, now
        from dsv4.kernels.sparse_attn import flashmla
        flashmla.prepare()
    if backend == "triton+flashmla+cudnn":           # and cudnn-frontend's import
        from dsv4.kernels.sparse_attn import cudnn_bwd
        cudnn_bwd.prepare()
    if backend == "triton+cudnn":                    # cudnn-frontend's indexer forward import, the capability
        from dsv4.kernels.indexer import cudnn_fwd
        cudnn_fwd.prepare()
    return _RESOLVED[(name, backend)]


def check_device(name: str, backend: str, device) -> None:
    """Raise KernelUnavailable unless `backend` can run op `name` on tensors of `device`."""
    if backend.startswith("triton") and device is not None and device.type != "cuda" and not (
            device.type == "cpu" and _TRITON["on_cpu"]):
        raise KernelUnavailable(f"{name}: backend '{backend}' needs CUDA or TRITON_INTERPRET=1 "
                                f"(set before triton is imported); got {device.type} tensors")


def get_op(name: str, backend: str = "naive", device=None):
    """The implementation of op `name` for `backend`, checked to run on `device` (a torch.device or None)."""
    fn = _RESOLVED.get((name, backend))
    if fn is None:
        fn = _resolve(name, backend)
    check_device(name, backend, device)
    return fn


def prepare(backend: str, device=None) -> None:
    """Resolve every op of `backend` now (imports, capability checks), e.g. before `torch.compile` traces."""
    for name in OPS:
        get_op(name, backend, device)


for _name in OPS:                 # the references now, so that no import happens inside a torch.compile trace
    _resolve(_name, "naive")
