"""The ``arbiter`` group: its options, and where each command lives (imported only when it runs or is
listed)."""

from __future__ import annotations

from pathlib import Path

import click

from .terminal import ArbiterGroup, quiet_kafka_logs


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


COMMANDS = {
    "kafka": "arbiter.cli.kafka:kafka", "topics": "arbiter.cli.topics:topics",
    "worker": "arbiter.cli.processes:worker", "runner": "arbiter.cli.processes:runner",
    "serve": "arbiter.cli.processes:serve", "console": "arbiter.cli.processes:console_",
    "ping": "arbiter.cli.ping:ping", "lock": "arbiter.cli.lock:lock",
    "agents": "arbiter.cli.identity:agents", "saga": "arbiter.cli.identity:saga",
    "sandbox": "arbiter.cli.sandbox:sandbox", "mcp": "arbiter.cli.coding:mcp", "hook": "arbiter.cli.coding:hook",
    "top": "arbiter.cli.top:top", "ledger": "arbiter.cli.ledger:ledger",
    "audit": "arbiter.cli.audit:audit", "replay": "arbiter.cli.audit:replay", "log": "arbiter.cli.audit:log_group",
    "demo": "arbiter.demo:demo", "chaos": "arbiter.chaos:chaos",
}
"""Every command: its name, and ``module:attribute``."""
main.lazy.update(COMMANDS)
