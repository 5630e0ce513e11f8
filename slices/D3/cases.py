"""Golden cases for D3 (fused backend): the Triton kernels' outputs and gradients on tiny odd shapes. On the CPU
they run in Triton's interpreter (the CLI selects it when no GPU is present); on a GPU, natively."""
import torch

from dsv4.harness.cases import golden_case


def _inputs(S=13, B=1, H=4, c=32, T=3, k=2, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(S, B, H, c, generator=g)
    kv = torch.randn(S, B, c, generator=g)
    comp = torch.randn(T, B, c, generator=g)
    idx = torch.stack([torch.randperm(T, generator=g)[:k] for _ in range(S * B)]).view(S, B, k)
    sink = torch.randn(H, generator=g)
    return [t.to(device) for t in (q, kv, comp, idx, sink)]


# Tolerances: the cross-host spread stored in goldens/cpu/_spread/D3.json (`dsv4 goldens spread --slice D3`,
# worst over harness/numerics.py's simulated hosts and the host that made the golden) x the margin named.
# Triton (interpreter) kernels: worst use 0.044 of (1e-5, 1e-4) (sparse attention o, 23x).
@golden_case("sparse_attn_triton_csa", tol={"o": (1e-5, 1e-4), "dq": (1e-5, 1e-4), "dkv": (1e-5, 1e-4),
                                             "dcomp": (1e-5, 1e-4), "dsink": (1e-5, 1e-4)})
def sparse_attn_triton_csa(device="cpu"):
    """Window 4 + 2 listed entries of ratio 4 + sink, S=13: forward and all gradients of the Triton kernel."""
    from dsv4.kernels.sparse_attn import sparse_attn
    q, kv, comp, idx, sink = _inputs(device=device)
    for t in (q, kv, comp, sink):
        t.requires_grad_(True)
    S, T = q.shape[0], comp.shape[0]                         # one document (B = 1): seg 0, pos 0..S-1
    dev = q.device
    meta = (torch.zeros(S, dtype=torch.long, device=dev), torch.arange(S, device=dev),
            torch.zeros(T, dtype=torch.long, device=dev), torch.arange(T, device=dev))
    o = sparse_attn(q[:, 0], kv[:, 0], comp[:, 0], idx[:, 0], sink, 4, 4, 32 ** -0.5, *meta, backend="triton")
    o = o[:, None]                                           # the golden's [S, B=1, H, c]
    w = torch.linspace(-1, 1, o.numel(), device=o.device).view_as(o)
    (o * w).sum().backward()
    return {"o": o.detach().cpu(), "dq": q.grad.cpu(), "dkv": kv.grad.cpu(), "dcomp": comp.grad.cpu(),
            "dsink": sink.grad.cpu()}


@golden_case("compress_pool_triton_overlap", tol={"pooled": (1e-5, 1e-4), "dkv": (1e-5, 1e-4)})
def compress_pool_triton_overlap(device="cpu"):
    """CSA overlapping pooling (m=4, width 8) of S=13 tokens by the Triton kernel, and its kv gradient."""
    from dsv4.kernels.compressor import compress_pool
    g = torch.Generator().manual_seed(1)
    kv = torch.randn(13, 1, 16, generator=g).to(device).requires_grad_(True)
    gate = torch.randn(13, 1, 16, generator=g).to(device)
    ape = torch.randn(4, 16, generator=g).to(device)
    seg, pos = torch.zeros(13, dtype=torch.long, device=device), torch.arange(13, device=device)
    p = compress_pool(kv[:, 0], gate[:, 0], ape, 4, True, seg, pos, backend="triton")[0][:3, None]   # [3, 1, 8]
    p.sum().backward()
    return {"pooled": p.detach().cpu(), "dkv": kv.grad.cpu()}
