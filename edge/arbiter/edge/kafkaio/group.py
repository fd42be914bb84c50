"""The worker's Kafka I/O on librdkafka: a consumer-group member and a producer, bridged to asyncio.

Theory of operation
-------------------
:class:`RdGroup` is the worker's consumer: a member of its group, reading the input topics. One
thread owns the librdkafka consumer (confluent-kafka lets one caller at a time into it) and does
everything with it: it polls, runs the group's rebalance callbacks, and carries out what the loop
asks (seeks, commits, committed offsets) between two polls. Records go to the loop in batches.

A rebalance runs the worker's own listener on the loop while the thread waits in librdkafka's
callback, still carrying out the loop's requests: the batch in flight settles and commits before
partitions are revoked, and a new assignment is restored before anything of it is fetched. The
offsets the listener seeks to are the ones the partitions are assigned at (a seek before the first
fetch is refused by librdkafka); a partition it does not seek starts at its committed offset.

Records fetched before a seek (a rewind, or a partition given back and taken again) must never be
handed out after it: every seek and assignment starts a new epoch of its partition, the thread
stamps each record with the epoch it was fetched in, and the loop hands out only the current
epoch's records, each partition in offset order, at or after the offset sought.

:class:`RdProducer` sends the worker's outputs and changelog, idempotent and ``acks=all``, each
record to the partition it names, in order per partition; one thread serves its delivery reports,
and a batch's future is done when every record of it is acknowledged. :class:`RdTxnProducer` is the
same, transactional, one per input partition under ``exactly_once``.

Errors are :class:`~arbiter.edge.kafkaio.KafkaIOError`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import Future as ThreadFuture
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

from confluent_kafka import OFFSET_BEGINNING, OFFSET_STORED, Consumer, KafkaError, KafkaException
from confluent_kafka import TopicPartition as RdPartition

from ..settings import Settings
from . import Headers, KafkaIOError
from .rdkafka import PolledProducer, _common, _Errors, io_error, refuse, reply

log = logging.getLogger("arbiter.kafka")

POLL_S = 0.05
"""How long the consumer's thread waits in one poll before it looks at the loop's requests again."""
REQUEST_S = 10.0
"""How long one request to the group's coordinator may take (committed offsets, a commit)."""


class Partition(NamedTuple):
    """A topic partition, as the worker keys its state."""

    topic: str
    partition: int


