"""`dsv4 convert SRC DST [--from auto|hf|official|megatron|train] --to hf|official|megatron [--json]` (checkpoint
interop, model/interop/).

`--from auto` (the default): a `dsv4 train` run (its dir, `checkpoints/`, or a step dir) is read as `train`
(its meta.json carries the model config), anything else as `hf`.
Exit 0 on success, 2 with one line on bad input (missing directory, unknown format, a tensor that does not fit,
a file that is not safetensors, a config field of the wrong type).
"""
from __future__ import annotations

import json
import os

import click

from dsv4.harness.errors import report_bad_input


def load_train(src: str):
    """The model of a `dsv4 train` checkpoint (the newest complete step under `src`), weights and buffers."""
    from dsv4.harness.train.checkpoint import latest_checkpoint, read_meta
    from dsv4.model.config import DSv4Config
    from dsv4.model.interop.common import CheckpointError, check_field_types, load_checked, read_safetensors
    from dsv4.model.model import DSv4Model
    d = latest_checkpoint(src)
    meta = read_meta(d)
    where = os.path.join(d, "meta.json")
    if "model_config" not in meta:
        raise CheckpointError(f"{where}: no model_config (a checkpoint older than `dsv4 train` writing it)")
    check_field_types(meta["model_config"], f"{where}: model_config")
    model = DSv4Model(DSv4Config.from_dict(meta["model_config"]))
    load_checked(model, read_safetensors(os.path.join(d, "model.safetensors")), os.path.join(d, "model.safetensors"))
    return model


def _is_train_checkpoint(src: str) -> bool:
    from dsv4.harness.train.checkpoint import CheckpointError, latest_checkpoint
    try:
        latest_checkpoint(src)
        return True
    except CheckpointError:
        return False


@click.command("convert")
@click.argument("src", type=click.Path())
@click.argument("dst", type=click.Path())
@click.option("--from", "src_format", default="auto", show_default=True,
              help="auto | hf | official | megatron | train (a `dsv4 train` run or checkpoint)")
@click.option("--to", "dst_format", default="official", show_default=True,
              help="hf | official | megatron (dev HybridModel names + config fields)")
@click.option("--hf-clamp-shared-expert", "clamp_shared", is_flag=True,
              help="--to hf of an unclamped model (DeepSeek's code): export HF's clamped shared expert instead of refusing")
@click.option("--json", "as_json", is_flag=True, help="print a JSON summary")
def convert_cmd(src, dst, src_format, dst_format, clamp_shared, as_json):
    """Convert a DSv4 checkpoint directory (config.json + safetensors, or a `dsv4 train` checkpoint) between
    HF and official naming."""
    from dsv4.model.config import ConfigError
    from dsv4.model.interop import CheckpointError, convert
    try:
        if src_format == "auto":
            src_format = "train" if _is_train_checkpoint(src) else "hf"
        model = load_train(src) if src_format == "train" else None
        summary = convert(src, dst, src_format, dst_format, clamp_shared, model=model)
    except (CheckpointError, ConfigError, FileNotFoundError, OSError, json.JSONDecodeError) as e:
        report_bad_input(e)
    if as_json:
        click.echo(json.dumps(summary))
    else:
        click.echo(f"converted {src} ({src_format}) -> {dst} ({dst_format}): {summary['tensors']} tensors, "
                   f"{summary['elements']} elements")
