"""What every ``arbiter`` command shares: settings from the command line, and failing clearly."""

from __future__ import annotations

import importlib
import sys
from typing import Any, NoReturn

import click
from pydantic import ValidationError

from arbiter.edge.settings import Settings, load_settings
from arbiter.kafka import local_cluster_settings


def fail(message: str, detail: str = "", code: int = 1) -> NoReturn:
    """Print ``error: message`` (and ``detail``) on stderr and exit ``code``."""
    click.secho(f"error: {message}", fg="red", err=True)
    if detail:
        click.echo(detail, err=True)
    sys.exit(code)


def unreachable(bootstrap: str, why: str = "") -> NoReturn:
    """Exit ``EXIT_UNAVAILABLE``: no Kafka answers (``why``: what the client saw). Every verb that needs
    Kafka says it in these words (docs/operations.md, When Kafka is down)."""
    fail(f"no Kafka answers at {bootstrap}{': ' + why if why else ''}", "is it up? 'arbiter kafka status' says; "
         "'arbiter kafka up' starts the local one (or pass --bootstrap)", code=EXIT_UNAVAILABLE)


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


EXIT_UNAVAILABLE = 3
"""Every command's exit status when Kafka could not be reached (``arbiter lock`` documents its others)."""


class ArbiterGroup(click.Group):
    """The ``arbiter`` command group: a command that cannot reach Kafka, or that finds a topic missing,
    ends with one clear line on stderr, never a traceback. Commands in ``lazy`` (name: ``module:attribute``)
    are imported only when run or listed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lazy: dict[str, str] = {}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.lazy})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        found = super().get_command(ctx, cmd_name)
        if found is None and cmd_name in self.lazy:
            module, _, attribute = self.lazy[cmd_name].partition(":")
            found = getattr(importlib.import_module(module), attribute)
            assert isinstance(found, click.Command), self.lazy[cmd_name]
            self.add_command(found, cmd_name)
        return found

    def invoke(self, ctx: click.Context) -> object:
        from aiokafka.errors import KafkaError

        from arbiter.agents.errors import ArbiterUnavailable
        from arbiter.edge.kafkaconn import describe
        from arbiter.edge.kafkaio import KafkaIOError
        from arbiter.edge.tail import TopicMissing

        try:
            return super().invoke(ctx)
        except TopicMissing as exc:
            fail(str(exc))
        except (KafkaError, KafkaIOError, ArbiterUnavailable, ConnectionError) as exc:
            unreachable((ctx.obj or {}).get("bootstrap") or _bootstrap(ctx), describe(exc))


def _bootstrap(ctx: click.Context) -> str:
    try:
        return load_settings(**(ctx.find_root().obj or {})).bootstrap
    except (ValidationError, TypeError):
        return "the configured bootstrap"


def quiet_kafka_logs() -> None:
    """A short command's answer is its output: Kafka clients' own log lines (and the connection guard's
    state changes) stay out of a terminal's stderr. ``worker`` and ``serve`` log them instead."""
    import logging

    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    logging.getLogger("arbiter.kafka").setLevel(logging.ERROR)
