"""`dsv4 convert SRC DST --from hf|official|megatron --to hf|official|megatron [--json]` (checkpoint interop, model/convert.py).

Exit 0 on success, 2 with one line on bad input (missing directory, unknown format, a tensor that does not fit).
"""
from __future__ import annotations

import json

import click

from dsv4.harness.errors import report_bad_input


@click.command("convert")
@click.argument("src", type=click.Path())
@click.argument("dst", type=click.Path())
@click.option("--from", "src_format", default="hf", show_default=True, help="hf | official | megatron")
@click.option("--to", "dst_format", default="official", show_default=True, help="hf | official | megatron (dev HybridModel names + config fields)")
@click.option("--hf-clamp-shared-expert", "clamp_shared", is_flag=True,
              help="--to hf of an unclamped model (DeepSeek's code): export HF's clamped shared expert instead of refusing")
@click.option("--json", "as_json", is_flag=True, help="print a JSON summary")
def convert_cmd(src, dst, src_format, dst_format, clamp_shared, as_json):
    """Convert a DSv4 checkpoint directory (config.json + safetensors) between HF and official naming."""
    from dsv4.model.config import ConfigError
    from dsv4.model.convert import CheckpointError, convert
    try:
        summary = convert(src, dst, src_format, dst_format, clamp_shared)
    except (CheckpointError, ConfigError, FileNotFoundError, OSError, json.JSONDecodeError) as e:
        report_bad_input(e)
    if as_json:
        click.echo(json.dumps(summary))
    else:
        click.echo(f"converted {src} ({src_format}) -> {dst} ({dst_format}): {summary['tensors']} tensors, "
                   f"{summary['elements']} elements")
