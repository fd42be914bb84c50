"""The seam's interface: the records, the errors and the two protocols every Kafka client behind it
implements, the position filter both readers share, and the factories that pick an implementation by
the ``kafka_client`` setting. (Theory of operation: the package's docstring, ``arbiter.edge.kafkaio``.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from ..settings import Settings

Headers = list[tuple[str, bytes]]

METADATA_TIMEOUT_S = 10.0
"""How long a metadata or offsets request may take before it counts as Kafka unreachable."""

CLIENTS = ("librdkafka", "aiokafka")
"""The implementations behind the seam, by their ``kafka_client`` setting."""


class TopicPartition(NamedTuple):
    """One partition of a topic (equal to aiokafka's and to a plain ``(topic, partition)`` tuple)."""

    topic: str
    partition: int


@dataclass(frozen=True, slots=True)
class Fetch:
    """How a reader fetches, where its default does not suit: a follower of many partitions that
    waits longer for fuller fetches, or the audit, whose records may be large. ``None``: the default."""

    isolation_level: str = "read_committed"
    """``read_uncommitted`` for a reader that must see what a transaction has not committed yet."""
    max_wait_ms: int | None = None
    min_bytes: int | None = None
    max_partition_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class Received:
    """One record read from a partition (the attributes ``verify`` and the door use)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: Headers
    timestamp: int
    """Milliseconds since the epoch: the producer's create time, or the broker's append time."""


class KafkaIOError(Exception):
    """A Kafka operation failed; ``retriable`` says whether trying again may help."""

    def __init__(self, message: str, *, retriable: bool) -> None:
        super().__init__(message)
        self.retriable = retriable


class Sender(Protocol):
    """Sends records, each acknowledged by every in-sync replica before ``send`` returns."""

    async def start(self) -> None:
        """Connect; raises ``KafkaIOError`` when no broker answers."""

    async def stop(self) -> None:
        """Wait briefly for records in flight, then disconnect."""

    async def partitions(self, topic: str) -> int:
        """How many partitions ``topic`` has (``KafkaIOError`` if it does not exist)."""

    async def send(self, topic: str, key: bytes, value: bytes, headers: Headers | None) -> None:
        """Append one record to the partition ``key`` maps to; return once it is acknowledged."""

    async def append(self, topic: str, key: bytes | None, value: bytes, headers: Headers | None,
                     partition: int | None = None) -> tuple[int, int]:
        """``send``, as given, saying where the record went: (partition, offset). ``partition`` puts it
        there whatever ``key`` hashes to; a None key goes to a partition picked at random (unless given).
        For records a fault campaign or a rogue agent injects to see the workers refuse them; the SDK
        uses ``send``."""


class Reader(Protocol):
    """Reads the committed records of the partitions it is told, each from an offset it is told."""

    async def start(self) -> None:
        """Connect; raises ``KafkaIOError`` when no broker answers."""

    async def stop(self) -> None:
        """Disconnect."""

    async def end_offset(self, topic: str, partition: int) -> int:
        """The offset after the partition's last committed record (its last stable offset; under
        ``read_uncommitted``, after its last record)."""

    async def offsets(self, topic: str, partition: int) -> tuple[int, int]:
        """The partition's first offset still in the log, and ``end_offset``."""

    async def partitions(self, topic: str) -> int | None:
        """How many partitions ``topic`` has (None: there is no such topic)."""

    async def committed(self, group: str, partitions: list[TopicPartition]) -> dict[TopicPartition, int]:
        """The offsets consumer group ``group`` committed, for those of ``partitions`` it committed one
        (the reader joins no group: this only asks)."""

    async def position(self, topic: str, partition: int) -> int:
        """The offset after the last record of a read partition handed out, and past any transaction
        markers after it that the reader has fetched (so a partition whose last entry is a commit marker
        is read to its end)."""

    def add(self, topic: str, partition: int, offset: int) -> None:
        """Read ``partition`` from ``offset`` on (from where it is, if it is read already)."""

    def drop(self, topic: str, partition: int) -> None:
        """Stop reading ``partition``; no record of it is handed out after this returns."""

    def reading(self) -> set[tuple[str, int]]:
        """The partitions being read."""

    async def read(self, timeout: float) -> list[Received]:
        """The next records of the partitions read, in offset order per partition (waits at most
        ``timeout`` seconds for the first; empty if none came)."""


class Positions:
    """Each read partition's next offset: the filter both readers hand records through."""

    __slots__ = ("next",)

    def __init__(self) -> None:
        self.next: dict[tuple[str, int], int] = {}

    def add(self, topic: str, partition: int, offset: int) -> bool:
        """Start a partition at ``offset``; False if it is read already (it keeps its position)."""
        if (topic, partition) in self.next:
            return False
        self.next[(topic, partition)] = offset
        return True

    def drop(self, topic: str, partition: int) -> bool:
        """Forget a partition; False if it was not read."""
        return self.next.pop((topic, partition), None) is not None

    def admit(self, record: Received) -> bool:
        """Whether ``record`` is the read partition's next (and advance past it)."""
        tp = (record.topic, record.partition)
        expected = self.next.get(tp)
        if expected is None or record.offset < expected:
            return False
        self.next[tp] = record.offset + 1
        return True


_MADE_BY: ContextVar[tuple[Callable[[], Sender], Callable[[], Reader]] | None] = ContextVar(
    "arbiter_kafka_clients", default=None)


@contextlib.contextmanager
def clients_of(sender: Callable[[], Sender], reader: Callable[[], Reader]) -> Iterator[None]:
    """Inside the block, and in the tasks started in it, ``sender_for`` and ``reader_for`` make their clients
    with these whatever the settings say: how a simulation (``arbiter.sim``) puts its Kafka under the SDK,
    the registry feed and the rest, in one process beside other runs."""
    token = _MADE_BY.set((sender, reader))
    try:
        yield
    finally:
        _MADE_BY.reset(token)


def sender_for(settings: Settings) -> Sender:
    """The ``kafka_client`` setting's sender for ``settings``."""
    made_by = _MADE_BY.get()
    if made_by is not None:
        return made_by[0]()
    if settings.kafka_client == "aiokafka":
        from .aio import AioSender

        return AioSender(settings)
    from .rdkafka import RdSender

    return RdSender(settings)


def reader_for(settings: Settings, fetch: Fetch | None = None) -> Reader:
    """The ``kafka_client`` setting's reader for ``settings``."""
    made_by = _MADE_BY.get()
    if made_by is not None:
        return made_by[1]()
    if settings.kafka_client == "aiokafka":
        from .aio import AioReader

        return AioReader(settings, fetch)
    from .rdkafka import RdReader

    return RdReader(settings, fetch)
