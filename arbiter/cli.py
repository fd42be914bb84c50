"""The ``arbiter`` command."""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from arbiter.agents.identities import ensure_identity
from arbiter.edge.kafkaauth import kafka_client_options
from arbiter.schemas.identity import IdentityError
from arbiter.streams.runtime.topics import TopicError, ensure_topics

from .console import fail, say, settings_of
from .kafka import LocalKafka, LocalKafkaError, broker_answers

F = TypeVar("F", bound=Callable[..., Any])


@click.group()
@click.option("--bootstrap", envvar="ARBITER_BOOTSTRAP", help="Kafka bootstrap servers (host:port,...). "
              "Default: the local broker. Env: ARBITER_BOOTSTRAP.")
@click.option("--kafka-port", type=int, envvar="ARBITER_KAFKA_PORT",
              help="Port of the local broker. Env: ARBITER_KAFKA_PORT.")
@click.option("--home", type=click.Path(path_type=Path), envvar="ARBITER_HOME",
              help="Folder for the local broker's jars, data and logs. Env: ARBITER_HOME. Default: ./.arbiter")
@click.version_option(package_name="arbiter")
@click.pass_context
def main(ctx: click.Context, bootstrap: str | None, kafka_port: int | None, home: Path | None) -> None:
    """Arbiter: concurrency control for fleets of AI agents, on Apache Kafka."""
    ctx.obj = {"bootstrap": bootstrap, "kafka_port": kafka_port, "home": home}


# -- kafka ---------------------------------------------------------------------------


@main.group()
def kafka() -> None:
    """Run a local Apache Kafka broker (KRaft: one node, or a cluster on loopback) from Maven Central jars."""


def _local(ctx: click.Context, nodes: int | None = None) -> LocalKafka:
    try:
        return LocalKafka(settings_of(ctx), say=say, nodes=nodes)
    except LocalKafkaError as exc:
        fail(str(exc))


@kafka.command("up")
@click.option("--timeout", default=90.0, show_default=True, help="Seconds to wait for the broker to answer.")
@click.option("--secure/--plain", default=None,
              help="--secure: clients must log in (SASL/SCRAM-SHA-512) and ACLs confine each principal "
                   "(arbiter-admin, arbiter-worker, arbiter-agent; passwords in <home>/secure/credentials.json). "
                   "--plain: no authentication. Default: the mode the broker's data was made in (plain when new). "
                   "Switching mode needs 'arbiter kafka reset' first.")
@click.option("--nodes", type=click.IntRange(1, 9), default=None,
              help="How many KRaft nodes (broker and controller each) to run on 127.0.0.1; node i uses ports "
                   "ARBITER_KAFKA_PORT + 2(i-1) and ARBITER_KAFKA_CONTROLLER_PORT + 2(i-1). 3: replication factor 3, "
                   "min.insync.replicas 2. Default: the count the data was made with (1 when new). Changing it "
                   "needs 'arbiter kafka reset' first. Not with --secure.")
@click.pass_context
def kafka_up(ctx: click.Context, timeout: float, secure: bool | None, nodes: int | None) -> None:
    """Start the local broker, or every node of the local cluster that is down (fetches it the first
    time; harmless when it runs)."""
    local = _local(ctx, nodes)
    try:
        click.echo(f"kafka: {local.up(timeout, secure=secure)}")
    except LocalKafkaError as exc:
        fail(str(exc), exc.log_tail)
    if local.nodes > 1:
        click.echo(f"kafka: a cluster of {local.nodes} nodes: bootstrap {local.bootstrap}, replication factor "
                   f"{local.replication_factor}, min.insync.replicas {2 if local.replication_factor >= 3 else 1}. "
                   "arbiter commands with this home use it when no --bootstrap is given; elsewhere:")
        click.echo(f"export ARBITER_BOOTSTRAP={local.bootstrap} ARBITER_REPLICATION_FACTOR={local.replication_factor}")
    if local.mode() == "secure":
        click.echo("kafka: clients connect with ARBITER_KAFKA_SECURITY_PROTOCOL=SASL_PLAINTEXT, "
                   "ARBITER_KAFKA_USERNAME=<principal> and ARBITER_KAFKA_PASSWORD=<its password from "
                   f"{local.credentials_file}>")


