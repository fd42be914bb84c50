"""The lease book: semantic mutex leases with monotonic fencing tokens, for one resource.

Theory of operation
-------------------
Everything that decides who holds a resource lives in this file, as two pure
functions over one resource's ``LeaseBook``:

    decide(book, command, now_ms, cause, rules) -> list[event]
    evolve(book, event) -> book

``decide`` never changes the book; it reads it and returns the events that the
command causes, in order. ``evolve`` folds one event into the book (in place, for
speed: the caller owns the book) and is the only way state changes, so the same
events always rebuild the same book: the processor, ``arbiter lock status`` and the
audit replay all fold with it.

Time is an argument. The processor passes the broker's append time of the command
(topics use ``LogAppendTime``), and ``decide`` never lets a book's clock go back.
A redelivered command therefore gets exactly the decision it got the first time,
which is what keeps tokens from ever being reused after a crash.

Rules
~~~~~
- Tokens: every grant takes ``last_token + 1``. ``last_token`` only grows and lives
  in the book (a changelogged table), so it survives an empty book, failover and
  restart.
- Modes: exclusive excludes everything; shared leases coexist, each with its own token.
- Queue: one order, higher ``priority`` first, FIFO within a priority. A request is
  granted at once only if it would stand at the head of the queue and is compatible
  with the holders: nobody barges past a waiter. On release, expiry, revocation or
  cancellation the head waiters are granted in the same step: a run of shared
  waiters together, or one exclusive waiter.
- Time: before any command is decided, holders whose ``expires_at_ms`` has passed are
  expired and waiters whose deadline has passed time out. ``LockTick`` does only that.
- Wait-for edges: a waiter waits on the nearest waiter ahead of it that it conflicts
  with (either of the two exclusive): that one must be granted and release first; with
  none ahead, on the holders it conflicts with. A run of shared waiters, granted together,
  never waits on itself. The book keeps each waiter's edge set and emits
  ``WaitEdgeAdded``/``WaitEdgeRemoved`` for the waiters a change reaches, which a hand-off
  keeps to O(1): the cost of a decision does not grow with the queue.
- Idempotence: a request id belongs to the identity that sent it (an agent; the operator or
  the detector for a revoke). A command whose (request id, sender) was decided before,
  refusals included (remembered in a bounded window, plus every live holder and waiter),
  produces no events at all; another sender's command with a remembered id is refused
  ``request_id_taken``. An id's send time is recorded once, by its first answer. A command sent
  outside the window (at or before the floor of forgotten ids: ``request_expired``; too far
  ahead: ``clock_skew``) is refused for that first, and its refusal is not remembered: it decided
  nothing. The floor never goes down, so a stale re-send is refused alike every time; one sent
  too far ahead is decided if it is sent again in time, as its refusal advises. Remembered, a
  burst of stale re-sends pushed live ids out of the memory and raised the floor, and one command
  sent far ahead, once forgotten, raised the floor to its own send time, refusing all until then.
- Cost: a decision changes the book in place and touches only what it changes. ``decide``
  (and a processor that must be able to drop a failed input) records how to undo each change
  (``LeaseBook.begin``), so nothing is copied whole, whatever the queue's length. Nothing in a
  book grows with its history: the indexes hold exactly the live waiters, and the id memory is
  bounded (``max_remembered_ids``), so a decision after 4,000 hand-offs costs what it costs after 10.
- Refusals are ``LockDenied`` events with a stable reason code and a JSON detail an
  LLM can act on. Nothing here raises for bad input.
"""

from __future__ import annotations

import bisect
import copy
import itertools
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any, Literal, cast

from arbiter.schemas import (
    Cause,
    Holder,
    LockCancelled,
    LockCancelRequested,
    LockDenied,
    LockExpired,
    LockGranted,
    LockQueued,
    LockReleased,
    LockReleaseRequested,
    LockRenewed,
    LockRenewRequested,
    LockRequested,
    LockRevoked,
    LockRevokeRequested,
    LockTick,
    LockWaitTimedOut,
    WaitEdgeAdded,
    WaitEdgeRemoved,
)
from arbiter.schemas.models import trusted
from arbiter.schemas.reasons import OUT_OF_WINDOW, Reason, what_to_do
from arbiter.streams.cores.fencing import token_problem

LockCommand = (
    LockRequested | LockRenewRequested | LockReleaseRequested | LockCancelRequested | LockRevokeRequested | LockTick
)
LockEvent = (
    LockGranted
    | LockQueued
    | LockDenied
    | LockRenewed
    | LockReleased
    | LockExpired
    | LockRevoked
    | LockCancelled
    | LockWaitTimedOut
    | WaitEdgeAdded
    | WaitEdgeRemoved
)
LOCK_COMMANDS = (
    LockRequested,
    LockRenewRequested,
    LockReleaseRequested,
    LockCancelRequested,
    LockRevokeRequested,
    LockTick,
)
LOCK_EVENTS = (
    LockGranted,
    LockQueued,
    LockDenied,
    LockRenewed,
    LockReleased,
    LockExpired,
    LockRevoked,
    LockCancelled,
    LockWaitTimedOut,
    WaitEdgeAdded,
    WaitEdgeRemoved,
)
"""Every event the lease book emits (and ``evolve`` folds)."""
RESOURCE_LOCK_COMMANDS = (
    LockRequested,
    LockRenewRequested,
    LockReleaseRequested,
    LockCancelRequested,
    LockRevokeRequested,
)
"""The lock commands that name a resource (every one but the tick)."""
MODES = ("exclusive", "shared")


