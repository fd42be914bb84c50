"""The ``arbiter`` command."""

from __future__ import annotations

import asyncio
import json
import signal
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click
from aiokafka.errors import KafkaError

from arbiter.agents.identities import ensure_identity
from arbiter.edge.kafkaauth import kafka_client_options
from arbiter.edge.kafkaconn import describe
from arbiter.edge.kafkaio import KafkaIOError
from arbiter.edge.settings import Settings
from arbiter.schemas.identity import IdentityError
from arbiter.streams.runtime.topics import TopicError, delete_topics_named, ensure_topics, live_topics, topic_sizes

from .answers import answer as _answer
from .answers import lock_run as _lock_run
from .console import ArbiterGroup, fail, quiet_kafka_logs, say, settings_of, unreachable
from .kafka import LocalKafka, LocalKafkaError, broker_answers

F = TypeVar("F", bound=Callable[..., Any])


@click.group(cls=ArbiterGroup)
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
    if ctx.invoked_subcommand not in ("worker", "serve", "runner"):
        quiet_kafka_logs()


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
    """Say whether the local broker (every node) runs and answers. Exit 1 when it does not serve (a
    cluster serves while a majority of its nodes, its KRaft quorum, does)."""
    local = _local(ctx)
    if local.nodes == 1:
        answers = local.answers()
        pid = local.pid()
        running = f"running (pid {pid})" if pid else "not running"
        click.echo(f"kafka: {running}; {local.bootstrap} {'answers' if answers else 'does not answer'}")
        sys.exit(0 if answers else 1)
    pids = local.pids()
    serving = [node.id for node in local.node_list if pids.get(node.id) and broker_answers(node.address, 2.0)]
    quorum = local.nodes // 2 + 1
    nodes = ", ".join(f"{i} {'serves' if i in serving else 'runs, does not answer' if pid else 'not running'}"
                      + (f" (pid {pid})" if pid else "") for i, pid in pids.items())
    serves = len(serving) >= quorum
    verdict = (f"the cluster serves ({len(serving)} of {local.nodes} nodes; it needs {quorum})" if serves
               else f"the cluster does not serve: {len(serving)} of {local.nodes} nodes answer, it needs {quorum}")
    click.echo(f"kafka: {local.nodes} nodes: {nodes}; {verdict}")
    sys.exit(0 if serves else 1)


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
    for state in states:
        click.echo(f"{'created' if state.created else 'exists '}  {state.name}  ({state.partitions} partitions)")


@topics.command("list")
@click.option("--prefix", default="", help="Only topics whose names start with this.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per topic.")
@click.pass_context
def topics_list(ctx: click.Context, prefix: str, as_json: bool) -> None:
    """Every topic on the broker (or those under --prefix), with its partitions and records."""
    settings = settings_of(ctx)
    sizes = _run_kafka(settings, topic_sizes(settings, prefix))
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
    names = [t.name for t in _run_kafka(settings, topic_sizes(settings, prefix))]
    live = [n for n in names if n in live_topics(settings)]
    if live and not yes:
        fail(f"{prefix!r} names {len(live)} of this configuration's own topics ({', '.join(live[:3])}"
             f"{', ...' if len(live) > 3 else ''}): the live log, the audit record",
             "add --yes to delete them anyway (nothing can bring them back)")
    if not names:
        say(f"no topics start with {prefix!r}")
        return
    deleted = _run_kafka(settings, delete_topics_named(settings, (prefix,)))
    say(f"deleted {deleted} topic(s) starting with {prefix!r}")


def _run_kafka(settings: Settings, work: Any) -> Any:
    try:
        return asyncio.run(work)
    except (KafkaError, KafkaIOError) as exc:
        unreachable(settings.bootstrap, describe(exc))


# -- worker --------------------------------------------------------------------------


@main.command()
@click.option("--loglevel", default="info", show_default=True,
              help="info: a line when it starts, when it is ready (and on each rebalance), and its throughput "
                   "every 10 s while it works; warning: problems only.")
@click.pass_context
def worker(ctx: click.Context, loglevel: str) -> None:
    """Run a stream-processor worker. Start more to share the partitions."""
    settings = settings_of(ctx)
    if not broker_answers(settings.bootstrap, options=kafka_client_options(settings)):
        unreachable(settings.bootstrap)
    from .identitycli import ensure_worker_identity

    ensure_worker_identity(settings)
    from arbiter.streams.runtime.worker import run_worker

    run_worker(settings, loglevel)


@main.command()
@click.option("--name", default="runner", show_default=True, help="Its identity (role runner): it signs verdicts.")
@click.option("--depth", type=click.IntRange(1, 64), default=4, show_default=True,
              help="How many merges of a train it checks at once, each on top of the ones ahead.")
