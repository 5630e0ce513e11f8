"""P4 golden cases: hash routing (exact indices from the seeded tid2eid), score routing with the expert bias
(exact indices, lower index first on ties), one bias update, the sequence-wise balance loss."""
import torch

from dsv4.harness.cases import golden_case


@golden_case("hash_and_score_routing_debug", tol={"hash_w": (1e-6, 1e-5), "score_w": (1e-6, 1e-5),
                                                  "bias_after": (1e-9, 0.0), "seq_aux": (1e-7, 1e-5)})
def hash_and_score_routing_debug():
    """debug config: layer 0 (hash) and layer 1 (score) gates on 19 seeded tokens."""
    from dsv4.model.config import get_config
    from dsv4.model.losses import AuxLosses
    from dsv4.model.moe import MoE
    cfg = get_config("debug")
    torch.manual_seed(0)
    hash_moe, score_moe = MoE(cfg, 0).train(), MoE(cfg, 1).train()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 19, cfg.hidden_size, generator=g)
    ids = torch.randint(0, cfg.vocab_size, (1, 19), generator=g)
    with torch.no_grad():
        score_moe.gate.bias.copy_(torch.randn(cfg.n_routed_experts, generator=g) * 0.05)
        hw, hidx, _ = hash_moe.gate(x[0], ids)
        sw, sidx, _ = score_moe.gate(x[0], None)
        collected = AuxLosses()
        score_moe(x, None, collected)
        aux = collected.moe[0].item()
    score_moe.gate.update_expert_bias()
    return {"hash_idx": hidx, "hash_w": hw, "table_rows": hash_moe.gate.tid2eid[:16], "score_idx": sidx,
            "score_w": sw, "bias_after": score_moe.gate.bias, "seq_aux": aux}