@dataclass(frozen=True)
class LeaseRules:
    """Limits and policies the lease book enforces."""

    max_ttl_ms: int = 3_600_000
    max_wait_ms: int = 3_600_000
    max_resource_bytes: int = 256
    lock_order: Literal["warn", "reject", "off"] = "warn"
    id_window_ms: int = 600_000
    """A command is refused (``request_expired``) once this long has passed since it was sent."""
    clock_skew_ms: int = 60_000
    """How far ahead of the broker a sender's clock may be (``clock_skew`` beyond)."""
    max_remembered_ids: int = 256
    """Per resource. Past it the oldest ids are forgotten early, and the window shrinks with them."""
    hide_tokens: bool = False
    """A refusal names the holders without their tokens, except the refused agent's own (with
    signatures on, as snapshots do). Rules recorded before this existed mean False."""
    forget_window_refusals: bool = True
    """A command sent outside the id window is refused for that before anything else, and the
    refusal is not remembered. Rules recorded before this existed mean False (such a refusal came
    after ``request_id_taken`` and was remembered like any answer), so their logs replay as decided."""


@dataclass(frozen=True, slots=True)
class Lease:
    """A live lease. Replaced, never mutated, so a book can be copied shallowly."""

    token: int
    agent_id: str
    request_id: str
    mode: str
    ttl_ms: int
    expires_at_ms: int


@dataclass(slots=True, eq=False)
class Waiter:
    """A queued request and the agents it currently waits on (``blockers``, the only field that
    changes: a book's copy copies its waiters)."""

    request_id: str
    agent_id: str
    mode: str
    ttl_ms: int
    priority: int
    seq: int
    deadline_ms: int
    queued_at_ms: int
    saga_id: str | None
    blockers: tuple[str, ...] = ()


IdKey = tuple[str, str]
"""(request id, sender): what the id memory remembers."""


@dataclass(slots=True)
class _Journal:
    """How to put a book back as it was when ``LeaseBook.begin`` was called."""

    scalars: tuple[int, int, int, int | None, int]
    holders: dict[int, Lease] | None = None
    """The holders as they were, saved at their first change (a decision changes few of them)."""
    steps: list[Callable[[], None]] = field(default_factory=list)
    """Undo steps of the queue, the waiters' edges, the deadline heap and the id memory, oldest first."""
    inserted: set[IdKey] = field(default_factory=set)
    evicted: list[tuple[IdKey, int, bool]] = field(default_factory=list)
    """Ids forgotten, oldest first: (key, send time, whether it was its id's owner)."""


