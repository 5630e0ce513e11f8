"""cuDNN's SM90 DSA indexer forward as an optional forward of our indexer scoring (issue 14).

Backend "triton+cudnn" of op `indexer_scores` (kernels/__init__.py, kernels/indexer/op.py `indexer_scores_cudnn`):
the scores I [Tq, N] are NVIDIA cudnn-frontend's `indexer_forward_wrapper` (bf16, or FP8 E4M3 with per-token fp32
descales) when it is importable and the call qualifies (`unqualified` below), then our visibility mask; the
backward (the dense warm-up's KL path) is ours (Triton, `dsv4::indexer_scores_bwd`: it reads only the inputs); the
top-k is ours (`indexer_topk` on these scores). Any call that does not qualify runs the Triton forward (the
fallback), same result contract. Nothing of cuDNN is in this repo: the wheel `nvidia-cudnn-frontend` 1.32.0 (with
`nvidia-cutlass-dsl[cu13]`, `apache-tvm-ffi`) is installed at run time (harness/device/cudnn_h200.sh).

cuDNN's contract (cudnn-frontend 1.32.0, python/cudnn/deepseek_sparse_attention/indexer_forward/; file:line there):
  * indexer_forward_wrapper(q [B,S_q,H,D], k [B,S_k,H_kv,D], w [B,S_q,H], ratio, sm_scale, q_causal_offsets [B]
    int32 | None, precision "bf16" | "fp8", q_scale, k_scale) -> TupleDict(scores=[B,S_q,S_k] fp32)  api.py:211-304;
    on SM90 (device_major() == 9, api.py:262) it calls _interface_sm90.indexer_fwd (api.py:281); default tuning
    only (m/n block 128, q_stage 2, kv_stage 4, api.py:266-278); no autograd (a plain function; cuDNN's indexer
    backward is a separate API, indexer_backward/api.py, not used here)
  * score[b,i,j] = sm_scale * sum_h relu(q[b,i,h] . k[b,j,0]) * w[b,i,h]        indexer_fwd_sm90.py:10-12, 371-380
    -inf where j >= (q_causal_offsets[b] + i + 1) // ratio (offsets default 0) or j >= S_k
    (indexer_fwd_sm90.py:391-398, 250; out.fill_(-inf) first, _interface_sm90.py:272-273)
  * D == 128, H_kv == 1, H in (16, 32, 64) bf16 / (32, 64) fp8            _interface_sm90.py:33-34, 177-185
  * bf16: q, k bf16; w bf16 or fp32 (fp32 with unit last stride)           _interface_sm90.py:55-59, 70-73
  * fp8: q, k float8_e4m3fn, q_scale [B,S_q,H] and k_scale [B,S_k,H_kv] fp32 DESCALES (one per token and head),
    _interface_sm90.py:60-67, 168-175; q descale folded into W, k descale after the head sum
    (indexer_fwd_sm90.py:14-16, 401-402); with fp32 W "already pre-scaled by q_scale * sm_scale" the kernel uses W
    as given and never applies sm_scale (_interface_sm90.py:103-104; indexer_fwd_sm90.py:296-303, 379-380)
  * q_causal_offsets: int32 [B] CUDA, read on the device (runtime.py validate_q_causal_offsets:51-70)
  * first call per (dtype, w dtype, H, ratio, ...) JIT-compiles its CuTe DSL kernel (_interface_sm90.py:213-270)

The mapping (ours: I[t,n] = sum_h (w[t,h] nI^-1/2) relu(qI[t,h] . kI[n]) cI^-1/2, -inf unless visible:
naive.causal_entry_mask, same document and entry_j[n] < (pos_q[t]+1) // ratio):
    B = 1, S_q = Tq, S_k = N, H = nI, one kv head: q [1,Tq,nI,cI], k [1,N,1,cI]
    W = w * nI^-1/2 * cI^-1/2 in fp32 (fp8: also * q descale), sm_scale = 1: the scale is ours, in fp32, on both paths
    q_causal_offsets = [off], off = max(0, max_t(ratio * hi[t] - t - 1)) with hi[t] = 1 + the last entry visible to
        t (0: none): cuDNN's ratio-causal window (off + t + 1) // ratio >= hi[t] covers every visible entry of every
        query (computed on the device, no host sync), so cuDNN skips only entries no query sees; then our mask
        sets -inf wherever the entry is not visible (other documents, padding, empty slots, incomplete entries).
    Exact for any layout. Cost: cuDNN's causal triangle is one per stream, so a packed stream of several documents
    also scores the cross-document pairs below it (masked afterwards); one document per stream (entries in order):
    off = 0, its own causal triangle, nothing wasted.
    fp8 (precision "fp8" = the indexer's one FP8 setting, Indexer.qk_precision / recipe indexer_qk_precision,
        kernels/indexer/fp4.py): qI, kI are the rotated, fake-quantised features (qk_fake_quant: e4m3 values, one
        ue8m0 scale per row); `fp8_split` re-forms (e4m3, descale) from them, exactly (values on the grid, the
        scale a power of two), so cuDNN's FP8 scores equal ours on the same features up to the accumulation order.
"""
from __future__ import annotations

