"""Gateway benchmarks: the pure check in-process, and intents through Kafka and a worker."""

from __future__ import annotations

import time
import uuid
from typing import Any

from arbiter.agents import ArbiterClient
from arbiter.edge.clock import now_ms
from arbiter.schemas import Cause, LockRequested, ToolIntent, ToolRejected, default_codec
from arbiter.streams.cores.gateway import Accepted, ContentState, GatewayRules, check
from arbiter.streams.cores.leases import new_book, step

from .env import bench_arbiter, burst
from .leases import percentiles


def pure_check(seconds: float) -> None:
    """``gateway.check`` on a fenced, versioned write by the live holder (accepted)."""
    cause = Cause(topic="bench", partition=0, offset=0)
    book = new_book("account:1")
    step(book, LockRequested(request_id="r", agent_id="a", resource="account:1", mode="exclusive",
                             ttl_ms=3_600_000, at_ms=0), 0, cause)
    content = ContentState("account:1")
    rules = GatewayRules(policies=(("account:", "both"),))
    intent = ToolIntent(intent_id="i", agent_id="a", resource="account:1", token=1, base_version=0, tool="refund",
                        arguments_json='{"order_id": "o-1", "amount": 100}', at_ms=0)
    tools = frozenset({"refund"})
    assert isinstance(check(book, content, intent, 1, cause, rules, tools), Accepted)
    count, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        for _ in range(10_000):
            check(book, content, intent, 1, cause, rules, tools)
        count += 10_000
    print(f"pure gateway check (accepted write): {count / elapsed:>10,.0f} checks/s")


async def round_trip(rate: float, count: int) -> None:
    """An optimistic commit (document merge patch, SQLite ledger): sent until the outcome arrives."""
    import asyncio

    async with bench_arbiter() as settings, ArbiterClient("bench-agent", settings) as client:
        samples = []
        version = 0
        interval, next_at = 1.0 / rate, time.perf_counter()
        for i in range(count):
            started = time.perf_counter()
            outcome = await client.commit("doc:bench", version, {"n": i})
            samples.append((time.perf_counter() - started) * 1000)
            assert outcome.applied, outcome.diagnostic
            version = outcome.version or version + 1
            next_at += interval
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
        print(f"intent round trip (commit, SQLite ledger) at ~{rate:.0f}/s: {percentiles(samples)}")


async def check_throughput(total: int, **overrides: Any) -> float:
    """Gateway checks per second of one worker: a burst of intents the gate refuses (no tool runs)."""
    codec = default_codec()
    async with bench_arbiter(**overrides) as settings:
        run = uuid.uuid4().hex[:6]
        sent = now_ms()  # (within the id window: an old send time is refused request_expired)
        payloads = [(f"account:{run}-{i % 1000}".encode(), codec.encode(ToolIntent(
            intent_id=f"{run}-{i}", agent_id="zombie", resource=f"account:{run}-{i % 1000}", token=1,
            base_version=0, tool="refund", arguments_json='{"order_id": "o", "amount": 1}', at_ms=sent)))
            for i in range(total)]
        _produced, elapsed = await burst(settings, payloads, ToolRejected)
        print(f"gateway checks, one worker, burst of {total} intents: {total / elapsed:>8,.0f} checks/s")
    return total / elapsed
