"""A throwaway Arbiter for one benchmark: own topics, own consumer group, N workers."""

from __future__ import annotations

import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from agents import ArbiterClient
from arbiter.demo import key_for_partition
from arbiter.processes import WorkerPool, wait_until_served
from arbiter.settings import Settings, Topics, load_settings
from arbiter.topics import ensure_topics


@asynccontextmanager
async def bench_arbiter(workers: int = 1, **overrides: Any) -> AsyncIterator[Settings]:
    """Topics created, ``workers`` workers started and serving every partition."""
    run = f"bench{time.time_ns() // 1_000_000}"
    base = load_settings()
    with tempfile.TemporaryDirectory() as home:
        settings = Settings(**{
            "bootstrap": base.bootstrap, "home": Path(home), "app_id": run,
            "topics": Topics(**{n: f"{run}.{n}" for n in Topics.model_fields}), **overrides,
        })
        await ensure_topics(settings)
        pool = WorkerPool(settings)
        pool.start(workers, loglevel="warning")
        try:
            keys = [key_for_partition(p, settings.partitions) for p in range(settings.partitions)]
            async with ArbiterClient("bench-warmup", settings) as client:
                await wait_until_served(client, pool, keys)
            yield settings
            pool.check_alive()
        finally:
            pool.stop()
