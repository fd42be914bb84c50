"""``arbiter top``: who holds what, right now, from a shell (the console's feed, drawn by ``rich``)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from typing import Any

import click

from .terminal import settings_of


def frame(state: Any, recent: deque[tuple[float, str]], rows: int = 25) -> Any:
    """One screen: the busiest resources (queue, then holders), refusals per second, lag, deadlocks."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    now = time.monotonic()
    while recent and now - recent[0][0] > 10:
        recent.popleft()
    refusals: dict[str, int] = {}
    for _at, reason in recent:
        refusals[reason] = refusals.get(reason, 0) + 1
    busiest = sorted(state.resources.items(), key=lambda kv: (-len(kv[1]["queue"]), -len(kv[1]["holders"]), kv[0]))
    leases = Table(title=f"leases held and queued ({len(state.resources)} resources, {state.decisions} decisions)",
                   expand=True, title_justify="left")
    leases.add_column("resource", overflow="fold")
    leases.add_column("holders", style="green", overflow="fold")
    leases.add_column("queue", style="yellow", overflow="fold")
    for resource, book in busiest[:rows]:
        leases.add_row(Text(resource), Text(", ".join(book["holders"])), Text(", ".join(book["queue"])))
    side = Table(expand=True, show_header=True)
    side.add_column("refusals /s (last 10 s)")
    side.add_column("lag (inputs behind)")
    side.add_column("deadlocks")
    lags = [f"{tp}: {n}" for tp, n in sorted(state.lag.items()) if n] or ["caught up"]
    reasons = [f"{n / 10:.1f} {r}" for r, n in sorted(refusals.items(), key=lambda kv: -kv[1])] or ["none"]
    cycles = [" -> ".join(d["cycle"]) + f" (victim {d['victim']})" for d in list(state.deadlocks)[-3:]] or ["none"]
    side.add_row(Text("\n".join(reasons)), Text("\n".join(lags)), Text("\n".join(cycles)))
    return Group(leases, side)


@click.command("top")
@click.option("--once", is_flag=True, help="Print one screen and exit (for a script or a log).")
@click.option("--refresh", type=float, default=0.5, show_default=True, help="Seconds between redraws.")
@click.option("--rows", type=int, default=25, show_default=True, help="Resources shown (the busiest first).")
@click.pass_context
def top(ctx: click.Context, once: bool, refresh: float, rows: int) -> None:
    """Who holds what right now, who waits, refusals per second and the workers' lag, redrawn live from the
    log (the console's stream, in a terminal). Ctrl-C ends it."""
    from rich.console import Console
    from rich.live import Live

    from arbiter.streams.runtime.livefeed import LiveFeed

    settings = settings_of(ctx)
    console = Console()

    async def run() -> None:
        recent: deque[tuple[float, str]] = deque(maxlen=100_000)

        def note(change: dict[str, Any]) -> None:
            if change.get("kind") == "denied" or (change.get("kind") == "write" and change.get("reason") != "applied"):
                recent.append((time.monotonic(), str(change.get("reason"))))

        async with LiveFeed(settings) as feed:
            feed.subscribe(note)
            if once:
                console.print(frame(feed.state, recent, rows))
                return
            with Live(frame(feed.state, recent, rows), console=console, refresh_per_second=max(1, round(1 / refresh)),
                      transient=False) as live:
                while True:
                    await asyncio.sleep(refresh)
                    live.update(frame(feed.state, recent, rows))

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run())
