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
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from arbiter.agents.errors import LeaseLost


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

    def remaining(self) -> float:
        """Seconds the lease has left by this machine's clock (a conservative bound: the worker's is later)."""
        return self._local_deadline - time.monotonic()

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
