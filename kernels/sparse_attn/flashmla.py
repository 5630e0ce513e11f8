"""FlashMLA's SM90 sparse prefill forward as an optional forward of our sparse attention (issue 14).

Backend "triton+flashmla" of op `sparse_attn` (kernels/__init__.py, kernels/sparse_attn/op.py
`sparse_attn_flashmla`): the forward is deepseek-ai/FlashMLA's `flash_mla_sparse_fwd` when `flash_mla` is
importable and the call qualifies (`unqualified` below), the backward is ours (Triton, `dsv4::sparse_attn_bwd`,
unchanged: it reads the forward's o and our log2 log-sum-exp, which `lse_ours` forms from FlashMLA's); any call that
does not qualify runs the Triton forward (the fallback), with the same result contract. Nothing of FlashMLA is in
this repo: `flash_mla` is imported at run time (harness/device/flashmla_h200.sh builds it on the H200).

FlashMLA's contract (deepseek-ai/FlashMLA at 9241ae3; file:line there):
  * flash_mla_sparse_fwd(q [s_q,h_q,d_qk] bf16, kv [s_kv,h_kv,d_qk] bf16, indices [s_q,h_kv,topk] int32, sm_scale,
    d_v=512, attn_sink [h_q] fp32 | None, topk_length [s_q] int32 | None) -> (out [s_q,h_q,d_v] bf16,
    max_logits [s_q,h_q] fp32, lse [s_q,h_q] fp32)                     flash_mla/flash_mla_interface.py:176-211
  * V = the first d_v channels of the same kv rows; d_qk in {512, 576}, d_v == 512    csrc/api/sparse_fwd.h:131-132
  * h_q in {64, 128} (sparse_fwd.h:192-198), h_kv == 1 and topk % 128 == 0, topk > 0
    (csrc/sm90/prefill/sparse/phase1.cuh:576-579; 128 = 2 * B_TOPK, config.h:27); SM90a or SM100f (sparse_fwd.h:115)
  * an index is a key iff 0 <= idx < s_kv (phase1.cuh:485; -1 = none), and with topk_length only the first
    topk_length[i] slots count (phase1.cuh:486-488; blocks past it are not computed, phase1.cuh:80-81)
  * lse: NATURAL log (logf(rL) + rM * ln2, phase1.cuh:449), WITHOUT the sink ("This argument has no effect on lse",
    flash_mla_interface.py:197), +inf for a query with no valid key (phase1.cuh:449; tests/ref.py:50-51)
  * out = Σ exp(l - m) V / (Σ exp(l - m) + exp(sink - m)), 0 for a query with no valid key whatever the sink
    (phase1.cuh:205-208) -- our one softmax over keys + sink (naive.py), padding queries 0 as ours.

The mapping (generalising harness/flashmla_peer.py's one-document one to the packed varlen stream):
    kv_all  [Tk + N, 1, c]  the key stream rows 0..Tk-1 (halo included), then the N compressed entries
    indices [Tq, 1, K]      per query t (key row u = q_offset + t): the W window columns u-W+1..u (-1 where not a
                            window key of u: other document, padding, below row 0, outside the position window),
                            then the entry columns Tk + n: CSA the listed entries comp_idx[t] that are visible,
                            HCA the entry slots elo[t] .. elo[t]+N-1 (kernels/_varlen.entry_ranges) that are
                            visible -- same document as u and complete (entry_j < (pos[u]+1) // ratio) --, -1
                            elsewhere; then -1 up to a multiple of 128 (K = 128 * ceil((W + k or N) / 128))
    topk_length [Tq]        1 + the last live column (0: none), so FlashMLA skips the dead tail blocks
Static shapes from the inputs' shapes only (no host sync; torch.compile traces it as data).
"""
from __future__ import annotations

import math

import torch

from dsv4.kernels._varlen import entry_ranges

from . import naive

