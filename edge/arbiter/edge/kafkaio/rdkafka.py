"""The Kafka seam on librdkafka (confluent-kafka's synchronous clients, bridged to asyncio).

Why not ``confluent_kafka.aio``: it sends every call through a thread pool (2.29 ms for two
hops where this bridge takes ~0.8-1.0) and its producer takes no headers, where Arbiter's
signatures go.

The producer is called from the event loop (``produce`` only queues); one thread calls its
``poll``, which runs the delivery reports, and each report settles its send's future on the
loop with ``call_soon_threadsafe``. The consumer has one owner, its reader thread:
confluent-kafka lets one caller at a time into a consumer (another thread's call spins until
``poll`` returns), so assignment changes and end-offset queries are handed to that thread
and run between two short polls. Records go to the loop in batches through a bounded queue
(the thread waits when the loop falls behind), and the loop-side :class:`Positions` filter
hands out each partition's records once and in order.

Settings that differ from librdkafka's defaults, and why: ``linger.ms=0`` and
``socket.nagle.disable`` (one command at a time must not wait for a batch; untuned, a hop took
5.7 ms), ``fetch.wait.max.ms=10`` and ``fetch.error.backoff.ms=10`` (an outcome is read within
~10 ms of its append), ``partitioner=murmur2_random`` (Kafka's Java rule, which the workers
and :func:`arbiter.schemas.partitioning.partition_for` use; librdkafka's default is CRC32),
``acks=all``, ``isolation.level=read_committed``, and a Python ``logger`` so librdkafka's log
lines go through ``logging`` (each at most once per 30 s) instead of to stderr.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future as ThreadFuture
from functools import partial
from typing import Any

from confluent_kafka import Consumer, ConsumerGroupTopicPartitions, KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from ..kafkaauth import rdkafka_options
from ..kafkaconn import Repeats
from ..settings import Settings
from . import METADATA_TIMEOUT_S, Fetch, Headers, KafkaIOError, Positions, Received
from . import TopicPartition as Partition

log = logging.getLogger("arbiter.kafka")
_librdkafka = logging.getLogger("arbiter.kafka.librdkafka")
_librdkafka.addFilter(Repeats())
# Where no logging is configured (a CLI verb, a script), librdkafka's lines are not printed by Python's
# last-resort handler ahead of the one error line the caller prints; configured logging still gets them.
_librdkafka.addHandler(logging.NullHandler())

POLL_S = 0.02
"""How long the reader thread waits for a record before it looks at its commands again."""
QUERY_S = 2.0
"""How long the reader thread waits for one end-offset answer (it reads nothing meanwhile)."""
BATCH = 500
"""Most records the reader thread hands the loop at once."""
BACKLOG = 64
"""Most batches waiting for the loop before the reader thread waits too."""
_DOWN = {KafkaError._ALL_BROKERS_DOWN, KafkaError._AUTHENTICATION, KafkaError._RESOLVE}
_PASSING = {KafkaError._TRANSPORT, KafkaError._TIMED_OUT, KafkaError._MSG_TIMED_OUT, KafkaError._ALL_BROKERS_DOWN,
            KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE, KafkaError._WAIT_COORD,
            KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError.REQUEST_TIMED_OUT}
"""Errors that pass (a broker restarting, a leader moving, a topic created a moment ago), whether or
not librdkafka marked them retriable (it marks only some of those it raises itself)."""


def io_error(err: KafkaError | KafkaException | BaseException, what: str) -> KafkaIOError:
    """A librdkafka error as the seam's."""
    if isinstance(err, KafkaException) and err.args and isinstance(err.args[0], KafkaError):
        err = err.args[0]
    if isinstance(err, KafkaError):
        retriable = err.retriable() or err.code() in _PASSING
        return KafkaIOError(f"{what}: {err.name()}: {err.str()}", retriable=retriable and not err.fatal())
    return KafkaIOError(f"{what}: {type(err).__name__}: {err}", retriable=True)


def _common(settings: Settings, errors: Any) -> dict[str, Any]:
    return {
        "bootstrap.servers": settings.bootstrap,
        "client.id": "arbiter",
        "socket.nagle.disable": True,
        "reconnect.backoff.ms": 50,
        "reconnect.backoff.max.ms": 1000,
        "logger": _librdkafka,
        "error_cb": errors,
        **rdkafka_options(settings),
    }


