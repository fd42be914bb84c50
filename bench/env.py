"""A throwaway Arbiter for one benchmark: own topics, own consumer group, N workers."""

from __future__ import annotations

import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from arbiter.agents import ArbiterClient
from arbiter.edge.clock import now_ms
from arbiter.edge.keys import signer_for
from arbiter.edge.settings import Settings, Topics, load_settings
from arbiter.processes import WorkerPool, wait_until_served
from arbiter.schemas import Record, default_codec
from arbiter.schemas.identity import ROLE_WORKER, Signer
from arbiter.schemas.partitioning import partition_for
from arbiter.streams.runtime.topics import ensure_topics


def key_for_partition(partition: int, partitions: int, prefix: str = "bench:") -> str:
    """A message key that Kafka's default partitioner sends to ``partition``."""
    for i in range(100_000):
        if partition_for(f"{prefix}{i}".encode(), partitions) == partition:
            return f"{prefix}{i}"
    raise RuntimeError(f"no key found for partition {partition}")


@asynccontextmanager
async def bench_arbiter(workers: int = 1, **overrides: Any) -> AsyncIterator[Settings]:
    """Topics created, ``workers`` workers started and serving every partition."""
    async with bench_workers(workers, **overrides) as (settings, _):
        yield settings


@asynccontextmanager
async def bench_workers(workers: int = 1, **overrides: Any) -> AsyncIterator[tuple[Settings, WorkerPool]]:
    """``bench_arbiter``, with the worker processes (to read their CPU time)."""
    run = f"bench{time.time_ns() // 1_000_000}"
    base = load_settings()
    runtime = overrides.pop("runtime", "batch")  # "faust": the baseline in bench/faust, not the product
    with tempfile.TemporaryDirectory() as home:
        settings = Settings(**{
            "bootstrap": base.bootstrap, "home": Path(home), "app_id": run,
            "topics": Topics(**{n: f"{run}.{n}" for n in Topics.model_fields}),
            "auto_enroll": True,  # the bench's own home issues its clients' keys on first use
            **overrides,
        })
        await ensure_topics(settings)
        pool = WorkerPool(settings)
        if runtime == "faust":
            pool.command = ("-m", "bench.faust")
        pool.start(workers, loglevel="warning")
        try:
            keys = [key_for_partition(p, settings.partitions) for p in range(settings.partitions)]
            async with ArbiterClient("bench-warmup", settings) as client:
                await wait_until_served(client, pool, keys)
            yield settings, pool
            pool.check_alive()
        finally:
            pool.stop()


def raw_signer(settings: Settings) -> Signer:
    """What signs the benchmarks' raw payloads (commands of many made-up agents, edges of the lease
    book): the workers' identity, which may send anything, so every payload passes the trust gate
    and costs the workers exactly the verification a signed agent command costs."""
    return signer_for(settings.home, ROLE_WORKER)


async def burst(settings: Settings, payloads: list[tuple[bytes, bytes]], decided: type[Record]) -> tuple[float, float]:
    """Produce ``payloads`` to the command topic as fast as possible; wait until as many
    ``decided`` events are on the event topic. Returns (seconds to produce, seconds in all)."""
    codec = default_codec()
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.bootstrap, group_id=None, enable_auto_commit=False)
    await consumer.start()
    producer = AIOKafkaProducer(bootstrap_servers=settings.bootstrap, linger_ms=5, max_batch_size=256 * 1024)
    await producer.start()
    try:
        tps = [TopicPartition(settings.topics.resource_events, p) for p in range(settings.partitions)]
        consumer.assign(tps)
        await consumer.seek_to_end(*tps)
        for tp in tps:
            await consumer.position(tp)
        topic = settings.topics.resource_commands
        signed = [(key, value, raw_signer(settings).sign(topic, key, value, now_ms())) for key, value in payloads]
        started = time.perf_counter()
        for key, value, headers in signed:
            await producer.send(topic, key=key, value=value, headers=headers)
        await producer.flush()
        produced = time.perf_counter() - started
        seen = 0
        while seen < len(payloads):
            for messages in (await consumer.getmany(timeout_ms=10_000)).values():
                seen += sum(1 for m in messages if isinstance(codec.decode(m.value), decided))
        return produced, time.perf_counter() - started
    finally:
        await producer.stop()
        await consumer.stop()