import torch

from dsv4.kernels.quant import triton as QT      # the fused FP8 quantiser (fp8_split on CUDA)
from dsv4.kernels.quant.naive import quantize
from dsv4.kernels.sparse_attn.flashmla import capability      # the device capability memo (one per device)

from . import naive

HEAD_DIM = 128                                        # _interface_sm90.py:178
HEADS = {"bf16": (16, 32, 64), "fp8": (32, 64)}       # _interface_sm90.py:33-34
ARCHS = ((9, 0),)                                     # SM90 (api.py:262); SM100 has its own kernels, untested here

_LOADED: dict = {}


def _import():
    try:
        from cudnn.deepseek_sparse_attention.indexer_forward import indexer_forward_wrapper
    except Exception as e:  # noqa: BLE001 - any import failure is a reason to fall back
        return None, (f"cudnn-frontend's DSA indexer forward not importable ({type(e).__name__}: {str(e)[:160]}); "
                      "install nvidia-cudnn-frontend (harness/device/cudnn_h200.sh)")
    return indexer_forward_wrapper, None


def load():
    """(cudnn's indexer_forward_wrapper, None), or (None, one line saying why not); imported once per process."""
    if "fn" not in _LOADED:
        _LOADED["fn"] = _import()
    return _LOADED["fn"]


def prepare() -> None:
    """Import now and read the device's capability (`kernels.get_op` resolving backend "triton+cudnn"), so that a
    torch.compile trace of the dispatch reads memos only."""
    load()
    if torch.cuda.is_available():
        capability(torch.empty(0, device="cuda"))


def unqualified(qI, kI, w, precision: str, fn, cap) -> str | None:
    """None when cuDNN's SM90 indexer forward can run this call, else one line saying why not (the call then runs
    the Triton forward). fn: the cuDNN function (None: not importable); cap: the device's (major, minor) | None."""
    Tq, nI, cI = qI.shape
    N = kI.shape[0]
    if precision not in HEADS:
        return f"precision must be one of {tuple(HEADS)}, got {precision!r}"
    if fn is None:
        return "cudnn-frontend's DSA indexer forward not importable"
    if cap is None or tuple(cap) not in ARCHS:
        return f"needs an SM90 GPU (cuDNN's SM90 indexer forward), got {'no CUDA device' if cap is None else cap}"
    if precision == "bf16" and {qI.dtype, kI.dtype} != {torch.bfloat16}:
        return f"bf16 needs bf16 qI / kI, got {sorted(str(d) for d in {qI.dtype, kI.dtype})}"
    if nI not in HEADS[precision]:
        return f"{precision} needs nI in {HEADS[precision]} heads, got {nI}"
    if cI != HEAD_DIM:
        return f"needs cI = {HEAD_DIM}, got {cI}"
    if Tq == 0 or N == 0:
        return "no queries or no entries"
    if Tq * N >= 2 ** 31:
        return "Tq * N >= 2^31 scores (int32 element offsets not assumed)"
    return None