class _Errors:
    """A client's error callback: logged once per window, and "no broker answers" told to the calls
    waiting (librdkafka says it once, when the last broker goes down, so it is also remembered until
    a call succeeds)."""

    GRACE_S = 1.0
    """How long a call started after "no broker answers" waits for one to answer after all."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.down: KafkaError | None = None
        self.down_since: float | None = None
        """When no broker answered first (``time.monotonic``), until one answers: said once, when it does."""
        self.watchers: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[Any]]] = []

    def __call__(self, err: KafkaError) -> None:  # in the client's polling thread
        if err.code() in _DOWN or err.fatal():
            self.down = err
            if self.down_since is None:
                self.down_since = time.monotonic()
            for loop, fut in self.watchers:
                loop.call_soon_threadsafe(_fail, fut, io_error(err, f"Kafka ({self.name})"))
            _librdkafka.warning("%s: %s", self.name, err.str())
        else:  # (a failed connect is logged by librdkafka itself, through ``logger``)
            _librdkafka.debug("%s: %s", self.name, err.str())

    def watch(self) -> tuple[asyncio.AbstractEventLoop, asyncio.Future[Any]]:
        """A future that fails when no broker answers (now, or a moment after: see ``GRACE_S``)."""
        loop = asyncio.get_running_loop()
        watcher = (loop, loop.create_future())
        self.watchers.append(watcher)
        if self.down is not None:
            loop.call_later(self.GRACE_S, _fail, watcher[1], io_error(self.down, f"Kafka ({self.name})"))
        return watcher

    def unwatch(self, watcher: tuple[asyncio.AbstractEventLoop, asyncio.Future[Any]], answered: bool) -> None:
        self.watchers.remove(watcher)
        if not watcher[1].done():
            watcher[1].cancel()
        elif not watcher[1].cancelled():
            watcher[1].exception()  # (the call's own answer came first: this one is not news)
        if answered:
            self.answered()

    def answered(self) -> None:
        """A broker answered (a call, a delivery, a fetch): an outage said before is over, and said so."""
        self.down = None
        since, self.down_since = self.down_since, None
        if since is not None:
            _librdkafka.warning("%s: Kafka reachable again after %.0f s", self.name, time.monotonic() - since)


def _failure(fut: asyncio.Future[Any]) -> BaseException:
    exc = fut.exception()
    assert exc is not None
    return exc


def _fail(fut: asyncio.Future[Any], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)


def _resolve(fut: asyncio.Future[Any], result: Any) -> None:
    if not fut.done():
        fut.set_result(result)


def _call_into(loop: asyncio.AbstractEventLoop, fut: asyncio.Future[Any], call: Callable[[], Any]) -> None:
    """Run ``call`` (in a thread) and settle ``fut`` on ``loop`` with its outcome."""
    try:
        outcome = partial(_resolve, fut, call())
    except BaseException as exc:  # (handed to the caller, as an executor would)
        outcome = partial(_fail, fut, exc)
    with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody is waiting any more
        loop.call_soon_threadsafe(outcome)


def reply(fut: ThreadFuture[Any], result: Any) -> None:
    """Answer a caller waiting across threads, unless it gave up (a timeout cancels the future: setting
    it then raises, and must not stop the thread that answers)."""
    if fut.set_running_or_notify_cancel():
        fut.set_result(result)


def refuse(fut: ThreadFuture[Any], exc: BaseException) -> None:
    """Fail a caller waiting across threads, unless it gave up (see ``reply``)."""
    if fut.set_running_or_notify_cancel():
        fut.set_exception(exc)


def _settle(fut: asyncio.Future[None], err: KafkaError | None) -> None:
    if fut.done():
        return  # the sender gave up on it (a timeout); the report is of no use now
    if err is None:
        fut.set_result(None)
    else:
        fut.set_exception(io_error(err, "Kafka did not take the record"))


def _settle_placed(fut: asyncio.Future[tuple[int, int]], where: tuple[int, int], err: KafkaError | None) -> None:
    if fut.done():
        return
    if err is None:
        fut.set_result(where)
    else:
        fut.set_exception(io_error(err, "Kafka did not take the record"))


Settle = Callable[[KafkaError | None], None]
"""What one delivery report settles: given the record's error, or None once it is acknowledged."""


