"""``python -m bench console``: what the live console costs, and how fresh it is.

One worker and one front door; an agent makes ``--rate`` decisions a second (100: acquire and release
by turns, over 1,000 resources) for ``--seconds`` (20) twice: with no console open, then with the page
open in Debian's headless Chromium. Printed:

- the door's CPU per 1,000 decisions, without and with the console (from ``/proc/<pid>/stat``: its
  own process, user and system time), and the difference: the console stream's cost;
- the page's update latency: from the agent's acquire to the holder appearing on the page, p50 and
  p99, against the acquire's own round trip at the agent (the page can be no fresher than the log).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from arbiter.agents import ArbiterClient
from arbiter.processes import DoorProcess

from .cdp import Browser
from .env import bench_arbiter

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


async def load(client: ArbiterClient, rate: float, seconds: float, offset: int,
               sent: dict[str, float] | None = None) -> int:
    """Acquire and release by turns at ``rate`` decisions/s; returns the decisions made."""
    decisions, started = 0, time.monotonic()
    i = 0
    while time.monotonic() - started < seconds:
        resource = f"doc:c{(offset + i) % 1000:04d}"
        i += 1
        if sent is not None:
            sent[resource] = time.time() * 1000
        lease = await client.acquire(resource, ttl=30)
        await client.release(lease)
        decisions += 2
        ahead = started + decisions / rate - time.monotonic()
        if ahead > 0:
            await asyncio.sleep(ahead)
    return decisions


async def measure(rate: float, seconds: float) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("console: needs Debian's chromium (apt-get install chromium)")
    async with bench_arbiter() as settings:
        door = DoorProcess(settings)
        await asyncio.to_thread(door.start)
        try:
            pid = door.proc.pid if door.proc is not None else 0
            async with ArbiterClient("console-bench", settings) as client:
                await load(client, rate, 2, 0)  # warm
                before = cpu_seconds(pid)
                quiet = await load(client, rate, seconds, 0)
                idle_cpu = cpu_seconds(pid) - before
                with tempfile.TemporaryDirectory() as profile:
                    async with Browser(chromium, Path(profile)) as page:
                        await page.open(door.url + "/")
                        await page.until("document.getElementById('status').textContent === 'live'", 30)
                        sent: dict[str, float] = {}
                        before = cpu_seconds(pid)
                        watched = await load(client, rate, seconds, 500, sent)
                        busy_cpu = cpu_seconds(pid) - before
                        appeared = await page.eval("window.arbiterConsole.appeared")
                        errors = list(page.errors)
        finally:
            door.stop()
    latencies = sorted(appeared[k] - sent[k.split("\u0000")[0]] for k in appeared
                       if k.split("\u0000")[0] in sent and appeared[k] >= sent[k.split("\u0000")[0]])
    per_k_idle = idle_cpu / quiet * 1000
    per_k_busy = busy_cpu / watched * 1000
    print(f"console: {rate:g} decisions/s for {seconds:g} s, one worker, one door (2-core VM)")
    print(f"console: door CPU {per_k_idle * 1000:6.1f} ms per 1,000 decisions with no console open, "
          f"{per_k_busy * 1000:6.1f} ms with the page open: the stream costs {(per_k_busy - per_k_idle) * 1000:.1f} "
          "ms per 1,000 decisions")
    if latencies:
        p50 = statistics.median(latencies)
        p99 = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))]
        print(f"console: page update latency (acquire sent -> holder on the page) p50 {p50:.0f} ms, p99 {p99:.0f} ms "
              f"over {len(latencies)} grants; page errors: {len(errors)}")
    else:
        print("console: no grant was seen on the page (NOT MET)")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench console", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=100.0)
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args(argv)
    asyncio.run(measure(args.rate, args.seconds))