LOG2E = 1.4426950408889634
INDEX_MULTIPLE = 128          # topk % (2 * B_TOPK) == 0 on SM90 (phase1.cuh:577, B_TOPK = 64 config.h:27)
HEADS = (64, 128)             # h_q (sparse_fwd.h:192-198)
HEAD_DIM = 512                # d_qk = d_v = 512: K = V share the row (sparse_fwd.h:131-132)
ARCHS = ((9, 0),)             # SM90a: the kernel issue 14 measured (SM100f is also FlashMLA's, untested here)


_LOADED: dict = {}            # the import's result, once per process (as sys.modules): the first `load`
_CAPS: dict = {}              # CUDA device index -> compute capability, once per device


def _import():
    try:
        import flash_mla
        fn = flash_mla.flash_mla_sparse_fwd
    except Exception as e:  # noqa: BLE001 - any import failure is a reason to fall back
        return None, (f"flash_mla not importable ({type(e).__name__}: {str(e)[:160]}); build it with "
                      "harness/device/flashmla_h200.sh")
    return fn, None


def load():
    """(flash_mla.flash_mla_sparse_fwd, None), or (None, one line saying why not). Imported once per process;
    nothing else of FlashMLA is read."""
    if "fn" not in _LOADED:
        _LOADED["fn"] = _import()
    return _LOADED["fn"]


def capability(x: torch.Tensor):
    """The compute capability (major, minor) of x's CUDA device; None for a non-CUDA tensor."""
    if not x.is_cuda:
        return None
    i = x.device.index if x.device.index is not None else torch.cuda.current_device()
    if i not in _CAPS:
        _CAPS[i] = tuple(torch.cuda.get_device_capability(i))
    return _CAPS[i]


def prepare() -> None:
    """Import flash_mla and read the current CUDA device's capability now (`kernels.get_op` resolving backend
    "triton+flashmla"), so that a torch.compile trace of the dispatch reads two memos, not an import / a driver
    query."""
    load()
    if torch.cuda.is_available():
        capability(torch.empty(0, device="cuda"))


def unqualified(q, kv, comp, fn, cap) -> str | None:
    """None when FlashMLA's SM90 sparse prefill can run this call, else one line saying why not (the call then
    runs the Triton forward). `fn`: the FlashMLA function (None: not importable); `cap`: the device's compute
    capability (`capability(q)`; None: not a CUDA device)."""
    Tq, H, c = q.shape
    N = 0 if comp is None else comp.shape[0]
    if fn is None:
        return "flash_mla not importable"
    if cap is None or tuple(cap) not in ARCHS:
        return f"needs an SM90 GPU (FlashMLA's SM90 sparse prefill), got {'no CUDA device' if cap is None else cap}"
    dts = {q.dtype, kv.dtype} | ({comp.dtype} if N else set())
    if dts != {torch.bfloat16}:
        return f"needs bf16 q / kv / comp, got {sorted(str(d) for d in dts)}"
    if H not in HEADS:
        return f"needs H in {HEADS} heads, got {H}"
    if c != HEAD_DIM:
        return f"needs c = d_qk = d_v = {HEAD_DIM}, got {c}"
    if Tq == 0:
        return "no queries"
    if kv.shape[0] + N >= 2 ** 31:
        return "more than 2^31 - 1 key rows (int32 indices)"
    return None


def padded(k: int, multiple: int = INDEX_MULTIPLE) -> int:
    """Index slots for k live columns: k rounded up to the multiple (at least one multiple)."""
    return max(multiple, multiple * math.ceil(k / multiple))