@dataclass(slots=True)
class LeaseBook:
    """Everything Arbiter knows about one resource's leases."""

    resource: str
    last_token: int = 0
    clock_ms: int = 0
    seq: int = 0
    holders: dict[int, Lease] = field(default_factory=dict)
    queue: list[Waiter] = field(default_factory=list)
    """Waiters in grant order: higher priority first, then by arrival (``seq``)."""
    seen: dict[IdKey, int] = field(default_factory=dict)
    """(request id, sender) decided, in decision order -> when its command was sent."""
    owners: dict[str, str] = field(default_factory=dict)
    """request id -> the sender of its first decision ("" in a book written before senders were
    recorded for cancels and revokes: any sender's command with that id is a repeat)."""
    born: int | None = None
    """The input offset at which the book was first kept (None: unknown, a book written before this was
    recorded). Commands on its resource at lower offsets were decided on no book, and left none: a
    command redelivered from before it is decided as it was, on an empty book (``ResourceShell.decide``)."""
    forgotten_sent_ms: int | None = None
    """The latest send time of an id forgotten early (over ``max_remembered_ids``): nothing sent
    at or before it is decided any more, so a forgotten id can never be decided again."""
    # Indexes derived from ``queue`` (never serialized): each lookup the hot path needs is O(1).
    queued: dict[str, Waiter] = field(default_factory=dict)
    """request id -> its waiter."""
    waiting: dict[str, Waiter] = field(default_factory=dict)
    """agent id -> its waiter (an agent waits at most once per resource)."""
    deadlines: list[tuple[int, int, str]] = field(default_factory=list)
    """(wait deadline, seq, request id) of every waiter, sorted: exactly the queue's, never an entry
    of a waiter gone (a heap cleaned lazily kept those, and grew with the book's history under
    ``decide``, whose undo put back what its clean-up took)."""
    journal: _Journal | None = field(default=None, compare=False, repr=False)
    """While recording (``begin``): how to undo what changed since."""
    id_next: int = field(default=0, compare=False)
    """How many ids the memory ever remembered. ``seen`` is first in, first out (ids are forgotten
    oldest first), so its ids are numbers ``id_next - len(seen)`` to ``id_next - 1``, in order: what lets
    the changelog keep them in fixed chunks (``arbiter.streams.shells.resource.book_take_id_rows``)."""
    taken: tuple[int, int] | None = field(default=None, compare=False, repr=False)
    """(``id_next``, the oldest id's number) when the changelog last wrote the book (None: unknown)."""

    def index(self) -> LeaseBook:
        """Rebuild the derived indexes from ``queue``."""
        self.queued = {w.request_id: w for w in self.queue}
        self.waiting = {w.agent_id: w for w in self.queue}
        self.deadlines = sorted(_deadline(w) for w in self.queue)
        return self

    def begin(self) -> Callable[[], None]:
        """Record every change from now until ``end``; the function returned undoes them all.

        The undo is exact (the same holders in the same order, the same queue, edges and id
        memory), and its record costs what the changes cost: a book is never copied whole."""
        assert self.journal is None, "a book records one decision at a time"
        journal = self.journal = _Journal((self.last_token, self.clock_ms, self.seq, self.forgotten_sent_ms,
                                           self.id_next))

        def undo() -> None:
            for step in reversed(journal.steps):
                step()
            if journal.holders is not None:
                self.holders = journal.holders
            self.last_token, self.clock_ms, self.seq, self.forgotten_sent_ms, self.id_next = journal.scalars
            if journal.evicted:
                back = [(key, sent, owner) for key, sent, owner in journal.evicted if key not in journal.inserted]
                self.seen = {**{key: sent for key, sent, _owner in back}, **self.seen}
                for (request_id, sender), _sent, owner in back:
                    if owner:
                        self.owners[request_id] = sender
            journal.steps.clear()
            journal.evicted.clear()

        return undo

    def end(self) -> None:
        """Stop recording (the undo ``begin`` returned stays valid until the book changes again)."""
        self.journal = None

    def _changing_holders(self) -> None:
        journal = self.journal
        if journal is not None and journal.holders is None:
            journal.holders = dict(self.holders)

    def next_wait_deadline(self) -> int | None:
        """The earliest deadline of a waiter still queued."""
        return self.deadlines[0][0] if self.deadlines else None

    def next_deadline(self) -> int | None:
        """The earliest moment at which time alone changes this book."""
        wait = self.next_wait_deadline()
        expiry = min((lease.expires_at_ms for lease in self.holders.values()), default=None)
        if wait is None or expiry is None:
            return wait if expiry is None else expiry
        return min(wait, expiry)

    def copy(self) -> LeaseBook:
        """An independent copy (leases are immutable and shared; waiters are copied)."""
        return LeaseBook(self.resource, self.last_token, self.clock_ms, self.seq, dict(self.holders),
                         [copy.copy(w) for w in self.queue], dict(self.seen), dict(self.owners),
                         self.born, self.forgotten_sent_ms, id_next=self.id_next).index()

    def is_idle(self) -> bool:
        """No holders and no waiters (the token counter still matters)."""
        return not self.holders and not self.queue

    def to_dict(self, tail: int | None = None) -> dict[str, Any]:
        """A JSON-friendly snapshot (checkpoints; the changelog's form with ``tail``). An id memory row
        is ``[request id, sent, sender]`` for the id's owner, with a fourth element ``1`` for another
        sender's command that was refused with that id. With ``tail``, only the newest ``tail`` ids are
        in it (``ids``: the changelog keeps the others in chunks of their own), with how many ids were
        ever remembered and how many are remembered now."""
        head: dict[str, Any] = {
            "resource": self.resource,
            "last_token": self.last_token,
            "clock_ms": self.clock_ms,
            "seq": self.seq,
            "holders": [
                [h.token, h.agent_id, h.request_id, h.mode, h.ttl_ms, h.expires_at_ms]
                for h in self.holders.values()
            ],
            "queue": [
                [w.request_id, w.agent_id, w.mode, w.ttl_ms, w.priority, w.seq, w.deadline_ms, w.queued_at_ms,
                 w.saga_id, list(w.blockers)]
                for w in self.queue
            ],
            "forgotten_sent_ms": self.forgotten_sent_ms,
        }
        if self.born is not None:
            head["born"] = self.born
        if tail is not None:
            newest = list(itertools.islice(reversed(self.seen.items()), tail))[::-1] if tail else []
            head["ids"] = {"next": self.id_next, "live": len(self.seen), "tail": self.id_rows(newest)}
            return head
        head["seen"] = self.id_rows(self.seen.items())
        return head

    def id_rows(self, ids: Iterable[tuple[IdKey, int]]) -> list[list[Any]]:
        """The id memory rows (``to_dict``) of ``ids`` ((request id, sender), sent)."""
        owners = self.owners
        return [[request_id, sent, sender] if owners.get(request_id) == sender else [request_id, sent, sender, 1]
                for (request_id, sender), sent in ids]

    def add_id_rows(self, rows: Iterable[list[Any]]) -> None:
        """Remember the ids of ``rows`` (``id_rows``), after those remembered already."""
        for row in rows:
            if isinstance(row, list):
                self.seen[(row[0], row[2])] = row[1]
                if len(row) == 3:
                    self.owners.setdefault(row[0], row[2])

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LeaseBook:
        """Inverse of ``to_dict``."""
        ids = data.get("ids")
        book = cls(
            resource=data["resource"],
            last_token=data["last_token"],
            clock_ms=data["clock_ms"],
            seq=data["seq"],
            holders={h[0]: Lease(*h) for h in data["holders"]},
            queue=[
                Waiter(w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7], w[8], tuple(w[9])) for w in data["queue"]
            ],
            forgotten_sent_ms=data.get("forgotten_sent_ms"),
            born=data.get("born"),
        )
        if isinstance(ids, dict):  # the changelog's head: the newest ids; the older come in chunks (``taken``)
            book.add_id_rows(ids["tail"])
            book.id_next = ids["next"]
            book.taken = (ids["next"], ids["next"] - ids["live"])
        else:
            book.add_id_rows(data.get("seen", ()))
            book.id_next = len(book.seen)
        return book.index()


# -- evolve -----------------------------------------------------------------------


def _unqueue(book: LeaseBook, request_id: str) -> int:
    """Take a waiter out of the queue; its former position (-1 if it was not queued)."""
    waiter = book.queued.pop(request_id, None)
    if waiter is None:
        return -1
    book.waiting.pop(waiter.agent_id, None)
    queue = book.queue
    position = 0 if queue[0] is waiter else queue.index(waiter)  # identity (waiters compare by identity)
    del queue[position]
    _drop_deadline(book, waiter)
    if book.journal is not None:
        book.journal.steps.append(lambda: _requeue(book, waiter, position))
    return position


def _requeue(book: LeaseBook, waiter: Waiter, position: int) -> None:
    book.queue.insert(position, waiter)
    book.queued[waiter.request_id] = waiter
    book.waiting[waiter.agent_id] = waiter
    bisect.insort(book.deadlines, _deadline(waiter))


