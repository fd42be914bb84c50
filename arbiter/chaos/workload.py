"""The honest work a chaos campaign disturbs: agents acquiring, writing through the gateway, releasing.

Each agent loops until told to stop: it picks one of the campaign's accounts, acquires an
exclusive lease on it (waiting in the queue), "thinks" for a moment, refunds one cent of a
new order through the gateway with its fencing token (and the version the grant reported),
and releases the lease. One such cycle is one *operation*:

- **succeeded**: granted, and the write applied;
- **refused**: a lease refusal (``LeaseDenied``: ``wait_timed_out``, ``busy``...) or a
  refused write (``stale_fencing_token``, ``lease_not_live``, ``version_conflict``...), by
  reason;
- **timed out**: no decision at all in time (``ArbiterTimeout``);
- **Kafka unreachable**: the command could not be sent (``ArbiterUnavailable``: a broker
  restarting); the agent tries again shortly with a new operation.

Every intent id sent is kept with whether the agent saw it applied, for the ledger check.
Latency is from the acquire call to the grant's arrival; every grant's arrival time is kept
for the longest gap without one.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from arbiter.agents import ArbiterClient, ArbiterError, ArbiterTimeout, ArbiterUnavailable, LeaseDenied
from arbiter.schemas.partitioning import partition_for


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in 0..1); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


@dataclass
class Phase:
    """What the agents did during one phase of a run (the calm baseline, or the campaign)."""

    name: str
    started: float = 0.0
    ended: float = 0.0
    attempted: int = 0
    succeeded: int = 0
    refused: Counter[str] = field(default_factory=Counter)
    timed_out: int = 0
    unavailable: int = 0
    release_failures: int = 0
    latencies: list[float] = field(default_factory=list)
    grants: list[float] = field(default_factory=list)
    granted_on: list[int] = field(default_factory=list)
    """The partition of each grant's resource (``grants``' order)."""

    def longest_gap(self) -> float:
        """The longest time in the phase without any grant (seconds), counted from its start to its end."""
        if not self.started:
            return 0.0
        end = self.ended or time.monotonic()
        times = [self.started, *sorted(t for t in self.grants if self.started <= t <= end), end]
        return max(b - a for a, b in itertools.pairwise(times))

    def summary(self) -> dict[str, Any]:
        """The phase's figures, JSON-friendly."""
        seconds = max((self.ended or time.monotonic()) - self.started, 1e-9)
        p50, p99 = percentile(self.latencies, 0.5), percentile(self.latencies, 0.99)
        return {
            "phase": self.name,
            "seconds": round(seconds, 2),
            "attempted": self.attempted,
            "succeeded": self.succeeded,
            "success_rate": round(self.succeeded / self.attempted, 4) if self.attempted else None,
            "succeeded_per_s": round(self.succeeded / seconds, 2),
            "refused": dict(self.refused.most_common()),
            "timed_out": self.timed_out,
            "unavailable": self.unavailable,
            "release_failures": self.release_failures,
            "grants": len(self.grants),
            "longest_gap_s": round(self.longest_gap(), 3),
            "acquire_p50_s": None if p50 is None else round(p50, 4),
            "acquire_p99_s": None if p99 is None else round(p99, 4),
        }


