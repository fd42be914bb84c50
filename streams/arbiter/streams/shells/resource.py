"""The resource processor's shell: the lease table, the expiry index and the outputs.

Theory of operation
-------------------
Every command for a resource arrives on the resource-command topic, keyed by the
resource, and is decided here in log order by ``arbiter.streams.cores.leases.step``. The decision's
time is the broker's append time of the command (``LogAppendTime``), so a redelivered
command gets the same decision and audit can replay it exactly.

Outputs, in this order, for each decision: every event to the resource-event topic
(key: resource), lock events to the agent inbox (key: agent id), wait-for edges to
the wait-edge topic (key: graph namespace); then the book to its table. The shell sends
through the input's pipeline (``arbiter.streams.shells.pipeline``), which holds the outputs and the table
writes until the input is done; the runtime produces the decisions before the changelog
of the state they leave, and commits the input's offset only once both are written.

A decision changes the stored book in place (``arbiter.streams.cores.leases.step``), so its cost does not
grow with the queue; it registers the book's undo with the input's scope, which runs it if
the input fails later on.

Expiry: the worker sends a ``LockTick`` into a partition's command log when a deadline of that
partition is due (``next_due``: the earliest lease expiry or wait deadline it holds), and
never otherwise, so an idle system writes nothing. The tick's append time is "now" for that
partition. An in-memory heap per partition of (next deadline, resource) finds the books a
tick must touch without scanning the table; it is rebuilt from the table once per rebalance.
"""

from __future__ import annotations

import heapq
import itertools
import json
from collections.abc import Callable, Iterable, MutableMapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from arbiter.schemas import (
    Cause,
    CheckVerdict,
    ContractError,
    Holder,
    LockTick,
    Ping,
    Pong,
    Record,
    ResourceSnapshot,
    SnapshotRequested,
    ToolIntent,
    WaitEdgeAdded,
    WaitEdgeRemoved,
)
from arbiter.schemas.identity import Verified
from arbiter.schemas.partitioning import partition_for
from arbiter.schemas.reasons import Reason
from arbiter.streams.cores import gateway
from arbiter.streams.cores.gateway import Accepted, ContentState, GatewayEvent, GatewayRules, ToolOutcome
from arbiter.streams.cores.leases import (
    RESOURCE_LOCK_COMMANDS,
    LeaseBook,
    LeaseRules,
    LockCommand,
    LockEvent,
    new_book,
    step,
)
from arbiter.streams.cores.train import Entry, Verdict
from arbiter.streams.shells.routes import Routes, Send
from arbiter.streams.shells.tables import InputScope
from arbiter.streams.shells.trains import TrainShell, is_train_intent


class ToolRunner(Protocol):
    """What the shell needs from a worker's tools (``arbiter.streams.tools.registry.ToolRegistry`` is one)."""

    def names(self) -> frozenset[str]:
        """Registered tool names."""

    def parse(self, intent: ToolIntent) -> Any:
        """Validated arguments, or a string saying why they are invalid."""

    async def run(self, intent: ToolIntent, arguments: Any) -> ToolOutcome:
        """Run the tool."""

    async def read(self, request: SnapshotRequested) -> str | None:
        """The resource's content as JSON, as its tools keep it; None when they keep none."""

    async def join(self, intent: ToolIntent, arguments: Any) -> ToolOutcome:
        """A merge's preflight on the repository host (``TrainTools``)."""

    async def land(self, resource: str, entry: Entry, head: str, verdict: Verdict | None) -> ToolOutcome:
        """Land a train's front entry (``TrainTools``)."""


