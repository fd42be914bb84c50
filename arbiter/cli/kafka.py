"""``arbiter kafka``: a local Apache Kafka broker (KRaft) from Maven Central's jars."""

from __future__ import annotations

import sys

import click

from arbiter.cli.terminal import fail, say, settings_of
from arbiter.kafka import LocalKafka, LocalKafkaError, broker_answers


@click.group()
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
