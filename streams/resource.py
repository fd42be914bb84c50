"""The resource processor's shell: the lease table, the expiry index and the outputs.

Theory of operation
-------------------
Every command for a resource arrives on the resource-command topic, keyed by the
resource, and is decided here in log order by ``streams.leases.step``. The decision's
time is the broker's append time of the command (``LogAppendTime``), so a redelivered
command gets the same decision and audit can replay it exactly.

Outputs, in this order, for each decision: every event to the resource-event topic
(key: resource), lock events to the agent inbox (key: agent id), wait-for edges to
the wait-edge topic (key: graph namespace); then the book to the changelogged table.
faust flushes the producer before it commits offsets, so a committed command always
has its events and its book in Kafka.

Expiry: a timer in every worker sends one ``LockTick`` per owned partition into the
command log. The tick's append time is "now" for that partition. An in-memory heap
per partition of (next deadline, resource) finds the books a tick must touch without
scanning the table; the heap is rebuilt from the table once per rebalance.
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from dataclasses import dataclass, field

from aiokafka.partitioner import DefaultPartitioner

from arbiter.contract import Cause, LockTick, Record, WaitEdgeAdded, WaitEdgeRemoved

from .leases import LeaseBook, LeaseRules, LockCommand, LockEvent, new_book, step

Send = Callable[[str, bytes, Record], Awaitable[None]]
"""send(topic, key, record): queue one output."""


@dataclass
class Outputs:
    """Where decisions go."""

    events_topic: str
    inbox_topic: str
    edges_topic: str
    graph_key: bytes


@dataclass
class ResourceShell:
    """Everything the resource processor does besides I/O, given a table and a sender."""

    books: MutableMapping[bytes, LeaseBook]
    partitions: int
    rules: LeaseRules
    outputs: Outputs
    send: Send
    _deadlines: dict[int, list[tuple[int, bytes]]] = field(default_factory=dict)
    _indexed_generation: int | None = None

    async def decide(self, key: bytes, command: LockCommand, now_ms: int, cause: Cause) -> list[LockEvent]:
        """Decide one lock command for the resource ``key`` and publish the result."""
        book = self.books.get(key)
        fresh = book is None
        if book is None:
            book = new_book(key.decode("utf-8", errors="replace"))
        events = step(book, command, now_ms, cause, self.rules)
        await self._publish(key, events)
        if not (fresh and book.is_idle() and book.last_token == 0):
            # A command that changed nothing on a never-used resource (bad input, say)
            # leaves no book behind.
            self.books[key] = book
            self._remember_deadline(cause.partition, key, book)
        return events

    async def tick(self, tick: LockTick, now_ms: int, cause: Cause, generation: int | None) -> int:
        """Advance time on one partition: decide the tick for every book that is due."""
        if generation != self._indexed_generation:
            self._rebuild_index(generation)
        heap = self._deadlines.setdefault(cause.partition, [])
        touched = 0
        while heap and heap[0][0] <= now_ms:
            _, key = heapq.heappop(heap)
            book = self.books.get(key)
            due = book.next_deadline() if book is not None else None
            if book is None or due is None or due > now_ms:
                continue  # stale entry: the book moved on since it was indexed
            events = step(book, tick, now_ms, cause, self.rules)
            await self._publish(key, events)
            self.books[key] = book
            self._remember_deadline(cause.partition, key, book)
            touched += 1
        return touched

    def partition_of(self, key: bytes) -> int:
        """The partition the producers' default partitioner gives ``key``."""
        parts = list(range(self.partitions))
        return int(DefaultPartitioner()(key, parts, parts))

    def _remember_deadline(self, partition: int, key: bytes, book: LeaseBook) -> None:
        due = book.next_deadline()
        if due is not None:
            heapq.heappush(self._deadlines.setdefault(partition, []), (due, key))

    def _rebuild_index(self, generation: int | None) -> None:
        self._deadlines.clear()
        for key, book in list(self.books.items()):
            due = book.next_deadline()
            if due is not None:
                heapq.heappush(self._deadlines.setdefault(self.partition_of(key), []), (due, key))
        self._indexed_generation = generation

    async def _publish(self, key: bytes, events: Iterable[LockEvent]) -> None:
        out = self.outputs
        for event in events:
            await self.send(out.events_topic, key, event)
            if isinstance(event, WaitEdgeAdded | WaitEdgeRemoved):
                await self.send(out.edges_topic, out.graph_key, event)
            else:
                await self.send(out.inbox_topic, event.agent_id.encode(), event)


def book_to_bytes(book: LeaseBook) -> bytes:
    """The table's changelog value."""
    return json.dumps(book.to_dict(), separators=(",", ":")).encode()


def book_from_bytes(data: bytes) -> LeaseBook:
    """Inverse of ``book_to_bytes``."""
    return LeaseBook.from_dict(json.loads(data))