@dataclass
class Workload:
    """The honest agents of a run and what they did, phase by phase."""

    clients: list[ArbiterClient]
    resources: list[str]
    seed: int
    partitions: int = 1
    ttl: float = 10.0
    wait: float = 10.0
    write_timeout: float = 15.0
    phases: list[Phase] = field(default_factory=list)
    intents: dict[tuple[str, str], bool] = field(default_factory=dict)
    """(resource, intent id) of every write sent -> whether its agent saw it applied."""
    cut_short: int = 0
    """Operations still running when the agents were stopped (cancelled; not counted in any phase)."""
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _granted: asyncio.Condition = field(default_factory=asyncio.Condition)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    @property
    def phase(self) -> Phase:
        """The phase now running."""
        return self.phases[-1]

    def begin(self, name: str) -> Phase:
        """End the phase running (if any) and start ``name``; the agents start with the first."""
        now = time.monotonic()
        if self.phases and not self.phase.ended:
            self.phase.ended = now
        self.phases.append(Phase(name, started=now))
        if not self._tasks:
            self._tasks = [asyncio.create_task(self._agent(i, c)) for i, c in enumerate(self.clients)]
        return self.phase

    async def stop(self, grace: float = 30.0) -> None:
        """Let each agent finish the operation it is in (up to ``grace`` seconds), then end the phase."""
        self._stop.set()
        done, pending = await asyncio.wait(self._tasks, timeout=grace) if self._tasks else (set(), set())
        for task in pending:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for task in done:
            failure = None if task.cancelled() else task.exception()
            if failure is not None:
                raise failure
        if self.phases and not self.phase.ended:
            self.phase.ended = time.monotonic()

    async def first_grant_after(self, moment: float, timeout: float) -> float | None:
        """The arrival (monotonic) of the first grant after ``moment``, waiting up to ``timeout`` seconds for
        one; None if none came."""
        def first() -> float | None:
            return next((t for p in reversed(self.phases) for t in p.grants if t > moment), None)

        async with self._granted:
            try:
                await asyncio.wait_for(self._granted.wait_for(lambda: first() is not None), timeout)
            except TimeoutError:
                return None
        return first()

    def resumed_after(self, moment: float, until: float) -> float | None:
        """Seconds from ``moment`` until every partition had a grant again (before ``until``); None if one
        had none in that time."""
        firsts: dict[int, float] = {}
        for phase in self.phases:
            for t, p in zip(phase.grants, phase.granted_on, strict=True):
                if moment < t <= until and (p not in firsts or t < firsts[p]):
                    firsts[p] = t
        if len(firsts) < self.partitions:
            return None
        return max(firsts.values()) - moment

    async def _agent(self, index: int, client: ArbiterClient) -> None:
        rng = random.Random(f"{self.seed}/{index}")
        n = 0
        while not self._stop.is_set():
            n += 1
            phase = self.phase
            phase.attempted += 1
            try:
                await self._operation(client, rng, n, phase)
            except asyncio.CancelledError:
                phase.attempted -= 1
                self.cut_short += 1
                raise

    async def _operation(self, client: ArbiterClient, rng: random.Random, n: int, phase: Phase) -> None:
        resource = rng.choice(self.resources)
        asked = time.monotonic()
        try:
            lease = await client.acquire(resource, ttl=self.ttl, wait=self.wait)
        except LeaseDenied as denied:
            phase.refused[denied.reason] += 1
            return
        except ArbiterTimeout:
            phase.timed_out += 1
            return
        except ArbiterUnavailable:
            phase.unavailable += 1
            await self._pause(rng)
            return
        granted = time.monotonic()
        now = self.phase  # a grant counts in the phase it arrives in
        now.latencies.append(granted - asked)
        now.grants.append(granted)
        now.granted_on.append(partition_for(resource.encode(), self.partitions))
        async with self._granted:
            self._granted.notify_all()
        try:
            await asyncio.sleep(rng.uniform(0.05, 0.25))  # the agent's "thinking", with the lease held
            intent_id = uuid.uuid4().hex
            self.intents[resource, intent_id] = False
            try:
                outcome = await client.execute(lease, "refund", {"order_id": f"{client.agent_id}-{n}", "amount": 1},
                                               base_version=lease.resource_version, intent_id=intent_id,
                                               timeout=self.write_timeout)
            except ArbiterTimeout:
                phase.timed_out += 1
                return
            except ArbiterUnavailable:
                phase.unavailable += 1
                return
            if outcome.applied:
                self.intents[resource, intent_id] = True
                phase.succeeded += 1
            else:
                phase.refused[outcome.reason] += 1
        finally:
            try:
                await asyncio.shield(client.release(lease, timeout=10))
            except ArbiterError:
                phase.release_failures += 1

    async def _pause(self, rng: random.Random) -> None:
        """After Kafka did not take a command: a moment before the next operation (no busy loop)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), rng.uniform(0.2, 0.5))