def _deadline(waiter: Waiter) -> tuple[int, int, str]:
    """A waiter's entry in ``LeaseBook.deadlines``."""
    return waiter.deadline_ms, waiter.seq, waiter.request_id


def _drop_deadline(book: LeaseBook, waiter: Waiter) -> None:
    deadlines, entry = book.deadlines, _deadline(waiter)
    at = bisect.bisect_left(deadlines, entry)
    assert at < len(deadlines) and deadlines[at] == entry, "every waiter's deadline is indexed"
    del deadlines[at]


def _granted(book: LeaseBook, event: Any) -> None:
    _unqueue(book, event.request_id)
    book._changing_holders()
    book.holders[event.token] = Lease(
        event.token, event.agent_id, event.request_id, event.mode,
        event.expires_at_ms - event.at_ms, event.expires_at_ms,
    )
    if event.token > book.last_token:
        book.last_token = event.token


def _edge_changed(book: LeaseBook, event: Any) -> None:
    waiter = book.waiting.get(event.waiter)
    if waiter is not None and event.edge_id == _edge_id(book.resource, waiter, event.holder):
        before = waiter.blockers
        if type(event) is WaitEdgeAdded:
            if event.holder not in before:
                waiter.blockers = tuple(sorted((*before, event.holder)))
        else:
            waiter.blockers = tuple(b for b in before if b != event.holder)
        if book.journal is not None and waiter.blockers != before:
            book.journal.steps.append(lambda: setattr(waiter, "blockers", before))


def _queued(book: LeaseBook, event: Any) -> None:
    book.seq += 1
    waiter = Waiter(event.request_id, event.agent_id, event.mode, event.ttl_ms, event.priority, book.seq,
                    event.wait_deadline_ms, event.at_ms, event.saga_id)
    queue = book.queue
    position = bisect.bisect_right(queue, _rank(waiter), key=_rank)
    queue.insert(position, waiter)
    book.queued[waiter.request_id] = waiter
    book.waiting[waiter.agent_id] = waiter
    bisect.insort(book.deadlines, _deadline(waiter))
    if book.journal is not None:
        book.journal.steps.append(lambda: _unqueued(book, waiter, position))


def _unqueued(book: LeaseBook, waiter: Waiter, position: int) -> None:
    del book.queue[position]
    del book.queued[waiter.request_id]
    del book.waiting[waiter.agent_id]
    _drop_deadline(book, waiter)


def _renewed(book: LeaseBook, event: Any) -> None:
    book._changing_holders()
    lease = book.holders[event.token]
    book.holders[event.token] = replace(
        lease, expires_at_ms=event.expires_at_ms, ttl_ms=event.expires_at_ms - event.at_ms
    )


def _ended(book: LeaseBook, event: Any) -> None:
    if event.token in book.holders:
        book._changing_holders()
        del book.holders[event.token]


def _left(book: LeaseBook, event: Any) -> None:
    _unqueue(book, event.request_id)


_FOLD: dict[type, Callable[[LeaseBook, Any], None]] = {
    LockGranted: _granted, WaitEdgeAdded: _edge_changed, WaitEdgeRemoved: _edge_changed, LockQueued: _queued,
    LockRenewed: _renewed, LockReleased: _ended, LockExpired: _ended, LockRevoked: _ended,
    LockCancelled: _left, LockWaitTimedOut: _left,
}
"""How each event changes holders, queue and counters (a refusal changes none of them)."""


def _apply(book: LeaseBook, event: LockEvent) -> None:
    """Fold one event into holders, queue and counters (not the id memory)."""
    fold = _FOLD.get(type(event))
    if fold is not None:
        fold(book, event)


def _rank(waiter: Waiter) -> tuple[int, int]:
    """A waiter's place in the queue: higher priority first, then arrival."""
    return -waiter.priority, waiter.seq


_ANSWERS = (LockGranted, LockQueued, LockDenied, LockRenewed, LockReleased, LockCancelled, LockRevoked)
"""The events that can be a command's first answer (and so record its request id)."""
_ANSWER_TYPES = frozenset(_ANSWERS)


def _stamp(book: LeaseBook, event: LockEvent, rules: LeaseRules) -> None:
    """Advance the book's clock and remember the deciding request (not the holders/queue)."""
    if event.at_ms > book.clock_ms:  # (every record's own time is at_ms)
        book.clock_ms = event.at_ms
    if type(event) in _ANSWER_TYPES:
        _remember(book, event, rules)


def _remember(book: LeaseBook, event: LockEvent, rules: LeaseRules) -> None:
    """Record the (request id, sender) an event answers, and forget ids whose window has passed."""
    answer = cast(LockCancelled, event)  # one of _ANSWERS: each has these fields but by_request_id
    kind = type(event)
    if kind is LockDenied and answer.reason in OUT_OF_WINDOW and rules.forget_window_refusals:
        return  # refused for its send time alone, deciding nothing (see the theory of operation)
    sent = answer.request_sent_at_ms
    by_command = kind is LockCancelled or kind is LockRevoked
    if sent is None:
        if by_command or kind is LockGranted:
            # A grant without a send time is a hand-off: its id was recorded, with its own send time,
            # by the LockQueued that answered it first (recording it again at the grant's time would
            # move the floor of forgotten ids to that time). Or it is a logged version-1 event.
            return
        sent = answer.at_ms  # version 1: the nearest time known
    if by_command:
        request_id = answer.by_request_id or answer.request_id
        sender = answer.by_agent_id or ""  # "" (any sender): written before senders were recorded
    else:
        request_id, sender = answer.request_id, answer.agent_id
    key = (request_id, sender)
    seen = book.seen
    if key in seen:
        return
    journal = book.journal
    seen[key] = sent
    book.id_next += 1
    fresh = request_id not in book.owners
    if fresh:
        book.owners[request_id] = sender
    if journal is not None:
        journal.inserted.add(key)
        journal.steps.append(lambda: _unremember(book, key, fresh))
    horizon = book.clock_ms - rules.id_window_ms
    while seen:
        first = next(iter(seen))
        if seen[first] >= horizon:
            break
        _forget(book, first)  # sent before the window: refused as expired from now on
    while len(seen) > rules.max_remembered_ids:
        sent_before = _forget(book, next(iter(seen)))
        book.forgotten_sent_ms = max(book.forgotten_sent_ms or sent_before, sent_before)


