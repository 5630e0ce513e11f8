"""Golden cases for P11 (packed micro-batches through one static PackedSeqParams buffer,
harness/train/packed_graph.py), and the micro-batches the tests share."""
import torch

from dsv4.harness.cases import golden_case

B, S = 2, 48                                                   # two rows of 48 slots: the fixed token budget
BATCHES = [[[20, 28], [48]], [[5, 7, 11, 25], [30, 9]], [[48], [1, 2, 3, 40]]]   # documents per row; tails padded


def debug_model(device="cpu", backend=None):
    """The seeded debug model in training mode, its experts on the dense GEMM form (the CPU default "loop" reads
    the per-expert counts on the host, which a graph cannot)."""
    from dsv4.model import get_config
    from dsv4.model.model import build_model
    torch.manual_seed(0)
    m = build_model(get_config("debug")).to(device).train().set_expert_gemm("dense")
    if backend:
        m.set_kernel_backend(backend)
    return m


def micro_batch(rows, seed, V, device="cpu"):
    """Documents of `rows` (lengths per row of S slots) -> ids, labels [B, S] (seeded), cu_seqlens and
    cu_seqlens_padded (each row's documents from its first slot; the row's tail is padding)."""
    g = torch.Generator().manual_seed(seed)
    real, padded = [0], []
    for r, lens in enumerate(rows):
        start = r * S
        for n in lens:
            padded.append(start)
            real.append(real[-1] + n)
            start += n
    padded.append(B * S)
    ids = torch.randint(0, V, (B, S), generator=g)
    labels = torch.randint(0, V, (B, S), generator=g)
    return ids.to(device), labels.to(device), torch.tensor(real), torch.tensor(padded)


# Tolerances: the cross-host spread stored in goldens/cpu/_spread/P11.json (`dsv4 goldens spread --slice P11`, worst
# over harness/numerics.py's simulated hosts): loss 4.8e-7 abs, grad norm 1.2e-7 abs, using 0.058 / 0.041 of
# (1e-6, 1e-6) (x17 / x24).
@golden_case("packed_graph_losses", tol={"loss": (1e-6, 1e-6), "grad_norm": (1e-6, 1e-6)})
def packed_graph_losses():
    """The debug model's loss and global gradient norm for each of BATCHES through one PackedGraphStep buffer
    (max_seqs 8, capture off on CPU)."""
    from dsv4.harness.train.packed_graph import PackedGraphStep
    model = debug_model()
    step = PackedGraphStep(model, (B, S), max_seqs=8)
    loss, norm = [], []
    for i, rows in enumerate(BATCHES):
        step.load(*micro_batch(rows, i, model.cfg.vocab_size))
        loss.append(step.step())
        norm.append(torch.linalg.vector_norm(torch.stack([p.grad.double().norm() for p in step.params])))
    return {"loss": torch.stack(loss), "grad_norm": torch.stack(norm).float()}
