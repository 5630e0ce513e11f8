"""Multi-process workers for the CP / EP tests (D7, D8, P9, P10): spawned with torch.multiprocessing over gloo.

They live in the package (not in a test file) so that spawned children can import them. Each worker writes its
per-rank results to `<outdir>/rank<r>.pt`; the test process compares them with its own single-rank oracle.
"""
from __future__ import annotations

import os
import socket
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


# fork: children inherit the imported modules (spawn re-imports torch + the model, ~4 s per process on 2 busy
# cores); children set one intra-op thread, so the parent's OpenMP pool is never used after the fork.
START_METHOD = os.environ.get("DSV4_MP_START", "fork")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn, world_size: int, *args) -> list[dict]:
    """Run fn(rank, world_size, port, outdir, *args) on world_size gloo processes; per-rank result dicts."""
    with tempfile.TemporaryDirectory() as outdir:
        mp.start_processes(fn, args=(world_size, free_port(), outdir, *args), nprocs=world_size, join=True,
                           start_method=START_METHOD)
        return [torch.load(os.path.join(outdir, f"rank{r}.pt")) for r in range(world_size)]


def _init(rank, ws, port, megatron: str | None = None):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ws)
    if megatron is None:
        return dist.group.WORLD
    import warnings
    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state as ps
    if megatron == "cp":
        ps.initialize_model_parallel(context_parallel_size=ws)
        return ps.get_context_parallel_group()
    ps.initialize_model_parallel(expert_model_parallel_size=ws)
    return ps.get_expert_model_parallel_group()


def _finish(outdir, rank, res, megatron=None):
    torch.save(res, os.path.join(outdir, f"rank{rank}.pt"))
    if megatron is not None:
        from megatron.core import parallel_state as ps
        ps.destroy_model_parallel()
    dist.destroy_process_group()


def randomize(mod, seed=1, std=0.3):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in mod.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (std if p.dim() > 1 else 0.5) + (1.0 if p.dim() == 1 else 0))


def stream_inputs(T, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, T, d, generator=g), torch.randn(1, T, d, generator=g)


# ---------------------------------------------------------------------------------------------- D7 primitives

def primitives_worker(rank, ws, port, outdir, C, halo, counts):
    """left_halo and gather_entries with gradients (plain torch.distributed WORLD group)."""
    from dsv4.model.context_parallel import gather_entries, left_halo
    group = _init(rank, ws, port)
    x_full = torch.arange(ws * C * 2, dtype=torch.float64).view(ws * C, 2)
    x = x_full[rank * C:(rank + 1) * C].clone().requires_grad_()
    hal = left_halo(x, halo, group)
    w = torch.arange(1, halo * 2 + 1, dtype=torch.float64).view(halo, 2) * (rank + 1)
    (hal * w).sum().backward()
    n = counts[rank]
    comp = (torch.arange(n * 3, dtype=torch.float64).view(n, 3) + 100 * rank).requires_grad_()
    cs, ss, js = gather_entries(comp, torch.full((n,), rank), torch.arange(n), group)
    (cs * (torch.arange(cs.shape[0], dtype=torch.float64)[:, None] + 1) * (rank + 1)).sum().backward()
    _finish(outdir, rank, {"halo": hal.detach(), "x_grad": x.grad, "comp": cs.detach(), "seg": ss, "j": js,
                           "comp_grad": comp.grad})


# ---------------------------------------------------------------------------------------------- D8 attention

def cp_attention_worker(rank, ws, port, outdir, cases, megatron="cp"):
    """For each case (layer, cu, cup, T): CP attention on this rank's chunk, forward + backward.
    megatron="cp": the group is Megatron-Core's parallel_state CP group; None: the default (WORLD) group."""
    from dsv4.model.attention import DSv4Attention
    from dsv4.model.config import get_config
    from dsv4.model.context_parallel import CPLayout, contiguous_chunk
    from dsv4.model.losses import AuxLosses
    group = _init(rank, ws, port, megatron)
    cfg = get_config("debug")
    res = []
    for layer, cu, cup, T in cases:
        torch.manual_seed(0)
        attn = DSv4Attention(cfg, layer).eval()
        randomize(attn)
        h, r = stream_inputs(T, cfg.hidden_size)
        s, e = contiguous_chunk(T, ws, rank)
        h_loc = h[:, s:e].clone().requires_grad_()
        aux = AuxLosses()
        out = attn(h_loc, CPLayout(cu, T, cup, group), aux)                    # the CP layout, same forward
        (out * r[:, s:e]).sum().backward()
        grads = {}
        for n, p in attn.named_parameters():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(g, group=group)                                    # data-parallel style sum
            grads[n] = g
        sel = aux.picks_doc(None) if aux.selections else None
        res.append({"out": out.detach()[0], "h_grad": h_loc.grad[0], "grads": grads, "sel": sel})
    _finish(outdir, rank, res, megatron)


# ---------------------------------------------------------------------------------------------- P9 MTP roll