@dataclass
class ResourceShell:
    """Everything the resource processor does besides I/O, given its tables and a sender."""

    books: MutableMapping[bytes, LeaseBook]
    contents: MutableMapping[bytes, ContentState]
    partitions: int
    rules: LeaseRules
    gate_rules: GatewayRules
    tools: ToolRunner
    routes: Routes
    send: Send
    worker_id: str = "replay"
    """Named in the answers to pings (which decide nothing)."""
    generation: Callable[[], int | None] = lambda: 0
    """The consumer group generation: the expiry index is rebuilt when it changes."""
    after_tool: Callable[[ToolIntent], None] = lambda _intent: None
    """Called between a tool's run and the record of its outcome (fault injection in tests)."""
    hide_tokens: bool = False
    """Snapshots show other agents' leases without their tokens (the trust boundary's rule;
    off for logs decided before it, so their replays stay exact)."""
    scope: InputScope | None = None
    """The input being decided: a book changed in place leaves its undo there."""
    _deadlines: dict[int, list[tuple[int, bytes]]] = field(default_factory=dict)
    _indexed_generation: int | None = None

    def __post_init__(self) -> None:
        self.trains = TrainShell(self.books, self.contents, self.gate_rules, self.tools, self.routes, self.send,
                                 self.after_tool)

    async def handle(self, key: bytes | None, command: Record, now_ms: int, cause: Cause,
                     sender: Verified | None = None) -> ContractError | None:
        """Decide one message of the resource-command topic; an error says why it must be dead-lettered."""
        if isinstance(command, LockTick):
            await self.tick(command, now_ms, cause)
            return None
        if isinstance(command, CheckVerdict):
            if key is None or key != command.resource.encode():
                return ContractError(Reason.KEY_MISMATCH, f"message key {key!r} is not the resource "
                                                          f"{command.resource!r}")
            await self.trains.checked(key, command, now_ms, cause)
            return None
        if isinstance(command, Ping):
            await self.send(self.routes.agent_inbox, command.agent_id.encode(), Pong(
                request_id=command.request_id, agent_id=command.agent_id, worker_id=self.worker_id,
                at_ms=now_ms, cause=cause))
            return None
        if not isinstance(command, (*RESOURCE_LOCK_COMMANDS, ToolIntent, SnapshotRequested)):
            return ContractError(Reason.UNSUPPORTED_COMMAND, f"{type(command).__name__} has no handler in this worker")
        if key is None or key != command.resource.encode():
            # Decided under another key, the resource would have two orders.
            return ContractError(Reason.KEY_MISMATCH, f"message key {key!r} is not the resource {command.resource!r}")
        if isinstance(command, ToolIntent):
            await self.execute(key, command, now_ms, cause)
        elif isinstance(command, SnapshotRequested):
            await self.snapshot(key, command, now_ms, cause)
        else:
            await self.decide(key, command, now_ms, cause)
        return None

    def _version(self, key: bytes) -> int:
        content = self.contents.get(key)
        return content.version if content is not None else 0

    async def decide(self, key: bytes, command: LockCommand, now_ms: int, cause: Cause) -> list[LockEvent]:
        """Decide one lock command for the resource ``key`` and publish the result."""
        stored = self.books.get(key)
        if stored is not None and stored.born is not None and 0 <= cause.offset < stored.born:
            # Redelivered from before the book was kept (a worker that died between its changelog and its
            # commit): it was decided on no book and left none. Deciding it on this one would give it a
            # second decision (a refused revoke or release would now take a later lease away).
            events = step(new_book(key.decode("utf-8", errors="replace")), command, now_ms, cause, self.rules,
                          self._version(key))
            await self._publish(key, events)
            return events
        fresh = stored is None
        book = new_book(key.decode("utf-8", errors="replace")) if stored is None else stored
        events = self._step(key, book, command, now_ms, cause, fresh)
        await self._publish(key, events)
        if not (fresh and book.is_idle() and book.last_token == 0):
            # A command that changed nothing on a never-used resource (bad input, say)
            # leaves no book behind.
            if fresh and cause.offset >= 0:
                book.born = cause.offset
            self.books[key] = book
            self._remember_deadline(cause.partition, key, book)
        if events and key.startswith(b"repo:"):
            await self.trains.settle(key, now_ms, cause)  # a merge whose lease is gone leaves its train
        return events

    async def execute(self, key: bytes, intent: ToolIntent, now_ms: int, cause: Cause) -> GatewayEvent | None:
        """Gate an intent; run its tool when accepted; record and publish the outcome (a merge: it joins its
        repository's train, which answers it when it lands or leaves)."""
        if is_train_intent(intent, self.gate_rules):
            await self.trains.join(key, intent, now_ms, cause)
            return None
        resource = key.decode("utf-8", errors="replace")
        book = self.books.get(key) or new_book(resource)
        stored = self.contents.get(key)
        content = ContentState(resource) if stored is None else stored.copy()  # copy on write (bounded: rules)
        verdict = gateway.check(book, content, intent, now_ms, cause, self.gate_rules, self.tools.names())
        if verdict is content.outcomes.get(intent.intent_id):
            # Seen before: answer again, never run again, record nothing new.
            assert not isinstance(verdict, Accepted)
            await self.send(self.routes.reply_to(intent.agent_id), intent.agent_id.encode(), verdict)
            return verdict
        event: GatewayEvent
        if isinstance(verdict, Accepted):
            arguments = self.tools.parse(intent)
            if isinstance(arguments, str):
                event = gateway.reject(content, book, intent, Reason.INVALID_ARGUMENTS, now_ms, cause,
                                       hide_tokens=self.gate_rules.hide_tokens, problem=arguments)
            else:
                outcome = await self.tools.run(intent, arguments)
                self.after_tool(intent)
                event = gateway.complete(book, content, intent, outcome, now_ms, cause, self.gate_rules.hide_tokens)
        else:
            event = verdict
        gateway.evolve(content, event, self.gate_rules)
        await self.send(self.routes.resource_events, key, event)
        await self.send(self.routes.reply_to(intent.agent_id), intent.agent_id.encode(), event)
        self.contents[key] = content
        return event

    async def snapshot(self, key: bytes, request: SnapshotRequested, now_ms: int, cause: Cause) -> None:
        """Answer a snapshot request in the resource's order."""
        resource = key.decode("utf-8", errors="replace")
        book = self.books.get(key) or new_book(resource)
        content = self.contents.get(key) or ContentState(resource)
        live = [h for h in book.holders.values() if h.expires_at_ms > now_ms]
        # Read in the resource's order: every tool run decided before this request has applied.
        content_json = await self.tools.read(request) if request.with_content else None
        await self.send(self.routes.agent_inbox, request.agent_id.encode(), ResourceSnapshot(
            request_id=request.request_id, agent_id=request.agent_id, resource=resource, version=content.version,
            content_hash=content.content_hash, high_water_token=book.last_token,
            holders=[Holder(agent_id=h.agent_id, request_id=h.request_id,
                            token=0 if self.hide_tokens and h.agent_id != request.agent_id else h.token,
                            mode=h.mode, expires_at_ms=h.expires_at_ms) for h in live],
            at_ms=now_ms, cause=cause, content_json=content_json,
        ))

    async def tick(self, tick: LockTick, now_ms: int, cause: Cause) -> int:
        """Advance time on one partition: decide the tick for every book that is due."""
        generation = self.generation()
        if generation != self._indexed_generation:
            self._rebuild_index(generation)
        if self.scope is not None:
            # The heap loses the entries this tick pops: if the tick fails, rebuild the index at the next.
            self.scope.on_discard(self._forget_index)
        heap = self._deadlines.setdefault(cause.partition, [])
        touched = 0
        while heap and heap[0][0] <= now_ms:
            _, key = heapq.heappop(heap)
            stored = self.books.get(key)
            due = stored.next_deadline() if stored is not None else None
            if stored is None or due is None or due > now_ms:
                continue  # stale entry: the book moved on since it was indexed
            book = stored
            events = self._step(key, book, tick, now_ms, cause, False)
            await self._publish(key, events)
            self.books[key] = book
            self._remember_deadline(cause.partition, key, book)
            if key.startswith(b"repo:"):
                await self.trains.settle(key, now_ms, cause)
            touched += 1
        return touched

    def _step(self, key: bytes, book: LeaseBook, command: LockCommand | LockTick, now_ms: int, cause: Cause,
              fresh: bool) -> list[LockEvent]:
        """Decide ``command`` into ``book`` in place; a stored book's changes can be undone by the scope
        (a fresh one is simply not stored when the input fails)."""
        if fresh or self.scope is None:
            return step(book, command, now_ms, cause, self.rules, self._version(key))
        undo = book.begin()
        try:
            return step(book, command, now_ms, cause, self.rules, self._version(key))
        finally:
            book.end()
            self.scope.on_discard(undo)

    def next_due(self, partition: int) -> int | None:
        """The earliest deadline (broker time, ms) of ``partition``'s books: when a tick there is next
        worth sending (None: nothing there waits on time). Stale entries are dropped on the way."""
        generation = self.generation()
        if generation != self._indexed_generation:
            self._rebuild_index(generation)
        heap = self._deadlines.get(partition)
        while heap:
            due, key = heap[0]
            stored = self.books.get(key)
            actual = stored.next_deadline() if stored is not None else None
            if actual is not None and actual <= due:
                return due
            heapq.heappop(heap)  # the book moved on (its new deadline, if any, was pushed when it was stored)
        return None

    def _remember_deadline(self, partition: int, key: bytes, book: LeaseBook) -> None:
        due = book.next_deadline()
        if due is not None:
            heapq.heappush(self._deadlines.setdefault(partition, []), (due, key))

    def _forget_index(self) -> None:
        self._indexed_generation = -1

    def _rebuild_index(self, generation: int | None) -> None:
        self._deadlines.clear()
        for key, book in list(self.books.items()):
            due = book.next_deadline()
            if due is not None:
                heapq.heappush(self._deadlines.setdefault(partition_for(key, self.partitions), []), (due, key))
        self._indexed_generation = generation

    async def _publish(self, key: bytes, events: Iterable[LockEvent]) -> None:
        routes = self.routes
        for event in events:
            await self.send(routes.resource_events, key, event)
            if isinstance(event, WaitEdgeAdded | WaitEdgeRemoved):
                await self.send(routes.wait_edges, routes.graph_key, event)
            else:
                await self.send(routes.reply_to(event.agent_id), event.agent_id.encode(), event)


