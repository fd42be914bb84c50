"""The faust runtime, kept as the measured baseline: the processors on faust-streaming's stream path.

The design names faust-streaming; Arbiter's workers run on aiokafka instead
(``arbiter.streams.runtime.worker``), because faust's per-message path measured ~6,500
messages/s doing nothing, gap-acked offsets at rebalances and hung in recovery
(docs/architecture.md, "Runtime"). This app runs the very same per-input pipeline (``arbiter.streams.shells.pipeline``)
on faust, so ``python -m bench runtime`` compares the two runtimes on equal decisions;
``python -m bench.faust`` runs one such worker. Nothing Arbiter installs imports it.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import sys
import threading
import time
from typing import Any, cast

import faust
from aiokafka import AIOKafkaProducer
from faust.serializers import codecs

from arbiter.edge.clock import now_ms
from arbiter.edge.kafkaauth import faust_credentials, kafka_client_options
from arbiter.edge.keys import anchors_for, signer_for
from arbiter.edge.registryfeed import RegistryFeed
from arbiter.edge.settings import Settings
from arbiter.schemas import LockTick, Record, WorkerStarted, default_codec
from arbiter.schemas.identity import ACTIVE, ROLE_WORKER, Refused, Registry, Verified
from arbiter.streams.cores.saga import Saga
from arbiter.streams.runtime.common import default_tools, failpoint, worker_id
from arbiter.streams.shells import Rules, ToolRunner
from arbiter.streams.shells.pipeline import TICK_KEY, Pipeline, RawInput, input_topics
from arbiter.streams.shells.resource import book_from_bytes, book_to_bytes, content_from_bytes, content_to_bytes
from arbiter.streams.shells.trust import Gate, LiveTrust

from .transport import GapGuard, Transport


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
    """faust App that uses Arbiter's transport (see ``arbiter.streams.runtime.transport``)."""

    arbiter_fetch_max_wait_ms: int | None = None
    exit_after_crash_s: float = 15.0

    async def crash(self, reason: BaseException) -> None:
        """Crash as faust does, but never hang half-stopped: if the process is still here after
        ``exit_after_crash_s``, it exits 1 so that a supervisor can restart it."""
        timer = threading.Timer(self.exit_after_crash_s, os._exit, (1,))
        timer.daemon = True
        timer.start()
        await super().crash(reason)

    def _new_transport(self) -> Any:
        return Transport(self.conf.broker_consumer, self)


def faust_settings(settings: Settings) -> dict[str, Any]:
    """faust settings, each chosen for Arbiter (docs/architecture.md, "Worker tuning", says why)."""
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
        **broker_credentials(settings),
    }


def broker_credentials(settings: Settings) -> dict[str, Any]:
    """faust's ``broker_credentials`` for a broker with SASL logins (``arbiter kafka up --secure``)."""
    values = faust_credentials(settings)
    if values is None:
        return {}
    import ssl

    return {"broker_credentials": faust.SASLCredentials(
        username=values["username"], password=values["password"], mechanism=values["mechanism"],
        ssl_context=ssl.create_default_context() if values["ssl"] else None)}


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


def restart_worker() -> None:
    """Replace this worker process with a fresh one (same arguments): it rejoins the group,
    rebuilds its tables and resumes every partition from the last committed offset."""
    logging.shutdown()
    os.execv(sys.executable, [sys.executable, "-m", "bench.faust", *sys.argv[1:]])


