"""Bad input -> one line on stderr and exit code 2, the same for every `dsv4` command."""
from __future__ import annotations

import sys

import click


def report_bad_input(e: BaseException) -> None:
    msg = str(e).splitlines()[0] if str(e) else type(e).__name__
    click.echo(f"dsv4: error: {msg}", err=True)
    sys.exit(2)