def fp8_split(x: torch.Tensor, use_triton: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., c] (qk_fake_quant's "fp8" features: e4m3 values times one power-of-two scale per row) -> (e4m3
    [..., c] torch.float8_e4m3fn, descale [...] fp32) with e4m3 * descale == x exactly for such x (a general x is
    quantised: e4m3, ue8m0 scale per row, DeepSeek's rule). fp32 x with c = 128 (one row = one 1 x 128 tile) on
    CUDA (use_triton None) or use_triton=True: the fused Triton FP8 quantiser (kernels/quant/triton.py, the same
    bits as `quantize`; H200 at [16384, 64, 128]: 0.374 ms vs 3.585); otherwise `quantize`. bf16 x takes
    `quantize`: on the H200 the Triton quantiser's bits differed from it on a bf16 test row (not investigated)."""
    c = x.shape[-1]
    if (x.is_cuda if use_triton is None else use_triton) and c == QT.TILE and x.dtype == torch.float32:
        q, s = QT.fp8_quantize(x.detach().reshape(-1, c), "e4m3", (1, c), "ue8m0")   # [R, c] e4m3, [R, 1]
        return q.view(x.shape), s.view(x.shape[:-1])
    qt = quantize(x.detach(), "e4m3", (1, c), "ue8m0")
    return qt.fp8(), qt.scale[..., 0].float()


def causal_offset(mask: torch.Tensor, ratio: int) -> torch.Tensor:
    """mask [Tq, N] bool (visible) -> q_causal_offsets [1] int32: the least off >= 0 whose cuDNN window
    (off + t + 1) // ratio covers every visible entry of every query t (module docstring)."""
    Tq, N = mask.shape
    last = N - 1 - mask.flip(1).to(torch.uint8).argmax(1)                          # the last visible entry
    hi = torch.where(mask.any(1), last + 1, 0)                                     # [Tq]
    need = ratio * hi - torch.arange(1, Tq + 1, device=mask.device)
    return need.amax().clamp_min(0).to(torch.int32).reshape(1)


def forward(fn, qI, kI, w, ratio: int, seg_q, pos_q, entry_seg, entry_j, precision: str = "bf16") -> torch.Tensor:
    """cuDNN's indexer forward on our arguments -> I [Tq, N] fp32, -inf where not visible (naive.indexer_scores'
    contract). `fn` has indexer_forward_wrapper's signature and returns."""
    Tq, nI, cI = qI.shape
    mask = naive.causal_entry_mask(seg_q, pos_q, entry_seg, entry_j, ratio)         # [Tq, N]
    off = causal_offset(mask, ratio)
    wdt = torch.promote_types(w.dtype, torch.float32)                              # fp32 (fp64 stays: tests)
    wf = w.detach().to(wdt) * (nI ** -0.5 * cI ** -0.5)                            # [Tq, nI] our scale
    if precision == "fp8":
        q8, qs = fp8_split(qI)                                                      # [Tq,nI,cI] e4m3, [Tq,nI]
        k8, ks = fp8_split(kI)                                                      # [N,cI] e4m3, [N]
        r = fn(q8[None], k8[None, :, None], (wf * qs)[None].contiguous(), ratio=int(ratio), sm_scale=1.0,
               q_causal_offsets=off, precision="fp8", q_scale=qs[None].contiguous(), k_scale=ks[None, :, None])
    else:
        r = fn(qI.detach().contiguous()[None], kI.detach().contiguous()[None, :, None], wf[None].contiguous(),
               ratio=int(ratio), sm_scale=1.0, q_causal_offsets=off, precision="bf16")
    return r["scores"][0].masked_fill_(~mask, float("-inf"))
