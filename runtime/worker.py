"""The faust application: settings reviewed for latency, and the processors wired up.

Processors stay thin: decode (dead-lettering what does not decode), hand the command
to a pure decision core, send the events it returns. Nothing else lives here.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any, cast

import faust
from faust.serializers import codecs

from contract import (
    Cause,
    ContractError,
    DeadlockDetected,
    LockTick,
    Ping,
    Pong,
    Record,
    ToolIntent,
    WaitEdgeAdded,
    WaitEdgeRemoved,
    default_codec,
)
from contract.settings import Settings
from cores.gateway import GatewayRules
from cores.leases import LeaseRules
from cores.saga import Saga
from cores.waitgraph import Edge, WaitGraph
from shells.deadletter import dead_letter
from shells.processors import Routes, edge_problem, on_edge, on_resource_command, on_saga, saga_key_problem
from shells.resource import (
    Outputs,
    ResourceShell,
    Send,
    ToolRunner,
    book_from_bytes,
    book_to_bytes,
    content_from_bytes,
    content_to_bytes,
)

from .transport import GapGuard, Transport

Handler = Callable[[Any, Record, Cause, int], Awaitable[None]]
"""handle(event, decoded record, cause, now_ms): one processor's decision."""
RESOURCE_PROCESSOR = "resource"
DEADLOCK_PROCESSOR = "deadlock"
SAGA_PROCESSOR = "saga"
TICK_KEY = b"__tick__"


class LeaseBookCodec(codecs.Codec):
    """faust codec for the lease table's values (compact JSON)."""

    def _dumps(self, obj: Any) -> bytes:
        return book_to_bytes(obj)

    def _loads(self, s: bytes) -> Any:
        return book_from_bytes(s)


class SagaCodec(codecs.Codec):
    """faust codec for the saga table's values (compact JSON)."""

    def _dumps(self, obj: Any) -> bytes:
        return json.dumps(obj.to_dict(), separators=(",", ":")).encode()

    def _loads(self, s: bytes) -> Any:
        return Saga.from_dict(json.loads(s))


class ContentStateCodec(codecs.Codec):
    """faust codec for the content table's values (compact JSON)."""

    def _dumps(self, obj: Any) -> bytes:
        return content_to_bytes(obj)

    def _loads(self, s: bytes) -> Any:
        return content_from_bytes(s)


codecs.register("arbiter-leasebook", LeaseBookCodec())
codecs.register("arbiter-content", ContentStateCodec())
codecs.register("arbiter-saga", SagaCodec())


class ArbiterApp(faust.App):
    """faust App that uses Arbiter's transport (see ``runtime.transport``)."""

    arbiter_fetch_max_wait_ms: int | None = None

    def _new_transport(self) -> Any:
        return Transport(self.conf.broker_consumer, self)


def worker_id(settings: Settings) -> str:
    """This worker's name in answers and diagnostics."""
    return settings.worker_id or f"{socket.gethostname()}:{os.getpid()}"


def lease_rules(settings: Settings) -> LeaseRules:
    """The lease book's rules from settings."""
    return LeaseRules(
        max_ttl_ms=settings.max_ttl_ms,
        max_wait_ms=settings.max_wait_ms,
        lock_order=settings.lock_order,
    )


def faust_settings(settings: Settings) -> dict[str, Any]:
    """faust settings, each chosen for Arbiter (README "Worker tuning" says why)."""
    settings.home.mkdir(parents=True, exist_ok=True)
    return {
        "broker": [f"kafka://{server}" for server in settings.bootstrap_list()],
        "processing_guarantee": settings.processing_guarantee,
        "topic_partitions": settings.partitions,
        "topic_replication_factor": settings.replication_factor,
        "broker_commit_interval": settings.commit_interval,
        "broker_session_timeout": settings.session_timeout,
        "broker_heartbeat_interval": settings.heartbeat_interval,
        "producer_linger_ms": settings.producer_linger_ms,
        "producer_max_request_size": 2 * settings.max_message_bytes,
        "consumer_auto_offset_reset": "earliest",
        # faust's standby replicas left the promoted partitions' recovery waiting
        # forever in our SIGKILL failover test ("No event received for active tp"),
        # a known class of faust recovery hangs. Without standbys the survivor replays
        # the changelog from the start: slower on big tables, but it completes.
        "table_standby_replicas": 0,
        "stream_wait_empty": False,
        "web_enabled": settings.web_port != 0,
        "web_port": settings.web_port or 6066,
        "datadir": str((settings.home / "worker-data").resolve()),
    }


