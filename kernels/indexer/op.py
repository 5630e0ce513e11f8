"""`dsv4::indexer_scores_fwd` / `dsv4::indexer_scores_bwd`: the Triton lightning-indexer scores as torch custom
ops (opaque to torch.compile; fake implementations for shapes). The bodies run `triton._IndexerScores`'s
forward / backward with a plain ctx record (`FnCtx`), so the numerics are those of the autograd.Function.
Packed layout (the contract of `naive.indexer_scores`): qI [Tq,nI,cI], kI [N,cI], w [Tq,nI], document metadata.
Top-k (`indexer_topk`) is plain PyTorch (a stable sort) and needs no registration."""
import torch

from dsv4.kernels._custom_op import autograd_op, backward_op
from dsv4.kernels._triton_util import FnCtx
from dsv4.kernels.indexer import naive
from dsv4.kernels.indexer import triton as T

Tensor = torch.Tensor


def _indexer_scores_fwd(qI: Tensor, kI: Tensor, w: Tensor, ratio: int, seg_q: Tensor, pos_q: Tensor,
                        entry_seg: Tensor, entry_j: Tensor) -> Tensor:
    return T._IndexerScores.forward(FnCtx(), qI, kI, w, ratio, seg_q, pos_q, entry_seg, entry_j)


indexer_scores_fwd = torch.library.custom_op("dsv4::indexer_scores_fwd", mutates_args=())(_indexer_scores_fwd)


@indexer_scores_fwd.register_fake
def _(qI, kI, w, ratio, seg_q, pos_q, entry_seg, entry_j):
    return qI.new_empty(qI.shape[0], kI.shape[0], dtype=torch.float32)


