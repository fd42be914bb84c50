"""How the SDK's cost grows with the number of agents in one process (``sdk-scale``).

N agents, one ``ArbiterClient`` each, each acquiring and releasing its own resource in a
loop for a fixed time, against one worker on topics of its own. Printed per N: grants
per second, acquire latency, and this process's CPU seconds per grant (the worker runs
in its own process and is not counted). A cost per grant that grows with N is the SDK's
doing: the worker sees the same one-resource-per-agent load whatever N is.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time

from arbiter.agents import ArbiterClient
from arbiter.edge.settings import Settings

from .env import bench_arbiter

AGENTS = (1, 8, 64)


async def _agent(client: ArbiterClient, until: float, latencies: list[float]) -> None:
    resource = f"sdk:{client.agent_id}"
    while time.perf_counter() < until:
        started = time.perf_counter()
        lease = await client.acquire(resource, ttl=30, wait=10)
        latencies.append((time.perf_counter() - started) * 1000)
        await client.release(lease)


async def _run(settings: Settings, agents: int, seconds: float) -> None:
    async with contextlib.AsyncExitStack() as stack:
        clients = [ArbiterClient(f"sdk-agent-{i}", settings) for i in range(agents)]
        await asyncio.gather(*(client.start() for client in clients))
        for client in clients:
            stack.push_async_callback(client.close)
        warm: list[float] = []
        await asyncio.gather(*(_agent(client, time.perf_counter() + 1.0, warm) for client in clients))
        latencies: list[float] = []
        cpu, wall = time.process_time(), time.perf_counter()
        await asyncio.gather(*(_agent(client, wall + seconds, latencies) for client in clients))
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    q = statistics.quantiles(latencies, n=100, method="inclusive")
    grants = len(latencies)
    print(f"sdk scale, {agents:>2} agent{'s' if agents > 1 else ' '} in one process, one client each: "
          f"{grants / wall:>6,.0f} grants/s  acquire p50 {q[49]:5.1f} ms  p99 {q[98]:6.1f} ms  "
          f"client CPU {cpu / grants * 1e6:5.0f} µs/grant ({cpu / wall:.0%} of a core; n={grants})")


async def scale(seconds: float, agents: tuple[int, ...] = AGENTS) -> None:
    """For each N in ``agents``: N clients in this process, each acquiring and releasing its own resource."""
    async with bench_arbiter() as settings:
        for n in agents:
            await _run(settings, n, seconds)
