"""P1 golden cases: which tensors stay FP32 under a bf16 cast (counts, exact) and one bf16 AdamW step with
mixed-dtype parameter groups (loss and moment sums per group)."""
import torch

from dsv4.harness.cases import golden_case


@golden_case("bf16_selective_fp32_debug", tol={"loss": (2e-2, 2e-2), "exp_avg_sq_fp32": (1e-9, 5e-2),
                                               "exp_avg_sq_bf16": (1e-9, 5e-2)})
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
