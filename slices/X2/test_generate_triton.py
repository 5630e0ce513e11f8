"""X2: cached generation with the Triton kernels (sparse_attn / indexer / compressor / mHC / SwiGLU; on CPU
through Triton's interpreter, selected by the root conftest) == with the naive kernels: the cached step feeds
the kernels a left context (q_offset) and few queries, shapes the training path never uses."""
import torch

from dsv4.model.generate import generate

from ._models import debug_model


def test_triton_backend_generation_equals_naive():
    torch.set_num_threads(1)
    m = debug_model(seed=1)
    p = torch.randint(1, 256, (2, 13), generator=torch.Generator().manual_seed(0))
    ref = generate(m, p, max_new_tokens=8, output_logits=True)
    m.set_kernel_backend("triton")
    try:
        got = generate(m, p, max_new_tokens=8, output_logits=True)
    finally:
        m.set_kernel_backend("naive")
    assert torch.equal(ref.sequences, got.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(ref.logits, got.logits)) <= 1e-5   # measured 3.7e-6