def _unremember(book: LeaseBook, key: IdKey, fresh: bool) -> None:
    book.seen.pop(key, None)
    if fresh and book.owners.get(key[0]) == key[1]:
        del book.owners[key[0]]


def _forget(book: LeaseBook, key: IdKey) -> int:
    """Forget one remembered id (the oldest); its send time."""
    sent = book.seen.pop(key)
    owner = book.owners.get(key[0]) == key[1]
    if owner:
        del book.owners[key[0]]
    if book.journal is not None:
        book.journal.evicted.append((key, sent, owner))
    return sent


def evolve(book: LeaseBook, event: LockEvent, rules: LeaseRules | None = None) -> LeaseBook:
    """Fold ``event`` into ``book`` (in place) and return it."""
    _apply(book, event)
    _stamp(book, event, rules or DEFAULT_RULES)
    return book


DEFAULT_RULES = LeaseRules()


def follow(book: LeaseBook, event: LockEvent) -> LeaseBook:
    """Fold ``event`` into who holds ``book``'s resource and who waits (in place), as a view that decides
    nothing does: the live console, ``arbiter top`` and the demo. Unlike ``evolve`` it keeps no id memory,
    and a view that started reading the log late (from a window) skips what refers to a lease or a
    waiter it never saw, instead of failing on it."""
    if isinstance(event, LockRenewed) and event.token not in book.holders:
        return book
    if isinstance(event, LockQueued) and (event.request_id in book.queued or event.agent_id in book.waiting):
        return book
    _apply(book, event)
    if event.at_ms > book.clock_ms:
        book.clock_ms = event.at_ms
    return book


# -- decide -----------------------------------------------------------------------