def content_to_bytes(content: ContentState) -> bytes:
    """The content table's changelog value."""
    return json.dumps(content.to_dict(), separators=(",", ":")).encode()


def content_from_bytes(data: bytes) -> ContentState:
    """Inverse of ``content_to_bytes``."""
    return ContentState.from_dict(json.loads(data))


def book_to_bytes(book: LeaseBook) -> bytes:
    """The table's changelog value."""
    return json.dumps(book.to_dict(), separators=(",", ":")).encode()


def book_from_bytes(data: bytes) -> LeaseBook:
    """Inverse of ``book_to_bytes`` (and of ``book_head_to_bytes``, its id memory to come from its rows)."""
    return LeaseBook.from_dict(json.loads(data))


# The changelog keeps a book's id memory apart from its live state. The memory is first in, first out,
# so its ids are numbered in order (``LeaseBook.id_next``): the newest ones, fewer than ``ID_CHUNK``, ride
# in the book's own record; each full run of ``ID_CHUNK`` numbers is a row of its own, written once when
# it fills and tombstoned once all its ids are forgotten. A decision writes the book's record and, one
# time in ``ID_CHUNK``, a chunk: never the whole memory again (up to ``max_remembered_ids`` ids
# re-encoded by every decision were a quarter of a worker's CPU), and an uncontended grant stays at
# four messages. Restored, the chunks' live ids go first, in number order, then the record's.