class PolledProducer:
    """One librdkafka producer and the thread that serves its delivery reports (``poll``): the
    reports one poll served are handed to the loop together, one wake-up for all of them."""

    def __init__(self, settings: Settings, name: str) -> None:
        self.settings = settings
        self._errors = _Errors(name)
        self._producer: Producer | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reports: list[tuple[Settle, KafkaError | None]] = []
        """Delivery reports a poll served, handed to the loop together when it returns."""

    def _start(self, config: dict[str, Any], thread: str, what: str) -> None:
        """Make the producer (``config`` on top of the common settings) and start its thread."""
        self._loop = asyncio.get_running_loop()
        try:
            self._producer = Producer({**_common(self.settings, self._errors), **config})
        except KafkaException as exc:
            raise io_error(exc, what) from exc
        self._thread = threading.Thread(target=self._serve, name=thread, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        producer, loop = self._producer, self._loop
        assert producer is not None and loop is not None
        while not self._stopping.is_set():
            producer.poll(0.1)
            if self._reports:
                reports, self._reports = self._reports, []
                if not loop.is_closed():
                    loop.call_soon_threadsafe(_settle_all, reports)

    def _report(self, settle: Settle, err: KafkaError | None, _msg: Any) -> None:
        """librdkafka's delivery callback: runs inside ``poll`` or ``flush``, in their thread."""
        self._reports.append((settle, err))
        if err is None and self._errors.down_since is not None:
            self._errors.answered()

    async def stop(self) -> None:
        producer, self._producer = self._producer, None
        if producer is None:
            return
        self._stopping.set()
        loop = asyncio.get_running_loop()
        if self._thread is not None:
            await loop.run_in_executor(None, self._thread.join)
        await loop.run_in_executor(None, producer.flush, 2.0)
        reports, self._reports = self._reports, []  # what the flush served (the thread has ended)
        _settle_all(reports)


class RdSender(PolledProducer):
    """Sends through one librdkafka producer; one thread serves its delivery reports."""

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings, "producer")

    async def start(self) -> None:
        settings = self.settings
        self._start({
            "acks": "all",
            "linger.ms": 0,
            "partitioner": "murmur2_random",
            "message.max.bytes": 2 * settings.max_message_bytes,
            # librdkafka retries a send this long by itself; the SDK's own deadline is the same.
            "message.timeout.ms": max(1000, int(settings.send_retry_seconds * 1000)),
        }, "arbiter-kafka-producer", "cannot make a Kafka producer")

    async def partitions(self, topic: str) -> int:
        producer = self._producer
        if producer is None:
            raise KafkaIOError("the sender is not started", retriable=False)
        metadata = await self._bounded(partial(producer.list_topics, topic, timeout=METADATA_TIMEOUT_S),
                                       f"reading {topic}'s metadata")
        found = metadata.topics.get(topic)
        if found is None or found.error is not None or not found.partitions:
            why = found.error.str() if found is not None and found.error is not None else "no such topic"
            raise KafkaIOError(f"topic {topic!r}: {why}", retriable=False)
        return len(found.partitions)

    async def _bounded(self, call: Any, what: str) -> Any:
        """Run a blocking client call in a thread, failing early if the client finds no broker.

        The thread is a daemon of its own, not the loop's executor: a call given up on ends on its own
        timeout, and ``asyncio.run`` waits for the executor's threads, so a command that found no broker
        would take that timeout (10 s) to exit."""
        loop = asyncio.get_running_loop()
        watcher = self._errors.watch()
        running: asyncio.Future[Any] = loop.create_future()
        threading.Thread(target=_call_into, args=(loop, running, call), name="arbiter-kafka-call", daemon=True).start()
        answered = False
        try:
            done, _ = await asyncio.wait({running, watcher[1]}, return_when=asyncio.FIRST_COMPLETED)
            if running in done:
                try:
                    result = running.result()
                except KafkaException as exc:
                    raise io_error(exc, what) from exc
                answered = True
                return result
            running.add_done_callback(lambda f: f.exception())  # (the thread ends on its own timeout)
            raise _failure(watcher[1])
        finally:
            self._errors.unwatch(watcher, answered)

    async def send(self, topic: str, key: bytes, value: bytes, headers: Headers | None) -> None:
        producer, loop = self._producer, self._loop
        if producer is None or loop is None:
            raise KafkaIOError("the sender is not started", retriable=False)
        fut: asyncio.Future[None] = loop.create_future()
        report = partial(self._report, partial(_settle, fut))
        extra: list[tuple[str, str | bytes | None]] | None = list(headers) if headers else None
        while True:
            try:
                producer.produce(topic, value=value, key=key, headers=extra, on_delivery=report)
                break
            except BufferError:  # librdkafka's queue is full: let the thread drain it
                await asyncio.sleep(0.002)
            except KafkaException as exc:
                raise io_error(exc, f"Kafka refused a record for {topic}") from exc
        await fut

    async def append(self, topic: str, key: bytes | None, value: bytes, headers: Headers | None,
                     partition: int | None = None) -> tuple[int, int]:
        producer, loop = self._producer, self._loop
        if producer is None or loop is None:
            raise KafkaIOError("the sender is not started", retriable=False)
        fut: asyncio.Future[tuple[int, int]] = loop.create_future()
        report = partial(self._placed, fut)
        extra: list[tuple[str, str | bytes | None]] | None = list(headers) if headers else None
        where = -1 if partition is None else partition  # (librdkafka's "unassigned": the partitioner's)
        while True:
            try:
                producer.produce(topic, value=value, key=key, partition=where, headers=extra, on_delivery=report)
                break
            except BufferError:
                await asyncio.sleep(0.002)
            except KafkaException as exc:
                raise io_error(exc, f"Kafka refused a record for {topic}") from exc
        return await fut

    def _placed(self, fut: asyncio.Future[tuple[int, int]], err: KafkaError | None, msg: Any) -> None:
        """``append``'s delivery callback (in the polling thread): its report says where the record went."""
        self._reports.append((partial(_settle_placed, fut, (msg.partition(), msg.offset())), err))