@dataclass(frozen=True, slots=True)
class Fetched:
    """One input record (the attributes the worker reads)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]]
    timestamp: int


class Listener:
    """What a rebalance tells the worker (on the loop, while the consumer's thread waits)."""

    async def on_partitions_revoked(self, revoked: set[Partition]) -> None: ...

    async def on_partitions_assigned(self, assigned: set[Partition]) -> None: ...


class RdGroup:
    """A consumer-group member on librdkafka, for the worker (see the module's docstring)."""

    def __init__(self, settings: Settings, *, client_id: str, group_id: str, session_ms: int, heartbeat_ms: int,
                 rebalance_ms: int, max_batch: int) -> None:
        self.settings = settings
        self._errors = _Errors("worker consumer")
        self.incremental = settings.group_protocol == "consumer"
        """KIP-848's protocol: the broker assigns, and each rebalance adds or takes some partitions only."""
        # Under KIP-848 the session, the heartbeat and the assignor are the broker's: its range assignor, which
        # gives each member the same partitions of every input topic (co-partitioned, as the classic one did).
        classic = {"group.remote.assignor": "range"} if self.incremental else {
            "session.timeout.ms": session_ms,
            "heartbeat.interval.ms": heartbeat_ms,
            "partition.assignment.strategy": "roundrobin",  # (aiokafka's default: the two can share a group)
        }
        self._config = {
            **_common(settings, self._errors),
            "client.id": client_id,
            "group.id": group_id,
            "group.protocol": settings.group_protocol,
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "isolation.level": "read_committed",
            "auto.offset.reset": "earliest",
            "fetch.wait.max.ms": settings.fetch_max_wait_ms,
            "fetch.error.backoff.ms": 10,
            # librdkafka's rebalance timeout is its max poll interval; a restore runs inside the callback.
            "max.poll.interval.ms": max(rebalance_ms, 300_000),
            "max.partition.fetch.bytes": 2 * settings.max_message_bytes,
            **classic,
        }
        self._max_batch = max_batch
        self._consumer: Consumer | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = threading.Event()
        self._closing = False
        self._requests: collections.deque[tuple[Callable[[Consumer], Any], ThreadFuture[Any]]] = collections.deque()
        self._topics: list[str] = []
        self._listener: Listener | None = None
        # The loop's side: what is assigned, each partition's epoch and next offset, what arrived.
        self._assigned: set[Partition] = set()
        self._epoch: dict[Partition, int] = {}
        self._next: dict[Partition, int] = {}
        self._arrived: collections.deque[list[tuple[int, Fetched]]] = collections.deque()
        self._wake: asyncio.Event | None = None
        # The thread's side: the epoch each partition is fetched in; offsets chosen inside a rebalance.
        self._fetching: dict[Partition, int] = {}
        self._placing: dict[Partition, int] | None = None
        self._committed: dict[Partition, int | None] = {}
        self._high: dict[Partition, int] = {}
        self._failed: BaseException | None = None

    # -- lifecycle --------------------------------------------------------------------

    def subscribe(self, topics: Iterable[str], *, listener: Listener) -> None:
        """The topics to read and who hears of rebalances (before ``start``)."""
        self._topics, self._listener = sorted(topics), listener

    async def start(self) -> None:
        """Make the consumer and join the group (the first assignment comes with the polls)."""
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        try:
            self._consumer = Consumer(self._config)
            self._consumer.subscribe(self._topics, on_assign=self._on_assign, on_revoke=self._on_revoke,
                                     on_lost=self._on_revoke)
        except KafkaException as exc:
            raise io_error(exc, "cannot make the worker's Kafka consumer") from exc
        self._thread = threading.Thread(target=self._run, name="arbiter-worker-consumer", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Leave the group (the partitions move at once) and close; rebalance callbacks are not run."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._closing = True
        self._stopping.set()
        await asyncio.get_running_loop().run_in_executor(None, thread.join)

    # -- the loop's side ----------------------------------------------------------------

    def assignment(self) -> set[Partition]:
        """The partitions assigned to this member now."""
        return set(self._assigned)

    def highwater(self, tp: Partition) -> int | None:
        """The partition's end offset, as of its last fetch (None before one)."""
        return self._high.get(tp)

    def seek(self, tp: Partition, offset: int) -> None:
        """Read ``tp`` from ``offset`` next: nothing fetched before this is handed out after it."""
        if tp not in self._assigned:
            return
        epoch = self._epoch[tp] = self._epoch.get(tp, 0) + 1
        self._next[tp] = offset
        self._ask(lambda c: self._seek(c, tp, offset, epoch))

    async def seek_to_beginning(self, tp: Partition) -> None:
        """Read ``tp`` from its first record next."""
        self.seek(tp, OFFSET_BEGINNING)

    async def committed(self, tp: Partition) -> int | None:
        """The group's committed offset of ``tp`` (None: none)."""
        offset: int | None = await self._request(lambda c: self._committed_of(c, tp),
                                                 f"reading the committed offset of {tp}")
        return offset

    async def group_metadata(self) -> Any:
        """The group's metadata as this member has it now (what a transaction's offsets are sent for)."""
        return await self._request(lambda c: c.consumer_group_metadata(), "reading the group's metadata")

    async def commit(self, offsets: dict[Any, int]) -> None:
        """Commit ``offsets`` for the group; ``KafkaIOError`` if the coordinator refuses or is away."""
        parts = [RdPartition(tp.topic, tp.partition, offset) for tp, offset in offsets.items()]

        def commit(consumer: Consumer) -> None:
            for part in consumer.commit(offsets=parts, asynchronous=False) or ():
                if part.error is not None:
                    raise KafkaException(part.error)
            for part in parts:  # (inside a rebalance, the committed offsets read at its start move on)
                tp = Partition(part.topic, part.partition)
                if tp in self._committed:
                    self._committed[tp] = part.offset

        await self._request(commit, "committing offsets")

    async def getmany(self, timeout_ms: int, max_records: int) -> dict[Partition, list[Fetched]]:
        """The records that arrived (waiting up to ``timeout_ms`` for some), per partition in order."""
        wake = self._wake
        assert wake is not None, "the consumer is not started"
        if self._failed is not None:
            raise KafkaIOError(f"the worker's Kafka consumer stopped: {self._failed}", retriable=False)
        if not self._arrived:
            wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), timeout_ms / 1000)
        out: dict[Partition, list[Fetched]] = {}
        count = 0
        while self._arrived and count < max_records:
            for epoch, record in self._arrived.popleft():
                tp = Partition(record.topic, record.partition)
                expected = self._next.get(tp)
                if tp not in self._assigned or epoch != self._epoch.get(tp) or expected is None:
                    continue
                if expected >= 0 and record.offset < expected:
                    continue
                self._next[tp] = record.offset + 1
                out.setdefault(tp, []).append(record)
                count += 1
        return out

    def _ask(self, work: Callable[[Consumer], Any]) -> ThreadFuture[Any]:
        answer: ThreadFuture[Any] = ThreadFuture()
        self._requests.append((work, answer))
        return answer

    async def _request(self, work: Callable[[Consumer], Any], what: str) -> Any:
        if self._thread is None:
            raise KafkaIOError("the worker's Kafka consumer is not started", retriable=False)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(self._ask(work)), REQUEST_S + 1)
        except KafkaException as exc:
            raise io_error(exc, what) from exc
        except TimeoutError as exc:
            raise KafkaIOError(f"{what}: no answer in {REQUEST_S + 1:g} s", retriable=True) from exc

    # -- the thread's side --------------------------------------------------------------

    def _run(self) -> None:
        consumer = self._consumer
        assert consumer is not None
        try:
            while not self._stopping.is_set():
                self._obey(consumer)
                # The first record as soon as it comes, then what else is there, waiting no more
                # (consume alone waits for a whole batch or its timeout).
                first = consumer.poll(POLL_S)
                if first is not None:
                    self._hand_over(consumer, [first, *consumer.consume(self._max_batch - 1, 0)])
        except Exception as exc:
            log.exception("the worker's Kafka consumer thread stopped")
            self._failed = exc
        finally:
            self._fail_requests(KafkaIOError("the worker's Kafka consumer stopped", retriable=False))
            try:
                consumer.close()
            except (KafkaException, RuntimeError) as exc:
                log.warning("closing the worker's Kafka consumer: %s", exc)
            self._wake_loop()

    def _hand_over(self, consumer: Consumer, messages: list[Any]) -> None:
        batch: list[tuple[int, Fetched]] = []
        seen: set[Partition] = set()
        for message in messages:
            err = message.error()
            if err is not None:
                if err.code() != KafkaError._PARTITION_EOF:
                    log.warning("the worker's Kafka consumer: %s", err.str())
                continue
            tp = Partition(message.topic(), message.partition())
            seen.add(tp)
            batch.append((self._fetching.get(tp, 0), Fetched(
                tp.topic, tp.partition, message.offset(), message.key(), message.value(), message.headers() or [],
                message.timestamp()[1])))
        for tp in seen:
            try:
                high = consumer.get_watermark_offsets(RdPartition(tp.topic, tp.partition), cached=True)[1]
            except KafkaException:
                continue
            if high >= 0:
                self._high[tp] = high
        if batch:
            if self._errors.down_since is not None:
                self._errors.answered()
            self._arrived.append(batch)
            self._wake_loop()

    def _wake_loop(self) -> None:
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None and not loop.is_closed():
            loop.call_soon_threadsafe(wake.set)

    def _obey(self, consumer: Consumer) -> None:
        while self._requests:
            work, answer = self._requests.popleft()
            if answer.cancelled():
                continue  # the caller gave up waiting (its timeout said so): the work is not wanted
            try:
                result = work(consumer)
            except Exception as exc:
                refuse(answer, exc)
            else:
                reply(answer, result)

    def _fail_requests(self, exc: BaseException) -> None:
        while self._requests:
            _work, answer = self._requests.popleft()
            refuse(answer, exc)

    def _seek(self, consumer: Consumer, tp: Partition, offset: int, epoch: int) -> None:
        self._fetching[tp] = epoch
        if self._placing is not None:
            self._placing[tp] = offset  # inside the rebalance: it is assigned at this offset
            return
        try:
            consumer.seek(RdPartition(tp.topic, tp.partition, offset))
        except KafkaException as exc:  # (not fetched yet): assign it at the offset instead
            log.debug("seek %s to %d: %s; assigning it there", tp, offset, exc)
            consumer.incremental_unassign([RdPartition(tp.topic, tp.partition)])
            consumer.incremental_assign([RdPartition(tp.topic, tp.partition, offset)])

    def _committed_of(self, consumer: Consumer, tp: Partition) -> int | None:
        if tp in self._committed:
            return self._committed[tp]
        (found,) = consumer.committed([RdPartition(tp.topic, tp.partition)], timeout=REQUEST_S)
        if found.error is not None:
            raise KafkaException(found.error)
        return found.offset if found.offset >= 0 else None

    def _in_loop(self, consumer: Consumer, work: Callable[[], Awaitable[None]]) -> None:
        """Run ``work`` on the loop and wait for it here, carrying out its requests meanwhile."""
        loop = self._loop
        assert loop is not None
        done = asyncio.run_coroutine_threadsafe(_call(work), loop)
        while True:
            try:
                done.result(timeout=0.001)
                return
            except TimeoutError:
                if self._closing:  # (the worker is stopping: it settles and leaves on its own)
                    done.cancel()
                    return
                self._obey(consumer)
            except BaseException:
                if not done.cancelled():
                    log.exception("the worker's rebalance listener failed")
                return

    def _on_revoke(self, consumer: Consumer, partitions: list[RdPartition]) -> None:
        if self._closing or self._listener is None:
            return
        revoked = {Partition(p.topic, p.partition) for p in partitions}
        listener = self._listener

        async def revoke() -> None:
            await listener.on_partitions_revoked(revoked)
            self._assigned -= revoked

        self._in_loop(consumer, revoke)
        for tp in revoked:
            self._fetching.pop(tp, None)
        if self.incremental:
            # Only these go: the listener hears of what stays as after any rebalance (an assignment).
            consumer.incremental_unassign(partitions)
            self._assign(consumer, set())

    def _on_assign(self, consumer: Consumer, partitions: list[RdPartition]) -> None:
        if self._closing or self._listener is None:
            return
        added = {Partition(p.topic, p.partition) for p in partitions}
        if self.incremental:
            self._assign(consumer, added)
            return
        self._assign_all(consumer, added)

    def _assign(self, consumer: Consumer, added: set[Partition]) -> None:
        """KIP-848: ``added`` join what this member keeps; the listener hears the whole assignment, and the
        offsets it seeks are where the added ones start (the kept ones are sought where they are)."""
        listener = self._listener
        assert listener is not None
        self._committed = self._committed_offsets(consumer, added)
        self._placing = {}
        whole = self._assigned | added

        async def assign() -> None:
            for tp in added:
                self._epoch[tp] = self._epoch.get(tp, 0) + 1
                self._next[tp] = self._committed.get(tp) or 0
            self._assigned = set(whole)
            epochs = dict(self._epoch)
            self._ask(lambda _c: self._fetching.update({tp: epochs[tp] for tp in added}))
            await listener.on_partitions_assigned(set(whole))

        try:
            self._in_loop(consumer, assign)
            self._obey(consumer)
        finally:
            placing, self._placing, self._committed = self._placing, None, {}
        if added:
            consumer.incremental_assign([RdPartition(tp.topic, tp.partition, placing.get(tp, OFFSET_STORED))
                                         for tp in sorted(added)])
        for tp, offset in sorted(placing.items()):
            if tp not in added:
                self._seek(consumer, tp, offset, self._fetching.get(tp, 0))

    def _committed_offsets(self, consumer: Consumer, tps: set[Partition]) -> dict[Partition, int | None]:
        """The group's committed offsets of ``tps``, in one request ({} when it fails: each is asked again)."""
        if not tps:
            return {}
        try:
            found = consumer.committed([RdPartition(tp.topic, tp.partition) for tp in sorted(tps)],
                                       timeout=REQUEST_S)
        except KafkaException as exc:
            log.warning("reading the committed offsets of a new assignment: %s", exc)
            return {}
        return {Partition(p.topic, p.partition): (p.offset if p.offset >= 0 else None)
                for p in found if p.error is None}

    def _assign_all(self, consumer: Consumer, assigned: set[Partition]) -> None:
        """The classic protocol: ``assigned`` is the whole assignment, all of it fetched from where the
        listener seeks (else the committed offset)."""
        listener = self._listener
        assert listener is not None
        self._committed = self._committed_offsets(consumer, assigned)  # one request for all, not one each
        self._placing = {}

        async def assign() -> None:
            for tp in assigned:
                self._epoch[tp] = self._epoch.get(tp, 0) + 1
                self._next[tp] = self._committed.get(tp) or 0
            self._assigned = set(assigned)
            epochs = dict(self._epoch)
            self._ask(lambda _c: self._fetching.update({tp: epochs[tp] for tp in assigned}))
            await listener.on_partitions_assigned(assigned)

        try:
            self._in_loop(consumer, assign)
            self._obey(consumer)
        finally:
            placing, self._placing, self._committed = self._placing, None, {}
        consumer.assign([RdPartition(tp.topic, tp.partition, placing.get(tp, OFFSET_STORED))
                         for tp in sorted(assigned)])


