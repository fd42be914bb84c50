"""What every ``arbiter`` command shares: settings from the command line, and failing clearly."""

from __future__ import annotations

import sys
from typing import NoReturn

import click
from pydantic import ValidationError

from contract.settings import Settings, load_settings


def fail(message: str, detail: str = "") -> NoReturn:
    """Print ``error: message`` (and ``detail``) on stderr and exit 1."""
    click.secho(f"error: {message}", fg="red", err=True)
    if detail:
        click.echo(detail, err=True)
    sys.exit(1)


def settings_of(ctx: click.Context) -> Settings:
    """The settings the command line, the environment and the defaults give; a clear error if invalid."""
    try:
        return load_settings(**(ctx.find_root().obj or {}))
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'settings'}: {e['msg']}" for e in exc.errors())
        fail(f"invalid settings: {problems}")


def say(message: str) -> None:
    """Progress for a person, on stderr."""
    click.echo(message, err=True)
