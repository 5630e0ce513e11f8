"""Bad input -> one line on stderr and exit code 2, the same for every `dsv4` command.

Under `--json` the error is also the one JSON document on stdout: {"error": "...", "exit_code": 2}.
Exit 1 is reserved for a regression (or a training run that diverged); whatever the user handed us that we
cannot use -- a file, a field, a missing GPU or package, a full disk -- is exit 2 with one line naming it.
"""
from __future__ import annotations

import errno
import json
import sys

import click

JSON = False          # set by the `dsv4` group while it runs a command line holding --json
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


class InputError(ValueError):
    """Bad input found by library code (not a click command); the CLI reports it as one line, exit 2."""


class BadInput(click.ClickException):
    """Raised inside a click command: `dsv4: error: <message>` on stderr, exit 2."""
    exit_code = 2

    def show(self, file=None):                 # a command invoked on its own (not through the `dsv4` group)
        click.echo(f"dsv4: error: {self.message}", err=True)


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


def one_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def report_bad_input(e: BaseException) -> None:
    fail(one_line(e))


def is_disk_full(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in DISK_FULL


def need_cuda(what: str) -> None:
    """Refuse, in one line naming what is missing, a command that needs a CUDA GPU on a machine without one."""
    import torch
    if not torch.cuda.is_available():
        raise BadInput(f"{what} needs a CUDA GPU: none visible (torch {torch.__version__}, "
                       f"torch.cuda.is_available() is False)")