@kafka.command("down")
@click.pass_context
def kafka_down(ctx: click.Context) -> None:
    """Stop the local broker (every node of a cluster) cleanly; its data stays."""
    click.echo(f"kafka: {_local(ctx).down()}")


@kafka.command("reset")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.pass_context
def kafka_reset(ctx: click.Context, yes: bool) -> None:
    """Stop the local broker (every node) and delete every message it holds; then any --nodes may start."""
    local = _local(ctx)
    if not yes:
        where = local.data if local.nodes == 1 else local.root / "nodes" / "*" / "data"
        click.confirm(f"Delete all Kafka data in {where}?", abort=True)
    click.echo(f"kafka: {local.reset()}")


@kafka.command("status")
@click.pass_context
def kafka_status(ctx: click.Context) -> None:
    """Say whether the local broker (every node) runs and answers. Exit 1 when it does not."""
    local = _local(ctx)
    answers = local.answers()
    if local.nodes == 1:
        pid = local.pid()
        running = f"running (pid {pid})" if pid else "not running"
    else:
        running = f"{local.nodes} nodes: " + ", ".join(f"{i} running (pid {pid})" if pid else f"{i} not running"
                                                       for i, pid in local.pids().items())
    verdict = "answers" if answers else "does not answer"
    click.echo(f"kafka: {running}; {local.bootstrap} {verdict if local.nodes == 1 else verdict + ' as a whole'}")
    sys.exit(0 if answers else 1)


# -- topics --------------------------------------------------------------------------


@main.group()
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
    except Exception as exc:
        fail(f"cannot reach Kafka at {settings.bootstrap}: {exc}")
    for state in states:
        click.echo(f"{'created' if state.created else 'exists '}  {state.name}  ({state.partitions} partitions)")


# -- worker --------------------------------------------------------------------------


@main.command()
@click.option("--loglevel", default="warning", show_default=True)
@click.pass_context
def worker(ctx: click.Context, loglevel: str) -> None:
    """Run a stream-processor worker. Start more to share the partitions."""
    settings = settings_of(ctx)
    if not broker_answers(settings.bootstrap, options=kafka_client_options(settings)):
        fail(f"no Kafka answers at {settings.bootstrap}; start one with 'arbiter kafka up' or pass --bootstrap")
    from .identitycli import ensure_worker_identity

    ensure_worker_identity(settings)
    from arbiter.streams.runtime.worker import run_worker

    run_worker(settings, loglevel)