def faust_app(settings: Settings, tools: ToolRunner | None = None) -> ArbiterApp:
    """Build the faust app and register every processor (``tools``: the ledger's by default)."""
    app = ArbiterApp(settings.app_id, **faust_settings(settings))
    app.arbiter_fetch_max_wait_ms = settings.fetch_max_wait_ms
    codec = default_codec(settings.max_message_bytes)
    me = worker_id(settings)
    topics = settings.topics
    rules = Rules.from_settings(settings)

    # Trust (docs/security.md): this worker signs all it sends; every input passes the gate.
    signer = signer_for(settings.home, settings.identity or ROLE_WORKER, settings.identity_key)
    registry = Registry(anchors_for(settings.home, settings.admin_public_keys))
    gate = Gate(registry, enabled=settings.verify_signatures)
    feed = RegistryFeed(registry, settings)
    feed_ready = asyncio.Event()
    feed_starting = asyncio.Lock()
    if not settings.verify_signatures:
        app.log.warning("SIGNATURE VERIFICATION IS OFF (ARBITER_VERIFY_SIGNATURES=false): any client with topic "
                        "access can act as any agent. Development only.")

    async def follow_registry() -> None:
        async with feed_starting:
            if feed_ready.is_set():
                return
            await feed.start()
            mine = registry.entries.get(signer.key_id)
            if settings.verify_signatures and (mine is None or mine.role != ROLE_WORKER or mine.status != ACTIVE):
                app.log.error("this worker's key %s (%s) is not registered as an active worker identity; run "
                              "'arbiter agents add %s --role worker'", signer.key_id[:16], signer.name, signer.name)
            feed_ready.set()

    def raw_topic(name: str) -> Any:
        return app.topic(name, key_type=bytes, value_type=bytes, key_serializer="raw", value_serializer="raw")

    async def send_bytes(topic: str, key: bytes, value: bytes) -> None:
        # Straight to faust's producer: Topic.send adds futures, callbacks and sensors
        # per message that cost more than the decision itself (docs/architecture.md, "Worker tuning").
        producer = await app.maybe_start_producer()
        await producer.send(topic, key, value, None, None, signer.sign(topic, key, value, now_ms()))

    async def send(topic: str, key: bytes, record: Record) -> None:
        await send_bytes(topic, key, codec.encode(record))

    def generation() -> int | None:
        return cast(int | None, app.consumer_generation_id)

    tables = {
        "books": raw_key_table(app, "leases", "arbiter-leasebook", settings.partitions),
        "contents": raw_key_table(app, "contents", "arbiter-content", settings.partitions),
        # One small changelog entry per edge (not the whole graph per write): the graph is
        # rebuilt in memory from the table after a rebalance.
        "graphs": raw_key_table(app, "waitedges", "raw", settings.partitions),
        "sagas": raw_key_table(app, "sagas", "arbiter-saga", settings.partitions),
    }
    runner = tools or default_tools(settings)

    class FaustTrust(LiveTrust):
        """The gate, once the registry is followed (faust starts tasks after the processors)."""

        async def admit(self, raw: RawInput, record: Record) -> Verified | Refused | None:
            if gate.enabled and not feed_ready.is_set():
                await follow_registry()
            return await super().admit(raw, record)

    trust = FaustTrust(gate, lambda: feed.catch_up(timeout=5.0), now_ms) if settings.verify_signatures else None

    def pipeline() -> Pipeline:
        """The one path of every input (``arbiter.streams.shells.pipeline``), over this app's tables: one per processor,
        since faust runs the three processors concurrently."""
        return Pipeline(rules, topics, settings.partitions, tables, runner, codec, trust=trust, worker_id=me,
                        generation=generation, after_tool=failpoint(settings),
                        on_detection=lambda d: app.log.warning("deadlock %s: victim %s, cycle %s", d.detection_id,
                                                               d.victim, " -> ".join(d.cycle)), clock=now_ms)

    gaps = GapGuard(os.environ.pop(GapGuard.RESTART_ENV, "")) \
        if settings.processing_guarantee == "at_least_once" else None

    def processor(topic_name: str) -> None:
        """Register one processor: every input through the pipeline, then its outputs to the producer."""
        path = pipeline()
        name = path.processors[topic_name]

        async def run(stream: Any) -> None:
            async for event in stream.events():
                msg = event.message
                hole = gaps.observe(msg.topic, msg.partition, msg.generation_id, msg.offset) if gaps else None
                if hole is not None:
                    app.log.error("faust skipped %s[%d] offsets %d..%d; restarting this worker to decide them in "
                                  "log order", msg.topic, msg.partition, *hole)
                    os.environ[GapGuard.RESTART_ENV] = GapGuard.describe(msg.topic, msg.partition, hole[0])
                    restart_worker()
                # The broker's append time: the same on every redelivery (see arbiter.streams.cores.leases).
                at_ms = round(msg.timestamp * 1000) if msg.timestamp else now_ms()
                outcome = await path.process(RawInput(msg.topic, msg.partition, msg.offset, event.key,
                                                      bytes(event.value or b""), tuple(msg.headers or ()), at_ms))
                # The decisions first, then the state that follows from them (docs/architecture.md, "Crash safety"): the
                # pipeline applied the table writes as the input finished; faust sends their changelog
                # after these records, and commits the offset once both are written.
                for topic, key, _record, value in outcome.outputs:
                    await send_bytes(topic, key, value)

        run.__name__ = run.__qualname__ = f"{name}_processor"
        app.agent(raw_topic(topic_name), name=name)(run)

    for topic_name in input_topics(topics):
        processor(topic_name)

    @app.task  # type: ignore[untyped-decorator]
    async def announce_rules() -> None:
        if settings.verify_signatures:
            await follow_registry()
        # The rules this worker decides by go into the log, so audit and replay use them.
        await send(topics.workers, me.encode(), WorkerStarted(
            worker_id=me, rules_json=rules.to_json(), processing_guarantee=settings.processing_guarantee,
            partitions=settings.partitions, at_ms=now_ms()))

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
    tick_producer: list[AIOKafkaProducer] = []

    @app.timer(interval=settings.tick_interval_ms / 1000.0, on_leader=False)  # type: ignore[untyped-decorator]
    async def tick_owned_partitions() -> None:
        # One tick per partition this worker owns: expiry decisions go through the log.
        # Sent by a producer of its own, never inside a transaction: under exactly_once faust puts
        # every write to a topic the worker consumes into that partition's transaction, which
        # commits only with consumed offsets, and an idle worker has none to commit.
        owned = sorted(tp.partition for tp in app.consumer.assignment() if tp.topic == topics.resource_commands)
        if not owned:
            return
        if not tick_producer:
            producer = AIOKafkaProducer(bootstrap_servers=settings.bootstrap, acks="all", linger_ms=0,
                                        **kafka_client_options(settings))
            await producer.start()
            tick_producer.append(producer)
        for partition in owned:
            tick = LockTick(request_id=f"{me}:{partition}:{next(tick_ids)}", partition=partition, at_ms=now_ms())
            value = codec.encode(tick)
            await tick_producer[0].send(topics.resource_commands, value, key=TICK_KEY, partition=partition,
                                        headers=signer.sign(topics.resource_commands, TICK_KEY, value, now_ms()))

    return app
