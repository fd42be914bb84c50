"""The runtime, measured: faust's stream path against the batched runtime, Kafka messages per grant,
and how one and two workers share a burst.

``python -m bench runtime``: the two runtimes side by side under both processing guarantees, in one
run, interleaved (``--reps`` rounds): burst grants/s, burst gateway checks/s, uncontended grant
latency and hand-off latency.
``python -m bench messages``: Kafka messages written per uncontended grant, per release, and per
hand-off with 1, 4 and 16 waiters queued, by topic (changelogs included).
``python -m bench scaling``: a burst decided by one worker, then by two, on 8 partitions.
``python -m bench floor``: one Kafka hop without Arbiter (produce, acks=all, until consumed).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from arbiter.agents import ArbiterClient, Lease
from arbiter.edge.kafkaauth import kafka_client_options
from arbiter.edge.settings import Settings, load_settings
from arbiter.streams.runtime.common import TABLES

from .env import bench_arbiter
from .gateway import check_throughput
from .leases import grant_latency, grant_throughput, handoff_latency

CASES = [("faust", "at_least_once"), ("batch", "at_least_once"), ("faust", "exactly_once"),
         ("batch", "exactly_once")]


def _load() -> str:
    return f"load {os.getloadavg()[0]:.1f}"


async def side_by_side(burst: int, count: int, reps: int) -> None:
    """Each figure for each (runtime, guarantee), ``reps`` interleaved rounds; medians."""
    figures: dict[tuple[str, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for rep in range(reps):
        for runtime, guarantee in CASES:
            case: dict[str, Any] = {"runtime": runtime, "processing_guarantee": guarantee}
            print(f"-- round {rep + 1}/{reps}: {runtime}, {guarantee} ({_load()})", flush=True)
            row = figures[(runtime, guarantee)]
            row["grants/s"].append(await grant_throughput(burst, **case))
            row["checks/s"].append(await check_throughput(burst, **case))
            latency = await grant_latency(100.0, count, **case)
            row["grant p50"].append(statistics.median(latency))
            row["grant p99"].append(statistics.quantiles(latency, n=100, method="inclusive")[98])
            handoff = await handoff_latency(max(20, count // 3), **case)
            row["handoff p50"].append(statistics.median(handoff))
    print(f"\nruntimes side by side, medians of {reps} round{'s' if reps > 1 else ''} "
          f"(burst {burst:,}, latency n={count}), {_load()} at the end:")
    print("| runtime | guarantee | burst grants/s | burst gateway checks/s | grant p50 / p99 ms | hand-off p50 ms |")
    print("|---|---|---|---|---|---|")
    for (runtime, guarantee), row in figures.items():
        med = {name: statistics.median(values) for name, values in row.items()}
        print(f"| {runtime} | {guarantee} | {med['grants/s']:,.0f} | {med['checks/s']:,.0f} | "
              f"{med['grant p50']:.1f} / {med['grant p99']:.1f} | {med['handoff p50']:.1f} |")


async def _offsets(settings: Settings, consumer: AIOKafkaConsumer) -> dict[str, int]:
    """The end offset of every topic (summed over partitions), changelogs included."""
    names = [*settings.topics.all(), *(spec.changelog(settings.app_id) for spec in TABLES.values())]
    tps = [TopicPartition(name, p) for name in names for p in range(settings.partitions)]
    ends = await consumer.end_offsets(tps)
    out: dict[str, int] = defaultdict(int)
    for tp, end in ends.items():
        out[tp.topic] += end
    return out


async def _count(settings: Settings, consumer: AIOKafkaConsumer, label: str, times: int,
                 work: Callable[[], Awaitable[None]]) -> float:
    """Messages written per ``work`` (run ``times`` times), by topic; printed, and the total returned."""
    before = await _offsets(settings, consumer)
    for _ in range(times):
        await work()
    await asyncio.sleep(1.0)  # the deadlock processor's changelog follows the edges it reads
    after = await _offsets(settings, consumer)
    delta = {topic.removeprefix(settings.app_id + "."): (after[topic] - before[topic]) / times
             for topic in after if after[topic] != before[topic]}
    total = sum(delta.values())
    parts = ", ".join(f"{topic.removeprefix(settings.app_id + '-')} {n:.2f}" for topic, n in sorted(delta.items()))
    print(f"{label}: {total:.2f} messages ({parts})")
    return total


async def messages(count: int) -> None:
    """Kafka messages per uncontended grant, per release, and per hand-off as the queue grows."""
    # Ticks off (one a minute): they are the clock, not the cost of a grant.
    async with bench_arbiter(tick_interval_ms=60_000) as settings, ArbiterClient("counter", settings) as client:
        consumer = AIOKafkaConsumer(bootstrap_servers=settings.bootstrap, group_id=None,
                                    **kafka_client_options(settings))
        await consumer.start()
        try:
            names = iter(range(1_000_000))
            leases = []

            async def grant() -> None:
                leases.append(await client.acquire(f"count:{next(names)}", ttl=60, wait=0))

            async def release() -> None:
                await client.release(leases.pop())

            await _count(settings, consumer, f"uncontended grant (n={count})", count, grant)
            await _count(settings, consumer, f"release, nobody waiting (n={count})", count, release)
            for waiters in (1, 4, 16):
                await _handoffs(settings, consumer, waiters, max(10, count // 10))
        finally:
            await consumer.stop()


async def _handoffs(settings: Settings, consumer: AIOKafkaConsumer, waiters: int, rounds: int) -> None:
    """Hand-offs on one resource with ``waiters`` queued: each round, the holder releases and queues again."""
    name = f"handoff-count:{waiters}:{time.time_ns()}"
    clients = [ArbiterClient(f"queue-{waiters}-{i}", settings) for i in range(waiters + 1)]
    for client in clients:
        await client.__aenter__()
    try:
        holder: tuple[ArbiterClient, Lease] = (clients[0], await clients[0].acquire(name, ttl=120, wait=0))
        queue = [(c, asyncio.create_task(c.acquire(name, ttl=120, wait=120))) for c in clients[1:]]
        await asyncio.sleep(1.0)  # everyone queued

        async def handoff() -> None:
            # The holder releases, the head waiter is granted, the releaser queues again at the tail.
            nonlocal holder
            releaser, lease = holder
            head, granted = queue.pop(0)
            await releaser.release(lease)
            holder = (head, await granted)
            queue.append((releaser, asyncio.create_task(releaser.acquire(name, ttl=120, wait=120))))
            await asyncio.sleep(0.05)  # the releaser is queued before the next round

        label = f"hand-off with {waiters} waiting, and the releaser queuing again (n={rounds})"
        await _count(settings, consumer, label, rounds, handoff)
        await holder[0].release(holder[1])
        for _client, task in queue:
            task.cancel()
    finally:
        for client in clients:
            await client.__aexit__(None, None, None)


async def scaling(burst: int) -> None:
    """The same burst on 8 partitions, decided by one worker, then by two (then one again)."""
    results: dict[int, list[float]] = defaultdict(list)
    for workers in (1, 2, 1, 2):
        results[workers].append(await grant_throughput(burst, workers=workers, partitions=8))
    for workers, rates in sorted(results.items()):
        print(f"scaling: {workers} worker{'s' if workers > 1 else ''} on 8 partitions: "
              f"{', '.join(f'{r:,.0f}' for r in rates)} grants/s ({_load()})")


async def floor_samples(settings: Settings, count: int, pause: float = 0.01) -> tuple[list[float], list[float]]:
    """The least a Kafka hop costs here, without Arbiter, in ms per sample: one record produced
    (acks=all) until acknowledged, and until a consumer parked on the partition has it. On a topic of
    its own, deleted at the end."""
    topic = f"bench-floor-{time.time_ns()}"
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.bootstrap, **kafka_client_options(settings))
    await admin.start()
    producer = AIOKafkaProducer(bootstrap_servers=settings.bootstrap, acks="all", linger_ms=0,
                                **kafka_client_options(settings))
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.bootstrap, group_id=None,
                                fetch_max_wait_ms=settings.fetch_max_wait_ms, **kafka_client_options(settings))
    try:
        await admin.create_topics([NewTopic(topic, 1, settings.replication_factor)])
        await producer.start()
        await consumer.start()
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        await consumer.seek_to_end(tp)
        await consumer.position(tp)
        acked, seen = [], []
        for _ in range(count):
            started = time.perf_counter()
            await producer.send_and_wait(topic, b"x" * 200, partition=0)
            acked.append((time.perf_counter() - started) * 1000)
            while not await consumer.getmany(tp, timeout_ms=1000):
                pass
            seen.append((time.perf_counter() - started) * 1000)
            await asyncio.sleep(pause)
    finally:
        await producer.stop()
        await consumer.stop()
        with contextlib.suppress(Exception):
            await admin.delete_topics([topic])
        await admin.close()
    return acked, seen


async def kafka_floor(count: int) -> None:
    """The least a Kafka hop costs here, without Arbiter. A grant is two such hops."""
    acked, seen = await floor_samples(load_settings(), count)
    print(f"kafka floor, one hop without Arbiter (n={count}): produced and acknowledged p50 "
          f"{statistics.median(acked):.2f} ms; produced until consumed p50 {statistics.median(seen):.2f} ms, "
          f"p99 {statistics.quantiles(seen, n=100, method='inclusive')[98]:.2f} ms")