class _Decision:
    """Collects the events of one decision, folding each into ``view`` as it goes."""

    def __init__(self, view: LeaseBook, now_ms: int, cause: Cause, version: int, sent_ms: int | None,
                 hide_tokens: bool = False) -> None:
        self.view = view
        self.hide_tokens = hide_tokens
        self.now = now_ms
        self.cause = cause
        self.sent = sent_ms
        """When the command being decided was sent (None for a tick): its first answer carries it."""
        self.version = version
        """The resource's content version now (the gateway's): every grant reports it."""
        self.events: list[LockEvent] = []

    def emit(self, event: LockEvent) -> None:
        self.events.append(event)
        _apply(self.view, event)

    # -- pieces shared by several commands --

    def holders_list(self) -> list[Holder]:
        return [trusted(Holder, agent_id=h.agent_id, request_id=h.request_id, token=h.token, mode=h.mode,
                       expires_at_ms=h.expires_at_ms) for h in self.view.holders.values()]

    def compatible(self, mode: str) -> bool:
        holders = self.view.holders
        if not holders:
            return True
        return mode == "shared" and all(h.mode == "shared" for h in holders.values())

    def grant(self, request_id: str, agent_id: str, mode: str, ttl_ms: int, warnings: list[str],
              answers: bool = False) -> None:
        token = self.view.last_token + 1
        expires = self.now + ttl_ms
        mine = trusted(Holder, agent_id=agent_id, request_id=request_id, token=token, mode=mode, expires_at_ms=expires)
        self.emit(trusted(LockGranted,
            request_id=request_id, agent_id=agent_id, resource=self.view.resource, token=token, mode=mode,
            expires_at_ms=expires, holders=[*self.holders_list(), mine], resource_version=self.version,
            warnings=warnings, request_sent_at_ms=self.sent if answers else None, at_ms=self.now,
            cause=self.cause,
        ))

    def remove_edges(self, waiter: Waiter) -> None:
        for holder in waiter.blockers:
            self.emit(trusted(WaitEdgeRemoved,
                edge_id=_edge_id(self.view.resource, waiter, holder), waiter=waiter.agent_id, holder=holder,
                source="lock", resource=self.view.resource, at_ms=self.now, cause=self.cause,
            ))

    def advance_time(self) -> None:
        """Expire holders and time out waiters whose moment has come, one at a time in time order,
        handing the resource on after each: a waiter whose deadline falls after a holder's expiry
        is granted, not timed out. An expiry and a deadline at the same moment: the expiry first."""
        view, now = self.view, self.now
        while True:
            lease = None
            for held in view.holders.values():
                if held.expires_at_ms <= now and (lease is None or (held.expires_at_ms, held.token)
                                                  < (lease.expires_at_ms, lease.token)):
                    lease = held
            due = view.next_wait_deadline()
            waiter = view.queued[view.deadlines[0][2]] if due is not None and due <= now else None
            if lease is not None and (waiter is None or lease.expires_at_ms <= waiter.deadline_ms):
                self.emit(trusted(LockExpired,
                    request_id=lease.request_id, agent_id=lease.agent_id, resource=view.resource,
                    token=lease.token, expires_at_ms=lease.expires_at_ms, at_ms=now, cause=self.cause,
                ))
            elif waiter is not None:
                self.leave(waiter, trusted(LockWaitTimedOut,
                    request_id=waiter.request_id, agent_id=waiter.agent_id, resource=view.resource,
                    waited_ms=now - waiter.queued_at_ms, at_ms=now, cause=self.cause,
                ))
            else:
                return
            self.hand_off()

    def hand_off(self) -> None:
        """Grant the head of the queue while it is compatible; then refresh the wait edges the
        change of holders touches."""
        while self.view.queue:
            head = self.view.queue[0]
            if not self.compatible(head.mode):
                break
            self.remove_edges(head)
            self.grant(head.request_id, head.agent_id, head.mode, head.ttl_ms, [])
        self.refresh_from(0)

    def refresh_from(self, position: int) -> None:
        """Bring the wait-for edges of the waiters from ``position`` on up to date, stopping after the
        first exclusive waiter: every waiter behind it waits on it or on someone behind it, so a change
        ahead of ``position`` cannot reach them. A hand-off touches O(1) waiters, whatever the queue.

        Whom a waiter waits on: the nearest waiter ahead of it that it conflicts with (either of the
        two exclusive), which must be granted and release first; or, when there is none, the holders
        it conflicts with. A run of shared waiters is granted together, so they never wait on each
        other, and a cycle of these edges is a real deadlock.
        """
        queue, holders = self.view.queue, self.view.holders
        # The nearest exclusive waiter ahead of ``position`` (a shared waiter's nearest conflict).
        exclusive_ahead: Waiter | None = None
        for earlier in range(position - 1, -1, -1):
            if queue[earlier].mode == "exclusive":
                exclusive_ahead = queue[earlier]
                break
        for index in range(position, len(queue)):
            waiter = queue[index]
            if waiter.mode == "exclusive" and index > 0:
                ahead: Waiter | None = queue[index - 1]
            else:
                ahead = exclusive_ahead
            if ahead is not None:
                want: tuple[str, ...] = (ahead.agent_id,) if ahead.agent_id != waiter.agent_id else ()
            else:
                want = tuple(sorted({h.agent_id for h in holders.values()
                                     if (waiter.mode == "exclusive" or h.mode == "exclusive")
                                     and h.agent_id != waiter.agent_id}))
            if want != waiter.blockers:
                self.reblock(waiter, want)
            if waiter.mode == "exclusive":
                return
            # (shared: the next waiter's nearest exclusive ahead is still ``exclusive_ahead``)

    def reblock(self, waiter: Waiter, want: tuple[str, ...]) -> None:
        """Emit the edge changes that make ``waiter`` wait on exactly ``want``."""
        for gone in sorted(set(waiter.blockers) - set(want)):
            self.emit(trusted(WaitEdgeRemoved,
                edge_id=_edge_id(self.view.resource, waiter, gone), waiter=waiter.agent_id, holder=gone,
                source="lock", resource=self.view.resource, at_ms=self.now, cause=self.cause,
            ))
        for new in sorted(set(want) - set(waiter.blockers)):
            self.emit(trusted(WaitEdgeAdded,
                edge_id=_edge_id(self.view.resource, waiter, new), waiter=waiter.agent_id, holder=new,
                source="lock", resource=self.view.resource, waiter_priority=waiter.priority,
                waiter_registered_at_ms=waiter.queued_at_ms, saga_id=waiter.saga_id, at_ms=self.now,
                cause=self.cause,
            ))

    def position(self, waiter: Waiter) -> int:
        """Where ``waiter`` stands in the queue (new waiters usually at the tail)."""
        queue = self.view.queue
        return len(queue) - 1 if queue and queue[-1] is waiter else queue.index(waiter)

    def leave(self, waiter: Waiter, event: LockCancelled | LockWaitTimedOut) -> None:
        """Take ``waiter`` out of the queue with ``event``, and re-point whoever waited on it."""
        position = self.position(waiter)
        self.remove_edges(waiter)
        self.emit(event)
        self.refresh_from(position)

    def deny(self, request_id: str, agent_id: str, reason: Reason, detail: dict[str, Any]) -> None:
        diagnostic = {
            "reason": reason,
            "resource": self.view.resource,
            **detail,
            "current": {
                "high_water_token": self.view.last_token,
                "holders": [{"agent_id": h.agent_id, "mode": h.mode, "expires_at_ms": h.expires_at_ms,
                             **({} if self.hide_tokens and h.agent_id != agent_id else {"token": h.token})}
                            for h in self.view.holders.values()],
                "waiting": len(self.view.queue),
            },
            "what_to_do": what_to_do(reason),
        }
        self.emit(trusted(LockDenied,
            request_id=request_id, agent_id=agent_id, resource=self.view.resource, reason=reason.value,
            detail=json.dumps(diagnostic, sort_keys=True), request_sent_at_ms=self.sent, at_ms=self.now,
            cause=self.cause,
        ))




def _edge_id(resource: str, waiter: Waiter, holder: str) -> str:
    return f"lock|{resource}|{waiter.request_id}|{holder}"


def _validate_acquire(cmd: LockRequested, rules: LeaseRules) -> tuple[Reason, dict[str, Any]] | None:
    if not cmd.resource or len(cmd.resource.encode()) > rules.max_resource_bytes:
        return Reason.INVALID_RESOURCE, {"you_sent": {"resource_bytes": len(cmd.resource.encode())},
                                    "limit_bytes": rules.max_resource_bytes}
    if not cmd.agent_id:
        return Reason.INVALID_AGENT, {}
    if cmd.mode not in MODES:
        return Reason.INVALID_MODE, {"you_sent": {"mode": cmd.mode[:64]}, "allowed": list(MODES)}
    if cmd.ttl_ms <= 0 or cmd.ttl_ms > rules.max_ttl_ms:
        return Reason.INVALID_TTL, {"you_sent": {"ttl_ms": cmd.ttl_ms}, "max_ttl_ms": rules.max_ttl_ms}
    if cmd.wait_ms < 0 or cmd.wait_ms > rules.max_wait_ms:
        return Reason.INVALID_WAIT, {"you_sent": {"wait_ms": cmd.wait_ms}, "max_wait_ms": rules.max_wait_ms}
    return None


