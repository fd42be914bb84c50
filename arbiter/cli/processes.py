"""``arbiter worker``, ``runner``, ``serve`` and ``console``: Arbiter's long-running processes."""

from __future__ import annotations

import asyncio
import signal
from typing import Any

import click

from arbiter.cli.terminal import fail, say, settings_of, unreachable
from arbiter.edge.kafkaauth import kafka_client_options
from arbiter.kafka import broker_answers


@click.command()
@click.option("--loglevel", default="info", show_default=True,
              help="info: a line when it starts, when it is ready (and on each rebalance), and its throughput "
                   "every 10 s while it works; warning: problems only.")
@click.pass_context
def worker(ctx: click.Context, loglevel: str) -> None:
    """Run a stream-processor worker. Start more to share the partitions."""
    settings = settings_of(ctx)
    if not broker_answers(settings.bootstrap, options=kafka_client_options(settings)):
        unreachable(settings.bootstrap)
    from .identity import ensure_worker_identity

    ensure_worker_identity(settings)
    from arbiter.streams.runtime.worker import run_worker

    run_worker(settings, loglevel)


@click.command()
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


@click.command()
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


@click.command("console")
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
