"""Reading Arbiter's log back: the raw material of ``lock status``, audit and replay."""

from __future__ import annotations

from collections.abc import AsyncIterator

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.partitioner import DefaultPartitioner

from contract import ContractError, Record, default_codec
from contract.settings import Settings
from cores.leases import LOCK_EVENTS, LeaseBook, evolve, new_book


def partition_for(key: bytes, partitions: int) -> int:
    """The partition the default partitioner gives ``key``."""
    parts = list(range(partitions))
    return int(DefaultPartitioner()(key, parts, parts))


async def read_partition(settings: Settings, topic: str, partition: int) -> AsyncIterator[tuple[int, bytes | None,
                                                                                               Record]]:
    """Every decodable message of one partition, from the beginning to the current end.

    Read-only: no consumer group, nothing committed. Messages that do not decode are
    skipped here (the processors dead-letter them).
    """
    codec = default_codec(settings.max_message_bytes)
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.bootstrap, group_id=None, enable_auto_commit=False,
                                auto_offset_reset="earliest", isolation_level="read_committed")
    await consumer.start()
    try:
        tp = TopicPartition(topic, partition)
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        end = (await consumer.end_offsets([tp]))[tp]
        while await consumer.position(tp) < end:
            batch = await consumer.getmany(tp, timeout_ms=5000)
            for message in batch.get(tp, []):
                if message.offset >= end:
                    return
                try:
                    record: Record = codec.decode(message.value)
                except ContractError:
                    continue
                yield message.offset, message.key, record
    finally:
        await consumer.stop()


async def lease_book(settings: Settings, resource: str) -> LeaseBook:
    """A resource's lease book, folded from its decisions on the resource-event topic."""
    book = new_book(resource)
    key = resource.encode()
    partition = partition_for(key, settings.partitions)
    async for _offset, msg_key, record in read_partition(settings, settings.topics.resource_events, partition):
        if msg_key == key and isinstance(record, LOCK_EVENTS):
            evolve(book, record)
    return book