def _lock_order_problem(cmd: LockRequested) -> str | None:
    later = sorted(r for r in cmd.held_resources if r > cmd.resource)
    if later:
        return (f"lock order: {cmd.agent_id} requests {cmd.resource!r} while holding {later[0]!r}, "
                "which sorts after it")
    return None


def _id_problem(book: LeaseBook, command: LockCommand, now_ms: int, rules: LeaseRules
                ) -> tuple[Reason, dict[str, Any]] | None:
    """Why a command that is not a repeat may not be decided now: sent too long ago, or in the future."""
    sent = command.at_ms
    floor = now_ms - rules.id_window_ms
    if book.forgotten_sent_ms is not None:
        floor = max(floor, book.forgotten_sent_ms)
    if sent <= floor:
        return Reason.REQUEST_EXPIRED, {"you_sent": {"at_ms": sent}, "refused_at_or_before_ms": floor,
                                        "id_window_ms": rules.id_window_ms}
    if sent > now_ms + rules.clock_skew_ms:
        return Reason.CLOCK_SKEW, {"you_sent": {"at_ms": sent}, "broker_time_ms": now_ms,
                                   "clock_skew_ms": rules.clock_skew_ms}
    return None


def _acquire(d: _Decision, cmd: LockRequested, rules: LeaseRules) -> None:
    problem = _validate_acquire(cmd, rules)
    if problem:
        d.deny(cmd.request_id, cmd.agent_id, *problem)
        return
    warnings: list[str] = []
    order = _lock_order_problem(cmd) if rules.lock_order != "off" else None
    if order and rules.lock_order == "reject":
        d.deny(cmd.request_id, cmd.agent_id, Reason.LOCK_ORDER_VIOLATION, {"problem": order})
        return
    if order:
        warnings.append(order)
    view = d.view
    if any(h.agent_id == cmd.agent_id for h in view.holders.values()):
        d.deny(cmd.request_id, cmd.agent_id, Reason.ALREADY_HOLDER, {})
        return
    if cmd.agent_id in view.waiting:
        d.deny(cmd.request_id, cmd.agent_id, Reason.ALREADY_WAITING, {})
        return
    ahead = bisect.bisect_right(view.queue, -cmd.priority, key=lambda w: -w.priority)
    if ahead == 0 and d.compatible(cmd.mode):
        d.grant(cmd.request_id, cmd.agent_id, cmd.mode, cmd.ttl_ms, warnings, answers=True)
        # A granted shared request can leave lower-priority waiters blocked on one more holder.
        d.refresh_from(0)
        return
    if cmd.wait_ms == 0:
        d.deny(cmd.request_id, cmd.agent_id, Reason.BUSY, {"you_sent": {"mode": cmd.mode, "wait_ms": 0}})
        return
    d.emit(trusted(LockQueued,
        request_id=cmd.request_id, agent_id=cmd.agent_id, resource=view.resource, mode=cmd.mode,
        ttl_ms=cmd.ttl_ms, saga_id=cmd.saga_id, position=ahead + 1, priority=cmd.priority,
        wait_deadline_ms=d.now + cmd.wait_ms,
        blocking_agents=sorted({h.agent_id for h in view.holders.values()}),
        warnings=warnings, request_sent_at_ms=d.sent, at_ms=d.now, cause=d.cause,
    ))
    position = d.position(view.queued[cmd.request_id])
    d.refresh_from(position)  # the new waiter
    d.refresh_from(position + 1)  # and those behind it that now wait on it


def _token_problem(d: _Decision, agent_id: str, token: int) -> tuple[Reason, dict[str, Any]] | None:
    reason = token_problem(d.view.holders, d.view.last_token, agent_id, token, d.now)
    return None if reason is None else (reason, {"you_sent": {"token": token, "agent_id": agent_id}})


def _renew(d: _Decision, cmd: LockRenewRequested, rules: LeaseRules) -> None:
    problem = _token_problem(d, cmd.agent_id, cmd.token)
    if problem:
        d.deny(cmd.request_id, cmd.agent_id, *problem)
        return
    lease = d.view.holders[cmd.token]
    ttl = cmd.ttl_ms if cmd.ttl_ms is not None else lease.ttl_ms
    if ttl <= 0 or ttl > rules.max_ttl_ms:
        d.deny(cmd.request_id, cmd.agent_id, Reason.INVALID_TTL, {"you_sent": {"ttl_ms": ttl},
                                                             "max_ttl_ms": rules.max_ttl_ms})
        return
    d.emit(trusted(LockRenewed, request_id=cmd.request_id, agent_id=cmd.agent_id, resource=d.view.resource,
                       token=cmd.token, expires_at_ms=d.now + ttl, request_sent_at_ms=d.sent, at_ms=d.now,
                       cause=d.cause))


def _release(d: _Decision, cmd: LockReleaseRequested) -> None:
    problem = _token_problem(d, cmd.agent_id, cmd.token)
    if problem:
        d.deny(cmd.request_id, cmd.agent_id, *problem)
        return
    d.emit(trusted(LockReleased, request_id=cmd.request_id, agent_id=cmd.agent_id, resource=d.view.resource,
                        token=cmd.token, request_sent_at_ms=d.sent, at_ms=d.now, cause=d.cause))
    d.hand_off()