async def _call(work: Callable[[], Awaitable[None]]) -> None:
    await work()


class RdProducer(PolledProducer):
    """The worker's producer on librdkafka: idempotent, ``acks=all``, records to the partitions named."""

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings, "worker producer")

    async def start(self) -> None:
        settings = self.settings
        self._start({
            "acks": "all",
            "enable.idempotence": True,  # retries keep each partition's order; none is written twice
            "linger.ms": settings.producer_linger_ms,
            "partitioner": "murmur2_random",  # (records the worker keys itself: Kafka's Java rule)
            "message.max.bytes": 2 * settings.max_message_bytes,
            "message.timeout.ms": 30_000,
        }, "arbiter-worker-producer", "cannot make the worker's Kafka producer")

    async def produce(self, records: list[tuple[str, int | None, bytes | None, bytes | None, Headers]]
                      ) -> asyncio.Future[None]:
        """Queue ``records`` (topic, partition or None for the key's, key, value, headers), in order; a
        future done once every one is acknowledged (failed if any is not)."""
        producer, loop = self._producer, self._loop
        if producer is None or loop is None:
            raise KafkaIOError("the worker's producer is not started", retriable=False)
        done: asyncio.Future[None] = loop.create_future()
        pending = _Pending(done, len(records))
        if not records:
            done.set_result(None)
            return done
        report = partial(self._report, pending.settle)
        for topic, partition, key, value, given in records:
            headers: list[tuple[str, str | bytes | None]] | None = list(given) if given else None
            while True:
                try:
                    if partition is None:
                        producer.produce(topic, value=value, key=key, headers=headers, on_delivery=report)
                    else:
                        producer.produce(topic, value=value, key=key, partition=partition, headers=headers,
                                         on_delivery=report)
                    break
                except BufferError:  # librdkafka's queue is full: let its thread drain it
                    await asyncio.sleep(0.002)
                except KafkaException as exc:
                    failed = io_error(exc, f"Kafka refused a record for {topic}")
                    pending.fail(failed)
                    raise failed from exc
        return done

    async def send(self, topic: str, value: bytes, *, key: bytes | None = None, partition: int | None = None,
                   headers: Headers | None = None) -> asyncio.Future[None]:
        """Queue one record; the future of its acknowledgement."""
        return await self.produce([(topic, partition, key, value, headers or [])])

    async def send_and_wait(self, topic: str, value: bytes, *, key: bytes | None = None,
                            headers: Headers | None = None) -> None:
        """Send one record and wait for its acknowledgement."""
        await (await self.send(topic, value, key=key, headers=headers))