def indices(seg, pos, Tq: int, window: int, ratio: int, comp_idx, entry_seg, entry_j, n_entries: int,
            q_offset: int = 0, multiple: int = INDEX_MULTIPLE):
    """(indices [Tq, 1, K] int32 into kv_all, topk_length [Tq] int32) of the module docstring's mapping, for a
    packed stream: seg / pos [Tk] of the key stream, comp_idx [Tq, k] (CSA) | None (HCA when n_entries > 0,
    window-only when 0), entry_seg / entry_j [N]."""
    Tk = seg.shape[0]
    rows, valid = naive.window_keys(seg, pos, Tq, window, q_offset)             # [Tq, W]
    cols = [torch.where(valid, rows, -1)]
    if n_entries > 0:
        sq, pq = seg[q_offset:q_offset + Tq], pos[q_offset:q_offset + Tq]
        if comp_idx is not None:                                                # CSA: the listed visible ones
            cidx, cvalid = naive.listed_entries(comp_idx, sq, pq, entry_seg, entry_j, ratio)
        else:                                                                   # HCA: the query's entry range
            elo, ehi = entry_ranges(sq, pq, entry_seg, entry_j, ratio)
            n = elo.long()[:, None] + torch.arange(n_entries, device=seg.device)    # [Tq, N]
            inr = n < ehi.long()[:, None]
            cidx = torch.where(inr, n, 0)
            cvalid = inr & (entry_seg[cidx] == sq[:, None]) & (sq[:, None] >= 0) \
                & (entry_j[cidx] < torch.div(pq + 1, ratio, rounding_mode="floor")[:, None])
        cols.append(torch.where(cvalid, Tk + cidx, -1))
    idx = torch.cat(cols, 1)
    K = idx.shape[1]
    idx = torch.nn.functional.pad(idx, (0, padded(K, multiple) - K), value=-1)
    slot = torch.arange(1, idx.shape[1] + 1, device=idx.device)
    length = torch.where(idx >= 0, slot, 0).amax(1)                            # 1 + the last live column
    return idx.to(torch.int32)[:, None], length.to(torch.int32)


def kv_all(kv: torch.Tensor, comp: torch.Tensor | None) -> torch.Tensor:
    """kv [Tk, c] (+ comp [N, c]) -> [Tk + N, 1, c] contiguous: the one key tensor FlashMLA indexes."""
    return (kv if comp is None or comp.shape[0] == 0 else torch.cat([kv, comp], 0)).contiguous()[:, None]


def lse_ours(lse_fm: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """FlashMLA's lse [Tq, H] (natural log, sink NOT included, +inf where no key) -> ours: the log-sum-exp of the
    one softmax over keys AND sink, in log2 units, fp32 (what `triton._sparse_attn_fwd` stores and the Triton
    backward reads; fp64 stays, for tests): log2(e^lse + e^sink) = logaddexp(lse, sink) * log2(e); no key:
    sink * log2(e)."""
    dt = torch.promote_types(lse_fm.dtype, torch.float32)
    s = sink.to(dt)[None, :].expand_as(lse_fm)
    none = torch.isposinf(lse_fm)
    return torch.where(none, s, torch.logaddexp(torch.where(none, s, lse_fm.to(dt)), s)) * LOG2E


def forward_raw(fn, q, kv, comp, comp_idx, sink, seg, pos, entry_seg, entry_j, window: int, ratio: int, scale: float,
                q_off: int, use_topk_length: bool = True):
    """FlashMLA's forward on our arguments -> (o [Tq,H,c], lse [Tq,H] FlashMLA's own: natural log, no sink, +inf
    with no key, ix [Tq, K] int32 its indices into kv_all). `fn` has flash_mla_sparse_fwd's signature and returns."""
    Tq, H, c = q.shape
    N = 0 if comp is None else comp.shape[0]
    ix, length = indices(seg, pos, Tq, window, max(int(ratio or 1), 1), comp_idx, entry_seg, entry_j, N, q_off)
    o, _max_logits, lse = fn(q.contiguous(), kv_all(kv, comp), ix, float(scale), c, sink.float().contiguous(),
                             length if use_topk_length else None)
    return o, lse, ix[:, 0]


def forward(fn, q, kv, comp, comp_idx, sink, seg, pos, entry_seg, entry_j, window: int, ratio: int, scale: float,
            q_off: int, use_topk_length: bool = True):
    """FlashMLA's forward on our arguments -> (o [Tq,H,c], lse [Tq,H] fp32 log2 units incl. the sink): the
    outputs of `dsv4::sparse_attn_fwd`."""
    o, lse, _ix = forward_raw(fn, q, kv, comp, comp_idx, sink, seg, pos, entry_seg, entry_j, window, ratio, scale,
                              q_off, use_topk_length)
    return o, lse_ours(lse, sink)
