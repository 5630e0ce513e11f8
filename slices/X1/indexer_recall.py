"""Top-k recall of the indexer's FP8 / FP4 QK paths against its high-precision path on a trained model's own
activations (issues 14 and 17):

    python -m dsv4.slices.X1.indexer_recall --config tiny --steps 100 --eval-len 512

trains `--config` with `dsv4 train`'s loop (fp32, CPU; debug / tiny recipes), then runs the trained model on
held-out text of `--eval-len` tokens with a forward hook on every CSA indexer that re-scores the same inputs
(qI, KI, w) at qk_precision bf16 / fp8 / fp4 (Indexer.forward; kernels/indexer/fp4.py) and measures
`topk_recall` over the queries with at least k visible entries; with re-ranking (Indexer.qk_rerank = m for m in
RERANK_MARGINS: the low-precision top ceil(k (1 + m)), its k best by the bf16 listed scores) the recall of the
selection the indexer returns (`picks_recall`). Prints one JSON line.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import replace

import torch

RERANK_MARGINS = (0.25, 0.5)


def recall_on_trained(config: str = "debug", steps: int = 30, eval_len: int = 256, seed: int = 1234) -> dict:
    from dsv4.harness.train import checkpoint as ckpt
    from dsv4.harness.train.data import GPTSamples, IndexedTokens
    from dsv4.harness.train.loop import RECIPES, build_model, train
    from dsv4.kernels.indexer.fp4 import picks_recall, topk_recall
    from dsv4.model.config import get_config
    from dsv4.model.indexer import Indexer
    with tempfile.TemporaryDirectory() as d:
        train(replace(RECIPES[config], steps=steps), d, seed=seed, progress=False)
        model = build_model(get_config(config))
        model.load_state_dict(ckpt.load_checkpoint(f"{d}/checkpoints")[0])
        data = GPTSamples(IndexedTokens(f"{d}/data/corpus"), eval_len, seed + 1)
        x, _ = data.batch(10_000, 2)                                  # held-out samples, [2, eval_len]
    model.eval()
    calls = []
    hooks = [m.register_forward_hook(lambda mod, args, kwargs, out: calls.append((mod, args, kwargs)),
                                     with_kwargs=True) for m in model.modules() if isinstance(m, Indexer)]
    with torch.no_grad():
        model(torch.from_numpy(x))
        for h in hooks:
            h.remove()
        res = {p: [] for p in ("fp8", "fp4")}
        res.update({f"{p}_rerank{m}": [] for p in ("fp8", "fp4") for m in RERANK_MARGINS})
        for mod, args, kwargs in calls:
            scores = {}
            for p in ("bf16", "fp8", "fp4"):
                mod.qk_precision = p
                scores[p] = mod(*args, **kwargs)[0]
            for p in ("fp8", "fp4"):
                res[p].append(topk_recall(scores[p], scores["bf16"], mod.topk, min_visible=mod.topk))
                mod.qk_precision = p
                for m in RERANK_MARGINS:
                    mod.qk_rerank = m
                    picks = mod(*args, **kwargs)[1]
                    res[f"{p}_rerank{m}"].append(picks_recall(picks, scores["bf16"], mod.topk, min_visible=mod.topk))
                mod.qk_rerank = 0.0
            mod.qk_precision = "bf16"
    return {"config": config, "train_steps": steps, "eval_tokens": int(x.size), "indexer_calls": len(calls),
            "topk": calls[0][0].topk if calls else None,
            **{f"recall_{p}": sum(v) / len(v) for p, v in res.items()},
            **{f"recall_{p}_min": min(v) for p, v in res.items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="tiny", choices=["debug", "tiny"])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--eval-len", type=int, default=512)
    a = ap.parse_args(argv)
    print(json.dumps(recall_on_trained(a.config, a.steps, a.eval_len)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