@click.option("--loglevel", default="info", show_default=True)
@click.pass_context
def runner(ctx: click.Context, name: str, depth: int, loglevel: str) -> None:
    """Run a check runner: it checks every configured repository's merge train (repos.toml's checks) and
    signs each verdict. It needs the repositories' disk (read-only) and runs checks as ARBITER_CHECK_USER."""
    import logging

    from arbiter.edge.keys import identity_problem
    from arbiter.runner import serve
    from arbiter.streams.tools.checks import CheckUserError, check_account

    problem = identity_problem(name)
    if problem:
        fail(f"--name {name[:200]!r} cannot be a runner's identity: {problem}")
    settings = settings_of(ctx)
    if not broker_answers(settings.bootstrap, options=kafka_client_options(settings)):
        unreachable(settings.bootstrap)
    try:  # said once, at the start, rather than by every check it would refuse
        check_account(settings.check_user)
    except CheckUserError as exc:
        fail(str(exc))
    logging.basicConfig(level=loglevel.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop = asyncio.Event()

    async def run() -> None:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        await serve(settings, name, depth, stop)

    asyncio.run(run())


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
        unreachable(settings.bootstrap)
    from arbiter.door.serve import ListenError
    from arbiter.door.serve import serve as run

    def ready(door: Any, url: str) -> None:
        say(f"front door {door.id} ready on {url} (console at {url}/, OpenAPI at {url}/openapi.json, docs at "
            f"{url}/docs)")

    try:
        run(settings, host=host, port=port, loglevel=loglevel, ssl_certfile=ssl_certfile, ssl_keyfile=ssl_keyfile,
            on_ready=ready)
    except ListenError as exc:
        fail(str(exc.strerror), "choose another with --port (or ARBITER_DOOR_PORT)")


@main.command("console")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (beyond loopback the console asks for an admin's API key).")
@click.option("--port", type=int, default=8090, show_default=True, help="Port (0: any free one).")
@click.pass_context
def console_(ctx: click.Context, host: str, port: int) -> None:
    """Serve the live console (leases, waits, deadlocks, sagas, refusals, lag) when no front door runs: a
    door of its own, on loopback by default. A running door serves the same page at its /."""
    settings = settings_of(ctx)
    if not broker_answers(settings.bootstrap, options=kafka_client_options(settings)):
        unreachable(settings.bootstrap)
    from arbiter.door.serve import ListenError
    from arbiter.door.serve import serve as run

    def ready(_door: Any, url: str) -> None:
        say(f"console on {url}/ (Ctrl-C stops it)")

    try:
        run(settings.model_copy(update={"door_host": host}), host=host, port=port, loglevel="warning",
            on_ready=ready)
    except ListenError as exc:
        fail(str(exc.strerror), "choose another with --port")


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

    Every answer is one JSON object on stdout, whatever happens. Exit 0: done; 1: refused (the
    JSON is the diagnostic); 2: no answer in time (it may still be decided: retry with the same
    command); 3: Arbiter could not be reached (Kafka down: retry shortly); 4: this agent cannot
    act (no key for it, or a bad setting).
    """


def _lock_call(ctx: click.Context, agent: str, work: Callable[[Any], Any]) -> None:
    from arbiter.agents import ArbiterClient

    settings = settings_of(ctx)

    async def run() -> Any:
        async with ArbiterClient(agent, settings) as client:
            return await work(client)

    _answer(_lock_run(settings, run()))


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
        from arbiter.schemas import LockDenied
        from arbiter.schemas.reasons import Reason

        outcome = await client.release_token(resource, token)
        if isinstance(outcome, LockDenied) and outcome.reason in (Reason.LEASE_NOT_LIVE, Reason.STALE_FENCING_TOKEN):
            # Already gone: not an error (the front door answers the same, 200 with released: false).
            return {"released": False, "resource": resource, "token": token, "reason": outcome.reason,
                    "detail": "the lease was already gone (not an error)"}
        return {"released": True, **_token_outcome(outcome)}

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
    request_id = _lock_run(settings, Operator(settings).revoke(resource, agent, reason))
    _answer({"requested": "revoke", "request_id": request_id, "resource": resource, "agent_id": agent,
             "reason": reason})


@lock.command("status")
@click.argument("resource")
@click.option("--agent", default=None, help="Show this agent's own tokens (other agents' are never shown).")
@click.option("--all-tokens", is_flag=True, help="Show every holder's token: for the operator (needs the "
                                                 "admin key in ARBITER_HOME).")
@click.pass_context
def lock_status(ctx: click.Context, resource: str, agent: str | None, all_tokens: bool) -> None:
    """Holders, waiters and the token high-water mark, folded from the event log. Other agents'
    tokens are shown as null."""
    from .history import lease_book

    settings = settings_of(ctx)
    if all_tokens and not (settings.home / "keys" / "admin.key").exists():
        _answer({"reason": "no_identity", "detail": "--all-tokens is for the operator: this home holds no admin key",
                 "what_to_do": "Run it where the admin key is, or leave out --all-tokens."}, "no_identity")
    skipped: list[str] = []
    book = _lock_run(settings, lease_book(settings, resource, skipped))
    for line in skipped:
        say(f"left out a decision no worker signed: {line}")
    _answer({
        "skipped_forged": len(skipped),
        "resource": resource,
        "high_water_token": book.last_token,
        "as_of_ms": book.clock_ms,
        "holders": [{"agent_id": h.agent_id, "token": h.token if all_tokens or h.agent_id == agent else None,
                     "mode": h.mode, "expires_at_ms": h.expires_at_ms} for h in book.holders.values()],
        "waiting": [{"agent_id": w.agent_id, "mode": w.mode, "priority": w.priority, "deadline_ms": w.deadline_ms}
                    for w in book.queue],
    })


def _register_late_commands() -> None:
    from .audit.cli import COMMANDS
    from .chaos import chaos
    from .demo import demo
    from .identitycli import agents, saga
    from .ledgercli import ledger
    from .mcpcli import hook, mcp
    from .sandboxcli import sandbox
    from .topcli import top

    main.add_command(demo)
    main.add_command(ledger)
    main.add_command(sandbox)
    main.add_command(mcp)
    main.add_command(hook)
    main.add_command(top)
    main.add_command(chaos)
    main.add_command(agents)
    main.add_command(saga)
    for command in COMMANDS:
        main.add_command(command)


_register_late_commands()
