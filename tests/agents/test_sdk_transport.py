"""The SDK's Kafka transport against the real broker: one send, one inbox reader."""

from __future__ import annotations

import asyncio

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from arbiter.agents.identities import ensure_identity
from arbiter.agents.transport import KafkaTransport
from arbiter.edge.clock import now_ms
from arbiter.edge.settings import Settings
from arbiter.schemas import Cause, Pong, Record, default_codec
from arbiter.schemas.partitioning import partition_for

pytestmark = pytest.mark.kafka

AGENT = "triage-7"


def _pong(request_id: str) -> Pong:
    return Pong(request_id=request_id, agent_id=AGENT, worker_id="w1", at_ms=2,
                cause=Cause(topic="t", partition=0, offset=0))


def _neighbour(partitions: int) -> str:
    """Another agent id whose inbox shares this agent's partition."""
    mine = partition_for(AGENT.encode(), partitions)
    names = (f"other-{i}" for i in range(1000))
    return next(name for name in names if partition_for(name.encode(), partitions) == mine)


class Inbox:
    """An ``on_record`` callback that keeps what it is handed and says when ``expect`` arrived."""

    def __init__(self, expect: int) -> None:
        self.records: list[Record] = []
        self.expect = expect
        self.arrived = asyncio.Event()

    def __call__(self, record: Record) -> None:
        self.records.append(record)
        if len(self.records) >= self.expect:
            self.arrived.set()


async def test_the_inbox_reader_hands_on_only_this_agents_records_from_now_on(kafka_settings: Settings) -> None:
    codec = default_codec(kafka_settings.max_message_bytes)
    inbox = kafka_settings.topics.agent_inbox
    raw = AIOKafkaProducer(bootstrap_servers=kafka_settings.bootstrap, acks="all")
    await raw.start()
    inbox_seen = Inbox(expect=2)
    transport = KafkaTransport(AGENT, kafka_settings, codec, inbox_seen)
    try:
        partitions = len(await raw.partitions_for(inbox))
        assert partitions == 2
        # Sent before start: the reader starts at the end, so never sees it.
        await raw.send_and_wait(inbox, key=AGENT.encode(), value=codec.encode(_pong("before")))
        await transport.start()
        worker = await ensure_identity(kafka_settings, "worker", role="worker")

        async def from_worker(key: str, record: Pong) -> None:
            value = codec.encode(record)
            await raw.send_and_wait(inbox, key=key.encode(), value=value,
                                    headers=worker.sign(inbox, key.encode(), value, now_ms()))

        await from_worker(_neighbour(partitions), _pong("not-mine"))
        await raw.send_and_wait(inbox, key=AGENT.encode(), value=b"not avro at all")
        await transport.send(inbox, AGENT, _pong("forged"))  # signed, but by an agent: never handed on
        await from_worker(AGENT, _pong("first"))
        await from_worker(AGENT, _pong("second"))
        await asyncio.wait_for(inbox_seen.arrived.wait(), 20)
        await asyncio.sleep(0.3)  # anything wrongly handed on would show up by now
    finally:
        await transport.close()
        await raw.stop()
    assert [record.request_id for record in inbox_seen.records if isinstance(record, Pong)] == ["first", "second"]
    assert len(inbox_seen.records) == 2
    assert transport.forged == 1


async def test_send_lands_on_the_partition_of_its_key(kafka_settings: Settings) -> None:
    codec = default_codec(kafka_settings.max_message_bytes)
    topic = kafka_settings.topics.resource_commands
    transport = KafkaTransport(AGENT, kafka_settings, codec, lambda record: None)
    await transport.start()
    try:
        for key in ("ticket:cust_8492", "account:482", "saga:refund:1"):
            await transport.send(topic, key, _pong(key))
    finally:
        await transport.close()
    consumer = AIOKafkaConsumer(bootstrap_servers=kafka_settings.bootstrap, group_id=None,
                                auto_offset_reset="earliest", enable_auto_commit=False)
    await consumer.start()
    try:
        consumer.assign([TopicPartition(topic, p) for p in range(2)])
        seen: dict[str, int] = {}
        async with asyncio.timeout(20):
            while len(seen) < 3:
                for tp, messages in (await consumer.getmany(timeout_ms=1000)).items():
                    for message in messages:
                        seen[message.key.decode()] = tp.partition
    finally:
        await consumer.stop()
    assert seen == {key: partition_for(key.encode(), 2) for key in seen}


async def test_send_before_start_says_how_to_start(kafka_settings: Settings) -> None:
    transport = KafkaTransport(AGENT, kafka_settings, default_codec(), lambda record: None)
    with pytest.raises(RuntimeError, match="async with ArbiterClient"):
        await transport.send(kafka_settings.topics.resource_commands, "k", _pong("x"))
    await transport.close()  # closing what never started is harmless
