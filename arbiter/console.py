"""What every ``arbiter`` command shares: settings from the command line, and failing clearly."""

from __future__ import annotations

import sys
from typing import NoReturn

import click
from pydantic import ValidationError

from arbiter.edge.settings import Settings, load_settings

from .kafka import local_cluster_settings


def fail(message: str, detail: str = "") -> NoReturn:
    """Print ``error: message`` (and ``detail``) on stderr and exit 1."""
    click.secho(f"error: {message}", fg="red", err=True)
    if detail:
        click.echo(detail, err=True)
    sys.exit(1)


def settings_of(ctx: click.Context) -> Settings:
    """The settings the command line, the environment and the defaults give; a clear error if invalid.

    With no bootstrap given (``--bootstrap``, ``ARBITER_BOOTSTRAP``), when the home holds a local
    cluster of several nodes (``arbiter kafka up --nodes 3``), its bootstrap list and replication
    factor 3 (unless ``ARBITER_REPLICATION_FACTOR`` says otherwise).
    """
    given = ctx.find_root().obj or {}
    try:
        settings = load_settings(**given)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'settings'}: {e['msg']}" for e in exc.errors())
        fail(f"invalid settings: {problems}")
    return settings if given.get("bootstrap") else local_cluster_settings(settings)


def say(message: str) -> None:
    """Progress for a person, on stderr."""
    click.echo(message, err=True)
