"""The live view of a running fleet, fed by the log: who holds what and who waits, the wait-for graph
with its cycles and victims, sagas and their compensations, refusals by reason over time, the workers
and their lag. The front door's console (``/``), ``arbiter console``, ``arbiter top`` and the demo show it
(it lives here, below the door, so that ``arbiter top`` needs no web framework). Who holds each resource
and who waits is folded by the lease core's own fold (``arbiter.streams.cores.leases.follow``), the one
the workers' books are made of, not by a copy of it.

``LiveFeed`` tails the decision topics (from their start, or the last ``window`` records of each
partition), folds each record into ``LiveState`` and hands every change, as one small JSON object,
to its subscribers. The state it keeps is an operator's: agents and resources by name, modes and
expiry times, never a fencing token. Names are user input; the page renders them as text.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, OrderedDict, defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiokafka.admin import AIOKafkaAdminClient

from arbiter.edge.kafkaauth import kafka_client_options
from arbiter.edge.kafkaconn import close_client
from arbiter.edge.kafkaio import Received, TopicPartition
from arbiter.edge.settings import Settings
from arbiter.edge.tail import Tail
from arbiter.schemas import (
    Compensated,
    DeadLetter,
    DeadlockDetected,
    LockCancelled,
    LockDenied,
    LockExpired,
    LockGranted,
    LockQueued,
    LockReleased,
    LockRenewed,
    LockRevoked,
    LockWaitTimedOut,
    Record,
    SagaFinished,
    SagaStep,
    ToolApplied,
    ToolRejected,
    WaitEdgeAdded,
    WaitEdgeRemoved,
    WorkerStarted,
)
from arbiter.streams.cores.leases import LeaseBook, follow, new_book

log = logging.getLogger(__name__)

HISTORY = 200
"""Events kept per resource and per agent, for a search's timeline."""
BUCKET_S = 10
"""Refusals are counted in buckets of this many seconds, for the last ``BUCKETS`` of them."""
BUCKETS = 30

_LeaseDecision = (LockGranted | LockQueued | LockReleased | LockExpired | LockRevoked | LockDenied | LockWaitTimedOut
                  | LockCancelled | LockRenewed)
"""The lease book's decisions: each changes who holds a resource or who waits for it (or is refused)."""


_Decision = (LockGranted | LockQueued | LockDenied | DeadlockDetected | Compensated | SagaFinished | ToolApplied
             | ToolRejected)
"""Decisions a redelivery may bring twice (the worker's outputs are at least once): folded once each."""
SEEN = 100_000
"""How many of the latest decisions the fold remembers to know a copy (a copy comes within seconds)."""