@main.command()
@click.option("--host", default=None, help="Address to listen on (default ARBITER_DOOR_HOST, 127.0.0.1).")
@click.option("--port", type=int, default=None, help="Port (default ARBITER_DOOR_PORT, 8080; 0: any free one).")
@click.option("--ssl-certfile", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Serve HTTPS/WSS with this certificate (do so beyond loopback: API keys are bearer secrets).")
@click.option("--ssl-keyfile", type=click.Path(exists=True, dir_okay=False), default=None)
@click.option("--loglevel", default="warning", show_default=True)
@click.pass_context
def serve(ctx: click.Context, host: str | None, port: int | None, ssl_certfile: str | None,
          ssl_keyfile: str | None, loglevel: str) -> None:
    """Run the front door: HTTP and WebSocket access for agents in any language (docs at /docs)."""
    settings = settings_of(ctx)
    if not broker_answers(settings.bootstrap, options=kafka_client_options(settings)):
        fail(f"no Kafka answers at {settings.bootstrap}; start one with 'arbiter kafka up' or pass --bootstrap")
    from arbiter.door.serve import serve as run

    scheme = "https" if ssl_certfile else "http"
    where = f"{scheme}://{host or settings.door_host}:{settings.door_port if port is None else port}"
    say(f"front door on {where} (OpenAPI at {where}/openapi.json, docs at {where}/docs)")
    run(settings, host=host, port=port, loglevel=loglevel, ssl_certfile=ssl_certfile, ssl_keyfile=ssl_keyfile)


# -- ping ----------------------------------------------------------------------------


@main.command()
@click.option("--count", default=5, show_default=True, help="How many round trips.")
@click.option("--timeout", default=30.0, show_default=True, help="Seconds to wait for each answer.")
@click.pass_context
def ping(ctx: click.Context, count: int, timeout: float) -> None:
    """Round trips through the workers: a Ping command in, a Pong in the agent inbox out."""
    from arbiter.agents import ArbiterClient, ArbiterTimeout

    settings = settings_of(ctx)

    async def run() -> list[float]:
        rtts = []
        await ensure_identity(settings, "arbiter-cli")  # the operator's own probe identity (admin key: first use)
        async with ArbiterClient("arbiter-cli", settings) as client:
            for i in range(count):
                result = await client.ping(key=f"ping:{i}", timeout=timeout)
                rtts.append(result.rtt_ms)
                click.echo(f"pong from {result.worker_id} partition {result.partition}: {result.rtt_ms:.1f} ms")
        return rtts

    try:
        rtts = asyncio.run(run())
    except ArbiterTimeout as exc:
        fail(str(exc))
    except IdentityError as exc:
        fail(str(exc))
    if rtts:
        click.echo(f"{len(rtts)} round trips: median {statistics.median(rtts):.1f} ms, max {max(rtts):.1f} ms")


# -- lock ----------------------------------------------------------------------------


@main.group()
def lock() -> None:
    """Acquire, renew and release leases from a shell (for agents not written in Python).

    Every answer is one JSON object on stdout. Exit 0: done; 1: refused (the JSON is
    the diagnostic); 2: no answer in time.
    """


def _lock_call(ctx: click.Context, agent: str, work: Callable[[Any], Any]) -> None:
    from arbiter.agents import ArbiterClient, ArbiterTimeout, LeaseDenied

    settings = settings_of(ctx)

    async def run() -> Any:
        async with ArbiterClient(agent, settings) as client:
            return await work(client)

    try:
        result = asyncio.run(run())
    except IdentityError as exc:
        fail(str(exc), "Each agent signs its commands with its own key: 'arbiter agents add NAME' issues one.")
    except LeaseDenied as exc:
        click.echo(json.dumps(exc.diagnostic, sort_keys=True))
        sys.exit(1)
    except ArbiterTimeout as exc:
        click.secho(f"error: {exc}", fg="red", err=True)
        sys.exit(2)
    click.echo(json.dumps(result, sort_keys=True))


_agent_option = click.option("--agent", required=True, help="The agent id that holds or asks for the lease.")


@lock.command("acquire")
@click.argument("resource")
@_agent_option
@click.option("--ttl", default=30.0, show_default=True, help="Lease TTL in seconds.")
@click.option("--mode", type=click.Choice(["exclusive", "shared"]), default="exclusive", show_default=True)
@click.option("--wait", default=0.0, show_default=True, help="Seconds to wait in the queue (0: try once).")
@click.option("--priority", default=0, show_default=True, help="Queue priority; higher is served first.")
@click.pass_context
def lock_acquire(ctx: click.Context, resource: str, agent: str, ttl: float, mode: str, wait: float,
                 priority: int) -> None:
    """Acquire a lease. Prints its token; renew it before the TTL runs out."""

    async def work(client: Any) -> dict[str, Any]:
        lease = await client.acquire(resource, ttl=ttl, mode=mode, wait=wait, priority=priority)
        return {"resource": resource, "agent_id": agent, "token": lease.token, "mode": lease.mode,
                "expires_at_ms": lease.expires_at_ms, "resource_version": lease.resource_version,
                "warnings": lease.warnings}

    _lock_call(ctx, agent, work)


def _token_outcome(outcome: Any) -> dict[str, Any]:
    from arbiter.agents import LeaseDenied
    from arbiter.schemas import LockDenied

    if isinstance(outcome, LockDenied):
        raise LeaseDenied.from_event(outcome)
    data: dict[str, Any] = outcome.model_dump(exclude={"cause"})
    return data


@lock.command("renew")
@click.argument("resource")
@_agent_option
@click.option("--token", type=int, required=True, help="The lease's fencing token.")
@click.option("--ttl", type=float, default=None, help="New TTL in seconds (default: the lease's own).")
@click.pass_context
def lock_renew(ctx: click.Context, resource: str, agent: str, token: int, ttl: float | None) -> None:
    """Extend a lease you hold."""

    async def work(client: Any) -> dict[str, Any]:
        return _token_outcome(await client.renew_token(resource, token, ttl))

    _lock_call(ctx, agent, work)


@lock.command("release")
@click.argument("resource")
@_agent_option
@click.option("--token", type=int, required=True, help="The lease's fencing token.")
@click.pass_context
def lock_release(ctx: click.Context, resource: str, agent: str, token: int) -> None:
    """Give a lease back."""

    async def work(client: Any) -> dict[str, Any]:
        return _token_outcome(await client.release_token(resource, token))

    _lock_call(ctx, agent, work)


@lock.command("revoke")
@click.argument("resource")
@click.option("--agent", required=True, help="The agent whose lease (or queued request) to take away.")
@click.option("--reason", required=True, help="Why: kept in the log, shown by the audit as a human action.")
@click.pass_context
def lock_revoke(ctx: click.Context, resource: str, agent: str, reason: str) -> None:
    """An operator's override: force-release AGENT's lease on RESOURCE (signed with the admin key)."""
    from arbiter.agents.identities import Operator

    settings = settings_of(ctx)
    try:
        request_id = asyncio.run(Operator(settings).revoke(resource, agent, reason))
    except IdentityError as exc:
        fail(str(exc))
    click.echo(json.dumps({"requested": "revoke", "request_id": request_id, "resource": resource, "agent_id": agent,
                           "reason": reason}, sort_keys=True))


@lock.command("status")
@click.argument("resource")
@click.option("--agent", default=None, help="Show this agent's own tokens (other agents' are never shown).")
@click.option("--all-tokens", is_flag=True, help="Show every holder's token: for the operator (needs the "
                                                 "admin key in ARBITER_HOME).")
@click.pass_context
def lock_status(ctx: click.Context, resource: str, agent: str | None, all_tokens: bool) -> None:
    """Holders, waiters and the token high-water mark, folded from the event log. Other agents'
    tokens are shown as null."""
    from .audit.replay import TrustAnchorsMissing
    from .history import lease_book

    settings = settings_of(ctx)
    if all_tokens and not (settings.home / "keys" / "admin.key").exists():
        fail("--all-tokens is for the operator: this home holds no admin key")
    skipped: list[str] = []
    try:
        book = asyncio.run(lease_book(settings, resource, skipped))
    except TrustAnchorsMissing as exc:
        fail(str(exc))
    except Exception as exc:
        fail(f"cannot read the log at {settings.bootstrap}: {exc}")
    for line in skipped:
        say(f"left out a decision no worker signed: {line}")
    click.echo(json.dumps({
        "skipped_forged": len(skipped),
        "resource": resource,
        "high_water_token": book.last_token,
        "as_of_ms": book.clock_ms,
        "holders": [{"agent_id": h.agent_id, "token": h.token if all_tokens or h.agent_id == agent else None,
                     "mode": h.mode, "expires_at_ms": h.expires_at_ms} for h in book.holders.values()],
        "waiting": [{"agent_id": w.agent_id, "mode": w.mode, "priority": w.priority, "deadline_ms": w.deadline_ms}
                    for w in book.queue],
    }, sort_keys=True))


def _register_late_commands() -> None:
    from .audit.cli import COMMANDS
    from .chaos import chaos
    from .demo import demo
    from .identitycli import agents, saga

    main.add_command(demo)
    main.add_command(chaos)
    main.add_command(agents)
    main.add_command(saga)
    for command in COMMANDS:
        main.add_command(command)


_register_late_commands()