def _settle_all(reports: list[tuple[Settle, KafkaError | None]]) -> None:
    for settle, err in reports:
        settle(err)


class RdReader:
    """Reads through one librdkafka consumer owned by its thread (assignment only, no group)."""

    def __init__(self, settings: Settings, fetch: Fetch | None = None) -> None:
        self.settings = settings
        self.fetch = fetch or Fetch()
        self._errors = _Errors("consumer")
        self._positions = Positions()
        self._gens: dict[tuple[str, int], int] = {}
        """Per partition, how many times it was added: a position the thread fetched before the last
        ``add`` is not the partition's any more."""
        self._fetched: dict[tuple[str, int], tuple[int, int]] = {}
        """Per partition, (generation, the consumer's position), published by the thread after the batch
        it fetched is queued (only once someone asks for ``position``: the SDK never does)."""
        self._track = False
        self._assigned: dict[tuple[str, int], int] = {}
        """The thread's own: each assigned partition's generation."""
        self._commands: collections.deque[tuple[Any, ...]] = collections.deque()
        self._batches: queue.Queue[list[Received]] = queue.Queue(BACKLOG)
        self._arrived: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._consumer: Consumer | None = None
        self._admin: AdminClient | None = None
        """For ``committed`` alone (the consumer asks for its own group's offsets only); made on first use."""
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._arrived = asyncio.Event()
        try:
            self._consumer = Consumer({
                **_common(self.settings, self._errors),
                # librdkafka wants a group id even for a consumer that only assigns; it never joins
                # this group and commits nothing (an agent's principal may read any group's offsets).
                "group.id": "arbiter-inbox-reader",
                "enable.auto.commit": False,
                "enable.auto.offset.store": False,
                "isolation.level": self.fetch.isolation_level,
                "fetch.wait.max.ms": self.fetch.max_wait_ms or 10,
                "fetch.error.backoff.ms": 10,
                "auto.offset.reset": "earliest",
                **({"fetch.min.bytes": self.fetch.min_bytes} if self.fetch.min_bytes else {}),
                **({"max.partition.fetch.bytes": self.fetch.max_partition_bytes}
                   if self.fetch.max_partition_bytes else {}),
            })
        except KafkaException as exc:
            raise io_error(exc, "cannot make a Kafka consumer") from exc
        self._thread = threading.Thread(target=self._run, name="arbiter-kafka-reader", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._admin = None  # (an admin client has no close: dropped, it disconnects)
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stopping.set()
        while True:  # (the thread may wait for room in the queue)
            try:
                self._batches.get_nowait()
            except queue.Empty:
                break
        await asyncio.get_running_loop().run_in_executor(None, thread.join)

    # -- the loop's side ----------------------------------------------------------------

    async def end_offset(self, topic: str, partition: int) -> int:
        return (await self.offsets(topic, partition))[1]

    async def offsets(self, topic: str, partition: int) -> tuple[int, int]:
        deadline = time.monotonic() + METADATA_TIMEOUT_S
        while True:
            try:
                answer: tuple[int, int] = await self._ask("offsets", topic, partition)
                return answer
            except KafkaIOError as exc:  # a partition created a moment ago may have no leader yet
                # (but no broker answering is said at once, whichever of the two paths said it first:
                # the query's own error, or the error callback's)
                if not exc.retriable or self._errors.down is not None or time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.05)

    async def partitions(self, topic: str) -> int | None:
        answer: int | None = await self._ask("meta", topic, -1)
        return answer

    async def committed(self, group: str, partitions: list[Partition]) -> dict[Partition, int]:
        if self._thread is None:
            raise KafkaIOError("the reader is not started", retriable=False)
        if self._admin is None:
            self._admin = AdminClient(_common(self.settings, _Errors("admin")))
        admin = self._admin
        request = ConsumerGroupTopicPartitions(group, [TopicPartition(t, p) for t, p in partitions])
        try:
            futures = admin.list_consumer_group_offsets([request], request_timeout=METADATA_TIMEOUT_S)
            answer = await asyncio.wrap_future(futures[group])
        except KafkaException as exc:
            raise io_error(exc, f"reading the offsets group {group} committed") from exc
        finally:
            admin.poll(0)  # (hands on the log lines it queued meanwhile)
        return {Partition(tp.topic, tp.partition): int(tp.offset) for tp in answer.topic_partitions or []
                if tp.error is None and tp.offset >= 0}  # (none committed: OFFSET_INVALID, below 0)

    async def position(self, topic: str, partition: int) -> int:
        tp = (topic, partition)
        handed = self._positions.next.get(tp)
        if handed is None:
            raise KafkaIOError(f"{topic}[{partition}] is not read", retriable=False)
        self._track = True
        # The thread publishes a position only after queueing what it fetched before it, so once the
        # queue is empty (no await between the two looks) every record below it has been handed out.
        fetched = self._fetched.get(tp)
        if fetched is None or fetched[0] != self._gens.get(tp) or not self._batches.empty():
            return handed
        return max(handed, fetched[1])

    async def _ask(self, kind: str, topic: str, partition: int) -> Any:
        """A question only the consumer's thread may put to it, answered between two polls."""
        if self._loop is None or self._thread is None:
            raise KafkaIOError("the reader is not started", retriable=False)
        answer: ThreadFuture[Any] = ThreadFuture()
        self._commands.append((kind, topic, partition, answer))
        watcher = self._errors.watch()
        waiting = asyncio.wrap_future(answer)
        answered = False
        try:
            done, _ = await asyncio.wait({waiting, watcher[1]}, return_when=asyncio.FIRST_COMPLETED)
            if waiting in done:
                result = waiting.result()
                answered = True
                return result
            waiting.add_done_callback(lambda f: f.exception())
            raise _failure(watcher[1])
        finally:
            self._errors.unwatch(watcher, answered)

    def add(self, topic: str, partition: int, offset: int) -> None:
        if self._positions.add(topic, partition, offset):
            gen = self._gens[(topic, partition)] = self._gens.get((topic, partition), 0) + 1
            self._commands.append(("add", topic, partition, offset, gen))

    def drop(self, topic: str, partition: int) -> None:
        if self._positions.drop(topic, partition):
            self._commands.append(("drop", topic, partition))

    def reading(self) -> set[tuple[str, int]]:
        return set(self._positions.next)

    async def read(self, timeout: float) -> list[Received]:
        arrived = self._arrived
        assert arrived is not None, "the reader is not started"
        try:
            async with asyncio.timeout(timeout):
                while True:
                    batch = self._take()
                    if batch:
                        return batch
                    arrived.clear()
                    batch = self._take()  # (a batch put between the first look and the clear)
                    if batch:
                        return batch
                    await arrived.wait()
        except TimeoutError:
            return []

    def _take(self) -> list[Received]:
        admitted: list[Received] = []
        admit = self._positions.admit
        while True:
            try:
                batch = self._batches.get_nowait()
            except queue.Empty:
                return admitted
            admitted.extend(record for record in batch if admit(record))

    # -- the thread's side --------------------------------------------------------------

    def _run(self) -> None:
        consumer = self._consumer
        assert consumer is not None
        try:
            while not self._stopping.is_set():
                self._obey(consumer)
                if self._track and self._assigned:
                    self._publish(consumer)  # (after the batches fetched before it are queued)
                first = consumer.poll(POLL_S)
                if first is None:
                    continue
                batch = self._records([first, *consumer.consume(BATCH - 1, 0)])
                while batch and not self._stopping.is_set():
                    try:
                        self._batches.put(batch, timeout=POLL_S)
                    except queue.Full:
                        self._obey(consumer)  # (commands still run while the loop catches up)
                        continue
                    loop, arrived = self._loop, self._arrived
                    assert loop is not None and arrived is not None
                    loop.call_soon_threadsafe(arrived.set)
                    break
        except Exception:
            log.exception("the Kafka reader thread stopped")
            raise
        finally:
            self._fail_commands(KafkaIOError("the reader stopped", retriable=False))
            consumer.close()

    def _publish(self, consumer: Consumer) -> None:
        """The consumer's position of every assigned partition, past the transaction markers it fetched."""
        try:
            found = consumer.position([TopicPartition(t, p) for t, p in self._assigned])
        except KafkaException:
            return
        assigned, fetched = self._assigned, self._fetched
        for tp in found:
            if tp.offset >= 0 and tp.error is None:
                key = (tp.topic, tp.partition)
                gen = assigned.get(key)
                if gen is not None:
                    fetched[key] = (gen, tp.offset)

    def _obey(self, consumer: Consumer) -> None:
        commands = self._commands
        while commands:
            command = commands.popleft()
            try:
                if command[0] == "add":
                    consumer.incremental_assign([TopicPartition(command[1], command[2], command[3])])
                    self._assigned[(command[1], command[2])] = command[4]
                elif command[0] == "drop":
                    self._assigned.pop((command[1], command[2]), None)
                    consumer.incremental_unassign([TopicPartition(command[1], command[2])])
                elif command[0] == "meta":
                    self._answer_meta(consumer, command[1], command[3])
                else:
                    answer: ThreadFuture[tuple[int, int]] = command[3]
                    try:  # (short: the thread polls nothing meanwhile; the loop asks again if it may help)
                        low, high = consumer.get_watermark_offsets(TopicPartition(command[1], command[2]),
                                                                   timeout=QUERY_S, cached=False)
                    except KafkaException as exc:
                        failed = io_error(exc, f"reading the offsets of {command[1]}[{command[2]}]")
                        if exc.args[0].code() == KafkaError._ALL_BROKERS_DOWN:
                            failed.retriable = False  # no broker answers: the caller hears it now
                        refuse(answer, failed)
                    else:
                        reply(answer, (int(low), int(high)))
            except KafkaException as exc:
                log.error("the Kafka reader could not %s %s[%d]: %s", command[0], command[1], command[2], exc)

    @staticmethod
    def _answer_meta(consumer: Consumer, topic: str, answer: ThreadFuture[int | None]) -> None:
        try:
            metadata = consumer.list_topics(topic, timeout=QUERY_S)
        except KafkaException as exc:
            failed = io_error(exc, f"reading {topic}'s metadata")
            if exc.args[0].code() == KafkaError._ALL_BROKERS_DOWN:
                failed.retriable = False
            refuse(answer, failed)
            return
        found = metadata.topics.get(topic)
        if found is not None and found.error is not None and found.error.code() != KafkaError.UNKNOWN_TOPIC_OR_PART:
            refuse(answer, io_error(found.error, f"reading {topic}'s metadata"))
            return
        reply(answer, len(found.partitions) if found is not None and found.error is None and found.partitions
              else None)

    def _fail_commands(self, exc: KafkaIOError) -> None:
        while self._commands:
            command = self._commands.popleft()
            if command[0] in ("offsets", "meta"):
                refuse(command[3], exc)

    def _records(self, messages: list[Any]) -> list[Received]:
        records = []
        for message in messages:
            err = message.error()
            if err is not None:
                if err.code() != KafkaError._PARTITION_EOF:
                    log.warning("the Kafka reader: %s", err.str())
                continue
            records.append(Received(message.topic(), message.partition(), message.offset(), message.key(),
                                    message.value(), message.headers() or [], message.timestamp()[1]))
        if records and self._errors.down_since is not None:
            self._errors.answered()
        return records