@dataclass
class LiveState:
    """What the console shows, folded from the log one record at a time."""

    books: dict[str, LeaseBook] = field(default_factory=dict)
    """resource -> its lease book (holders and queue), while anyone holds it or waits for it."""
    since: dict[str, dict[int, int]] = field(default_factory=dict)
    """resource -> token -> when that lease was granted."""
    edges: dict[str, dict[str, Any]] = field(default_factory=dict)
    """edge id -> {waiter, holder, source, resource}."""
    deadlocks: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=50))
    sagas: dict[str, dict[str, Any]] = field(default_factory=dict)
    refusals: dict[int, dict[str, int]] = field(default_factory=dict)
    """bucket start (s) -> reason -> count."""
    workers: dict[str, dict[str, Any]] = field(default_factory=dict)
    """worker id -> what it announced when it started (``WorkerStarted``), running or not."""
    members: list[str] | None = None
    """The ids of the workers in the workers' group now (None: not measured yet): the ones running."""
    lag: dict[str, int] = field(default_factory=dict)
    """topic/partition -> inputs not yet decided by the workers' group (every input partition)."""
    history: dict[str, deque[dict[str, Any]]] = field(
        default_factory=lambda: defaultdict(lambda: deque(maxlen=HISTORY)))
    decisions: int = 0
    counts: Counter[str] = field(default_factory=Counter)
    """Decisions by kind (grants, granted after waiting, expired, writes, deadlocks, compensations, sagas by
    outcome): the totals the demo prints."""
    rejections: Counter[str] = field(default_factory=Counter)
    """Refusals by reason, in all (``refusals`` keeps the recent ones, by time)."""
    victims: list[str] = field(default_factory=list)
    """Each deadlock's victim, in order."""
    saga_of: dict[str, str] = field(default_factory=dict)
    """Each agent's saga, as its delegation edges name it."""
    seen: OrderedDict[tuple[str, bytes], None] = field(default_factory=OrderedDict)
    """The latest decisions folded, by content: a copy delivered again is folded once (``SEEN``)."""

    @property
    def resources(self) -> dict[str, dict[str, Any]]:
        """resource -> {"holders": {agent: {mode, expires_at_ms, since_ms, token}}, "queue": [agent...]}."""
        return {r: _book_view(book, self.since.get(r, {})) for r, book in self.books.items()}

    def snapshot(self) -> dict[str, Any]:
        """Everything, for a page that just opened (the resources that have a holder or a queue)."""
        return {"kind": "snapshot", "resources": {r: _shown(v) for r, v in self.resources.items()},
                "edges": list(self.edges.values()), "deadlocks": list(self.deadlocks),
                "sagas": dict(list(self.sagas.items())[-200:]), "refusals": self._refusals(),
                "workers": self.workers, "members": self.members, "lag": self.lag, "decisions": self.decisions}

    def _refusals(self) -> list[dict[str, Any]]:
        keep = sorted(self.refusals)[-BUCKETS:]
        return [{"at": at, "by_reason": self.refusals[at]} for at in keep]

    def _remember(self, names: list[str], event: dict[str, Any]) -> None:
        for name in names:
            if name:
                self.history[name].append(event)

    def _refused(self, at_ms: int, reason: str) -> None:
        bucket = at_ms // 1000 // BUCKET_S * BUCKET_S
        row = self.refusals.setdefault(bucket, {})
        row[reason] = row.get(reason, 0) + 1
        for old in sorted(self.refusals)[:-BUCKETS]:
            del self.refusals[old]

    def apply(self, record: Record) -> dict[str, Any] | None:
        """Fold one record in; the change to send to the pages (None: nothing they show changed, or a copy of a
        decision folded already)."""
        if isinstance(record, _Decision):
            identity = (type(record).__name__, record.__pydantic_serializer__.to_json(record))
            if identity in self.seen:
                return None
            self.seen[identity] = None
            if len(self.seen) > SEEN:
                self.seen.popitem(last=False)
        change = self._fold(record)
        while len(self.sagas) > 2000:
            self.sagas.pop(next(iter(self.sagas)))
        return change

    def _fold(self, record: Record) -> dict[str, Any] | None:
        """Fold ``record`` in by its type; the change (None: nothing shown changed)."""
        if isinstance(record, _LeaseDecision):
            return self._lease_decided(record)
        if isinstance(record, ToolApplied | ToolRejected):
            return self._write_decided(record)
        if isinstance(record, WaitEdgeAdded | WaitEdgeRemoved):
            return self._edge(record)
        if isinstance(record, DeadlockDetected):
            return self._deadlock(record)
        if isinstance(record, SagaStep | Compensated | SagaFinished):
            return self._saga(record)
        if isinstance(record, WorkerStarted):
            self.workers[record.worker_id] = {"id": record.worker_id, "started_at_ms": record.at_ms,
                                              "guarantee": record.processing_guarantee}
            return {"kind": "worker", "worker": self.workers[record.worker_id]}
        if isinstance(record, DeadLetter):
            self._refused(record.at_ms, f"dead letter: {record.reason}")
            return {"kind": "dead_letter", "reason": record.reason, "at": record.at_ms}
        return None

    def _lease_decided(self, record: _LeaseDecision) -> dict[str, Any]:
        self.decisions += 1
        resource, agent, at = record.resource, record.agent_id, record.at_ms
        book = self.books.get(resource) or new_book(resource)
        kind = type(record).__name__.removeprefix("Lock").lower()
        waited = isinstance(record, LockGranted) and record.request_id in book.queued
        follow(book, record)
        since = self.since.setdefault(resource, {})
        if isinstance(record, LockGranted):
            since[record.token] = at
        for token in since.keys() - book.holders.keys():
            del since[token]
        if waited:
            self.counts["granted after waiting"] += 1
        if isinstance(record, LockDenied):
            self._refused(at, record.reason)
        self._count_lease(record)
        change = {"kind": kind, "resource": resource, "agent": agent, "at": at,
                  "reason": getattr(record, "reason", None), "book": _shown(_book_view(book, since))}
        if book.holders or book.queue:
            self.books[resource] = book
        else:
            self.books.pop(resource, None)
            self.since.pop(resource, None)
        self._remember([record.resource, agent], {k: v for k, v in change.items() if k != "book"})
        return change

    def _count_lease(self, record: _LeaseDecision) -> None:
        if isinstance(record, LockGranted):
            self.counts["grants"] += 1
        elif isinstance(record, LockExpired):
            self.counts["expired"] += 1
        elif isinstance(record, LockDenied):
            self.rejections[record.reason] += 1

    def _write_decided(self, record: ToolApplied | ToolRejected) -> dict[str, Any]:
        self.decisions += 1
        at = record.at_ms
        reason = "applied" if isinstance(record, ToolApplied) else record.reason
        if isinstance(record, ToolRejected):
            self._refused(at, record.reason)
            self.rejections[record.reason] += 1
        else:
            self.counts["writes"] += 1
        change = {"kind": "write", "resource": record.resource, "agent": record.agent_id, "at": at,
                  "tool": record.tool, "reason": reason}
        self._remember([record.resource, record.agent_id], change)
        return change

    def _edge(self, record: WaitEdgeAdded | WaitEdgeRemoved) -> dict[str, Any] | None:
        if isinstance(record, WaitEdgeAdded):
            if record.source == "delegation" and record.saga_id:
                self.saga_of.setdefault(record.waiter, record.saga_id)
            self.edges[record.edge_id] = {"id": record.edge_id, "waiter": record.waiter, "holder": record.holder,
                                          "source": record.source, "resource": record.resource}
            return {"kind": "edge", "edge": self.edges[record.edge_id]}
        if self.edges.pop(record.edge_id, None) is not None:
            return {"kind": "edge_removed", "id": record.edge_id}
        return None

    def _deadlock(self, record: DeadlockDetected) -> dict[str, Any] | None:
        found = {"id": record.detection_id, "victim": record.victim, "cycle": list(record.cycle),
                 "at": record.at_ms, "message": record.message}
        if all(d["id"] != found["id"] for d in self.deadlocks):
            self.deadlocks.append(found)
            self.counts["deadlocks"] += 1
            self.victims.append(record.victim)
            self._remember(list(record.cycle), {"kind": "deadlock", "at": record.at_ms,
                                               "agent": record.victim, "reason": record.message})
            return {"kind": "deadlock", "deadlock": found}
        return None

    def _saga(self, record: SagaStep | Compensated | SagaFinished) -> dict[str, Any]:
        if isinstance(record, SagaStep):
            saga = self.sagas.setdefault(record.saga_id, {"id": record.saga_id, "status": "running", "steps": 0,
                                                          "compensated": 0, "agent": record.agent_id})
            saga["steps"] = max(saga["steps"], record.step + 1)
        elif isinstance(record, Compensated):
            saga = self.sagas.setdefault(record.saga_id, {"id": record.saga_id, "status": "compensating", "steps": 0,
                                                          "compensated": 0, "agent": ""})
            saga["compensated"] += 1
            saga["status"] = "compensating"
            self.counts["compensations"] += 1
        else:
            saga = self.sagas.setdefault(record.saga_id, {"id": record.saga_id, "steps": 0, "compensated": 0,
                                                          "agent": ""})
            saga["status"] = record.outcome
            self.counts[f"sagas {record.outcome.lower()}"] += 1
        return {"kind": "saga", "saga": saga}


