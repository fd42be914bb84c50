"""Idle costs nothing: a worker writes a clock tick only when a deadline it holds is due.

A lease of two seconds still expires on time (a tick is written for it); then, with nothing
waiting on time, a worker writes no record at all to any topic: here for 15 s on the real broker
(its clients' own timers run in that time: metadata, heartbeats, commits), and for an hour of
virtual time on the simulation (tests/sim/test_sim_worker.py::test_an_idle_worker_writes_nothing_for_an_hour).
"""

from __future__ import annotations

import asyncio
import time

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from arbiter.agents import ArbiterClient
from arbiter.edge.kafkaauth import kafka_client_options
from arbiter.edge.settings import Settings
from arbiter.processes import WorkerPool
from arbiter.schemas import LockExpired
from arbiter.streams.runtime.common import TABLES
from tests.streams.shells.test_trust_kafka import read_topic

pytestmark = pytest.mark.kafka

IDLE_S = 15.0


async def _written(settings: Settings) -> int:
    """Every record ever written to the run's topics and changelogs (the sum of their end offsets)."""
    names = [*settings.topics.all(), *(spec.changelog(settings.app_id) for spec in TABLES.values())]
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.bootstrap, group_id=None, **kafka_client_options(settings))
    await consumer.start()
    try:
        tps = [TopicPartition(n, p) for n in names for p in range(settings.partitions)]
        return sum((await consumer.end_offsets(tps)).values())
    finally:
        await consumer.stop()


async def test_a_lease_still_expires_on_time_and_an_idle_worker_writes_nothing(kafka_settings: Settings,
                                                                               worker: WorkerPool) -> None:
    settings = kafka_settings
    async with ArbiterClient("sleepy", settings) as sleepy:
        lease = await sleepy.acquire("doc:nap", ttl=2, wait=5)
        granted = time.monotonic()
        seen = await read_topic(settings, settings.topics.resource_events, until=lambda s: any(
            isinstance(m.record, LockExpired) and m.record.token == lease.token for m in s))
        expired_after = time.monotonic() - granted
    (expiry,) = [m.record for m in seen if isinstance(m.record, LockExpired)]
    assert expiry.at_ms - lease.expires_at_ms < 1_000, "the expiry was decided late"
    assert expired_after < 2.0 + 2.0, f"the lease was seen expired {expired_after:.1f} s after its grant"
    await asyncio.sleep(2.0)  # the expiry's own changelog and inbox copies are written
    before = await _written(settings)
    await asyncio.sleep(IDLE_S)
    after = await _written(settings)
    worker.check_alive()
    assert after == before, f"an idle worker wrote {after - before} records in {IDLE_S:.0f} s"
