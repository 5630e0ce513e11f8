"""P11: packed micro-batches of a fixed token budget through one static PackedSeqParams buffer
(harness/train/packed_graph.py). Oracles: the same model on the dynamic layout of each micro-batch
(`cu_seqlens=` -> Layout.packed), loss and every gradient bit for bit; torch.compile(fullgraph=True, dynamic=False)
of the region across micro-batches with recompiles made errors (the host-side conditions of a CUDA-graph capture);
on a GPU, the captured graph's replays against eager runs of the same kernels."""
import pytest
import torch

from dsv4.harness.train.packed_graph import PackedGraphStep, _check_capturable
from dsv4.model.packed_seq import PackedSeqError
from dsv4.slices.P11.cases import BATCHES, B, S
from dsv4.slices.P11.cases import debug_model as _model
from dsv4.slices.P11.cases import micro_batch as _batch


def _eager(model, ids, labels, cu, cup):
    for p in model.parameters():
        p.grad = None
    loss = model(ids, labels=labels, cu_seqlens=cu, cu_seqlens_padded=cup, return_logits=False).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.requires_grad]


def test_static_buffer_step_equals_the_dynamic_layout_bit_for_bit():
    """Three micro-batches (2 to 6 documents, padded tails) through one buffer of max_seqs 8: loss and all
    gradients equal the model on each micro-batch's own Layout.packed (same ops, same order)."""
    model = _model()
    step = PackedGraphStep(model, (B, S), max_seqs=8)
    assert not step.capture
    V = model.cfg.vocab_size
    buf_ptr = step.buf.data_ptr()
    for i, rows in enumerate(BATCHES):
        ids, labels, cu, cup = _batch(rows, i, V)
        step.load(ids, labels, cu, cup)
        loss = step.step()
        grads = [p.grad.clone() for p in step.params]
        ref_loss, ref_grads = _eager(model, ids, labels, cu, cup)
        assert torch.equal(loss, ref_loss), (i, loss, ref_loss)
        assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads)), i
    assert step.buf.data_ptr() == buf_ptr and tuple(step.buf.shape) == (4, 9)


def test_region_traces_whole_with_no_recompile_across_micro_batches():
    """The region's forward (layout from the buffer, the model, the loss) under torch.compile(fullgraph=True,
    dynamic=False, aot_eager), whose AOTAutograd also traces the backward: no graph break (no host read of a
    tensor) and, with recompiles made errors, one graph for all three micro-batches (no value of the offsets reaches
    a guard or a shape); loss and gradients equal the eager region's bit for bit."""
    import torch._dynamo as D
    model = _model()
    step = PackedGraphStep(model, (B, S), max_seqs=8)
    D.reset()
    compiled = torch.compile(step.forward, fullgraph=True, dynamic=False, backend="aot_eager")
    V = model.cfg.vocab_size
    with D.config.patch(error_on_recompile=True):
        for i, rows in enumerate(BATCHES):
            step.load(*_batch(rows, i, V))
            for p in step.params:
                p.grad = None
            got = compiled()
            got.backward()
            got_grads = [p.grad.clone() for p in step.params]
            ref = step.step()
            assert torch.equal(got.detach(), ref), i              # aot_eager runs the same aten ops in order
            assert all(torch.equal(a, b) for a, b in zip(got_grads, (p.grad for p in step.params))), i
    D.reset()