def _book_view(book: LeaseBook, since: dict[int, int]) -> dict[str, Any]:
    """What the pages show of a lease book: its holders by agent, its queue in grant order."""
    return {"holders": {lease.agent_id: {"mode": lease.mode, "expires_at_ms": lease.expires_at_ms,
                                         "since_ms": since.get(lease.token), "token": lease.token}
                        for lease in book.holders.values()},
            "queue": [waiter.agent_id for waiter in book.queue]}


def _shown(book: dict[str, Any]) -> dict[str, Any]:
    """A book as the pages get it: never a fencing token (the demo, in process, reads them from ``resources``)."""
    holders = [{"agent": a, **{k: v for k, v in h.items() if k != "token"}} for a, h in book["holders"].items()]
    return {"holders": holders, "queue": list(book["queue"])}


class LiveFeed:
    """The log, tailed into a ``LiveState``; each change handed to every subscriber."""

    def __init__(self, settings: Settings, window: int = 100_000) -> None:
        self.settings = settings
        self.window = window
        self.state = LiveState()
        self.listeners: set[Callable[[dict[str, Any]], None]] = set()
        self._tail: Tail | None = None
        self._lagging: asyncio.Task[None] | None = None
        self.ready = asyncio.Event()

    def subscribe(self, listener: Callable[[dict[str, Any]], None]) -> Callable[[], None]:
        """Call ``listener`` with each change; returns the way to stop."""
        self.listeners.add(listener)
        return lambda: self.listeners.discard(listener)

    def _on(self, message: Received, record: Record | None) -> None:
        if record is None:
            return
        change = self.state.apply(record)
        if change is not None and self.ready.is_set():
            for listener in tuple(self.listeners):
                listener(change)

    async def start(self) -> None:
        topics = self.settings.topics
        where = [topics.resource_events, topics.wait_edges, topics.saga_events, topics.saga_commands,
                 topics.dead_letter, topics.workers]
        probe = Tail(self.settings, where, start="beginning")
        async with probe:
            starts, ends = await probe.starts(), await probe.ends()
        start = {tp: max(starts.get(tp, 0), end - self.window) for tp, end in ends.items()}
        # The broker holds each fetch up to 200 ms to gather a batch: one wake-up per batch, not per record
        # (at 100 decisions/s, per record cost the door a fifth of a core); the page stays well within 1 s.
        self._tail = Tail(self.settings, list(start), start=start, on_message=self._on, fetch_max_wait_ms=200,
                          fetch_min_bytes=1 << 20)
        await self._tail.start()
        await self._tail.caught_up(timeout=60)
        self.ready.set()
        self._lagging = asyncio.create_task(self._lag_forever(), name="arbiter-live-lag")

    async def stop(self) -> None:
        if self._lagging is not None:
            self._lagging.cancel()
            await asyncio.gather(self._lagging, return_exceptions=True)
        if self._tail is not None:
            await self._tail.stop()

    async def __aenter__(self) -> LiveFeed:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _lag_forever(self, every: float = 2.0) -> None:
        """The workers' group, every ``every`` seconds: who is in it, and its lag per input partition."""
        admin = AIOKafkaAdminClient(bootstrap_servers=self.settings.bootstrap, **kafka_client_options(self.settings))
        try:
            await admin.start()
            while True:
                with contextlib.suppress(Exception):  # an outage: the last figures stand until it ends
                    members, lag = await self._measure(admin)
                    at = int(time.time() * 1000)
                    if members != self.state.members:
                        self.state.members = members
                        self._tell({"kind": "members", "members": members, "at": at})
                    if lag != self.state.lag:
                        self.state.lag = lag
                        self._tell({"kind": "lag", "lag": lag, "at": at})
                await asyncio.sleep(every)
        finally:
            await close_client(admin)

    async def _measure(self, admin: AIOKafkaAdminClient) -> tuple[list[str], dict[str, int]]:
        """The client ids of the group's members (a worker's is its id), and, for every input partition,
        the inputs after the group's committed offset (after the log's start where none is committed)."""
        group = self.settings.app_id
        described = await admin.describe_consumer_groups([group])
        members = sorted(m["client_id"] for r in described for g in r.to_object()["groups"] if g["group"] == group
                         for m in g["members"])
        committed = await admin.list_consumer_group_offsets(group)
        topics = self.settings.topics
        assert self._tail is not None
        inputs = [TopicPartition(t, p) for t in (topics.resource_commands, topics.wait_edges, topics.saga_commands)
                  for p in range(self.settings.partitions)]  # co-partitioned: as many partitions each
        offsets = await self._tail.offsets_of(inputs)
        return members, {f"{tp.topic}/{tp.partition}": max(0, end - (
            committed[tp].offset if tp in committed and committed[tp].offset >= 0 else start))
                         for tp, (start, end) in offsets.items()}

    def _tell(self, change: dict[str, Any]) -> None:
        for listener in tuple(self.listeners):
            listener(change)