def raw_key_table(app: faust.App, name: str, value_serializer: str, partitions: int) -> Any:
    """A changelogged table with bytes keys (the resource) and our own value codec.

    faust derives a table's serializers from faust Record types, else JSON, and
    ``app.Table`` creates the changelog topic at once. So the table is built by hand,
    its serializers set, and only then registered (which creates the changelog topic).
    """
    table: Any = cast(Any, app.conf.Table)(
        app, name=name, default=None, beacon=app.tables.beacon, partitions=partitions,
    )
    table.key_serializer = "raw"
    table.value_serializer = value_serializer
    return app.tables.add(table)


def shell_routes(settings: Settings) -> Routes:
    """Where the deadlock and saga processors send their outputs."""
    t = settings.topics
    return Routes(t.resource_commands, t.agent_inbox, t.wait_edges, t.saga_commands, t.saga_events)


def resource_shell(settings: Settings, books: Any, contents: Any, tools: ToolRunner, send: Send,
                   after_tool: Any = None) -> ResourceShell:
    """The resource processor's shell over ``books``/``contents`` (tables, or dicts in a replay)."""
    topics = settings.topics
    return ResourceShell(
        books=books, contents=contents, partitions=settings.partitions, rules=lease_rules(settings),
        gate_rules=GatewayRules(policies=Settings.parse_policies(settings.policies),
                                max_arguments_bytes=settings.max_patch_bytes),
        tools=tools,
        outputs=Outputs(topics.resource_events, topics.agent_inbox, topics.wait_edges, settings.graph_key.encode(),
                        saga_topic=topics.saga_commands),
        send=send, after_tool=after_tool or (lambda _intent: None),
    )


def default_tools(settings: Settings) -> ToolRunner:
    """The ledger's tools against the configured database."""
    from tools.ledger import Ledger, register_ledger_tools
    from tools.registry import ToolRegistry

    registry = ToolRegistry()
    register_ledger_tools(registry, Ledger(settings.ledger_url()))
    return registry


def failpoint(settings: Settings) -> Any:
    """``ARBITER_FAILPOINT=crash_after_tool:<intent id prefix>``: SIGKILL this worker right
    after the tool of the first intent whose id starts with the prefix ran, before its
    outcome is recorded. For crash tests only."""
    spec = os.environ.get("ARBITER_FAILPOINT", "")
    kind, _, target = spec.partition(":")
    if kind != "crash_after_tool" or not target:
        return lambda _intent: None

    def crash(intent: ToolIntent) -> None:
        if intent.intent_id.startswith(target):
            os.kill(os.getpid(), signal.SIGKILL)

    return crash


