"""The worker: the processors on a Kafka consumer group, one fetched batch at a time.

Theory of operation
-------------------
One consumer, in the ``app_id`` group, reads the three input topics (resource
commands, wait edges, saga commands): librdkafka's (``arbiter.edge.kafkaio.group``), or
aiokafka's with ``kafka_client=aiokafka``; both answer the same few calls. ``getmany`` hands back whatever
has arrived (a batch is never waited for), and each batch goes through four steps under one
lock:

1. **Decide.** Every record, partition by partition in log order, through the one path
   every input takes (``arbiter.streams.shells.pipeline``): decode, the trust gate, the
   partition its key hashes to, the topic's shell over per-input views of the tables, the
   encoding of its outputs. A refused input is answered and dead-lettered; one that raises anywhere is
   quarantined (nothing it caused is kept) and dead-lettered ``processor_failed``.
2. **Produce** every output of the batch, signed, in decision order.
3. **Write the changelog**: one record per table key the batch changed (its last value,
   or a tombstone), to the changelog partition of the input partition that changed it.
4. **Commit** the batch's offsets, only once 2 and 3 are acknowledged (``acks=all``).

Under ``exactly_once`` steps 2-4 are one Kafka transaction per input partition, through a
producer whose ``transactional_id`` names that partition (``RdTxnProducer``), so the worker
that takes a partition over fences the one that had it (``init_transactions``) before it reads
the partition's changelog. Under ``at_least_once`` a crash between 2 and 4 redelivers the
batch, and the decisions are idempotent (request and intent ids are remembered; time is
the broker's append time, the same on every delivery).

State: each table lives in memory for the partitions this worker owns (``ChangelogTable``),
and is rebuilt from its compacted changelog topic when a partition is assigned
(``on_partitions_assigned``, before any of its inputs is decided). A partition this worker
kept across a rebalance, whose committed offset nobody else moved, keeps its state.

A failure to produce or commit (a broker gone, a fenced producer) rewinds the batch's
partitions: their state is rebuilt from the changelog and their positions go back to the
last committed offset, then the loop carries on. Nothing restarts the process.

Time: every ``tick_interval_ms`` a task sends a ``LockTick`` into each owned resource partition
where a deadline is due (``ResourceShell.next_due``), outside any transaction; an idle worker
writes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import time
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import KafkaError, ProducerFenced
from aiokafka.structs import ConsumerRecord

from arbiter.edge.clock import now_ms
from arbiter.edge.kafkaauth import kafka_client_options
from arbiter.edge.kafkaconn import Repeats, close_client, describe
from arbiter.edge.kafkaio import Fetch, KafkaIOError, Reader
from arbiter.edge.kafkaio.group import RdGroup, RdProducer, RdTxnProducer
from arbiter.edge.kafkaio.rdkafka import RdReader
from arbiter.edge.keys import anchors_for, signer_for
from arbiter.edge.registryfeed import RegistryFeed
from arbiter.edge.settings import Settings
from arbiter.schemas import ContractError, LockTick, Record, WorkerStarted, default_codec
from arbiter.schemas.identity import ACTIVE, ROLE_WORKER, Registry
from arbiter.schemas.partitioning import partition_for
from arbiter.schemas.reasons import Reason
from arbiter.streams.runtime.common import (
    TABLES,
    TableSpec,
    default_tools,
    failpoint,
    lost_outputs_failpoint,
    worker_id,
)
from arbiter.streams.runtime.metrics import WorkerMetrics
from arbiter.streams.runtime.topics import TopicError, ensure_changelogs, ensure_topics, group_session_bounds
from arbiter.streams.shells import Rules, ToolRunner
from arbiter.streams.shells.pipeline import TICK_KEY, Pipeline, RawInput, input_topics, processor_of
from arbiter.streams.shells.trust import Gate, LiveTrust

log = logging.getLogger("arbiter.worker")
_tick_log = logging.getLogger("arbiter.worker.ticks")
_tick_log.addFilter(Repeats())  # a tick per partition a second: in an outage, one line per 30 s says it

KAFKA_ERRORS = (KafkaError, KafkaIOError)
"""A Kafka call failed: aiokafka's errors, or the librdkafka seam's."""
Encoded = tuple[str, bytes, bytes]
"""(topic, key, encoded value): one output to produce (the pipeline's ``Output``, its record left behind)."""
REPORT_S = 10.0
STOP_BUDGET = 12.0
"""Seconds a stopping worker spends settling and closing at most (docs/operations.md: SIGTERM exits within 15 s)."""
EXIT_UNAVAILABLE = 3
"""The worker's exit status when it could not start because Kafka did not answer."""
BATCH_BYTES = 1024 * 1024
"""Most bytes per produced batch (per partition); a bigger output goes in a batch of its own."""

GC_THRESHOLDS = (20_000, 20, 20)
"""The collector's thresholds in a worker (CPython's are 700, 10, 10): a young collection once
20,000 more containers were made than freed, not 700. Reference counting frees nearly all of
what a decision makes; what survives is state the collector would walk again and again."""


def _settle_heap() -> None:
    """After a restore: collect once, then move everything that survives (the restored state,
    long-lived) out of the collector's sight, so the young collections stop walking it."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()


class ChangelogTable(MutableMapping[bytes, Any]):
    """One table's values for the partitions this worker owns, and the keys a batch changed.

    Writes land in the partition ``partition`` names (the runtime sets it to the input's);
    ``changes`` lists each changed (partition, key) once, for the changelog. A table whose spec has
    ``rows`` writes, per value, its new rows, its record, then its rows' tombstones (``RowSpec``).
    """

    def __init__(self, spec: TableSpec, topic: str) -> None:
        self.spec = spec
        self.topic = topic
        self.data: dict[bytes, Any] = {}
        self.home: dict[bytes, int] = {}
        self.partition = -1
        self.changes: dict[tuple[int, bytes], None] = {}
        self.gone: dict[tuple[int, bytes], list[bytes]] = {}
        """Per (partition, key) deleted since the changelog was last taken: the rows to tombstone."""

    def __getitem__(self, key: bytes) -> Any:
        return self.data[key]

    def __setitem__(self, key: bytes, value: Any) -> None:
        old = self.data.get(key)
        if old is not None and old is not value and self.spec.rows is not None:
            self.gone.setdefault((self.partition, key), []).extend(self.spec.rows.keys(old))
        self.data[key] = value
        self.home[key] = self.partition
        self.changes[(self.partition, key)] = None

    def __delitem__(self, key: bytes) -> None:
        old = self.data.pop(key)
        if self.spec.rows is not None:
            self.gone.setdefault((self.partition, key), []).extend(self.spec.rows.keys(old))
        self.home.pop(key, None)
        self.changes[(self.partition, key)] = None

    def __iter__(self) -> Iterator[bytes]:
        return iter(list(self.data))

    def __len__(self) -> int:
        return len(self.data)

    def load(self, partition: int, key: bytes | None, value: bytes | None) -> None:
        """Apply one changelog record (restoring a partition)."""
        if key is None:
            return
        if value is None:
            self.data.pop(key, None)
            self.home.pop(key, None)
        else:
            self.data[key] = self.spec.loads(value)
            self.home[key] = partition

    def load_rows(self, partition: int, rows: list[tuple[bytes, bytes | None]]) -> None:
        """Apply the row records of ``partition`` (the last record per row key), after ``load``."""
        spec = self.spec.rows
        assert spec is not None
        by_value: dict[bytes, list[tuple[bytes, bytes]]] = {}
        for row_key, value in rows:
            if value is not None:
                key, item = spec.split(row_key)
                by_value.setdefault(key, []).append((item, value))
        for key, items in by_value.items():
            if self.home.get(key) == partition:  # (rows of a value gone are tombstoned with it)
                spec.attach(self.data[key], items)

    def drop(self, partitions: set[int]) -> None:
        """Forget every key of ``partitions`` (no longer owned, or about to be restored)."""
        for key in [k for k, p in self.home.items() if p in partitions]:
            del self.data[key]
            del self.home[key]
        self.changes = {c: None for c in self.changes if c[0] not in partitions}
        self.gone = {c: rows for c, rows in self.gone.items() if c[0] not in partitions}

    def take_changes(self, partitions: set[int] | None = None) -> list[tuple[str, int, bytes, bytes | None]]:
        """The changelog records (topic, partition, key, value or tombstone) for what changed (in
        ``partitions``, or all), forgetting them."""
        out: list[tuple[str, int, bytes, bytes | None]] = []
        rows = self.spec.rows
        for partition, key in list(self.changes):
            if partitions is not None and partition not in partitions:
                continue
            del self.changes[(partition, key)]
            value = self.data.get(key) if self.home.get(key) == partition else None
            if rows is None:
                out.append((self.topic, partition, key, None if value is None else self.spec.dumps(value)))
                continue
            # New rows, the record, then the tombstones (see RowSpec): all in this partition, in this order.
            taken = [] if value is None else rows.take(value)
            written = {item for item, row in taken if row is not None}
            out.extend((self.topic, partition, rows.row_key(key, item), row) for item, row in taken if row is not None)
            out.append((self.topic, partition, key, None if value is None else rows.head(value)))
            gone = [*self.gone.pop((partition, key), ()), *(item for item, row in taken if row is None)]
            out.extend((self.topic, partition, rows.row_key(key, item), None)
                       for item in dict.fromkeys(gone) if item not in written)
        return out


class Clients(Protocol):
    """Where a worker's Kafka clients come from instead of the ``kafka_client`` setting: a simulation's
    (``arbiter.sim``), with librdkafka's interfaces (``arbiter.edge.kafkaio.group``)."""

    async def prepare(self, changelogs: list[str]) -> None:
        """Create the topics and these changelogs if they do not exist."""

    def producer(self) -> Any:
        """A producer like ``RdProducer``."""

    def reader(self) -> Reader:
        """A reader for the changelogs (the seam's)."""

    def group(self, member_id: str, group_id: str, session_ms: int) -> Any:
        """A group member like ``RdGroup``."""

    def transactional(self, transactional_id: str) -> Any:
        """A transactional producer like ``RdTxnProducer``."""


class _Listener(ConsumerRebalanceListener):  # type: ignore[misc]  # aiokafka ships no types: its base is Any here
    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    async def on_partitions_revoked(self, revoked: Any) -> None:
        await self.worker.revoked(set(revoked))

    async def on_partitions_assigned(self, assigned: Any) -> None:
        try:
            await self.worker.assigned(set(assigned))
        except Exception:
            # aiokafka would log this and carry on with partitions whose state is missing: stop instead.
            log.exception("taking over %s failed; stopping this worker", _names(set(assigned)))
            self.worker.exit_code = 1
            self.worker.stop()


class Worker:
    """One worker process: the three processors, their tables, the clock, the trust gate."""

    def __init__(self, settings: Settings, tools: ToolRunner | None = None, clients: Clients | None = None) -> None:
        self.settings = settings
        self.clients = clients
        """Where its Kafka clients come from, when not from the ``kafka_client`` setting (a simulation's)."""
        self.me = worker_id(settings)
        self.codec = default_codec(settings.max_message_bytes)
        self.kafka = kafka_client_options(settings)
        self._lose_outputs = None if (prefix := lost_outputs_failpoint()) is None else prefix.encode()
        self.rules = Rules.from_settings(settings)
        self.exactly_once = settings.processing_guarantee == "exactly_once"
        self.rdkafka = settings.kafka_client == "librdkafka" or clients is not None
        """The input consumer, the producers and the restorer on librdkafka (``arbiter.edge.kafkaio``), or
        ``clients`` with their interface; aiokafka's with ``kafka_client=aiokafka``."""
        self.signer = signer_for(settings.home, settings.identity or ROLE_WORKER, settings.identity_key)
        self.registry = Registry(anchors_for(settings.home, settings.admin_public_keys))
        self.gate = Gate(self.registry, enabled=settings.verify_signatures)
        self.feed = RegistryFeed(self.registry, settings)
        self.tables = {name: ChangelogTable(spec, spec.changelog(settings.app_id)) for name, spec in TABLES.items()}
        processors = processor_of(settings.topics)
        self.inputs = input_topics(settings.topics)
        self.tables_of = {topic: [t for t in self.tables.values() if t.spec.processor == processors[topic]]
                          for topic in self.inputs}
        """Each input topic's tables (their changelog partitions follow the input's)."""
        self.generation = 0
        self.owned: set[TopicPartition] = set()
        self.revoking: set[TopicPartition] = set()
        """Partitions revoked, until the rebalance assigns again: none of their inputs is decided meanwhile,
        and a transaction of one that fails was fenced by the next owner (it is not rewound here)."""
        self.next: dict[TopicPartition, int] = {}
        """Per owned partition, the offset after the last input decided and committed."""
        self.decided_to: dict[TopicPartition, int] = {}
        """Per owned partition, the offset after the last input decided (committed or in flight)."""
        self._inflight: asyncio.Task[None] | None = None
        """The last batch on its way: its outputs, then its changelog, then its commit (``_settle``)."""
        self._acked: asyncio.Future[None] | None = None
        """Done once that batch's outputs are acknowledged (the next batch's go out then)."""
        self._uncommitted: dict[TopicPartition, int] = {}
        """Offsets whose commit failed, decisions and changelog written: the next commit carries them."""
        self.lock = asyncio.Lock()
        self.stopping = asyncio.Event()
        self.stop_asked: float | None = None
        """When (``time.monotonic``) the stop was asked for: what the log's time to stop counts from."""
        self.exit_code = 0
        self.consumer: Any = None
        """The input consumer: an ``AIOKafkaConsumer``, or an ``RdGroup`` (``self.rdkafka``)."""
        self.producer: Any = None
        """Outputs under at_least_once; ticks and announcements always (never in a transaction)."""
        self.transactional: dict[TopicPartition, Any] = {}
        """Under exactly_once, each owned input partition's transactional producer (``RdTxnProducer``, or
        aiokafka's)."""
        self.restorer: Any = None
        """What reads the changelogs back: the seam's ``RdReader``, or an ``AIOKafkaConsumer``."""
        self.pipeline = Pipeline(
            self.rules, settings.topics, settings.partitions, self.tables, tools or default_tools(settings),
            self.codec, trust=LiveTrust(self.gate, lambda: self.feed.catch_up(timeout=5.0), now_ms)
            if settings.verify_signatures else None,
            worker_id=self.me, generation=lambda: self.generation, after_tool=failpoint(settings),
            on_detection=lambda d: log.warning("deadlock %s: victim %s, cycle %s", d.detection_id, d.victim,
                                               " -> ".join(d.cycle)), clock=now_ms)
        self.decided = 0
        self._ticks = 0
        self.stats = _Stats()
        self.metrics = WorkerMetrics(books=lambda: self.tables.get("books"))
        self.processor_of = processors
        self._metrics_server: Any = None
        self._retries: set[asyncio.Task[None]] = set()

    # -- wiring -----------------------------------------------------------------------

    def _producer(self, transactional_id: str | None = None) -> AIOKafkaProducer:
        return AIOKafkaProducer(
            bootstrap_servers=self.settings.bootstrap, acks="all", enable_idempotence=True,
            linger_ms=self.settings.producer_linger_ms, max_request_size=2 * self.settings.max_message_bytes,
            max_batch_size=max(BATCH_BYTES, 2 * self.settings.max_message_bytes),
            transactional_id=transactional_id, **self.kafka)

    def _batches(self, producer: Any = None) -> _Batches | _RdBatches:
        """A packer of records for ``producer`` (default: the worker's own)."""
        producer = self.producer if producer is None else producer
        return _RdBatches(producer) if self.rdkafka else _Batches(producer)

    # -- lifecycle --------------------------------------------------------------------

    async def run(self) -> None:
        """Run until SIGTERM/SIGINT (or ``stop``); leave the group on the way out."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.stop)
        settings = self.settings
        if not settings.verify_signatures:
            log.warning("SIGNATURE VERIFICATION IS OFF (ARBITER_VERIFY_SIGNATURES=false): any client with topic "
                        "access can act as any agent. Development only.")
        if not await self._started():
            return
        if settings.metrics_port:
            try:
                self._metrics_server = self.metrics.serve(settings.metrics_port, settings.metrics_host,
                                                          settings.metrics_allowed_hosts)
                log.info("metrics on http://%s:%d/metrics", settings.metrics_host, settings.metrics_port)
            except OSError as exc:  # another worker on this machine has the port: decide anyway, say so
                log.error("metrics not served: %s:%d: %s", settings.metrics_host, settings.metrics_port, exc)
        gc.set_threshold(*GC_THRESHOLDS)
        ticker = asyncio.create_task(self._tick_forever(), name="arbiter-ticks")
        lease = self.rules.leases
        log.info("worker %s started on %s: %s, signatures %s; rules: max ttl %g s, max wait %g s, lock order %s, id "
                 "window %g s, policies %s; waiting for partitions from group %s", self.me,
                 "librdkafka" if self.rdkafka else "aiokafka", settings.processing_guarantee,
                 "verified" if settings.verify_signatures else "NOT verified",
                 lease.max_ttl_ms / 1000, lease.max_wait_ms / 1000, lease.lock_order, lease.id_window_ms / 1000,
                 settings.policies, settings.app_id)
        await self._consume_until_stopped(ticker)

    async def _started(self) -> bool:
        """Start (``_start``) unless a stop comes first; whether it started. A failure to start is closed
        and logged with the exit status it means, or raised when it is not Kafka's or the topics'."""
        # Starting needs Kafka; a stop asked for meanwhile ends it (no broker: it would wait for ever).
        starting = asyncio.ensure_future(self._start())
        stop = asyncio.ensure_future(self.stopping.wait())
        try:
            await asyncio.wait({starting, stop}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the worker's own task is cancelled: so is its start
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
            raise
        finally:
            stop.cancel()
        if not starting.done():
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
            log.info("worker %s stopped before it was ready", self.me)
            await self._close()
            return False
        failed = starting.exception()
        if failed is None:
            return True
        await self._close()
        if isinstance(failed, TopicError):
            log.error("worker %s could not start: %s", self.me, failed)
            self.exit_code = 1
        elif isinstance(failed, KafkaError | KafkaIOError | OSError | TimeoutError):
            log.error("worker %s could not start: Kafka at %s: %s", self.me, self.settings.bootstrap,
                      describe(failed))
            self.exit_code = EXIT_UNAVAILABLE
        else:
            raise failed
        return False

    async def _consume_until_stopped(self, ticker: asyncio.Task[None]) -> None:
        """Decide batches until the stop; then stop ``ticker`` and the retries, let the batch under way
        finish (within a quarter of the stop budget) and close. A failure of the consuming loop is raised."""
        consuming = asyncio.ensure_future(self._consume())
        stop = asyncio.ensure_future(self.stopping.wait())
        try:
            await asyncio.wait({consuming, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            ticker.cancel()
            # A batch under way when the stop came (its sends waiting on an unreachable broker, say)
            # gets a quarter of the stop budget to finish; then it is cut short, uncommitted.
            if not consuming.done():
                done, _pending = await asyncio.wait({consuming}, timeout=STOP_BUDGET / 4)
                if not done:
                    log.warning("the batch under way did not finish within %g s; stopping without it",
                                STOP_BUDGET / 4)
                    consuming.cancel()
            for retry in list(self._retries):
                retry.cancel()
            await asyncio.gather(ticker, consuming, *self._retries, return_exceptions=True)
            await self._close()
        if not consuming.cancelled() and consuming.exception() is not None:
            raise cast(BaseException, consuming.exception())

    async def _start(self) -> None:
        """Topics, registry, producers and the group membership: everything before the first batch."""
        settings = self.settings
        if self.clients is not None:
            await self.clients.prepare([t.topic for t in self.tables.values()])
        else:
            await ensure_topics(settings)
            await ensure_changelogs(settings, [t.topic for t in self.tables.values()])
        await self.feed.start()
        mine = self.registry.entries.get(self.signer.key_id)
        if settings.verify_signatures and (mine is None or mine.role != ROLE_WORKER or mine.status != ACTIVE):
            log.error("this worker's key %s (%s) is not registered as an active worker identity; run "
                      "'arbiter agents add %s --role worker'", self.signer.key_id[:16], self.signer.name,
                      self.signer.name)
        self.producer = (self.clients.producer() if self.clients is not None else RdProducer(settings)
                         if self.rdkafka else self._producer())
        await self.producer.start()
        if self.clients is not None:
            self.restorer = self.clients.reader()
        elif self.rdkafka:
            self.restorer = RdReader(settings, Fetch(max_wait_ms=settings.fetch_max_wait_ms,
                                                     max_partition_bytes=2 * settings.max_message_bytes))
        else:
            self.restorer = AIOKafkaConsumer(bootstrap_servers=settings.bootstrap, group_id=None,
                                             enable_auto_commit=False, isolation_level="read_committed",
                                             fetch_max_wait_ms=settings.fetch_max_wait_ms, **self.kafka)
        await self.restorer.start()
        # The rules this worker decides by go into the log, so audit and replay use them.
        await self._send_now(settings.topics.workers, self.me.encode(), WorkerStarted(
            worker_id=self.me, rules_json=self.rules.to_json(), processing_guarantee=settings.processing_guarantee,
            partitions=settings.partitions, at_ms=now_ms()))
        session, heartbeat = await self._session_timeouts()
        if self.rdkafka:
            self.consumer = (self.clients.group(self.me, settings.app_id, round(session * 1000))
                             if self.clients is not None else
                             RdGroup(settings, client_id=self.me, group_id=settings.app_id,
                                     session_ms=round(session * 1000), heartbeat_ms=round(heartbeat * 1000),
                                     rebalance_ms=max(30_000, round(3 * session * 1000)),
                                     max_batch=settings.max_batch))
            self.consumer.subscribe(sorted(self.inputs), listener=_Listener(self))
            await self.consumer.start()
            return
        self.consumer = AIOKafkaConsumer(
            # Its client id is the worker's: the group's members say which workers run (the console shows them).
            client_id=self.me, bootstrap_servers=settings.bootstrap, group_id=settings.app_id, enable_auto_commit=False,
            auto_offset_reset="earliest", isolation_level="read_committed",
            fetch_max_wait_ms=settings.fetch_max_wait_ms,
            session_timeout_ms=round(session * 1000),
            heartbeat_interval_ms=round(heartbeat * 1000),
            # How long a rebalance waits for the living members to rejoin. aiokafka defaults it to the
            # session timeout: with a short one, a member still settling its last batch was dropped,
            # rejoined, and set off the next rebalance (a storm). A dead member is already gone by
            # then (its session expired), so a longer wait costs a failover nothing.
            rebalance_timeout_ms=max(30_000, round(3 * session * 1000)),
            max_partition_fetch_bytes=2 * settings.max_message_bytes, **self.kafka)
        self.consumer.subscribe(sorted(self.inputs), listener=_Listener(self))
        await self.consumer.start()

    async def _session_timeouts(self) -> tuple[float, float]:
        """The session timeout (how long after a crash the group moves a worker's partitions: the
        failover time's largest part) and heartbeat interval to use: the configured ones, brought
        within what the brokers accept (a broker refuses a group member outside its bounds)."""
        session = self.settings.session_timeout
        bounds = None if self.clients is not None else await group_session_bounds(self.settings)
        if bounds is not None and not bounds[0] <= session <= bounds[1]:
            wanted, session = session, min(max(session, bounds[0]), bounds[1])
            log.warning("the brokers accept session timeouts of %g to %g s (group.min/max.session.timeout.ms), "
                        "not ARBITER_SESSION_TIMEOUT=%g: using %g s, so a killed worker's partitions move after "
                        "that long. Lower group.min.session.timeout.ms for fast failover ('arbiter kafka up' does).",
                        bounds[0], bounds[1], wanted, session)
        return session, min(self.settings.heartbeat_interval, session / 3)

    def stop(self) -> None:
        """Ask the worker to finish its batch and leave."""
        if self.stop_asked is None:
            self.stop_asked = time.monotonic()
        self.stopping.set()

    async def _close(self) -> None:
        """Settle the last batch and close every client, within ``STOP_BUDGET`` whatever Kafka's state:
        what is not committed by then is decided again by the partitions' next owner (ids are
        decided once)."""
        started = time.monotonic()
        async with self.lock:
            try:
                await asyncio.wait_for(self._settled(), STOP_BUDGET / 4)
                await asyncio.wait_for(self._commit_carried(), STOP_BUDGET / 4)
            except (*KAFKA_ERRORS, TimeoutError) as exc:
                log.warning("the last batch was not committed (its next owner decides it again): %s",
                            describe(exc))
            if self.consumer is not None:
                await close_client(self.consumer, STOP_BUDGET / 4)  # leaves the group: the partitions move at once
            clients = [*self.transactional.values(), self.producer, self.restorer]
            await asyncio.gather(*(close_client(c, STOP_BUDGET / 4) for c in clients if c is not None),
                                 self.feed.stop())
            self.transactional.clear()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
        # Counted from the stop request: the batch under way when it came is part of stopping too.
        now = time.monotonic()
        log.info("worker %s stopped after %d decisions (%.1f s to stop, %.1f s of it closing)", self.me,
                 self.decided, now - (self.stop_asked if self.stop_asked is not None else started), now - started)

    async def _consume(self) -> None:
        assert self.consumer is not None
        stop = asyncio.create_task(self.stopping.wait())
        try:
            while not self.stopping.is_set():
                fetch = asyncio.create_task(self.consumer.getmany(timeout_ms=1000,
                                                                  max_records=self.settings.max_batch))
                await asyncio.wait([fetch, stop], return_when=asyncio.FIRST_COMPLETED)
                if not fetch.done():
                    fetch.cancel()
                    await asyncio.gather(fetch, return_exceptions=True)
                    break
                batch = fetch.result()
                if batch:
                    await self._batch(batch)
        finally:
            stop.cancel()

    # -- one batch --------------------------------------------------------------------

    async def _batch(self, batch: dict[TopicPartition, list[ConsumerRecord]]) -> None:
        async with self.lock:
            parts = self._decidable(batch)
            if not parts:
                return
            if self.exactly_once:
                for tp, records in parts:
                    await self._transaction(tp, records)
                    self._lag([(tp, records)])
                return
            outputs: list[Encoded] = []
            t0 = time.perf_counter()
            for tp, records in parts:
                for record in records:
                    outputs.extend(await self._decide(record))
                self.decided_to[tp] = records[-1].offset + 1
            self._lag(parts)
            tps = {tp for tp, _records in parts}
            offsets = {tp: records[-1].offset + 1 for tp, records in parts}
            deciding = time.perf_counter() - t0
            try:
                # Decided while the previous batch was on its way: its outputs must be on the log before
                # this one's go out (a partition's outputs stay in order; a failure there rewinds both).
                # Its changelog and commit may still be on their way: this batch's wait for them (_settle).
                if self._acked is not None:
                    await self._acked
                assert self.producer is not None
                changelog = self._batches()
                sent = await self._produce(self.producer, outputs, tps, changelog)
            except KAFKA_ERRORS as exc:
                await self._failed(exc, tps)
                return
            loop = asyncio.get_running_loop()
            acked: asyncio.Future[None] = loop.create_future()
            acked.add_done_callback(_retrieved)
            self._inflight, self._acked = loop.create_task(self._settle(
                sent, changelog, self._inflight, acked, offsets, sum(len(r) for _t, r in parts), len(outputs),
                deciding)), acked
            self._inflight.add_done_callback(self._settle_done)

    def _lag(self, parts: list[tuple[TopicPartition, list[ConsumerRecord]]]) -> None:
        """Each decided partition's lag: inputs appended after the last one decided, and that one's age."""
        if self.consumer is None:
            return
        for tp, records in parts:
            high = self.consumer.highwater(tp)
            if high is not None:
                self.metrics.lag(tp.topic, tp.partition, high - (records[-1].offset + 1), records[-1].timestamp)

    def _settle_done(self, settling: asyncio.Task[None]) -> None:
        """A batch in flight that fails while no other batch comes is rewound at once, not when the next one does."""
        if settling.cancelled() or settling.exception() is None:
            return

        async def recover() -> None:
            async with self.lock:
                if self._inflight is settling:
                    await self._failed(cast(BaseException, settling.exception()), set())

        retry = asyncio.get_running_loop().create_task(recover())
        self._retries.add(retry)
        retry.add_done_callback(self._retries.discard)

    async def _settle(self, sent: list[asyncio.Future[Any]], changelog: _Batches | _RdBatches,
                      previous: asyncio.Task[None] | None, acked: asyncio.Future[None],
                      offsets: dict[TopicPartition, int], inputs: int, outputs: int, deciding: float) -> None:
        """Wait for a batch's outputs to be acknowledged (then ``acked`` is done), then for the batch before
        it to settle, then send its changelog and wait for that, then commit its offsets. It runs while
        the next batch is decided and sent: a failure here, or in the batch before, rewinds both.

        The changelog goes only after the outputs (at_least_once): a state restored from it must never
        hold a decision whose outputs may not be on the log. A redelivered input decided on a state
        that holds it produces nothing (the cores are idempotent by id), so its answer, written by no
        one, would be lost; decided on a state without it, it produces the same outputs again."""
        assert self.consumer is not None
        t0 = time.perf_counter()
        try:
            if sent:
                await asyncio.gather(*sent)
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError):
                acked.cancel()
            elif not acked.done():
                acked.set_exception(exc)
            raise
        acked.set_result(None)
        if previous is not None:
            await previous  # its changelog and commit go first
        recorded = await changelog.send()
        if recorded:
            await asyncio.gather(*recorded)
        t1 = time.perf_counter()
        # A commit that fails (the group's coordinator moving, say) is carried by the next one: the
        # decisions and the changelog are on the log, and the state in memory is theirs. Rewinding
        # here would decide the inputs since the last commit again, on a state restored from a
        # changelog already past them (a wait-for edge removed since comes back, and closes a cycle
        # that no longer exists).
        pending = {tp: offset for tp, offset in self._uncommitted.items() if tp in self.owned}
        pending.update(offsets)
        try:
            await self.consumer.commit(pending)
        except KAFKA_ERRORS as exc:
            self._uncommitted = pending
            log.warning("committing %s failed (%s); the next commit carries it", _names(set(pending)), exc)
        else:
            self._uncommitted = {}
            self.next.update(pending)
        self.stats.add(inputs, outputs, deciding, t1 - t0, time.perf_counter() - t1)

    async def _commit_carried(self) -> None:
        """Commit the offsets a failed commit left to the next one (``_settle``), now: after a rebalance that
        kept their partitions here, and before a stop. A partition whose last input came before the failure
        gets no next batch, and its decided input would stay uncommitted, to be decided again by its next
        owner (found by ./dev sim, rebalances seed 62). A failure here is carried on, as before."""
        pending = {tp: offset for tp, offset in self._uncommitted.items() if tp in self.owned}
        if not pending or self.consumer is None:
            return
        try:
            await self.consumer.commit(pending)
        except KAFKA_ERRORS as exc:
            log.warning("committing %s failed again (%s); the next commit carries it", _names(set(pending)), exc)
        else:
            self._uncommitted = {tp: o for tp, o in self._uncommitted.items() if tp not in pending}
            self.next.update(pending)

    async def _settled(self) -> None:
        """Wait for the batch in flight, if any; a ``KafkaError`` if it could not be written or committed."""
        inflight, self._inflight, self._acked = self._inflight, None, None
        if inflight is not None:
            await inflight

    async def _failed(self, exc: BaseException, tps: set[TopicPartition]) -> None:
        """A batch could not be written or committed: every partition with decisions not committed
        (this batch's, and the one in flight before it) goes back to its last commit."""
        with contextlib.suppress(*KAFKA_ERRORS):
            await self._settled()
        dirty = tps | set(self.owned)
        self._distrust(dirty)
        rewind = dirty & (self.consumer.assignment() if self.consumer else set())
        log.error("could not write or commit a batch (%s); rewinding %s to the last commit", exc, _names(rewind))
        await self._rewind(rewind)

    def _distrust(self, tps: set[TopicPartition] | None = None) -> None:
        """A batch of ``tps`` (default: every owned partition) was decided but not committed: their state in
        memory and their positions may be ahead of what the log holds, so a rebalance that keeps them here
        restores them from their changelog and their last commit instead of going on where they were (it
        went on past the batch: its decisions stayed uncommitted, and the lag never closed)."""
        for tp in set(self.owned) if tps is None else tps:
            self.next.pop(tp, None)

    def _decidable(self, batch: dict[TopicPartition, list[ConsumerRecord]]
                   ) -> list[tuple[TopicPartition, list[ConsumerRecord]]]:
        """The records of ``batch`` to decide now, per partition in order.

        aiokafka makes a new assignment active before it calls ``on_partitions_assigned``, so a
        batch can hold records of a partition whose state is not restored yet: its position goes
        back to its first record, to be fetched again once it is. A partition no longer assigned
        is left to its new owner (which starts at the last commit). Records before the next offset
        expected (fetched again after a rebalance that kept the partition here) were decided already.
        """
        assert self.consumer is not None
        assigned = self.consumer.assignment()
        parts = []
        for tp in sorted(batch):
            records = batch[tp]
            if not records or tp not in assigned:
                continue
            if tp not in self.owned or tp in self.revoking:
                # Not ours (yet), or being revoked (fetched before the rebalance): left for its owner,
                # from where this fetch began.
                self.consumer.seek(tp, records[0].offset)
                continue
            expected = self.decided_to.get(tp, -1)
            records = [r for r in records if r.offset >= expected]
            if records:
                parts.append((tp, records))
        return parts

    async def _transaction(self, tp: TopicPartition, records: list[ConsumerRecord]) -> None:
        producer = self.transactional[tp]
        outputs: list[Encoded] = []
        t0 = time.perf_counter()
        for record in records:
            outputs.extend(await self._decide(record))
        offset = records[-1].offset + 1
        try:
            t1 = time.perf_counter()
            await _begin(producer)
            sent = await self._produce(producer, outputs, {tp})
            if sent:
                await asyncio.gather(*sent)
            t2 = time.perf_counter()
            await self._commit_transaction(producer, tp, offset)
            self.stats.add(len(records), len(outputs), t1 - t0, t2 - t1, time.perf_counter() - t2)
        except KAFKA_ERRORS as exc:
            assert self.consumer is not None
            if tp in self.revoking or tp not in self.consumer.assignment():
                # Revoked while it was in flight, and fenced by the next owner: that one starts from the last
                # commit. Rewinding here would fence it back (a fenced producer cannot even abort).
                log.info("the transaction for %s ended with the partition's revocation (%s); its next owner "
                         "decides it again", _names({tp}), exc)
                if self.transactional.get(tp) is producer:
                    del self.transactional[tp]
                await close_client(producer)
                return
            log.error("the transaction for %s failed (%s); rewinding it to the last commit", _names({tp}), exc)
            await _abort(producer, exc)
            await self._rewind({tp})
            return
        self.next[tp] = self.decided_to[tp] = offset

    async def _commit_transaction(self, producer: Any, tp: TopicPartition, offset: int) -> None:
        """The input's offset into the transaction, then the transaction's commit."""
        if self.rdkafka:
            await producer.send_offsets({tp: offset}, await self.consumer.group_metadata())
            await producer.commit()
        else:
            await producer.send_offsets_to_transaction({tp: offset}, self.settings.app_id)
            await producer.commit_transaction()

    async def _produce(self, producer: Any, outputs: list[Encoded], tps: set[TopicPartition],
                       changelog: _Batches | _RdBatches | None = None) -> list[asyncio.Future[Any]]:
        """Queue the decisions, then the changelog of the state they leave; the futures of their
        acknowledgements. Given ``changelog``, the changelog records are packed there now (the next
        batch may change the tables before they go) and left for the caller to send.

        Records are packed into one batch per partition (``BatchBuilder``), not sent one by one:
        aiokafka's per-message ``send`` costs more than a decision, and ships tiny requests."""
        batches = self._batches(producer)
        changes = batches if changelog is None else changelog
        partitions = self.settings.partitions
        lose, lost = self._lose_outputs, False
        # One signature per group of outputs (a Merkle root), not one per output: see Signer.sign_batch.
        for (topic, key, value), headers in zip(outputs, self.signer.sign_batch(outputs, now_ms()), strict=True):
            if lose is not None and key.startswith(lose):
                lost = True
                continue
            batches.add(topic, partition_for(key, partitions), key, value, headers)
        if lost:
            self._lose_outputs = None
        for tp in tps:
            for table in self.tables_of[tp.topic]:
                for topic, partition, row, state in table.take_changes({tp.partition}):
                    changes.add(topic, partition, row, state, [])
        sent = await batches.send()
        if lost:
            failed: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            failed.set_exception(KafkaError("failpoint lose_outputs_once: outputs not taken"))
            sent.append(failed)
        return sent

    async def _decide(self, message: ConsumerRecord) -> list[Encoded]:
        """Decide one input; its outputs (answers, events, dead letters), in order."""
        self.decided += 1
        # The broker's append time: the same on every redelivery (see arbiter.streams.cores.leases).
        at_ms = message.timestamp if message.timestamp and message.timestamp > 0 else now_ms()
        raw = RawInput(message.topic, message.partition, message.offset, message.key, bytes(message.value or b""),
                       tuple(message.headers or ()), at_ms)
        for table in self.tables.values():
            table.partition = message.partition  # the input's writes go to its changelog partition
        outcome = await self.pipeline.process(raw)
        self.metrics.observe(self.processor_of.get(message.topic, "none"), at_ms,
                             (record for _t, _k, record, _v in outcome.outputs), outcome.letter, outcome.stage)
        return [(topic, key, value) for topic, key, _record, value in outcome.outputs]

    async def _send_now(self, topic: str, key: bytes, record: Record) -> None:
        assert self.producer is not None
        value = self.codec.encode(record)
        await self.producer.send_and_wait(topic, value, key=key, headers=self.signer.sign(topic, key, value, now_ms()))

    # -- rebalances -------------------------------------------------------------------

    async def revoked(self, revoked: set[TopicPartition]) -> None:
        """Called before a rebalance: the batch in flight finishes (and commits) first."""
        async with self.lock:
            self.revoking = set(revoked)  # until the assignment: nothing of them is decided meanwhile
            try:
                await self._settled()
            except KAFKA_ERRORS as exc:  # the next owner starts at the last commit, and decides the rest
                log.error("the last batch before the rebalance was not committed: %s", exc)
                self._distrust()
            log.info("rebalance: %d partitions revoked (%s)", len(revoked), _names(revoked))

    async def assigned(self, assigned: set[TopicPartition]) -> None:
        """Called after a rebalance, before any input of the new assignment is decided: restore
        the state of every partition this worker did not hold, from its changelog."""
        assert self.consumer is not None
        async with self.lock:
            self.revoking = set()
            try:
                await self._settled()  # (revoked did it, unless this worker's first assignment)
            except KAFKA_ERRORS:
                self._distrust()
            started = time.monotonic()
            self.generation += 1
            gone = self.owned - assigned
            self._forget(gone)
            for tp in gone:
                self.next.pop(tp, None)
                self.decided_to.pop(tp, None)
            for tp in gone:
                producer = self.transactional.pop(tp, None)
                if producer is not None:
                    await close_client(producer)
            restore = set()
            for tp in assigned:
                committed = await self.consumer.committed(tp)
                if tp in self.owned and tp in self.next and committed == self.next[tp]:
                    # Held throughout, and nobody else committed anything on it: its state stands, and it
                    # goes on from the first input not decided here, whatever position the rebalance left
                    # (records fetched before it and left undecided, while it was being revoked, are not
                    # skipped).
                    if self.decided_to.get(tp, -1) >= 0:
                        self.consumer.seek(tp, self.decided_to[tp])
                    continue
                restore.add(tp)
                self.next[tp] = self.decided_to[tp] = -1 if committed is None else committed
            # An offset whose commit failed counts only where this worker went on deciding: elsewhere it
            # could move another owner's commit back.
            self._uncommitted = {tp: offset for tp, offset in self._uncommitted.items()
                                 if tp in assigned and tp not in restore}
            if self.exactly_once:
                await self._fence(restore)
            try:
                restored = await self._restore(restore)
            except KAFKA_ERRORS as exc:
                log.error("restoring %s failed (%s); trying again in 1 s", _names(restore), exc)
                self.owned = set(assigned) - restore
                retry = asyncio.get_running_loop().create_task(self._rewind_later(restore))
                self._retries.add(retry)
                retry.add_done_callback(self._retries.discard)
                return
            self.owned = set(assigned)
            await self._commit_carried()
            if restore:
                _settle_heap()
            self.metrics.owned.set(len(assigned))
            self.metrics.forget_partitions((tp.topic, tp.partition) for tp in gone)
            log.info("ready: deciding %d partitions (%d restored from %d changelog records) in %.0f ms: %s",
                     len(assigned), len(restore), restored, (time.monotonic() - started) * 1000,
                     _names(assigned))

    async def _fence(self, tps: set[TopicPartition]) -> None:
        """A fresh transactional producer for each of ``tps`` (exactly_once). Its ``init_transactions``
        fences the partition's previous producer, here or in another worker, and ends its open
        transaction, before this worker reads the partition's changelog."""
        for tp in sorted(tps):
            old = self.transactional.pop(tp, None)
            if old is not None:
                await old.stop()
            name = f"{self.settings.app_id}-{tp.topic}-{tp.partition}"
            producer = (self.clients.transactional(name) if self.clients is not None else
                        RdTxnProducer(self.settings, name) if self.rdkafka else self._producer(name))
            await producer.start()
            self.transactional[tp] = producer

    def _forget(self, tps: set[TopicPartition]) -> None:
        for tp in tps:
            for table in self.tables_of.get(tp.topic, ()):
                table.drop({tp.partition})

    async def _restore(self, tps: set[TopicPartition]) -> int:
        """Rebuild the tables of ``tps`` from their changelogs; the number of records read."""
        assert self.restorer is not None
        self._forget(tps)
        where: dict[TopicPartition, ChangelogTable] = {}
        for tp in tps:
            for table in self.tables_of[tp.topic]:
                where[TopicPartition(table.topic, tp.partition)] = table
        if not where:
            return 0
        # Only a key's last record counts: keep the raw bytes and decode each key once at the end
        # (a changelog not yet compacted holds every change of every key).
        latest: dict[tuple[TopicPartition, bytes], bytes | None] = {}
        if self.rdkafka:
            count = await _read_changelogs(self.restorer, sorted(where), latest)
        else:
            count = await self._read_changelogs_aio(sorted(where), latest)
        rows: dict[TopicPartition, list[tuple[bytes, bytes | None]]] = {}
        for n, ((ctp, key), value) in enumerate(latest.items()):
            spec = where[ctp].spec.rows
            if spec is not None and spec.is_row(key):
                rows.setdefault(ctp, []).append((key, value))
            else:
                where[ctp].load(ctp.partition, key, value)
            if n % 500 == 499:
                await asyncio.sleep(0)  # a long restore must not starve the heartbeat (a 1.2 s session)
        for ctp, items in rows.items():  # once every value they belong to is back
            where[ctp].load_rows(ctp.partition, items)
            await asyncio.sleep(0)
        return count

    async def _read_changelogs_aio(self, ctps: list[TopicPartition],
                                   latest: dict[tuple[TopicPartition, bytes], bytes | None]) -> int:
        """``_read_changelogs`` on aiokafka's consumer."""
        restorer = self.restorer
        restorer.assign(ctps)
        await restorer.seek_to_beginning(*ctps)
        ends = await restorer.end_offsets(ctps)
        remaining = {ctp for ctp in ctps if ends[ctp] > await restorer.position(ctp)}
        count, last_report = 0, time.monotonic()
        while remaining:
            batch = await restorer.getmany(*remaining, timeout_ms=500, max_records=10_000)
            for ctp, records in batch.items():
                for record in records:
                    if record.key is not None:
                        latest[(ctp, record.key)] = record.value
                count += len(records)
            for ctp in list(remaining):
                if await restorer.position(ctp) >= ends[ctp]:
                    remaining.discard(ctp)
            last_report = _report_restore(count, len(remaining), last_report)
        # Paused, not unassigned: an idle assignment would be fetched from forever, and assign([])
        # makes aiokafka ask the broker for the metadata of every topic.
        restorer.pause(*ctps)
        return count

    async def _rewind(self, tps: set[TopicPartition]) -> bool:
        """After a failed write or commit: state from the changelog, positions from the last commit.
        When that fails too (the broker is still away), the partitions wait, undecided, and it is
        tried again a second later; False then."""
        assert self.consumer is not None
        for tp in tps:
            self.next.pop(tp, None)  # (until restored: a rebalance meanwhile restores it instead of keeping it)
        try:
            if self.exactly_once:
                await self._fence(tps)
            await self._restore(tps)
            for tp in tps:
                committed = await self.consumer.committed(tp)
                carried = self._uncommitted.get(tp)
                if carried is not None and (committed is None or carried > committed):
                    committed = carried  # decided, written and in the changelog: only its commit failed
                self.next[tp] = self.decided_to[tp] = -1 if committed is None else committed
                if committed is None:
                    await self.consumer.seek_to_beginning(tp)
                else:
                    self.consumer.seek(tp, committed)
            return True
        except KAFKA_ERRORS as exc:
            log.error("rewinding %s failed too (%s); trying again in 1 s", _names(tps), exc)
            self.owned -= tps  # their records are fetched again, and wait, until this succeeds
            self.generation += 1
            retry = asyncio.get_running_loop().create_task(self._rewind_later(tps))
            self._retries.add(retry)
            retry.add_done_callback(self._retries.discard)
            return False

    async def _rewind_later(self, tps: set[TopicPartition]) -> None:
        await asyncio.sleep(1.0)
        async with self.lock:
            assert self.consumer is not None
            tps = tps & self.consumer.assignment()  # a rebalance since may have moved (and restored) them
            tps -= self.owned
            if tps and await self._rewind(tps):
                self.owned |= tps

    # -- the clock --------------------------------------------------------------------

    async def _tick_forever(self) -> None:
        """Time through the log: every ``tick_interval_ms``, a ``LockTick`` into each owned resource partition
        where a deadline is due (a lease's expiry, a waiter's time-out), and nowhere else: idle costs nothing."""
        interval = self.settings.tick_interval_ms / 1000.0
        reported = time.monotonic()
        while True:
            await asyncio.sleep(interval)
            if time.monotonic() - reported >= REPORT_S:
                reported = time.monotonic()
                self.stats.report()
                self.stats = _Stats()
            if self.producer is None:
                continue
            async with self.lock:  # the deadline index is read between decisions, never during one
                due = self._due_partitions()
            for partition in due:
                await self._send_tick(partition)

    def _due_partitions(self) -> list[int]:
        topic, now = self.settings.topics.resource_commands, now_ms()
        owned = sorted(tp.partition for tp in self.owned if tp.topic == topic)
        resource = self.pipeline.shells.resource
        return [p for p in owned if (due := resource.next_due(p)) is not None and due <= now]

    async def _send_tick(self, partition: int) -> None:
        assert self.producer is not None
        topic = self.settings.topics.resource_commands
        self._ticks += 1
        tick = LockTick(request_id=f"{self.me}:{partition}:{self._ticks}", partition=partition, at_ms=now_ms())
        value = self.codec.encode(tick)
        try:
            sent = await self.producer.send(topic, value, key=TICK_KEY, partition=partition,
                                            headers=self.signer.sign(topic, TICK_KEY, value, now_ms()))
        except KAFKA_ERRORS as exc:
            log.warning("tick for %s[%d] not sent: %s", topic, partition, exc)
            return
        sent.add_done_callback(_log_tick_failure)


@dataclass
class _Stats:
    """What the worker did since the last report (logged every ``REPORT_S`` at info level)."""

    batches: int = 0
    inputs: int = 0
    outputs: int = 0
    deciding: float = 0.0
    producing: float = 0.0
    committing: float = 0.0
    since: float = field(default_factory=lambda: time.monotonic())

    def add(self, inputs: int, outputs: int, deciding: float, producing: float, committing: float) -> None:
        self.batches += 1
        self.inputs += inputs
        self.outputs += outputs
        self.deciding += deciding
        self.producing += producing
        self.committing += committing

    def report(self) -> None:
        """Log it (the caller starts a new one)."""
        if self.batches:
            elapsed = time.monotonic() - self.since
            log.info("%d inputs in %d batches (%.1f a batch) in %.0f s: %.0f inputs/s, %d outputs; "
                     "deciding %.0f%%, producing %.0f%%, committing %.0f%% of the time", self.inputs, self.batches,
                     self.inputs / self.batches, elapsed, self.inputs / elapsed, self.outputs,
                     100 * self.deciding / elapsed, 100 * self.producing / elapsed, 100 * self.committing / elapsed)


class _Batches:
    """Records packed per partition, in order, then handed to the producer a batch at a time."""

    def __init__(self, producer: AIOKafkaProducer) -> None:
        self.producer = producer
        self.open: dict[tuple[str, int], Any] = {}
        self.full: list[tuple[str, int, Any]] = []

    def add(self, topic: str, partition: int, key: bytes | None, value: bytes | None,
            headers: list[tuple[str, bytes]]) -> None:
        """Append one record to its partition's batch (a new batch when that one is full)."""
        where = (topic, partition)
        builder = self.open.get(where)
        if builder is None or builder.append(timestamp=None, key=key, value=value, headers=headers) is None:
            if builder is not None:
                self.full.append((topic, partition, builder))
            builder = self.open[where] = self.producer.create_batch()
            if builder.append(timestamp=None, key=key, value=value, headers=headers) is None:
                raise ContractError(Reason.TOO_LARGE, f"a record of {len(value or b'')} bytes does not fit a batch")

    async def send(self) -> list[asyncio.Future[Any]]:
        """Queue every batch, in the order filled; the futures of their acknowledgements."""
        self.full.extend((topic, partition, builder) for (topic, partition), builder in self.open.items())
        self.open.clear()
        sent = [await self.producer.send_batch(builder, topic, partition=partition)
                for topic, partition, builder in self.full]
        self.full.clear()
        return sent


class _RdBatches:
    """Records in order, handed to the librdkafka producer together (it batches them itself)."""

    def __init__(self, producer: RdProducer) -> None:
        self.producer = producer
        self.records: list[tuple[str, int | None, bytes | None, bytes | None, list[tuple[str, bytes]]]] = []

    def add(self, topic: str, partition: int, key: bytes | None, value: bytes | None,
            headers: list[tuple[str, bytes]]) -> None:
        """Append one record."""
        self.records.append((topic, partition, key, value, headers))

    async def send(self) -> list[asyncio.Future[Any]]:
        """Queue every record, in order; the future of their acknowledgement (none if there are none)."""
        records, self.records = self.records, []
        return [await self.producer.produce(records)] if records else []


async def _read_changelogs(reader: Reader, ctps: list[TopicPartition],
                           latest: dict[tuple[TopicPartition, bytes], bytes | None]) -> int:
    """Read each changelog partition of ``ctps`` from its first record to its end as of now, each key's
    last value into ``latest``; the number of records read. The partitions are dropped after."""
    ends: dict[TopicPartition, int] = {}
    for ctp in ctps:
        first, end = await reader.offsets(ctp.topic, ctp.partition)
        ends[ctp] = end
        reader.add(ctp.topic, ctp.partition, first)
    remaining = {ctp for ctp in ctps if ends[ctp] > await reader.position(ctp.topic, ctp.partition)}
    count, last_report = 0, time.monotonic()
    try:
        while remaining:
            for record in await reader.read(0.5):
                if record.key is not None:
                    latest[(TopicPartition(record.topic, record.partition), record.key)] = record.value
                count += 1
            for ctp in list(remaining):
                if await reader.position(ctp.topic, ctp.partition) >= ends[ctp]:
                    remaining.discard(ctp)
            last_report = _report_restore(count, len(remaining), last_report)
    finally:
        for ctp in ctps:
            reader.drop(ctp.topic, ctp.partition)
    return count


def _report_restore(count: int, remaining: int, last: float) -> float:
    """Say how a long restore goes, every 5 s; when it was last said."""
    if time.monotonic() - last <= 5:
        return last
    log.info("restoring state: %d changelog records read, %d partitions to go", count, remaining)
    return time.monotonic()


async def _begin(producer: Any) -> None:
    """Begin a transaction on either client's transactional producer."""
    if hasattr(producer, "begin"):  # librdkafka's (or a simulation's)
        producer.begin()
    else:
        await producer.begin_transaction()


async def _abort(producer: Any, failure: BaseException) -> None:
    """Abort the transaction that ended in ``failure``, unless its producer was fenced (it can do nothing
    more, not even abort: the partition's next producer ends the transaction)."""
    if isinstance(failure, ProducerFenced) or getattr(failure, "fenced", False):
        return
    with contextlib.suppress(*KAFKA_ERRORS):
        await (producer.abort() if hasattr(producer, "begin") else producer.abort_transaction())


def _retrieved(fut: asyncio.Future[Any]) -> None:
    """(A batch's ``acked`` that failed with nobody waiting: its settle task reports the failure.)"""
    if not fut.cancelled():
        fut.exception()


def _log_tick_failure(sent: asyncio.Future[Any]) -> None:
    if not sent.cancelled() and sent.exception() is not None:
        _tick_log.warning("a tick was not written: %s", sent.exception())


def _names(tps: set[TopicPartition]) -> str:
    return ", ".join(f"{tp.topic}[{tp.partition}]" for tp in sorted(tps)) or "nothing"


def run_worker(settings: Settings, loglevel: str = "info") -> None:
    """``arbiter worker`` on the batched runtime."""
    logging.basicConfig(level=loglevel.upper(), format="[%(asctime)s] %(levelname)s %(name)s: %(message)s")
    logging.getLogger("aiokafka").setLevel(max(logging.WARNING, logging.getLogger().level))
    worker = Worker(settings)
    asyncio.run(worker.run())
    if worker.exit_code:
        raise SystemExit(worker.exit_code)
