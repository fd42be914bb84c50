"""A simulated Kafka behind the seam (``arbiter.edge.kafkaio``): the log a simulation's processes share.

Theory of operation
-------------------
``SimKafka`` holds topics of partitions of records in memory, each appended at the next offset
with the virtual clock's time (``arbiter.sim.loop``), and the offsets consumer groups committed.
``SimSender`` and ``SimReader`` implement the seam's ``Sender`` and ``Reader`` over it, with the
contract the real clients keep (``tests/edge/test_kafkaio_contract.py``): a key goes to Kafka's
Java partition for it, a send returns once the record is in the log, a reader hands out each
record of the partitions it reads from the offset it was given, once and in order.

Faults come from the simulation's seeded random source (``Faults``), so a seed replays them:
a send waits a while before it lands (and others overtake it), a send whose acknowledgement was
lost is retried and lands twice (at least once, as a real producer without idempotence), the
broker is unavailable for a window (every call fails, retriable), and a reader is slow to see
what was appended.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Coroutine, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from arbiter.edge.clock import now_ms
from arbiter.edge.kafkaio import Headers, KafkaIOError, Positions, Received, TopicPartition, clients_of
from arbiter.schemas.partitioning import partition_for


@dataclass(frozen=True, slots=True)
class Faults:
    """What goes wrong, and how often (probabilities per call; times in seconds of virtual time)."""

    send_delay_s: float = 0.0
    """A send lands after a random delay up to this long (sends overtake each other)."""
    duplicate_p: float = 0.0
    """A send lands twice (its acknowledgement was lost and it was retried)."""
    read_delay_s: float = 0.0
    """A read waits a random while up to this long before it looks (a slow consumer)."""
    outages: tuple[tuple[float, float], ...] = ()
    """(from, until) windows of virtual seconds since the start when no call succeeds."""
    produce_s: float = 0.0
    """A worker's produce lands after a random while up to this long, in order (librdkafka's queue and the
    broker's acknowledgement): a crash meanwhile loses what had not landed. 0: it lands as it is produced."""
    fetch_s: float = 0.001
    """Every fetch takes at least this long (a round trip to the broker): a consumer that fetches the same
    records again and again spins in time, as it would on a real broker, not in one instant forever."""