def test_bad_input_names_the_field(monkeypatch):
    """Bad micro-batches are refused naming the field, with or without megatron-core (the GPU machines have none:
    the static step's offsets are a duck-typed record, `packed_seq.stream_offsets`)."""
    from dsv4.model import packed_seq

    def no_megatron():
        raise PackedSeqError("megatron-core is not installed: PackedSeqParams unavailable")
    monkeypatch.setattr(packed_seq, "_packed_seq_params_cls", no_megatron)
    model = _model()
    step = PackedGraphStep(model, (B, S), max_seqs=2)
    ids, labels, cu, cup = _batch(BATCHES[1], 0, model.cfg.vocab_size)
    with pytest.raises(PackedSeqError, match=r"6 documents exceed the static max_seqs 2"):
        step.load(ids, labels, cu, cup)
    with pytest.raises(PackedSeqError, match=r"input_ids shape \(1, 96\) != the static \(2, 48\)"):
        step.load(ids.reshape(1, -1), labels, cu, cup)
    with pytest.raises(PackedSeqError, match=r"ends at 200, past the 96 slots"):
        step.load(ids, labels, torch.tensor([0, 200]), torch.tensor([0, 200]))
    with pytest.raises(PackedSeqError, match=r"a document of 60 tokens exceeds the static max_seqlen 48"):
        step.load(ids, labels, torch.tensor([0, 60]), torch.tensor([0, 96]))
    if not torch.cuda.is_available():
        with pytest.raises(PackedSeqError, match=r"capture needs the model on a CUDA device"):
            PackedGraphStep(model, (B, S), max_seqs=2, capture=True)
    _check_capturable(model)                                    # "dense": nothing read on the host
    model.set_expert_gemm("loop")
    with pytest.raises(PackedSeqError, match=r"layers\.\d+\.ffn\.experts\.gemm 'loop' reads the per-expert counts"):
        _check_capturable(model)


def test_replays_hand_back_the_captured_grads_after_grad_is_rebound(monkeypatch):
    """The capture's bookkeeping on CPU, with torch.cuda's graph API faked: a replay writes into the .grad tensors
    allocated during capture (the fake re-runs the region and copies into them), and step() points every parameter's
    .grad at them again, even after an eager run (or zero_grad(set_to_none=True)) rebound .grad. Without the
    rebinding the first GPU run (session 24) compared a stale .grad: 1.32 relative off."""
    import contextlib

    class Graph:
        def replay(self):
            loss = step.region()                                # what the captured kernels compute ...
            for g, q in zip(captured, step.params):             # ... written into the capture's tensors
                g.copy_(q.grad)
            step.loss.copy_(loss)

    class Stream:
        def wait_stream(self, other):
            pass
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", lambda g: contextlib.nullcontext())
    model = _model()
    step = PackedGraphStep(model, (B, S), max_seqs=8, capture=False, warmup=1)
    step.capture = True                                         # (a CPU model: the capture path, faked)
    captured = []
    V = model.cfg.vocab_size
    for i, rows in enumerate(BATCHES):
        ids, labels, cu, cup = _batch(rows, i, V)
        step.load(ids, labels, cu, cup)
        loss = step.step().clone()
        if i == 0:
            captured = [q.grad for q in step.params]               # the tensors the capture allocated
        assert all(q.grad is g for q, g in zip(step.params, captured)), i
        grads = [p.grad.clone() for p in step.params]
        ref_loss, ref_grads = _eager(model, ids, labels, cu, cup)     # rebinds every .grad
        assert torch.equal(loss, ref_loss), i
        assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads)), i


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a GPU")
def test_captured_graph_replays_each_micro_batch_on_gpu():
    """The debug model on the Triton kernels in fp32, captured once, replayed for three micro-batches: loss and
    gradients against eager runs of the same kernels on each micro-batch's dynamic layout, relative 1e-5 (the
    sparse-attention backward adds dKV with atomics, so the order of its sums differs run to run)."""
    from dsv4.kernels._testing import assert_rel
    model = _model("cuda", "triton")
    step = PackedGraphStep(model, (B, S), max_seqs=8)
    assert step.capture
    V = model.cfg.vocab_size
    for i, rows in enumerate(BATCHES):
        ids, labels, cu, cup = _batch(rows, i, V, "cuda")
        step.load(ids, labels, cu, cup)
        loss = step.step().clone()
        grads = [p.grad.clone() for p in step.params]
        ref_loss, ref_grads = _eager(model, ids, labels, cu, cup)
        assert_rel("loss", loss, ref_loss, 1e-5)
        for n, (a, b) in enumerate(zip(grads, ref_grads)):
            assert_rel(f"grad {n}", a, b, 1e-5)
    assert step.graph is not None
