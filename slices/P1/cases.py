"""P1 golden cases: which tensors stay FP32 under a bf16 cast (counts, exact) and one bf16 AdamW step with
mixed-dtype parameter groups (loss and moment sums per group)."""
import torch

from dsv4.harness.cases import golden_case


# Tolerances: the cross-host spread stored in goldens/cpu/_spread/P1.json (`dsv4 goldens spread --slice P1`,
# worst over harness/numerics.py's simulated hosts and the host that made the golden) x the margin named.
# loss: worst rel 2.6e-5 (ATEN avx2) -> rtol 3e-4 (11x); was (2e-2, 2e-2), 1000x loose on a value that is
# bit-exact run to run. exp_avg_sq sums: worst rel 9.6e-4 (fp32 group, MKL_CBWR=COMPATIBLE) and 1.5e-3 (bf16
# group, DNNL_MAX_CPU_ISA=AVX2: oneDNN's bf16 kernels) -> rtol 1e-2 (10x) and 2e-2 (13x); were 5e-2.
@golden_case("bf16_selective_fp32_debug", tol={"loss": (0.0, 3e-4), "exp_avg_sq_fp32": (0.0, 1e-2),
                                               "exp_avg_sq_bf16": (0.0, 2e-2)})
def bf16_selective_fp32_debug():
    """debug DSv4Model cast to bf16: tensor/element counts per dtype (exact), the bf16 loss of S = 17 tokens,
    and sum(exp_avg_sq) of the FP32 and bf16 AdamW groups after one step."""
    from dsv4.model.config import get_config
    from dsv4.model.model import DSv4Model
    torch.manual_seed(0)
    m = DSv4Model(get_config("debug")).to(torch.bfloat16).train()
    sd = m.state_dict()
    n32 = sum(1 for v in sd.values() if v.dtype == torch.float32)
    e32 = sum(v.numel() for v in sd.values() if v.dtype == torch.float32)
    n16 = sum(1 for v in sd.values() if v.dtype == torch.bfloat16)
    fp32 = [p for p in m.parameters() if p.dtype == torch.float32]
    low = [p for p in m.parameters() if p.dtype != torch.float32]
    opt = torch.optim.AdamW([{"params": low}, {"params": fp32, "weight_decay": 0.0}], lr=1e-3)
    ids = torch.randint(0, 256, (1, 17), generator=torch.Generator().manual_seed(1))
    out = m(ids, labels=ids)
    out.loss.backward()
    opt.step()
    s32 = sum(opt.state[p]["exp_avg_sq"].double().sum().item() for p in fp32 if p in opt.state)
    s16 = sum(opt.state[p]["exp_avg_sq"].double().sum().item() for p in low if p in opt.state)
    return {"n_fp32": n32, "elems_fp32": e32, "n_bf16": n16, "loss": out.loss.item(),
            "exp_avg_sq_fp32": s32, "exp_avg_sq_bf16": s16}