class RdTxnProducer(RdProducer):
    """The transactional producer of one input partition (``exactly_once``): its ``transactional.id``
    names the partition, so whichever worker takes the partition over makes one of the same id, whose
    ``init_transactions`` fences this one and ends its open transaction before the changelog is read.

    librdkafka's transaction calls block (they wait for the coordinator): each runs in a thread of the
    loop's executor, while this producer's own thread keeps serving delivery reports. A failure says
    what may follow (``TxnError``): ``fenced`` (another producer of this id took over: nothing more from
    this one, not even an abort), else the transaction must be aborted before the next."""

    def __init__(self, settings: Settings, transactional_id: str) -> None:
        super().__init__(settings)
        self.transactional_id = transactional_id

    async def start(self) -> None:
        settings = self.settings
        self._start({
            "acks": "all",
            "enable.idempotence": True,
            "transactional.id": self.transactional_id,
            "transaction.timeout.ms": TXN_TIMEOUT_MS,
            "linger.ms": settings.producer_linger_ms,
            "partitioner": "murmur2_random",
            "message.max.bytes": 2 * settings.max_message_bytes,
            "message.timeout.ms": TXN_TIMEOUT_MS,
        }, "arbiter-worker-txn-producer", "cannot make a transactional Kafka producer")
        await self._txn(lambda p: p.init_transactions(REQUEST_S * 3), "starting transactions")

    def begin(self) -> None:
        """Begin a transaction (no round trip: the first record starts it on the broker)."""
        producer = self._producer
        if producer is None:
            raise KafkaIOError("the transactional producer is not started", retriable=False)
        try:
            producer.begin_transaction()
        except KafkaException as exc:
            raise TxnError.of(exc, "beginning a transaction") from exc

    async def send_offsets(self, offsets: dict[Any, int], group: Any) -> None:
        """Make ``offsets`` (the next input to read, per partition) part of the transaction, for ``group``
        (the consumer's group metadata, ``RdGroup.group_metadata``)."""
        parts = [RdPartition(tp.topic, tp.partition, offset) for tp, offset in offsets.items()]
        await self._txn(lambda p: p.send_offsets_to_transaction(parts, group, REQUEST_S), "adding offsets")

    async def commit(self) -> None:
        """Commit the transaction: its records and offsets are visible to read_committed readers at once."""
        await self._txn(lambda p: p.commit_transaction(REQUEST_S), "committing a transaction")

    async def abort(self) -> None:
        """Abort the transaction: nothing of it is ever read."""
        await self._txn(lambda p: p.abort_transaction(REQUEST_S), "aborting a transaction")

    async def _txn(self, call: Callable[[Any], Any], what: str) -> None:
        producer = self._producer
        if producer is None:
            raise KafkaIOError("the transactional producer is not started", retriable=False)
        try:
            await asyncio.get_running_loop().run_in_executor(None, call, producer)
        except KafkaException as exc:
            raise TxnError.of(exc, what) from exc