@dataclass
class SimKafka:
    """The simulated cluster: topics, their partitions' records, the groups' committed offsets."""

    rng: random.Random = field(default_factory=lambda: random.Random(0))
    faults: Faults = field(default_factory=Faults)
    topics: dict[str, list[list[Received]]] = field(default_factory=dict)
    committed: dict[str, dict[TopicPartition, int]] = field(default_factory=dict)
    groups: dict[str, object] = field(default_factory=dict)
    """Each consumer group's coordinator (``arbiter.sim.group``)."""
    txn_epochs: dict[str, int] = field(default_factory=dict)
    """Each transactional id's current producer epoch: an older one is fenced."""
    tasks: set[asyncio.Task[None]] = field(default_factory=set, repr=False)
    dead: set[str] = field(default_factory=set)
    """Owners whose clients crashed: every call of theirs fails from then on (``kill``)."""
    _waiting: dict[tuple[str, int], list[asyncio.Future[None]]] = field(default_factory=dict, repr=False)
    """Per partition, the readers waiting for its next record."""
    _start: float | None = field(default=None, repr=False)

    def create_topic(self, name: str, partitions: int) -> None:
        """Create ``name`` with ``partitions`` partitions (nothing if it exists)."""
        self.topics.setdefault(name, [[] for _ in range(partitions)])

    def append(self, topic: str, partition: int, key: bytes | None, value: bytes, headers: Headers) -> int:
        """Append one record now; its offset."""
        log = self._partition(topic, partition)
        log.append(Received(topic, partition, len(log), key, value, list(headers), now_ms()))
        self._wake(topic, partition)
        return len(log) - 1

    def records(self, topic: str, partition: int, start: int = 0, count: int | None = None) -> list[Received]:
        """One partition's records from offset ``start`` (at most ``count``), in offset order."""
        log = self._partition(topic, partition)
        return log[start:] if count is None else log[start:start + count]

    def spawn(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run ``work`` in the background (the cluster's own doings: noticing a dead member, a rebalance)."""
        loop = asyncio.get_running_loop()
        task = loop.create_task(work)
        self.tasks.add(task)

        def done(task: asyncio.Task[None]) -> None:
            self.tasks.discard(task)
            if not task.cancelled() and task.exception() is not None:
                loop.call_exception_handler({"message": "a task of the simulated Kafka failed",
                                             "exception": task.exception(), "task": task})

        task.add_done_callback(done)
        return task

    def kill(self, owner: str) -> None:
        """``owner``'s process died: none of its clients reaches the cluster again."""
        self.dead.add(owner)

    def check_up(self, what: str, owner: str = "") -> None:
        """Raise the retriable error a real client raises while the broker is unavailable (and a fatal one
        for a client whose process died)."""
        if owner and owner in self.dead:
            raise KafkaIOError(f"{what}: {owner} is dead", retriable=False)
        if self.down():
            at = asyncio.get_running_loop().time() - (self._start or 0.0)
            raise KafkaIOError(f"{what}: the simulated broker is unavailable (at {at:.3f} s)", retriable=True)

    def down(self) -> bool:
        """Whether the broker is away now (in one of the faults' outages)."""
        loop = asyncio.get_running_loop()
        if self._start is None:
            self._start = loop.time()
        at = loop.time() - self._start
        return any(start <= at < end for start, end in self.faults.outages)

    async def fetched(self, timeout: float) -> bool:
        """A fetch's round trip (and a slow consumer's lag); False, after ``timeout``, while the broker is away:
        a real consumer's fetch then returns nothing (the client retries underneath), it does not fail."""
        faults = self.faults
        await asyncio.sleep(faults.fetch_s + (self.rng.uniform(0, faults.read_delay_s) if faults.read_delay_s else 0.0))
        if self.down():
            await asyncio.sleep(timeout)
            return False
        return True

    async def appended(self, timeout: float, partitions: Iterable[tuple[str, int]]) -> None:
        """Wait until a record is appended to one of ``partitions``, or ``timeout`` seconds pass."""
        wanted = list(partitions)
        if not wanted:
            await asyncio.sleep(timeout)
            return
        woken: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        for tp in wanted:
            self._waiting.setdefault(tp, []).append(woken)
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(woken, timeout)
        finally:
            for tp in wanted:
                waiting = self._waiting.get(tp)
                if waiting is not None and woken in waiting:
                    waiting.remove(woken)

    def _wake(self, topic: str, partition: int) -> None:
        for woken in self._waiting.pop((topic, partition), ()):
            if not woken.done():
                woken.set_result(None)

    def _partition(self, topic: str, partition: int) -> list[Received]:
        parts = self.topics.get(topic)
        if parts is None:
            raise KafkaIOError(f"{topic}: no such topic", retriable=False)
        if not 0 <= partition < len(parts):
            raise KafkaIOError(f"{topic}[{partition}]: no such partition", retriable=False)
        return parts[partition]


class SimSender:
    """The seam's ``Sender`` over a ``SimKafka``."""

    def __init__(self, kafka: SimKafka) -> None:
        self.kafka = kafka

    async def start(self) -> None:
        self.kafka.check_up("connecting")

    async def stop(self) -> None:
        return None

    async def partitions(self, topic: str) -> int:
        self.kafka.check_up(f"reading {topic}'s metadata")
        parts = self.kafka.topics.get(topic)
        if parts is None:
            raise KafkaIOError(f"{topic}: no such topic", retriable=False)
        return len(parts)

    async def send(self, topic: str, key: bytes, value: bytes, headers: Headers | None) -> None:
        await self.append(topic, key, value, headers)

    async def append(self, topic: str, key: bytes | None, value: bytes, headers: Headers | None,
                     partition: int | None = None) -> tuple[int, int]:
        kafka, faults = self.kafka, self.kafka.faults
        count = await self.partitions(topic)
        if partition is None:
            partition = partition_for(key, count) if key is not None else kafka.rng.randrange(count)
        if faults.send_delay_s:
            await asyncio.sleep(kafka.rng.uniform(0, faults.send_delay_s))
            kafka.check_up(f"sending to {topic}")
        offset = kafka.append(topic, partition, key, value, headers or [])
        if faults.duplicate_p and kafka.rng.random() < faults.duplicate_p:
            offset = kafka.append(topic, partition, key, value, headers or [])  # the retry of a lost ack
        return partition, offset


class SimReader:
    """The seam's ``Reader`` over a ``SimKafka`` (every record is committed: it writes no transactions)."""

    def __init__(self, kafka: SimKafka, max_batch: int = 500, owner: str = "") -> None:
        self.kafka = kafka
        self.max_batch = max_batch
        self.owner = owner
        self._positions = Positions()

    async def start(self) -> None:
        self.kafka.check_up("connecting")

    async def stop(self) -> None:
        self._positions = Positions()

    async def end_offset(self, topic: str, partition: int) -> int:
        self.kafka.check_up(f"reading the offsets of {topic}[{partition}]")
        return len(self.kafka.records(topic, partition))

    async def offsets(self, topic: str, partition: int) -> tuple[int, int]:
        return 0, await self.end_offset(topic, partition)

    async def partitions(self, topic: str) -> int | None:
        self.kafka.check_up(f"reading {topic}'s metadata")
        parts = self.kafka.topics.get(topic)
        return None if parts is None else len(parts)

    async def committed(self, group: str, partitions: list[TopicPartition]) -> dict[TopicPartition, int]:
        self.kafka.check_up(f"reading group {group}'s offsets")
        known = self.kafka.committed.get(group, {})
        return {tp: known[tp] for tp in partitions if tp in known}

    async def position(self, topic: str, partition: int) -> int:
        at = self._positions.next.get((topic, partition))
        if at is None:
            raise KafkaIOError(f"{topic}[{partition}] is not read", retriable=False)
        return at

    def add(self, topic: str, partition: int, offset: int) -> None:
        self._positions.add(topic, partition, offset)

    def drop(self, topic: str, partition: int) -> None:
        self._positions.drop(topic, partition)

    def reading(self) -> set[tuple[str, int]]:
        return set(self._positions.next)

    async def read(self, timeout: float) -> list[Received]:
        kafka = self.kafka
        if self.owner and self.owner in kafka.dead:
            raise KafkaIOError(f"reading: {self.owner} is dead", retriable=False)
        if not await kafka.fetched(timeout):
            return []
        got = self._take()
        if not got and timeout > 0:
            await kafka.appended(timeout, self._positions.next)
            got = self._take()
        return got

    def _take(self) -> list[Received]:
        out: list[Received] = []
        for (topic, partition), at in sorted(self._positions.next.items()):
            for record in self.kafka.records(topic, partition, at, self.max_batch - len(out)):
                if self._positions.admit(record):
                    out.append(record)
            if len(out) >= self.max_batch:
                break
        return out


class SimProducer:
    """A producer with librdkafka's interface (``arbiter.edge.kafkaio.group.RdProducer``), for a worker."""

    def __init__(self, kafka: SimKafka, owner: str = "") -> None:
        self.kafka, self.owner = kafka, owner
        self._last: asyncio.Future[None] | None = None
        """What this producer produced last, not landed yet maybe: the next lands after it."""

    async def start(self) -> None:
        self.kafka.check_up("connecting", self.owner)

    async def stop(self) -> None:
        return None

    async def produce(self, records: list[tuple[str, int | None, bytes | None, bytes | None, Headers]]
                      ) -> asyncio.Future[None]:
        """Append ``records`` in order (each on its partition, or its key's); a future done once all landed
        (at once, or ``Faults.produce_s`` later, after everything this producer produced before)."""
        kafka = self.kafka
        kafka.check_up("producing", self.owner)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        done.add_done_callback(_retrieved)
        if not kafka.faults.produce_s:
            self._append(records)
            done.set_result(None)
            return done
        # Chained on the landing itself, not on the caller's future: a caller that stops waiting (its future
        # cancelled) does not let the next records overtake its own, which are still on their way.
        landed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        previous, self._last = self._last, landed
        delay = kafka.rng.uniform(0, kafka.faults.produce_s)

        async def land() -> None:
            try:
                await asyncio.sleep(delay)
                if previous is not None:
                    await previous
                # librdkafka retries while the broker is away (virtual time: polling costs nothing)
                while kafka.down() and self.owner not in kafka.dead:  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
                if self.owner in kafka.dead:  # the process died with the records in its queue
                    if not done.done():
                        done.set_exception(KafkaIOError(f"producing: {self.owner} is dead", retriable=False))
                    return
                self._append(records)  # (even when the caller stopped waiting: what was queued is sent)
                if not done.done():
                    done.set_result(None)
            finally:
                landed.set_result(None)

        kafka.spawn(land())
        return done

    def _append(self, records: list[tuple[str, int | None, bytes | None, bytes | None, Headers]]) -> None:
        for topic, partition, key, value, headers in records:
            where = partition if partition is not None else partition_for(key or b"", len(self.kafka.topics[topic]))
            self.kafka.append(topic, where, key, value or b"", headers)

    async def send(self, topic: str, value: bytes, *, key: bytes | None = None, partition: int | None = None,
                   headers: Headers | None = None) -> asyncio.Future[None]:
        return await self.produce([(topic, partition, key, value, headers or [])])

    async def send_and_wait(self, topic: str, value: bytes, *, key: bytes | None = None,
                            partition: int | None = None, headers: Headers | None = None) -> None:
        await (await self.send(topic, value, key=key, partition=partition, headers=headers))


def _retrieved(done: asyncio.Future[None]) -> None:
    """A produce whose caller is gone (its process crashed) fails unheard, not as the loop's failure."""
    if not done.cancelled():
        done.exception()


@contextlib.contextmanager
def seam_of(kafka: SimKafka) -> Iterator[None]:
    """Inside the block every client the seam makes (the SDK's, the registry feed's...) is ``kafka``'s."""
    with clients_of(lambda: SimSender(kafka), lambda: SimReader(kafka)):
        yield
