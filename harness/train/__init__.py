"""dsv4.harness.train: the training system, apart from the verification tooling in dsv4.harness.

loop.py (recipes, the one-device loop, `dsv4 train`), dist.py (the same step under torchrun on a DeviceMesh),
data.py (Megatron indexed format, tokenizers' byte default), tokenizer.py, packing.py (P7's scheduler),
sft.py, schedule.py / curriculum.py (LR / MTP-weight schedules, long-context stages), optim.py (Muon hybrid NS +
AdamW), checkpoint.py / dcp_checkpoint.py, loading.py (`--init PATH`), flops.py (FLOP accounting, `dsv4 flops`),
bench.py (`dsv4 bench train`), profile_step.py, lowp_bench.py (X1). Nothing is imported here: the CLI loads
each command's module lazily.
"""