def _cancel(d: _Decision, cmd: LockCancelRequested) -> None:
    waiter = d.view.queued.get(cmd.target_request_id)
    if waiter is None or waiter.agent_id != cmd.agent_id:
        d.deny(cmd.request_id, cmd.agent_id, Reason.NOT_WAITING, {"you_sent": {"target_request_id":
                                                                          cmd.target_request_id}})
        return
    d.leave(waiter, trusted(LockCancelled, request_id=waiter.request_id, agent_id=waiter.agent_id,
                                  resource=d.view.resource, reason=Reason.CANCELLED_BY_AGENT.value,
                                  by_request_id=cmd.request_id, by_agent_id=cmd.agent_id,
                                  request_sent_at_ms=d.sent, at_ms=d.now,
                                  cause=d.cause))
    d.hand_off()


def _revoke(d: _Decision, cmd: LockRevokeRequested) -> None:
    leases = [h for h in d.view.holders.values()
              if h.agent_id == cmd.agent_id and (cmd.token is None or h.token == cmd.token)]
    waiting = d.view.waiting.get(cmd.agent_id)
    waiters = [waiting] if waiting is not None and cmd.token is None else []
    if not leases and not waiters:
        # Refused to whoever sent it (an operator, the detector): it is their request id.
        d.deny(cmd.request_id, cmd.requested_by, Reason.NOTHING_TO_REVOKE,
               {"you_sent": {"agent_id": cmd.agent_id, "token": cmd.token}})
        return
    for lease in leases:
        d.emit(trusted(LockRevoked, request_id=lease.request_id, agent_id=lease.agent_id, resource=d.view.resource,
                           token=lease.token, reason=cmd.reason, by_request_id=cmd.request_id,
                           by_agent_id=cmd.requested_by,
                           request_sent_at_ms=d.sent, at_ms=d.now, cause=d.cause))
    for waiter in waiters:
        d.leave(waiter, trusted(LockCancelled, request_id=waiter.request_id, agent_id=waiter.agent_id,
                                      resource=d.view.resource, reason=cmd.reason, by_request_id=cmd.request_id,
                                      by_agent_id=cmd.requested_by,
                                      request_sent_at_ms=d.sent, at_ms=d.now, cause=d.cause))
    d.hand_off()


_HANDLERS: dict[type, Callable[[_Decision, Any, LeaseRules], None]] = {
    LockRequested: _acquire,
    LockRenewRequested: _renew,
    LockReleaseRequested: lambda d, c, _r: _release(d, c),
    LockCancelRequested: lambda d, c, _r: _cancel(d, c),
    LockRevokeRequested: lambda d, c, _r: _revoke(d, c),
}


def _run(view: LeaseBook, command: LockCommand, now_ms: int, cause: Cause, rules: LeaseRules,
         version: int) -> list[LockEvent]:
    if isinstance(command, LockTick):
        d = _Decision(view, max(now_ms, view.clock_ms), cause, version, None, rules.hide_tokens)
        if view.holders or view.queue:
            d.advance_time()
        return d.events
    sender = _sender(command)
    request_id = command.request_id
    taken = _taken(view, request_id, sender)
    if taken is None:
        return []  # decided before: a request id has one decision, ever
    d = _Decision(view, max(now_ms, view.clock_ms), cause, version, command.at_ms, rules.hide_tokens)
    if view.holders or view.queue:
        d.advance_time()
    problem = _id_problem(view, command, d.now, rules)
    if taken and (problem is None or not rules.forget_window_refusals):
        d.deny(request_id, sender, Reason.REQUEST_ID_TAKEN, {"you_sent": {"request_id": request_id}})
    elif problem is not None:
        d.deny(request_id, sender, *problem)
    else:
        _HANDLERS[type(command)](d, command, rules)
    return d.events


def _sender(command: LockCommand) -> str:
    """Whose request id a command's is: its agent's; an operator's or the detector's for a revoke."""
    if isinstance(command, LockRevokeRequested):
        return command.requested_by
    assert not isinstance(command, LockTick), "a tick is nobody's request"
    return command.agent_id


def _taken(book: LeaseBook, request_id: str, sender: str) -> bool | None:
    """None: ``sender``'s command with ``request_id`` was decided before (it is remembered, or it is a
    live waiter or holder); True: another sender's was; False: the id is free."""
    if (request_id, sender) in book.seen:
        return None
    owner = book.owners.get(request_id)
    if owner == "":
        return None  # recorded before senders were (a cancel's or revoke's id): any sender's is a repeat
    waiter = book.queued.get(request_id)
    if waiter is not None:
        return None if waiter.agent_id == sender else True
    for lease in book.holders.values():
        if lease.request_id == request_id:
            return None if lease.agent_id == sender else True
    return owner is not None


def decide(
    book: LeaseBook, command: LockCommand, now_ms: int, cause: Cause, rules: LeaseRules = DEFAULT_RULES,
    version: int = 0,
) -> list[LockEvent]:
    """The events ``command`` causes on ``book`` at ``now_ms`` (the book is not changed: the decision
    folds into it and is undone, at the cost of what it changed, never of a copy).

    ``version`` is the resource's content version (the gateway's), reported in grants.
    """
    undo = book.begin()
    try:
        return _run(book, command, now_ms, cause, rules, version)
    finally:
        book.end()
        undo()


def step(
    book: LeaseBook, command: LockCommand, now_ms: int, cause: Cause, rules: LeaseRules = DEFAULT_RULES,
    version: int = 0,
) -> list[LockEvent]:
    """``decide`` and ``evolve`` fused: apply ``command`` to ``book`` in place, return its events.

    Equal, by construction and by test, to folding ``decide``'s events with ``evolve``;
    it only saves folding every event twice, which the processor's hot path needs.
    """
    events = _run(book, command, now_ms, cause, rules, version)
    for event in events:
        _stamp(book, event, rules)
    return events


def new_book(resource: str) -> LeaseBook:
    """An empty book for ``resource``."""
    return LeaseBook(resource, taken=(0, 0))
