"""Leases as an agent sees them: a token to write with, and a flag that says when to stop.

Theory of operation
-------------------
``ArbiterClient.lease(...)`` returns a ``LeaseContext``. Entering it sends an acquire
and suspends until the decision arrives in the agent's inbox (granted, denied, timed
out or cancelled). While the body runs, a background task renews the lease every
third of its TTL. The lease counts as lost, at once and without a network round trip,
when any of these happens:

- an ``LockExpired`` or ``LockRevoked`` event for it reaches the inbox;
- a renewal is refused;
- the local clock passes the TTL since the last successful acquire or renew was
  *sent* (a conservative bound: the broker decided later than we sent).

An agent checks ``lease.lost`` (or calls ``lease.check()``) between steps, so it stops
acting on stale state; the gateway rejects a write from a lost lease regardless.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from contract import LockCancelled, LockDenied, LockWaitTimedOut
from contract.reasons import Reason, is_retriable, what_to_do


class ArbiterError(Exception):
    """Base of the SDK's errors. ``retriable`` says whether the same call may succeed later."""

    retriable = False


class ArbiterUnavailable(ArbiterError):
    """Arbiter could not be reached, or the connection broke mid-call. Retriable: the command may or
    may not have been decided, so retry with the same ids (a decided id is answered, never decided again)."""

    retriable = True


class LeaseDenied(ArbiterError):
    """The lease was not granted. ``reason`` is a stable code; ``diagnostic`` says what to do.

    ``str(error)`` is the JSON diagnostic, ready to paste into an LLM's context.
    """

    def __init__(self, reason: str, diagnostic: dict[str, Any]) -> None:
        super().__init__(json.dumps(diagnostic, sort_keys=True))
        self.reason = reason
        self.diagnostic = diagnostic

    @classmethod
    def from_event(cls, record: LockDenied | LockWaitTimedOut | LockCancelled) -> LeaseDenied:
        """The error an agent sees for a refusal, a wait time-out or a withdrawn request."""
        if isinstance(record, LockDenied):
            try:
                diagnostic = json.loads(record.detail)
            except ValueError:
                diagnostic = {"reason": record.reason, "detail": record.detail}
            return cls(record.reason, diagnostic)
        if isinstance(record, LockWaitTimedOut):
            return cls("wait_timed_out", {
                "reason": "wait_timed_out", "resource": record.resource, "waited_ms": record.waited_ms,
                "what_to_do": what_to_do(Reason.WAIT_TIMED_OUT)})
        return cls(record.reason, {
            "reason": record.reason, "resource": record.resource,
            "what_to_do": "Your request was withdrawn before it was granted."})

    @property
    def retriable(self) -> bool:  # type: ignore[override]
        """Busy, timed out, cancelled and deadlock victims may succeed later; bad input will not.

        The one table of which reasons are retriable is ``contract.reasons``.
        """
        return is_retriable(self.reason)


class LeaseLost(ArbiterError):
    """The lease expired or was revoked: stop acting on this resource."""


@dataclass(eq=False)
class Lease:
    """A granted lease: write with ``token``; stop when ``lost``."""

    resource: str
    agent_id: str
    request_id: str
    token: int
    mode: str
    ttl_ms: int
    expires_at_ms: int
    resource_version: int
    warnings: list[str] = field(default_factory=list)
    lost_reason: str | None = None
    _local_deadline: float = 0.0
    _lost_event: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def lost(self) -> bool:
        """True once the lease is gone (expired, revoked, renewal refused, or out of time)."""
        if self.lost_reason is None and time.monotonic() >= self._local_deadline:
            self.mark_lost("ttl_elapsed_locally")
        return self.lost_reason is not None

    def check(self) -> None:
        """Raise ``LeaseLost`` if the lease is gone."""
        if self.lost:
            raise LeaseLost(f"lease on {self.resource!r} (token {self.token}) is lost: {self.lost_reason}")

    async def wait_lost(self) -> str:
        """Suspend until the lease is lost by an event; returns the reason."""
        await self._lost_event.wait()
        return self.lost_reason or "lost"

    def mark_lost(self, reason: str) -> None:
        """Record that the lease is gone (first reason wins)."""
        if self.lost_reason is None:
            self.lost_reason = reason
            self._lost_event.set()

    def extended(self, sent_at: float, expires_at_ms: int, ttl_ms: int) -> None:
        """A renewal sent at monotonic time ``sent_at`` was granted."""
        self.expires_at_ms = expires_at_ms
        self.ttl_ms = ttl_ms
        self._local_deadline = max(self._local_deadline, sent_at + ttl_ms / 1000)


OnAcquired = Callable[[Lease], Awaitable[None]]
"""A hook that refreshes the agent's context after the grant, before the body runs."""