def restart_worker() -> None:
    """Replace this worker process with a fresh one (same arguments): it rejoins the group,
    rebuilds its tables and resumes every partition from the last committed offset."""
    logging.shutdown()
    os.execv(sys.executable, [sys.executable, "-m", "arbiter", *sys.argv[1:]])


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def create_app(settings: Settings, tools: ToolRunner | None = None) -> ArbiterApp:
    """Build the faust app and register every processor (``tools``: the ledger's by default)."""
    app = ArbiterApp(settings.app_id, **faust_settings(settings))
    app.arbiter_fetch_max_wait_ms = settings.fetch_max_wait_ms
    codec = default_codec(settings.max_message_bytes)
    me = worker_id(settings)
    topics = settings.topics

    def raw_topic(name: str) -> Any:
        return app.topic(name, key_type=bytes, value_type=bytes, key_serializer="raw", value_serializer="raw")

    commands = raw_topic(topics.resource_commands)
    dead_letters = raw_topic(topics.dead_letter)
    books = raw_key_table(app, "leases", "arbiter-leasebook", settings.partitions)
    contents = raw_key_table(app, "contents", "arbiter-content", settings.partitions)

    async def send(topic: str, key: bytes, record: Record) -> None:
        # Straight to faust's producer: Topic.send adds futures, callbacks and sensors
        # per message that cost more than the decision itself (README "Worker tuning").
        producer = await app.maybe_start_producer()
        await producer.send(topic, key, codec.encode(record), None, None, None)

    shell = resource_shell(settings, books, contents, tools or default_tools(settings), send, failpoint(settings))

    async def reject(event: Any, cause: Cause, error: ContractError, processor: str = RESOURCE_PROCESSOR) -> None:
        letter = dead_letter(error, processor=processor, source=cause, key=event.key,
                             value=bytes(event.value or b""), now_ms=_now_ms(),
                             max_message_bytes=settings.max_message_bytes)
        await dead_letters.send(key=event.key, value=codec.encode(letter))
        app.log.warning("dead-lettered %s[%d]@%d: %s", cause.topic, cause.partition, cause.offset, error)

    gaps = GapGuard(os.environ.pop(GapGuard.RESTART_ENV, "")) \
        if settings.processing_guarantee == "at_least_once" else None

    def processor(topic: Any, name: str, handle: Handler) -> None:
        """Register a thin processor: decode (dead-lettering what does not), then ``handle``."""

        async def run(stream: Any) -> None:
            async for event in stream.events():
                msg = event.message
                cause = Cause(topic=msg.topic, partition=msg.partition, offset=msg.offset)
                hole = gaps.observe(msg.topic, msg.partition, msg.generation_id, msg.offset) if gaps else None
                if hole is not None:
                    app.log.error("faust skipped %s[%d] offsets %d..%d; restarting this worker to decide them in "
                                  "log order", msg.topic, msg.partition, *hole)
                    os.environ[GapGuard.RESTART_ENV] = GapGuard.describe(msg.topic, msg.partition, hole[0])
                    restart_worker()
                try:
                    record: Record = codec.decode(event.value)
                except ContractError as error:
                    await reject(event, cause, error, name)
                    continue
                # The broker's append time: the same on every redelivery (see cores.leases).
                now_ms = round(msg.timestamp * 1000) if msg.timestamp else _now_ms()
                try:
                    await handle(event, record, cause, now_ms)
                except Exception as exc:
                    # A bug, not bad input. Carrying on would leave a table behind the events
                    # already sent, so stop the worker: it restarts from the last committed
                    # offset and rebuilds its tables from their changelogs.
                    app.log.exception("%s processor failed on %r; stopping the worker", name, msg)
                    await app.crash(exc)
                    raise

        run.__name__ = run.__qualname__ = f"{name}_processor"
        app.agent(topic, name=name)(run)

    async def handle(event: Any, command: Record, cause: Cause, now_ms: int) -> None:
        """Decide one resource command."""
        if isinstance(command, Ping):
            await send(topics.agent_inbox, command.agent_id.encode(), Pong(
                ping_id=command.ping_id, agent_id=command.agent_id, worker_id=me, decided_at_ms=now_ms,
                cause=cause))
            return
        problem = await on_resource_command(shell, event.key, command, now_ms, cause, app.consumer_generation_id)
        if problem is not None:
            await reject(event, cause, problem)

    routes = shell_routes(settings)
    edges_topic = raw_topic(topics.wait_edges)
    # One small changelog entry per edge (not the whole graph per write): the graph is
    # rebuilt in memory from the table after a rebalance. Key: graph key NUL edge id.
    edge_rows = raw_key_table(app, "waitedges", "raw", settings.partitions)
    graph_cache: dict[bytes, WaitGraph] = {}
    cache_generation: list[int | None] = [None]

    def graph_for(key: bytes) -> WaitGraph:
        if cache_generation[0] != app.consumer_generation_id:
            graph_cache.clear()
            cache_generation[0] = app.consumer_generation_id
        graph = graph_cache.get(key)
        if graph is None:
            graph = WaitGraph()
            prefix = key + b"\x00"
            for row_key, row in list(edge_rows.items()):
                if row_key.startswith(prefix):
                    edge_id = row_key[len(prefix):].decode()
                    if row == b"cancelled":
                        graph.cancelled[edge_id] = None
                    else:
                        graph.add(Edge.from_row(json.loads(row)))
            graph_cache[key] = graph
        return graph

    def save_graph(key: bytes, graph: WaitGraph, edges_before: set[str], cancelled_before: set[str]) -> None:
        prefix = key + b"\x00"
        for edge_id in edges_before - graph.edges.keys():
            edge_rows.pop(prefix + edge_id.encode(), None)
        for edge_id in graph.edges.keys() - edges_before:
            edge_rows[prefix + edge_id.encode()] = json.dumps(graph.edges[edge_id].to_row()).encode()
        for edge_id in graph.cancelled.keys() - cancelled_before:
            edge_rows[prefix + edge_id.encode()] = b"cancelled"
        for edge_id in cancelled_before - graph.cancelled.keys():
            if edge_id not in graph.edges:
                edge_rows.pop(prefix + edge_id.encode(), None)

    async def handle_edge(event: Any, edge: Record, cause: Cause, now_ms: int) -> None:
        """Fold one wait-for edge into its graph and act on the deadlocks it closes."""
        problem = edge_problem(edge)
        if problem is not None:
            await reject(event, cause, problem, DEADLOCK_PROCESSOR)
            return
        if isinstance(edge, DeadlockDetected):
            return  # our own decisions, logged beside the edges they were made from
        assert isinstance(edge, WaitEdgeAdded | WaitEdgeRemoved)
        graph = graph_for(event.key)
        edges_before, cancelled_before = set(graph.edges), set(graph.cancelled)
        for detection in await on_edge(graph, event.key, edge, now_ms, cause, routes, send):
            app.log.warning("deadlock %s: victim %s, cycle %s", detection.detection_id, detection.victim,
                            " -> ".join(detection.cycle))
        save_graph(event.key, graph, edges_before, cancelled_before)

    saga_topic = raw_topic(topics.saga_commands)
    sagas = raw_key_table(app, "sagas", "arbiter-saga", settings.partitions)

    async def handle_saga(event: Any, record: Record, cause: Cause, now_ms: int) -> None:
        """Decide one saga message: an agent's step or abort, or an answer to the saga's own agent."""
        problem = saga_key_problem(event.key, record)
        if problem is not None:
            await reject(event, cause, problem, SAGA_PROCESSOR)
            return
        saga_id = event.key.decode()
        saga = sagas.get(event.key) or Saga(saga_id)
        await on_saga(saga, event.key, record, now_ms, cause, routes, send)
        sagas[event.key] = saga

    processor(commands, RESOURCE_PROCESSOR, handle)
    processor(edges_topic, DEADLOCK_PROCESSOR, handle_edge)
    processor(saga_topic, SAGA_PROCESSOR, handle_saga)

    stall = {"remaining": -1, "since": time.monotonic()}

    @app.timer(interval=2.0, on_leader=False)  # type: ignore[untyped-decorator]
    async def recovery_watchdog() -> None:
        # faust's table recovery can wait forever for changelog messages that never come
        # (seen in our SIGKILL failover test; a known class of faust recovery hangs).
        # A worker whose recovery makes no progress for ARBITER_RECOVERY_STALL_SECONDS
        # starts itself afresh: same arguments, new process, recovery from scratch.
        recovery = cast(Any, app.tables).recovery
        now = time.monotonic()
        if not recovery.in_recovery:
            stall.update(remaining=-1, since=now)
            return
        remaining = recovery.active_remaining_total()
        if remaining != stall["remaining"]:
            stall.update(remaining=remaining, since=now)
            return
        if now - stall["since"] >= settings.recovery_stall_seconds:
            app.log.error("table recovery made no progress for %.0f s (%d changelog messages left); "
                          "restarting this worker", now - stall["since"], remaining)
            restart_worker()

    tick_ids = itertools.count()

    @app.timer(interval=settings.tick_interval_ms / 1000.0, on_leader=False)  # type: ignore[untyped-decorator]
    async def tick_owned_partitions() -> None:
        # One tick per partition this worker owns: expiry decisions go through the log.
        owned = sorted(tp.partition for tp in app.consumer.assignment() if tp.topic == topics.resource_commands)
        for partition in owned:
            tick = LockTick(tick_id=f"{me}:{partition}:{next(tick_ids)}", partition=partition, sent_at_ms=_now_ms())
            await commands.send(key=TICK_KEY, value=codec.encode(tick), partition=partition)

    return app
