"""`dsv4 generate`: text / token generation with the DSv4 KV cache (model/generate.py, slice X2).

    dsv4 generate (--init PATH | --config debug|tiny|proxy [--seed S]) (--prompt TEXT ... | --ids 1,2,3 ...)
                  [--max-new-tokens N] [--temperature T] [--top-p P] [--sample-seed S] [--eos ID]
                  [--tokenizer tokenizer.json] [--padding left|right] [--device cpu|cuda] [--dtype fp32|bf16]
                  [--json]

Several prompts form one batch (padded on `--padding`, default left). Progress on stderr; with --json exactly
one JSON document on stdout (tokens, text, tokens/s, cache bytes). Greedy unless --temperature > 0.
"""
from __future__ import annotations

import json
import sys
import time

import click

from dsv4.harness.errors import report_bad_input


@click.command("generate")
@click.option("--init", "init", type=click.Path(), default=None,
              help="HF / official checkpoint directory or a dsv4 training run")
@click.option("--config", "config", default=None, help="named config with a random init (debug|tiny|proxy)")
@click.option("--seed", type=int, default=1234, show_default=True, help="init seed with --config")
@click.option("--prompt", "prompts", multiple=True, help="prompt text (repeatable: a batch)")
@click.option("--ids", "ids", multiple=True, help="prompt token ids, comma separated (repeatable)")
@click.option("--max-new-tokens", type=int, default=32, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy")
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--sample-seed", type=int, default=0, show_default=True, help="seed of the sampling generator")
@click.option("--eos", type=int, default=None, help="end-of-sequence id (default: the tokenizer's eod)")
@click.option("--tokenizer", type=click.Path(), default=None, help="tokenizer.json (default: byte-level)")
@click.option("--padding", type=click.Choice(["left", "right"]), default="left", show_default=True)
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--dtype", type=click.Choice(["fp32", "bf16"]), default="fp32", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="one JSON document on stdout")
def generate_cmd(init, config, seed, prompts, ids, max_new_tokens, temperature, top_p, sample_seed, eos,
                 tokenizer, padding, device, dtype, as_json):
    """Generate continuations of prompts with the DSv4 KV cache (greedy or temperature / top-p sampling)."""
    import torch

    from dsv4.harness.train.data import DataError
    from dsv4.harness.train.loading import InitError, load_model
    from dsv4.harness.train.tokenizer import load_tokenizer
    from dsv4.model.config import ConfigError, get_config
    from dsv4.model.interop import CheckpointError
    from dsv4.model.generate import CacheError, cache_elements_per_token, generate, tqdm_progress
    try:
        if (init is None) == (config is None):
            raise InitError("generate: give exactly one of --init PATH or --config NAME")
        if bool(prompts) == bool(ids):
            raise InitError("generate: give --prompt TEXT or --ids LIST (one of them)")
        if device == "cuda" and not torch.cuda.is_available():
            raise InitError("generate.device: cuda requested but no CUDA device is available")
        tok = load_tokenizer(tokenizer)
        if init:
            model, src = load_model(init)
        else:
            from dsv4.model.model import DSv4Model
            torch.manual_seed(seed)
            model, src = DSv4Model(get_config(config)), f"random:{config}:{seed}"
        if prompts:
            rows = [[int(v) for v in tok.encode(p)] for p in prompts]
        else:
            try:
                rows = [[int(v) for v in s.split(",") if v.strip()] for s in ids]
            except ValueError:
                raise InitError(f"generate.ids: not a comma-separated list of integers: {ids!r}") from None
        V = model.cfg.vocab_size
        if any(not r for r in rows):
            raise InitError("generate: an empty prompt")
        if any(not 0 <= v < V for r in rows for v in r):
            raise InitError(f"generate: a prompt token id is outside the vocabulary [0, {V})")
        S = max(len(r) for r in rows)
        x = torch.zeros(len(rows), S, dtype=torch.long)
        mask = torch.zeros(len(rows), S, dtype=torch.long)
        for b, r in enumerate(rows):
            sl = slice(S - len(r), S) if padding == "left" else slice(0, len(r))
            x[b, sl] = torch.tensor(r)
            mask[b, sl] = 1
        dev = torch.device(device)
        model = model.to(dev)
        if dtype == "bf16":
            model = model.to_bf16()
        g = torch.Generator(device=dev).manual_seed(sample_seed)
        t0 = time.perf_counter()
        out = generate(model, x.to(dev), mask.to(dev), max_new_tokens=max_new_tokens,
                       do_sample=temperature > 0, temperature=temperature, top_p=top_p, generator=g,
                       eos_token_id=tok.eod if eos is None else eos,
                       progress=tqdm_progress() if max_new_tokens else None)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    except (InitError, CacheError, ConfigError, CheckpointError, DataError, OSError) as e:
        report_bad_input(e)
    new = out.new_tokens.cpu().tolist()
    n_new = sum(len(r) for r in new)
    doc = {"source": src, "prompts": rows, "new_tokens": new,
           "text": [tok.decode(r) for r in new], "wall_s": round(wall, 4),
           "tokens_per_s": round(n_new / wall, 2) if wall > 0 else None,
           "cache_bytes": out.cache.nbytes(),
           "cache_elements_per_token": cache_elements_per_token(model.cfg),
           "sampling": {"temperature": temperature, "top_p": top_p, "seed": sample_seed}}
    if as_json:
        click.echo(json.dumps(doc))
    else:
        for t in doc["text"]:
            click.echo(t)
        click.echo(f"{n_new} tokens in {wall:.2f} s ({doc['tokens_per_s']} tokens/s), cache {doc['cache_bytes']} B",
                   err=True)
