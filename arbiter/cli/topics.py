"""``arbiter topics``: create, list and delete Arbiter's topics."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import click
from aiokafka.errors import KafkaError

from arbiter.cli.terminal import fail, say, settings_of, unreachable
from arbiter.edge.kafkaconn import describe
from arbiter.edge.kafkaio import KafkaIOError
from arbiter.edge.settings import Settings
from arbiter.streams.runtime.topics import TopicError, delete_topics_named, ensure_topics, live_topics, topic_sizes


@click.group()
def topics() -> None:
    """Manage Arbiter's topics."""


@topics.command("create")
@click.pass_context
def topics_create(ctx: click.Context) -> None:
    """Create every topic (co-partitioned, kept forever). Idempotent."""
    settings = settings_of(ctx)
    try:
        states = asyncio.run(ensure_topics(settings))
    except TopicError as exc:
        fail(str(exc))
    for state in states:
        click.echo(f"{'created' if state.created else 'exists '}  {state.name}  ({state.partitions} partitions)")


@topics.command("list")
@click.option("--prefix", default="", help="Only topics whose names start with this.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per topic.")
@click.pass_context
def topics_list(ctx: click.Context, prefix: str, as_json: bool) -> None:
    """Every topic on the broker (or those under --prefix), with its partitions and records."""
    settings = settings_of(ctx)
    sizes = run_kafka(settings, topic_sizes(settings, prefix))
    live = live_topics(settings)
    for t in sizes:
        if as_json:
            click.echo(json.dumps({"name": t.name, "partitions": t.partitions, "records": t.records,
                                   "in_use": t.name in live}))
        else:
            mark = "  (this configuration's)" if t.name in live else ""
            records = f"{t.records:>12,}" if t.records is not None else f"{'?':>12}"
            click.echo(f"{t.name:<60} {t.partitions:>3} partitions {records} records{mark}")
    if not sizes and not as_json:
        say(f"no topics{' starting with ' + repr(prefix) if prefix else ''} at {settings.bootstrap}")


@topics.command("delete")
@click.argument("prefix")
@click.option("--yes", is_flag=True, help="Also delete this configuration's own topics (the live log: gone for good).")
@click.pass_context
def topics_delete(ctx: click.Context, prefix: str, yes: bool) -> None:
    """Delete every topic whose name starts with PREFIX (e.g. arbiter.demo.7-ab12cd., one kept demo run:
    its changelogs too, which are named after its app id, arbiter.demo.<run>.app)."""
    settings = settings_of(ctx)
    if len(prefix) < 3 or prefix.startswith("__"):
        fail(f"prefix {prefix!r} would name too much: give at least three characters, not Kafka's own '__' topics")
    names = [t.name for t in run_kafka(settings, topic_sizes(settings, prefix))]
    live = [n for n in names if n in live_topics(settings)]
    if live and not yes:
        fail(f"{prefix!r} names {len(live)} of this configuration's own topics ({', '.join(live[:3])}"
             f"{', ...' if len(live) > 3 else ''}): the live log, the audit record",
             "add --yes to delete them anyway (nothing can bring them back)")
    if not names:
        say(f"no topics start with {prefix!r}")
        return
    deleted = run_kafka(settings, delete_topics_named(settings, (prefix,)))
    say(f"deleted {deleted} topic(s) starting with {prefix!r}")


def run_kafka(settings: Settings, work: Any) -> Any:
    try:
        return asyncio.run(work)
    except (KafkaError, KafkaIOError) as exc:
        unreachable(settings.bootstrap, describe(exc))
