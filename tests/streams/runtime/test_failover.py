"""A worker killed with SIGKILL while it holds leases: the survivor continues every token."""

from __future__ import annotations

import time

import pytest

from arbiter.agents import ArbiterClient, ArbiterTimeout, LeaseDenied
from arbiter.edge.settings import Settings
from arbiter.processes import WorkerPool
from arbiter.schemas import LockReleased
from arbiter.schemas.partitioning import key_for_partition

pytestmark = pytest.mark.kafka


async def owners(client: ArbiterClient, keys: list[str]) -> dict[int, str]:
    found: dict[int, str] = {}
    for key in keys:
        try:
            result = await client.ping(key, timeout=2)
        except ArbiterTimeout:
            continue
        found[result.partition] = result.worker_id
    return found


async def test_sigkill_while_holding_leases_continues_tokens(kafka_settings: Settings, workers: WorkerPool) -> None:
    workers.start(2)
    parts = kafka_settings.partitions
    keys = [key_for_partition(p, parts) for p in range(parts)]
    resources = [key_for_partition(p, parts, prefix=f"account:{i}-") for p in range(parts) for i in range(2)]

    async with ArbiterClient("holder", kafka_settings) as holder, ArbiterClient("rival", kafka_settings) as rival:
        deadline = time.monotonic() + 90
        while len(set((current := await owners(holder, keys)).values())) < 2 or len(current) < parts:
            workers.check_alive()
            assert time.monotonic() < deadline, f"workers never split the partitions: {current}"

        tokens = {}
        for name in resources:
            for _ in range(3):  # push every token past 1, so "continues" means something
                lease = await holder.acquire(name, ttl=120, wait=0)
                await holder.release(lease)
            tokens[name] = (await holder.acquire(name, ttl=120, wait=0)).token
            assert tokens[name] == 4

        victim_name = current[0]
        victim = next(w for w in workers.workers if w.name == victim_name)
        victim.kill()

        deadline = time.monotonic() + 90
        while set((after := await owners(holder, keys)).values()) != {n for n in current.values() if n != victim_name} \
                or len(after) < parts:
            assert time.monotonic() < deadline, f"the survivor never took over: {after}"

        for name in resources:
            with pytest.raises(LeaseDenied) as busy:  # the holder's lease survived the crash
                await rival.acquire(name, ttl=10, wait=0)
            assert busy.value.reason == "busy"
            released = await holder.release_token(name, tokens[name])
            assert isinstance(released, LockReleased), f"{name}: the recovered book lost the holder"
            fresh = await rival.acquire(name, ttl=10, wait=0)
            assert fresh.token == tokens[name] + 1, f"{name}: token reused or skipped after failover"
