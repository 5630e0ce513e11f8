"""P1: selective FP32 under a bf16 cast and an exact mixed-dtype optimizer checkpoint round trip."""
import torch

from dsv4.model.config import get_config
from dsv4.model.model import DSv4Model
from dsv4.model.precision import cast_model, fp32_kept_names, load_optimizer, save_optimizer

CFG = get_config("debug")
FP32_SUFFIXES = ("hc_attn_fn", "hc_attn_base", "hc_attn_scale", "hc_ffn_fn", "hc_ffn_base", "hc_ffn_scale",
                 "hc_head_fn", "hc_head_base", "hc_head_scale", "attn_sink", ".ape", "gate.bias", "norm.weight")


def _expect_fp32(name):
    return name.endswith(FP32_SUFFIXES)


def _model(seed=0):
    torch.manual_seed(seed)
    return DSv4Model(CFG)


def test_dtypes_after_bf16_cast():
    for cast in (lambda m: m.to(torch.bfloat16), lambda m: m.to_bf16(), lambda m: m.bfloat16(),
                 lambda m: cast_model(m, torch.bfloat16)):
        m = cast(_model())
        sd = m.state_dict()
        kinds = {"attn_sink", ".ape", "gate.bias", "hc_head_fn", "hc_attn_fn", "q_norm.weight", "kv_norm.weight",
                 "compressor.norm.weight", "enorm.weight", "attn_norm.weight", "mtp.0.norm.weight"}
        for kind in kinds:                                                     # every kind is present
            assert any(k.endswith(kind) for k in sd), kind
        for k, v in sd.items():
            if v.is_floating_point():
                want = torch.float32 if _expect_fp32(k) else torch.bfloat16
                assert v.dtype == want, (k, v.dtype)
            else:
                assert v.dtype == torch.int64, k                               # tid2eid stays an index table
        assert sd["layers.1.attn.wq_a.weight"].dtype == torch.bfloat16
        assert sd["layers.1.ffn.experts.w13"].dtype == torch.bfloat16
        assert set(fp32_kept_names(m)) == {k for k, v in sd.items() if v.is_floating_point() and _expect_fp32(k)}


def test_bf16_forward_backward_and_fp32_adamw_state():
    m = _model(1).to(torch.bfloat16).train()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    ids = torch.randint(0, CFG.vocab_size, (1, 11))
    out = m(ids, labels=ids)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    opt.step()
    for name, p in m.named_parameters():
        if p.grad is None:                       # e.g. the HCA compressor: S=11 < 16 gives no entry
            continue
        st = opt.state[p]
        assert p.grad.dtype == p.dtype, name
        assert st["exp_avg"].dtype == p.dtype and st["exp_avg_sq"].dtype == p.dtype, name
    assert opt.state[m.hc_head_fn]["exp_avg"].dtype == torch.float32
    assert opt.state[m.head.weight]["exp_avg"].dtype == torch.bfloat16


def _trained_opt(seed, steps=1):
    """A bf16 model with an AdamW over two groups (low precision / FP32-kept), after `steps` steps."""
    m = _model(seed).to(torch.bfloat16).train()
    fp32 = [p for n, p in m.named_parameters() if p.dtype == torch.float32]
    low = [p for n, p in m.named_parameters() if p.dtype != torch.float32]
    opt = torch.optim.AdamW([{"params": low, "lr": 1e-3}, {"params": fp32, "lr": 3e-4, "weight_decay": 0.0}])
    for _ in range(steps):
        ids = torch.randint(0, CFG.vocab_size, (1, 9))
        m(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return m, opt


def _assert_same_opt(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for pid in sa["state"]:
        for k, v in sa["state"][pid].items():
            w = sb["state"][pid][k]
            assert v.dtype == w.dtype and torch.equal(v, w), (pid, k)


def test_optimizer_checkpoint_exact_round_trip(tmp_path):
    m, opt = _trained_opt(2)
    dtypes = {v["exp_avg"].dtype for v in opt.state_dict()["state"].values()}
    assert dtypes == {torch.float32, torch.bfloat16}                           # really mixed
    save_optimizer(opt, str(tmp_path / "opt.safetensors"))
    m2, opt2 = _trained_opt(3, steps=0)
    m2.load_state_dict(m.state_dict())
    load_optimizer(opt2, str(tmp_path / "opt.safetensors"))
    _assert_same_opt(opt, opt2)
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    m3, opt3 = _trained_opt(4, steps=0)
    opt3.load_state_dict(torch.load(tmp_path / "opt.pt", weights_only=True))
    _assert_same_opt(opt, opt3)
    # the restored optimizer continues exactly like the original
    ids = torch.randint(0, CFG.vocab_size, (1, 9), generator=torch.Generator().manual_seed(9))
    for mm, oo in ((m, opt), (m2, opt2)):
        mm(ids, labels=ids).loss.backward()
        oo.step()
    for (n, p), (_, q) in zip(m.named_parameters(), m2.named_parameters()):
        assert torch.equal(p, q), n
