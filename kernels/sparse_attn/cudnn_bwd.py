"""cuDNN's SM90 DSA sparse-attention backward as the optional backward of backend "triton+flashmla+cudnn" (issue 14).

The pair: deepseek-ai/FlashMLA's sparse prefill forward (flashmla.py) and NVIDIA cudnn-frontend's DSA backward, both on
the same packed varlen index mapping (flashmla.py's module docstring: one key tensor kv_all = key stream rows then
compressed entries, per query a row of global indices, -1 = none). The forward saves FlashMLA's own lse (natural log,
sink NOT included: "KV-only"), which is exactly what cuDNN's backward reads. Nothing of cuDNN is in this repo: the
wheel `nvidia-cudnn-frontend` (1.32.0, with `nvidia-cutlass-dsl[cu13]` and `apache-tvm-ffi`) is installed at run
time (harness/device/cudnn_h200.sh); any call that cannot use it runs backend "triton+flashmla" (then "triton").

cuDNN's contract (cudnn-frontend 1.32.0; python/cudnn/deepseek_sparse_attention/sparse_attention_backward/
_interface_sm90.py `flash_attn_bwd_sm90` docstring, api.py `sparse_attention_backward_wrapper`):
  * wrapper(q [S_q,H,D], kv [S_kv,D] (K = V, one KV head), out [S_q,H,D_v], dout, lse [S_q,H] fp32 "KV-only LSE",
    attn_sink [H] fp32, topk_idxs [S_q,K] int32 global kv rows, softmax_scale, topk_length [S_q] int32 | None)
    -> {"dq" [S_q,H,D] q.dtype, "dkv" [S_kv,D] kv.dtype, "d_sink" [H] fp32}
  * bf16 / fp16, D in {512, 576}, D_v = 512, H > 1; SM90 (this file) or SM100
  * "Entries outside [0, S_kv) are ignored in both compact and non-compact modes"; we pass topk_length = None
    (every slot visited): its training adapter (training.py `_normalize_cudnn_sparse_metadata`) says the length
    form assumes a compact valid prefix, and our rows hold -1 inside the prefix (window columns of other documents)
  * dKV: fp32 atomics into a workspace, then a cast (non-deterministic on SM90, as our Triton backward's dcomp);
    first call per (dtype, D, H, K) JIT-compiles its CuTe DSL kernels (seconds), later calls hit its cache.
"""
from __future__ import annotations

import torch

from . import flashmla as FM

_LOADED: dict = {}


def _import():
    try:
        from cudnn.deepseek_sparse_attention.sparse_attention_backward.api import sparse_attention_backward_wrapper
    except Exception as e:  # noqa: BLE001 - any import failure is a reason to fall back
        return None, (f"cudnn-frontend's DSA backward not importable ({type(e).__name__}: {str(e)[:160]}); install "
                      "nvidia-cudnn-frontend (harness/device/cudnn_h200.sh)")
    return sparse_attention_backward_wrapper, None


def load():
    """(cudnn's sparse_attention_backward_wrapper, None), or (None, one line saying why not); once per process."""
    if "fn" not in _LOADED:
        _LOADED["fn"] = _import()
    return _LOADED["fn"]


def prepare() -> None:
    """Import now (`kernels.get_op` resolving the backend), so a torch.compile trace reads memos only."""
    load()
    FM.prepare()


def unqualified(q, kv, comp, fwd_fn, bwd_fn, cap) -> str | None:
    """None when FlashMLA's forward and cuDNN's backward can both run this call, else one line why not."""
    why = FM.unqualified(q, kv, comp, fwd_fn, cap)
    if why is not None:
        return why
    if bwd_fn is None:
        return "cudnn-frontend's DSA backward not importable"
    return None


def backward(bwd_fn, q, kv_all, o, do, lse_fm, sink, ix, scale: float):
    """cuDNN's backward on the forward's record -> (dq [Tq,H,c], dkv_all [Tk+N, c], dsink [H] fp32).
    kv_all [Tk+N, c] (flashmla.kv_all without the head axis), ix [Tq, K] int32, lse_fm [Tq, H] FlashMLA's lse."""
    r = bwd_fn(q.contiguous(), kv_all.contiguous(), o.contiguous(), do.contiguous(), lse_fm.contiguous(),
               sink.float().contiguous(), ix.contiguous(), softmax_scale=float(scale), topk_length=None)
    return r["dq"], r["dkv"], r["d_sink"]
