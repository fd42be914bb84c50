"""Kafka 3.9 for older clusters: a smoke subset of the suite against a 3.9.1 broker of its own, and the
local broker's data carried from 3.9.1 to the current release in place (never back).

The suite runs against the current 4.x release (``ARBITER_KAFKA_VERSION``, 4.4.0). The tests imported
below run again here, in this module, where ``bootstrap`` names a 3.9.1 broker started on free ports:
the seed stories under exactly_once (transactions and their markers, the audit), the gateway's fencing
and a worker killed between its tool and its commit, leases under load, and a failover.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from arbiter.edge.settings import Settings
from arbiter.kafka import LocalKafka, LocalKafkaError
from arbiter.streams.runtime.topics import ensure_topics
from tests.kafka.test_localkafka import free_port
from tests.streams.runtime.test_exactly_once import run  # noqa: F401  (the fixture, on this module's broker)
from tests.streams.runtime.test_exactly_once import (
    test_the_decisions_are_written_in_the_transactions as test_39_transactions,
)
from tests.streams.runtime.test_exactly_once import test_the_log_passes_audit as test_39_exactly_once_audit
from tests.streams.runtime.test_failover import test_sigkill_while_holding_leases_continues_tokens as test_39_failover
from tests.streams.shells.test_gateway_kafka import clients, gateway, module_tmp  # noqa: F401
from tests.streams.shells.test_gateway_kafka import (
    test_both_seed_zombies_are_rejected_and_the_live_holder_writes as test_39_zombies,
)
from tests.streams.shells.test_gateway_kafka import (
    test_killed_between_tool_and_offset_commit_the_tool_runs_once as test_39_tool_once,
)
from tests.streams.shells.test_leases_kafka import test_mutual_exclusion_under_load as test_39_mutual_exclusion

pytestmark = [pytest.mark.kafka, pytest.mark.e2e]

OLDER = "3.9.1"

__all__ = ["test_39_exactly_once_audit", "test_39_failover", "test_39_mutual_exclusion", "test_39_tool_once",
           "test_39_transactions", "test_39_zombies"]


def _settings(home: Path, version: str) -> Settings:
    port = free_port()
    return Settings(home=home, kafka_port=port, kafka_controller_port=free_port(), bootstrap=f"127.0.0.1:{port}",
                    partitions=2, kafka_heap="384m", kafka_version=version)


@pytest.fixture(scope="module")
def bootstrap(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Kafka 3.9.1 broker of this module's own, for the tests imported above."""
    broker = LocalKafka(_settings(tmp_path_factory.mktemp("kafka39") / "home", OLDER))
    broker.up()
    try:
        yield broker.bootstrap
    finally:
        broker.down()


async def _produce(settings: Settings, value: bytes) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=settings.bootstrap, acks="all")
    await producer.start()
    try:
        await producer.send_and_wait(settings.topics.resource_events, key=b"k", value=value, partition=0)
    finally:
        await producer.stop()


async def _first(settings: Settings) -> bytes | None:
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.bootstrap, group_id=None, auto_offset_reset="earliest")
    await consumer.start()
    try:
        tp = TopicPartition(settings.topics.resource_events, 0)
        consumer.assign([tp])
        batch = await consumer.getmany(tp, timeout_ms=10_000, max_records=1)
        return next((m.value for m in batch.get(tp, [])), None)
    finally:
        await consumer.stop()


def test_data_written_by_39_is_kept_by_the_current_release_and_never_goes_back(tmp_path: Path) -> None:
    home = tmp_path / "home"
    older = _settings(home, OLDER)
    broker = LocalKafka(older)
    broker.up()
    try:
        asyncio.run(ensure_topics(older))
        asyncio.run(_produce(older, b"written by 3.9.1"))
    finally:
        broker.down()
    current = older.model_copy(update={"kafka_version": Settings().kafka_version})
    said: list[str] = []
    upgraded = LocalKafka(current, say=said.append)
    upgraded.up()
    try:
        assert asyncio.run(_first(current)) == b"written by 3.9.1"
        assert any(f"from {OLDER} to {current.kafka_version}" in line for line in said), said
    finally:
        upgraded.down()
    with pytest.raises(LocalKafkaError, match=f"ARBITER_KAFKA_VERSION={current.kafka_version}"):
        LocalKafka(older).up()
    assert LocalKafka(older).pid() is None