ID_CHUNK = 16
"""Ids per changelog chunk row (the book's own record holds fewer than this many)."""


def book_head_to_bytes(book: LeaseBook) -> bytes:
    """The changelog value of a book: its live state and its newest ids (``book_take_id_rows``)."""
    tail = book.id_next % ID_CHUNK
    return json.dumps(book.to_dict(tail=min(tail, len(book.seen))), separators=(",", ":")).encode()


def _chunk_key(chunk: int) -> bytes:
    return chunk.to_bytes(8, "big")


def book_take_id_rows(book: LeaseBook) -> list[tuple[bytes, bytes | None]]:
    """The chunk rows the book's changelog needs since it was last written: the chunks filled since
    (with their ids still remembered), and tombstones for those whose ids are all forgotten since."""
    next_id, first = book.id_next, book.id_next - len(book.seen)
    was_next, was_first = book.taken if book.taken is not None else (first, first)
    book.taken = (next_id, first)
    out: list[tuple[bytes, bytes | None]] = [
        (_chunk_key(chunk), None) for chunk in range(was_first // ID_CHUNK, first // ID_CHUNK)]
    filled = range(max(was_next // ID_CHUNK, first // ID_CHUNK), next_id // ID_CHUNK)
    for chunk in filled:
        start = max(chunk * ID_CHUNK, first)
        ids = itertools.islice(book.seen.items(), start - first, (chunk + 1) * ID_CHUNK - first)
        out.append((_chunk_key(chunk), json.dumps({"from": start, "ids": book.id_rows(ids)},
                                                  separators=(",", ":")).encode()))
    return out


def book_id_row_keys(book: LeaseBook) -> list[bytes]:
    """Every chunk row the book may have in the changelog (their tombstones when it goes)."""
    first = book.id_next - len(book.seen)
    if book.taken is not None:
        first = min(first, book.taken[1])
    return [_chunk_key(chunk) for chunk in range(first // ID_CHUNK, book.id_next // ID_CHUNK + 1)]


def book_attach_id_rows(book: LeaseBook, rows: list[tuple[bytes, bytes]]) -> None:
    """Put a restored book's older ids back from its chunk rows, before the newest (its record's)."""
    if book.taken is None:
        return  # a book written whole (before chunks): its record held every id
    first, boundary = book.taken[1], book.id_next - book.id_next % ID_CHUNK
    newest, book.seen = book.seen, {}
    for _key, value in sorted(rows):
        chunk = json.loads(value)
        start = chunk["from"]
        live = [row for n, row in enumerate(chunk["ids"], start) if first <= n < boundary]
        book.add_id_rows(live)
    book.seen.update(newest)
