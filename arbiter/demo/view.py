"""The demo's live view: the run's decision topics folded into who holds and waits for what, drawn on a terminal."""

from __future__ import annotations

import asyncio
import time
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import click
from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from arbiter.edge.settings import Settings
from arbiter.edge.tail import Tail
from arbiter.schemas import (
    Compensated,
    DeadlockDetected,
    LockCancelled,
    LockDenied,
    LockExpired,
    LockGranted,
    LockQueued,
    LockReleased,
    LockRevoked,
    LockWaitTimedOut,
    Record,
    SagaFinished,
    ToolApplied,
    ToolRejected,
    WaitEdgeAdded,
)

# -- the live view -------------------------------------------------------------------------


@dataclass
class LiveState:
    """What the run's decisions say, folded as they arrive."""

    holders: dict[str, dict[int, str]] = field(default_factory=lambda: defaultdict(dict))
    queued: dict[str, dict[str, str]] = field(default_factory=lambda: defaultdict(dict))
    counts: Counter[str] = field(default_factory=Counter)
    rejections: Counter[str] = field(default_factory=Counter)
    victims: list[str] = field(default_factory=list)
    sagas: dict[str, str] = field(default_factory=dict)
    """Each agent's saga, by the delegation edges it sends (anyone who reads the log sees them)."""

    seen: set[tuple[str, str]] = field(default_factory=set)

    def feed(self, record: Record) -> None:
        """Fold one decision (a redelivered copy counts once)."""
        from arbiter.audit.log import identity

        if isinstance(record, LockGranted | LockQueued | DeadlockDetected | Compensated | SagaFinished | ToolApplied
                      | ToolRejected | LockDenied):
            ident = identity(record)
            if ident in self.seen:
                return
            self.seen.add(ident)
        if isinstance(record, LockGranted):
            self.counts["grants"] += 1
            if self.queued[record.resource].pop(record.request_id, None) is not None:
                self.counts["granted after waiting"] += 1
            self.holders[record.resource][record.token] = record.agent_id
        elif isinstance(record, LockQueued):
            self.queued[record.resource][record.request_id] = record.agent_id
        elif isinstance(record, LockReleased | LockExpired | LockRevoked):
            self.holders[record.resource].pop(record.token, None)
            if isinstance(record, LockExpired):
                self.counts["expired"] += 1
        elif isinstance(record, LockCancelled | LockWaitTimedOut):
            self.queued[record.resource].pop(record.request_id, None)
        elif isinstance(record, LockDenied | ToolRejected):
            self.rejections[record.reason] += 1
        elif isinstance(record, ToolApplied):
            self.counts["writes"] += 1
        elif isinstance(record, DeadlockDetected):
            self.counts["deadlocks"] += 1
            self.victims.append(record.victim)
        elif isinstance(record, Compensated):
            self.counts["compensations"] += 1
        elif isinstance(record, SagaFinished):
            self.counts[f"sagas {record.outcome.lower()}"] += 1
        elif isinstance(record, WaitEdgeAdded) and record.source == "delegation" and record.saga_id:
            self.sagas.setdefault(record.waiter, record.saga_id)

    def leases(self, agents: Iterable[str]) -> list[tuple[str, str, int]]:
        """(agent, resource, token) of each lease one of ``agents`` holds now."""
        wanted = set(agents)
        return sorted((agent, resource, token) for resource, held in self.holders.items()
                      for token, agent in held.items() if agent in wanted)

    def lines(self, done: int, total: int, elapsed: float, width: int = 30) -> list[str]:
        """The view, as lines of text."""
        out = [progress_line("swarm", done, total, elapsed, width)]
        busy = sorted(r for r in set(self.holders) | set(self.queued) if self.holders[r] or self.queued[r])
        out.append(f"leases: {sum(len(h) for h in self.holders.values())} held, "
                   f"{sum(len(q) for q in self.queued.values())} queued")
        for resource in busy[:8]:
            held = ", ".join(f"{agent} (token {token})" for token, agent in sorted(self.holders[resource].items()))
            waiting = ", ".join(sorted(self.queued[resource].values()))
            out.append(f"  {resource[:44]:<44} held by {held or '-'}" + (f"; queued: {waiting}" if waiting else ""))
        if len(busy) > 8:
            out.append(f"  ... and {len(busy) - 8} more resources")
        reasons = ", ".join(f"{reason} {n}" for reason, n in self.rejections.most_common()) or "none"
        out.append(f"grants {self.counts['grants']}, writes {self.counts['writes']}, rejections: {reasons}")
        out.append(f"deadlocks {self.counts['deadlocks']}"
                   + (f" (victim {', '.join(self.victims)})" if self.victims else "")
                   + f", compensations {self.counts['compensations']}")
        return out


def progress_line(label: str, done: int, total: int, elapsed: float, width: int = 30) -> str:
    """``swarm [####------] 12/40 steps, 3.1 s``."""
    filled = round(width * done / max(total, 1))
    return f"{label} [{'#' * filled}{'-' * (width - filled)}] {done}/{total} steps, {elapsed:5.1f} s"


async def follow(settings: Settings, state: LiveState, stop: asyncio.Event,
                 catch_up: asyncio.Event | None = None) -> None:
    """Fold the run's decision topics into ``state`` until ``stop`` (read-only, no group).

    Once ``catch_up`` is set, it reads on to the topics' end offsets as of then, and
    returns. A message that does not decode is skipped and counted; a bug in the fold
    is raised.
    """
    t = settings.topics
    async with Tail(settings, [t.resource_events, t.wait_edges, t.saga_events], start="beginning",
                    isolation_level="read_uncommitted") as tail:
        ends: dict[Any, int] | None = None
        while not stop.is_set():
            if ends is None and catch_up is not None and catch_up.is_set():
                ends = await tail.ends()
            if ends is not None:
                for _message, record in await tail.read_to_end(ends):
                    _fold(state, record)
                return
            for _message, record in await tail.read():
                _fold(state, record)


def _fold(state: LiveState, record: Record | None) -> None:
    if record is None:
        state.counts["messages the view could not decode"] += 1
    else:
        state.feed(record)


class Screen:
    """The live view: ``rich``'s ``Live`` on a terminal (it crops each line to the terminal's width, follows
    resizes, and leaves one clean final frame when ``close``d, so what is printed next starts below it);
    elsewhere (a pipe, a log) the progress line every few seconds."""

    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console()
        self.live: Live | None = None
        self.last_print = 0.0

    def draw(self, lines: list[str]) -> None:
        if self.console.is_terminal:
            frame = Group(*(Text(line, no_wrap=True, overflow="ellipsis") for line in lines))
            if self.live is None:
                self.live = Live(frame, console=self.console, auto_refresh=False, transient=False,
                                 vertical_overflow="crop")
                self.live.start()
            self.live.update(frame, refresh=True)
        elif time.monotonic() - self.last_print >= 5:
            self.last_print = time.monotonic()
            click.echo(lines[0])

    def close(self) -> None:
        """Stop redrawing: the last frame stays, and the cursor is below it."""
        if self.live is not None:
            self.live.stop()
            self.live = None
