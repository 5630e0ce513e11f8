"""D8 integration: the full DSv4Model (debug: window / CSA / HCA layers, MoE, mHC, MTP) in training mode under
static contiguous CP (cp = 2, 4; gloo) == each document run alone on one rank: logits, MTP logits (the MTP roll
crosses rank boundaries), the total loss (LM + 0.3 MTP + indexer KL, global token / query weighting) and every
parameter gradient (summed over ranks), fp32.

Oracle: `model(doc)` per document in this process; the loss is assembled from per-document CE sums and the
per-document indexer losses weighted by their number of queries with a candidate.
"""
import functools

import pytest
import torch
import torch.nn.functional as F

from dsv4.slices.D8._workers import build_debug_model, cp_model_worker, packed_batch, spawn

LENS = [6, 21, 3, 34, 9]
PADDED = [6, 24, 3, 37, 10]          # T = 80: documents straddle the rank boundaries for cp = 2 and 4
# the slice's fp32 bound; measured worst
# over the 11 simulated hosts of harness/numerics.py (native, ATEN default/avx2/avx512, MKL_CBWR=COMPATIBLE/AVX2,
# MKL_ENABLE_INSTRUCTIONS=SSE4_2/AVX2, DNNL_MAX_CPU_ISA=AVX2, 2 combinations):
# logits / loss 5.7e-7 (x18), gradients 2.5e-7 (x40)
TOL = 1e-5


@functools.lru_cache(maxsize=None)
def _oracle():
    model = build_debug_model(train=True)
    cfg = model.cfg
    cu, cup, T, seg, ids, labels = packed_batch(LENS, PADDED, cfg.vocab_size)
    logits = torch.zeros(T, cfg.vocab_size)
    mtp_logits = torch.zeros(T, cfg.vocab_size)
    lm, mtp, n_lm, n_mtp, il_num, il_den = 0.0, 0.0, 0, 0, 0.0, 0
    for d, L in enumerate(LENS):
        rows = torch.nonzero(seg == d).flatten()
        o = model(ids[:, rows])
        il = [l for l, _ in o.aux.indexer]
        logits[rows], mtp_logits[rows] = o.logits[0].detach(), o.mtp_logits[0].detach()
        lab = labels[0, rows]
        mlab = torch.cat([lab[1:], torch.tensor([-100])])
        lm = lm + F.cross_entropy(o.logits[0], lab, ignore_index=-100, reduction="sum")
        mtp = mtp + F.cross_entropy(o.mtp_logits[0], mlab, ignore_index=-100, reduction="sum")
        n_lm += int((lab != -100).sum()); n_mtp += int((mlab != -100).sum())
        n_q = max(0, L - cfg.csa_ratio + 1)                                     # queries with a candidate
        for l in il:
            if n_q:
                il_num = il_num + l * n_q
        il_den += n_q
    loss = lm / n_lm + cfg.mtp_loss_scaling_factor * mtp / n_mtp + il_num / il_den
    loss.backward()
    grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}
    return seg, logits, mtp_logits, loss.detach(), grads


@pytest.mark.parametrize("cp,recompute", [(2, False), (4, False), (2, True)])
def test_cp_model_equals_per_document(cp, recompute):
    """recompute=True: whole-block recompute (model/recompute.py) under the CP layout == the same oracle."""
    res = spawn(cp_model_worker, cp, LENS, PADDED, recompute)
    seg, logits, mtp_logits, loss, grads = _oracle()
    real = seg >= 0
    lg = torch.cat([r["logits"] for r in res])
    mlg = torch.cat([r["mtp_logits"] for r in res])
    e_lg = (lg[real] - logits[real]).abs().max().item()
    e_mlg = (mlg[real] - mtp_logits[real]).abs().max().item()
    e_loss = abs(res[0]["loss"].item() - loss.item())
    assert e_lg <= TOL and e_mlg <= TOL and e_loss <= TOL, (e_lg, e_mlg, e_loss)
    e_g = 0.0
    for n, g in res[0]["grads"].items():
        e = (g - grads[n]).abs().max().item() / max(1.0, grads[n].abs().max().item())
        assert e <= TOL, (n, e)
        e_g = max(e_g, e)
    assert grads["layers.1.attn.indexer.wq_b.weight"].abs().max() > 0         # the indexer loss is in
    print(f"cp={cp}: logits {e_lg:.2e}, mtp logits {e_mlg:.2e}, loss {e_loss:.2e}, grads (rel) {e_g:.2e}")