def cp_roll_worker(rank, ws, port, outdir, cu, cup, T):
    from dsv4.model.context_parallel import contiguous_chunk, rank_layout
    from dsv4.model.mtp_roll import roll_packed_cp
    group = _init(rank, ws, port)
    s, e = contiguous_chunk(T, ws, rank)
    seg, _ = rank_layout(cu, T, ws, rank, 0, cup)
    ids = (torch.arange(T) * 7 + 3) % 97
    x_full = torch.randn(T, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x = x_full[s:e].clone().requires_grad_()
    w = torch.randn(T, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)[s:e]
    ids_next, valid = roll_packed_cp(ids[s:e], seg, group, fill=0)
    x_next, _ = roll_packed_cp(x, seg, group, fill=0.0)
    (x_next * w).sum().backward()
    _finish(outdir, rank, {"ids_next": ids_next, "valid": valid, "x_next": x_next.detach(), "x_grad": x.grad})


# ---------------------------------------------------------------------------------------------- P10 EP dispatch

def ep_worker(rank, ws, port, outdir, counts, layers, static_tokens, megatron, capacity=None):
    """EP MoE on this rank's `counts[rank]` tokens (ids and x slices of one global batch), fwd + bwd."""
    from dsv4.model.config import get_config
    from dsv4.model.ep_dispatch import EPDispatcher
    from dsv4.model.moe import MoE
    group = _init(rank, ws, port, megatron)
    cfg = get_config("debug")
    n_all = sum(counts)
    s = sum(counts[:rank]); e = s + counts[rank]
    res = []
    for layer in layers:
        torch.manual_seed(0)
        moe = MoE(cfg, layer)
        randomize(moe, seed=3, std=0.1)
        g = torch.Generator().manual_seed(5)
        x = torch.randn(1, n_all, cfg.hidden_size, generator=g)
        ids = torch.randint(0, cfg.vocab_size, (1, n_all), generator=g)
        r = torch.randn(1, n_all, cfg.hidden_size, generator=g)
        x_loc = x[:, s:e].clone().requires_grad_()
        moe.dispatcher = EPDispatcher(group, static_tokens, capacity)           # the layer's own forward
        y = moe(x_loc, ids[:, s:e])
        with torch.no_grad():
            idx = moe.gate(x_loc.reshape(-1, x_loc.shape[-1]), ids[:, s:e])[1]
        (y * r[:, s:e]).sum().backward()
        grads = {}
        for n, p in moe.named_parameters():
            gr = p.grad if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(gr, group=group)
            grads[n] = gr
        res.append({"y": y.detach()[0], "idx": idx, "x_grad": x_loc.grad[0], "grads": grads})
    _finish(outdir, rank, res, megatron)


# ---------------------------------------------------------------------------------------------- D8 full model

def build_debug_model(train: bool):
    """DSv4Model (debug config, no sequence aux loss) with non-trivial sinks / ape / norms, seeded."""
    from dsv4.model.config import get_config
    from dsv4.model.model import DSv4Model
    torch.manual_seed(0)
    model = DSv4Model(get_config("debug", seq_aux_loss_coeff=0.0)).train(train)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("attn_sink") or n.endswith(".ape") or n.endswith("norm.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5 + (1.0 if n.endswith("norm.weight") else 0.0))
            elif p.dim() == 2 and ".attn." in n:
                p.mul_(10.0)
    return model


def packed_batch(lens, padded, vocab):
    """ids / labels [1, T] of documents in padded slots; labels = next token inside the doc, -100 elsewhere."""
    from dsv4.model.layout import seg_pos_from_cu_seqlens
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    cup = torch.tensor([0] + torch.tensor(padded).cumsum(0).tolist())
    T = int(cup[-1])
    seg, _ = seg_pos_from_cu_seqlens(cu, T, cup)
    ids = torch.randint(0, vocab, (1, T), generator=torch.Generator().manual_seed(2))
    labels = torch.full((1, T), -100)
    for d in range(len(lens)):
        rows = torch.nonzero(seg == d).flatten()
        labels[0, rows[:-1]] = ids[0, rows[1:]]
    return cu, cup, T, seg, ids, labels


def cp_model_worker(rank, ws, port, outdir, lens, padded, recompute=False):
    from dsv4.model.context_parallel import CPLayout, contiguous_chunk
    group = _init(rank, ws, port)
    model = build_debug_model(train=True).set_recompute(recompute)
    cu, cup, T, seg, ids, labels = packed_batch(lens, padded, model.cfg.vocab_size)
    s, e = contiguous_chunk(T, ws, rank)
    out = model(ids[:, s:e], labels[:, s:e], layout=CPLayout(cu, T, cup, group))   # the CP layout
    out.loss.backward()
    loss = out.loss.detach().clone()
    dist.all_reduce(loss, group=group)
    grads = {}
    for n, p in model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(g, group=group)
        grads[n] = g
    _finish(outdir, rank, {"logits": out.logits.detach()[0], "mtp_logits": out.mtp_logits.detach()[0],
                           "loss": loss, "grads": grads if rank == 0 else None})


def ep_model_worker(rank, ws, port, outdir, lens_per_rank):
    """EP over the whole model: rank r runs ITS OWN packed batch (documents lens_per_rank[r], different total
    lengths) through the debug DSv4Model with experts dispatched over the EP group; fwd + bwd of the loss."""
    from dsv4.model.ep_dispatch import parallelize
    group = _init(rank, ws, port)
    model = parallelize(build_debug_model(train=True), ep=group)
    lens = lens_per_rank[rank]
    cu, cup, T, seg, ids, labels = packed_batch(lens, lens, model.cfg.vocab_size)
    out = model(ids, labels, cu_seqlens=cu, cu_seqlens_padded=cup)
    out.loss.backward()
    grads = {}
    for n, p in model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(g, group=group)
        grads[n] = g
    _finish(outdir, rank, {"logits": out.logits.detach()[0], "loss": out.loss.detach(),
                           "grads": grads if rank == 0 else None})
