"""One acquire, from its send to its end, as a machine with no I/O: the inbox records in, what to do out.

Theory of operation
-------------------
A request is ``SENT``; a ``LockQueued`` makes it ``QUEUED`` (how long that answer took bounds
the way back of a later grant); its final answer makes it ``GRANTED``, ``REFUSED`` (denied,
timed out in the queue, cancelled), and a grant later ``LOST`` (expired or revoked, by an
inbox record). A caller that stops waiting (its own time-out, a cancellation, a caller of the
front door who hung up) ``withdraw``s it: the request is cancelled, and a grant that still
comes is given back at once (``GIVE_BACK``), never held by nobody.

``ArbiterClient.acquire`` and ``lease`` (and through them the front door) drive one of these
per request: ``feed`` each inbox record for its request id and act on what it returns.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from arbiter.schemas import (
    LockCancelled,
    LockDenied,
    LockExpired,
    LockGranted,
    LockQueued,
    LockRevoked,
    LockWaitTimedOut,
    Record,
)


class State(Enum):
    """Where a pending acquire is."""

    SENT = "sent"
    QUEUED = "queued"
    GRANTED = "granted"
    REFUSED = "refused"
    WITHDRAWN = "withdrawn"
    LOST = "lost"


class Do(Enum):
    """What the caller must do after a record."""

    NOTHING = "nothing"
    QUEUED = "queued"
    """Tell whoever waits for the queue position (``on_queued``)."""
    ANSWER = "answer"
    """The final answer is in (``final``): wake the caller."""
    MARK_LOST = "mark_lost"
    """The granted lease is gone (``lost_reason``)."""
    GIVE_BACK = "give_back"
    """A grant arrived after the request was withdrawn: release ``final``'s token."""


FINAL = (LockGranted, LockDenied, LockWaitTimedOut, LockCancelled)
"""A request's final answers."""


@dataclass
class PendingAcquire:
    """One acquire's life."""

    request_id: str
    sent_at: float
    """When it was sent (a monotonic clock's seconds)."""
    state: State = State.SENT
    queued_after: float | None = None
    """Seconds from sending until its LockQueued arrived."""
    final: Record | None = None
    lost_reason: str | None = None

    def feed(self, record: Record, now: float) -> Do:
        """Take one inbox record for this request id, arrived at ``now``."""
        if isinstance(record, LockQueued):
            if self.state is State.SENT:
                self.state, self.queued_after = State.QUEUED, now - self.sent_at
                return Do.QUEUED
            return Do.NOTHING
        if isinstance(record, FINAL):
            if self.state in (State.SENT, State.QUEUED):
                self.final = record
                self.state = State.GRANTED if isinstance(record, LockGranted) else State.REFUSED
                return Do.ANSWER
            if self.state is State.WITHDRAWN and isinstance(record, LockGranted):
                self.final = record
                return Do.GIVE_BACK
            return Do.NOTHING  # a second answer (a redelivered or misrouted copy's refusal): the first stands
        if isinstance(record, LockExpired | LockRevoked) and self.state is State.GRANTED:
            self.state = State.LOST
            self.lost_reason = "expired" if isinstance(record, LockExpired) else f"revoked: {record.reason}"
            return Do.MARK_LOST
        return Do.NOTHING

    def withdraw(self) -> bool:
        """The caller stopped waiting; True when the request was still open (send a cancel)."""
        if self.state in (State.SENT, State.QUEUED):
            self.state = State.WITHDRAWN
            return True
        return False

    def ttl_from(self, now: float) -> float:
        """The moment to count a grant's TTL from, never later than the broker's grant: the send, for an
        immediate grant; for a queued one, the grant's arrival less a full round trip (the LockQueued's),
        which bounds the grant's own way back. Never the send of a queued request: a wait longer than
        the TTL would lose the lease on arrival."""
        return self.sent_at if self.queued_after is None else now - self.queued_after
