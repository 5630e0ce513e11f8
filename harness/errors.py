"""Bad input -> one line on stderr and exit code 2, the same for every `dsv4` command.

Under `--json` the error is also the one JSON document on stdout: {"error": "...", "exit_code": 2}.
"""
from __future__ import annotations

import json
import sys

import click

JSON = False          # set by the `dsv4` group while it runs a command line holding --json


def _json_mode() -> bool:
    ctx = click.get_current_context(silent=True)
    while ctx is not None:
        if ctx.params.get("as_json"):
            return True
        ctx = ctx.parent
    return JSON


def fail(msg: str, code: int = 2):
    msg = msg.strip().splitlines()[0] if msg.strip() else "error"
    click.echo(f"dsv4: error: {msg}", err=True)
    if _json_mode():
        click.echo(json.dumps({"error": msg, "exit_code": code}))
    sys.exit(code)


def report_bad_input(e: BaseException) -> None:
    fail(str(e) or type(e).__name__)