def _indexer_scores_bwd(dI: Tensor, qI: Tensor, kI: Tensor, w: Tensor, ratio: int, seg_q: Tensor, pos_q: Tensor,
                        entry_seg: Tensor, entry_j: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    ctx = FnCtx()                                      # what _IndexerScores.forward leaves
    ctx.save_for_backward(qI.contiguous(), kI.contiguous(), w.contiguous(),
                          *T._meta(seg_q, pos_q, entry_seg, entry_j))
    ctx.cfg = (ratio, qI.shape[1] ** -0.5 * qI.shape[2] ** -0.5)
    dq, dk, dw, *_ = T._IndexerScores.backward(ctx, dI)
    return dq, dk, dw


indexer_scores_bwd = torch.library.custom_op("dsv4::indexer_scores_bwd", mutates_args=())(_indexer_scores_bwd)


@indexer_scores_bwd.register_fake
def _(dI, qI, kI, w, ratio, seg_q, pos_q, entry_seg, entry_j):
    return qI.new_empty(qI.shape), kI.new_empty(kI.shape), w.new_empty(w.shape)


def _setup(ctx, inputs, output):
    qI, kI, w, ratio, seg_q, pos_q, entry_seg, entry_j = inputs
    ctx.save_for_backward(qI, kI, w, seg_q, pos_q, entry_seg, entry_j)
    ctx.ratio = int(ratio)


def _backward(ctx, dI):
    qI, kI, w, seg_q, pos_q, entry_seg, entry_j = ctx.saved_tensors
    bwd = backward_op(ctx, indexer_scores_bwd, _indexer_scores_bwd)
    dq, dk, dw = bwd(dI, qI, kI, w, ctx.ratio, seg_q, pos_q, entry_seg, entry_j)
    return dq, dk, dw, None, None, None, None, None


_scores = autograd_op(indexer_scores_fwd, _indexer_scores_fwd, _setup, _backward)


def indexer_scores(qI: Tensor, kI: Tensor, w: Tensor, ratio: int, seg_q: Tensor, pos_q: Tensor, entry_seg: Tensor,
                   entry_j: Tensor) -> Tensor:
    """qI [Tq,nI,cI], kI [N,cI], w [Tq,nI], metadata -> I [Tq,N] fp32 (-inf where not visible), Triton custom op."""
    naive.check_scores_args(qI, kI, w, ratio, seg_q, pos_q, entry_seg, entry_j)
    return _scores(qI, kI, w, int(ratio), seg_q, pos_q, entry_seg, entry_j)



# ------------------------------------------------------------------ scores at the listed entries (sparse-mode loss)
# Plain PyTorch in query chunks (bf16 products on the tensor cores, fp32 ReLU-weighted sums), recomputed in
# backward, registered as custom ops so the compiler sees one node and no [Tq,k,cI] gather is ever kept:
#   dots[t,k,h] = kI[idx[t,k]] . qI[t,h];  I[t,k] = s * sum_h w[t,h] ReLU(dots[t,k,h]),  s = (nI cI)^-1/2
#   dw[t,h] = s * sum_k dI[t,k] ReLU(dots);  dd = dI[t,k] s w[t,h] 1[dots > 0]
#   dqI[t,h] = sum_k dd[t,k,h] kI[idx[t,k]];  dkI[idx[t,k]] += sum_h dd[t,k,h] qI[t,h]
#   dkI: when N·nI <= _DENSE_DK·k, as GEMMs dkI += S[c·h, N]ᵀ · qI[c·h, cI] with S the chunk's dd scattered into dense
#   rows over the entries (triton.scatter_picks: plain stores) -- tensor-core work 2·N·nI·cI per query instead of
#   k·cI fp32 atomic adds (index_add_: 20 ms of a 16K-token proxy step on the H200, 69 launches); otherwise (many
#   entries per pick) the index_add_ below.
_CHUNK = 512                    # queries per chunk: [512, k=512, cI=128] bf16 = 64 MiB gathered at a time
_SPILL_ROWS = 4096              # dk rows that absorb the -1 picks' zero adds (spread: no long serial queue)
_DENSE_DK = 1024                # GEMM dkI while N·nI <= _DENSE_DK·k (the GEMM's extra FLOPs beat the atomics)
_DENSE_DK_BYTES = 1 << 26       # at most 64 MiB of dense S at a time (sub-chunks of queries)


def _dots(qI, kI, idx):
    K = kI[torch.where(idx >= 0, idx, 0)]                                       # [C, k, cI]
    return K, torch.bmm(K, qI.transpose(1, 2).to(K.dtype)).float()              # [C, k, nI] fp32


def _indexer_scores_listed_fwd(qI: Tensor, kI: Tensor, w: Tensor, idx: Tensor) -> Tensor:
    nI, cI = qI.shape[-2:]
    out = torch.empty(idx.shape, device=qI.device, dtype=torch.float32)
    for a in range(0, idx.shape[0], _CHUNK):
        e = min(a + _CHUNK, idx.shape[0])
        _, d = _dots(qI[a:e], kI, idx[a:e])
        out[a:e] = torch.bmm(torch.relu(d), w[a:e, :, None].float()).squeeze(-1) * (nI * cI) ** -0.5
    return out.masked_fill_(idx < 0, float("-inf"))


indexer_scores_listed_fwd = torch.library.custom_op("dsv4::indexer_scores_listed_fwd",
                                                    mutates_args=())(_indexer_scores_listed_fwd)


@indexer_scores_listed_fwd.register_fake
def _(qI, kI, w, idx):
    return qI.new_empty(idx.shape, dtype=torch.float32)


def _indexer_scores_listed_bwd(dI: Tensor, qI: Tensor, kI: Tensor, w: Tensor,
                               idx: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    nI, cI = qI.shape[-2:]
    s = (nI * cI) ** -0.5
    dq = torch.empty(qI.shape, device=qI.device, dtype=torch.float32)
    dw = torch.empty(w.shape, device=qI.device, dtype=torch.float32)
    n_kv, k = kI.shape[0], idx.shape[1]
    dense = n_kv * nI <= _DENSE_DK * k
    spill = 0 if dense else min(_CHUNK * k, _SPILL_ROWS)
    dk = torch.zeros((n_kv + spill, *kI.shape[1:]), device=qI.device, dtype=torch.float32)   # + spill rows
    spill_row = n_kv + torch.arange(_CHUNK * k, device=qI.device) % max(spill, 1)              # [C*k]
    sub = max(1, _DENSE_DK_BYTES // max(1, nI * n_kv * kI.element_size()))                    # queries per S
    dI = torch.where(idx >= 0, dI, torch.zeros_like(dI)).float()
    for a in range(0, idx.shape[0], _CHUNK):
        e = min(a + _CHUNK, idx.shape[0])
        K, d = _dots(qI[a:e], kI, idx[a:e])                                       # [C,k,cI], [C,k,nI]
        g = dI[a:e, :, None]                                                      # [C, k, 1]
        dw[a:e] = (g * torch.relu(d)).sum(1) * s                                  # [C, nI]
        dd = (g * w[a:e, None, :].float() * s) * (d > 0)                          # [C, k, nI]
        dq[a:e] = torch.bmm(dd.transpose(1, 2).to(K.dtype), K).float()           # [C, nI, cI]
        if dense:
            for b in range(a, e, sub):
                c = min(b + sub, e)
                S = T.scatter_picks(dd[b - a:c - a], idx[b:c], n_kv, K.dtype)    # [c-b, nI, N]
                dk[:n_kv] += (S.flatten(0, 1).t() @ qI[b:c].flatten(0, 1).to(K.dtype)).float()   # [N, cI]
            continue
        dks = torch.bmm(dd.to(K.dtype), qI[a:e].to(K.dtype)).float()             # [C, k, cI]
        # A -1 pick's dks is zero (dI is zeroed above); it goes to one of the `spill` rows past the end, dropped
        # below, spread so that no row queues many adds: under torch.use_deterministic_algorithms CUDA's
        # index_add_ is a sorted index_put_(accumulate=True) that walks repeated indices serially (all -1s once
        # went to row 0: ~500K serial adds per CSA layer at 4K), and compacting the valid picks (nonzero) cost a
        # host sync per chunk. The real rows get the same adds in the same order as before.
        fi = idx[a:e].flatten()
        fi = torch.where(fi >= 0, fi, spill_row[:fi.numel()])
        dk.index_add_(0, fi, dks.flatten(0, 1))
    return dq.to(qI.dtype), dk[:n_kv].to(kI.dtype), dw.to(w.dtype)


indexer_scores_listed_bwd = torch.library.custom_op("dsv4::indexer_scores_listed_bwd",
                                                    mutates_args=())(_indexer_scores_listed_bwd)


@indexer_scores_listed_bwd.register_fake
def _(dI, qI, kI, w, idx):
    return qI.new_empty(qI.shape), kI.new_empty(kI.shape), w.new_empty(w.shape)


def _setup_listed(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward_listed(ctx, dI):
    qI, kI, w, idx = ctx.saved_tensors
    dq, dk, dw = backward_op(ctx, indexer_scores_listed_bwd, _indexer_scores_listed_bwd)(dI, qI, kI, w, idx)
    return dq, dk, dw, None


_scores_listed = autograd_op(indexer_scores_listed_fwd, _indexer_scores_listed_fwd, _setup_listed, _backward_listed)


def indexer_scores_listed(qI: Tensor, kI: Tensor, w: Tensor, idx: Tensor) -> Tensor:
    """`naive.indexer_scores_listed` in query chunks with recompute (custom op; any device)."""
    return _scores_listed(qI, kI, w, idx)
