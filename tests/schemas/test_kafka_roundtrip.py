"""Avro single-object events through the real broker."""

from __future__ import annotations

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from arbiter.edge.settings import Settings
from arbiter.schemas import Cause, Holder, LockGranted, LockQueued, Record, ToolIntent, default_codec

pytestmark = pytest.mark.kafka


def _events() -> list[Record]:
    cause = Cause(topic="arbiter.resource.commands", partition=0, offset=41)
    holder = Holder(agent_id="alpha", request_id="r1", token=7, mode="exclusive", expires_at_ms=30_000)
    return [
        LockGranted(request_id="r1", agent_id="alpha", resource="account:482", token=7, mode="exclusive",
                    expires_at_ms=30_000, holders=[holder], resource_version=3, at_ms=1, cause=cause),
        LockQueued(request_id="r2", agent_id="beta", resource="account:482", mode="shared", ttl_ms=5000,
                   position=1, priority=0,
                   wait_deadline_ms=60_000, blocking_agents=["alpha"], at_ms=2, cause=cause),
        ToolIntent(intent_id="i1", agent_id="alpha", resource="account:482", token=7, tool="refund",
                   arguments_json='{"amount": 120}', at_ms=3),
    ]


async def test_events_round_trip_through_kafka_in_key_order(kafka_settings: Settings) -> None:
    codec = default_codec()
    topic = kafka_settings.topics.resource_events
    producer = AIOKafkaProducer(bootstrap_servers=kafka_settings.bootstrap, acks="all")
    await producer.start()
    try:
        sent = _events()
        for record in sent:
            await producer.send_and_wait(topic, key=b"account:482", value=codec.encode(record))
        partition = await producer.partitions_for(topic)
    finally:
        await producer.stop()

    consumer = AIOKafkaConsumer(bootstrap_servers=kafka_settings.bootstrap, group_id=None,
                                auto_offset_reset="earliest", enable_auto_commit=False)
    await consumer.start()
    try:
        consumer.assign([TopicPartition(topic, p) for p in sorted(partition)])
        received: list[Record] = []
        while len(received) < len(sent):
            batch = await consumer.getmany(timeout_ms=10_000)
            assert batch, "timed out waiting for the events"
            for messages in batch.values():
                for message in messages:
                    assert message.key == b"account:482"
                    assert message.value[:2] == b"\xc3\x01"
                    received.append(codec.decode(message.value))
    finally:
        await consumer.stop()
    assert received == sent
