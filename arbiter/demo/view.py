"""The demo's live view: the run's decision topics folded into who holds and waits for what, drawn on a terminal."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
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
    Record,
)
from arbiter.streams.runtime.livefeed import LiveState

# -- the live view -------------------------------------------------------------------------


@dataclass
class SwarmView:
    """The demo's view of its run: the log's one live fold (``arbiter.streams.runtime.livefeed.LiveState``,
    which the console and ``arbiter top`` show too), drawn as lines of text."""

    state: LiveState = field(default_factory=LiveState)

    def feed(self, record: Record) -> None:
        """Fold one decision (a redelivered copy counts once)."""
        self.state.apply(record)

    @property
    def counts(self) -> Counter[str]:
        """Decisions by kind."""
        return self.state.counts

    @property
    def rejections(self) -> Counter[str]:
        """Refusals by reason."""
        return self.state.rejections

    @property
    def victims(self) -> list[str]:
        """Each deadlock's victim."""
        return self.state.victims

    @property
    def sagas(self) -> dict[str, str]:
        """Each agent's saga, by the delegation edges it sends (anyone who reads the log sees them)."""
        return self.state.saga_of

    def leases(self, agents: Iterable[str]) -> list[tuple[str, str, int]]:
        """(agent, resource, token) of each lease one of ``agents`` holds now."""
        wanted = set(agents)
        return sorted((agent, resource, held["token"]) for resource, book in self.state.resources.items()
                      for agent, held in book["holders"].items() if agent in wanted)

    def lines(self, done: int, total: int, elapsed: float, width: int = 30) -> list[str]:
        """The view, as lines of text."""
        books = self.state.resources
        out = [progress_line("swarm", done, total, elapsed, width)]
        out.append(f"leases: {sum(len(b['holders']) for b in books.values())} held, "
                   f"{sum(len(b['queue']) for b in books.values())} queued")
        busy = sorted(books)
        for resource in busy[:8]:
            holders = sorted((held["token"], agent) for agent, held in books[resource]["holders"].items())
            held = ", ".join(f"{agent} (token {token})" for token, agent in holders)
            waiting = ", ".join(sorted(books[resource]["queue"]))
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


async def follow(settings: Settings, state: SwarmView, stop: asyncio.Event,
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


def _fold(state: SwarmView, record: Record | None) -> None:
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