TXN_TIMEOUT_MS = 60_000
"""How long the broker keeps a transaction of a producer that went silent open before it aborts it."""


class TxnError(KafkaIOError):
    """A transaction call failed; ``fenced``: another producer of the same id took over (this one is done),
    else ``abortable``: abort, and the next transaction may succeed."""

    def __init__(self, message: str, *, retriable: bool, fenced: bool, abortable: bool) -> None:
        super().__init__(message, retriable=retriable)
        self.fenced, self.abortable = fenced, abortable

    @classmethod
    def of(cls, exc: KafkaException, what: str) -> TxnError:
        err = exc.args[0] if exc.args and isinstance(exc.args[0], KafkaError) else None
        if err is None:
            return cls(f"{what}: {exc}", retriable=False, fenced=False, abortable=True)
        fenced = err.fatal() or err.code() in (KafkaError._FENCED, KafkaError.PRODUCER_FENCED,
                                               KafkaError.INVALID_PRODUCER_EPOCH)
        return cls(f"{what}: {err.name()}: {err.str()}", retriable=err.retriable() and not fenced, fenced=fenced,
                   abortable=not fenced and err.txn_requires_abort())


class _Pending:
    """A batch's acknowledgements still to come."""

    __slots__ = ("done", "left")

    def __init__(self, done: asyncio.Future[None], left: int) -> None:
        self.done, self.left = done, left

    def fail(self, exc: BaseException) -> None:
        if not self.done.done():
            self.done.set_exception(exc)

    def settle(self, err: KafkaError | None) -> None:
        if self.done.done():
            return
        if err is not None:
            self.done.set_exception(io_error(err, "Kafka did not take a record"))
            return
        self.left -= 1
        if self.left == 0:
            self.done.set_result(None)

