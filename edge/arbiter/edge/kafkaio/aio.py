"""The Kafka seam on aiokafka (pure Python, on the event loop).

Kept behind the seam for users who cannot load librdkafka and as the contract suite's second
implementation; librdkafka took ~3.5x less latency and ~5x less CPU a round trip here.

aiokafka's ``assign`` replaces a whole assignment and forgets its positions, so a partition is
assigned once and then paused while no one reads it: ``add`` seeks it and resumes it, ``drop``
pauses it, both synchronous. Every partition of a topic is assigned at its first ``add``, so
the metadata asked for is that topic's alone.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError

from ..kafkaauth import kafka_client_options
from ..kafkaconn import close_client
from ..settings import Settings
from . import METADATA_TIMEOUT_S, Fetch, Headers, KafkaIOError, Positions, Received
from . import TopicPartition as Partition


def io_error(exc: KafkaError, what: str) -> KafkaIOError:
    """An aiokafka error as the seam's."""
    return KafkaIOError(f"{what}: {type(exc).__name__}: {exc}", retriable=bool(exc.retriable))


class AioSender:
    """Sends through one ``AIOKafkaProducer``."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.producer: AIOKafkaProducer | None = None

    async def start(self) -> None:
        settings = self.settings
        # A front door sends for a thousand agents through this one producer: a batch as large as a
        # request (not aiokafka's 16 KiB) keeps a burst from queueing sends behind full batches.
        producer = AIOKafkaProducer(bootstrap_servers=settings.bootstrap, acks="all", linger_ms=0,
                                    max_request_size=2 * settings.max_message_bytes,
                                    max_batch_size=2 * settings.max_message_bytes,
                                    **kafka_client_options(settings))
        try:
            await producer.start()
        except KafkaError as exc:
            await close_client(producer)
            raise io_error(exc, f"Kafka at {settings.bootstrap}") from exc
        self.producer = producer

    async def stop(self) -> None:
        producer, self.producer = self.producer, None
        if producer is not None:
            await close_client(producer)

    async def partitions(self, topic: str) -> int:
        if self.producer is None:
            raise KafkaIOError("the sender is not started", retriable=False)
        try:
            async with asyncio.timeout(METADATA_TIMEOUT_S):  # (aiokafka waits as long as the topic is unknown)
                found = await self.producer.partitions_for(topic)
        except KafkaError as exc:
            raise io_error(exc, f"reading {topic}'s metadata") from exc
        except TimeoutError:
            raise KafkaIOError(f"topic {topic!r}: no metadata within {METADATA_TIMEOUT_S:g} s (no such topic, "
                               "or no broker answers)", retriable=True) from None
        return len(found)

    async def send(self, topic: str, key: bytes, value: bytes, headers: Headers | None) -> None:
        if self.producer is None:
            raise KafkaIOError("the sender is not started", retriable=False)
        try:
            await self.producer.send_and_wait(topic, key=key, value=value, headers=headers)
        except KafkaError as exc:
            raise io_error(exc, f"Kafka did not take a record for {topic}") from exc

    async def append(self, topic: str, key: bytes | None, value: bytes, headers: Headers | None,
                     partition: int | None = None) -> tuple[int, int]:
        if self.producer is None:
            raise KafkaIOError("the sender is not started", retriable=False)
        try:
            meta = await self.producer.send_and_wait(topic, key=key, value=value, headers=headers,
                                                     partition=partition)
        except KafkaError as exc:
            raise io_error(exc, f"Kafka did not take a record for {topic}") from exc
        return int(meta.partition), int(meta.offset)


class AioReader:
    """Reads through one ``AIOKafkaConsumer`` without a group."""

    def __init__(self, settings: Settings, fetch: Fetch | None = None) -> None:
        self.settings = settings
        self.fetch = fetch or Fetch()
        self.consumer: AIOKafkaConsumer | None = None
        self._admin: AIOKafkaAdminClient | None = None
        """For ``committed`` alone (a consumer without a group cannot ask a group's offsets)."""
        self._positions = Positions()
        self._topics: dict[str, int] = {}

    async def start(self) -> None:
        settings = self.settings
        fetch = self.fetch
        options: dict[str, Any] = {}
        if fetch.min_bytes:
            options["fetch_min_bytes"] = fetch.min_bytes
        if fetch.max_partition_bytes:
            options["max_partition_fetch_bytes"] = fetch.max_partition_bytes
        consumer = AIOKafkaConsumer(bootstrap_servers=settings.bootstrap, enable_auto_commit=False,
                                    fetch_max_wait_ms=fetch.max_wait_ms or 50, group_id=None,
                                    isolation_level=fetch.isolation_level, auto_offset_reset="earliest",
                                    **options, **kafka_client_options(settings))
        try:
            await consumer.start()
        except KafkaError as exc:
            await close_client(consumer)
            raise io_error(exc, f"Kafka at {settings.bootstrap}") from exc
        self.consumer = consumer

    async def stop(self) -> None:
        consumer, self.consumer = self.consumer, None
        admin, self._admin = self._admin, None
        for client in (admin, consumer):
            if client is not None:
                await close_client(client)

    async def end_offset(self, topic: str, partition: int) -> int:
        consumer = self._started()
        tp = TopicPartition(topic, partition)
        try:
            end = int((await consumer.end_offsets([tp]))[tp])
            if topic not in self._topics:  # (so that ``add`` can assign the whole topic at once)
                found = consumer.partitions_for_topic(topic)  # known: asking for the end fetched the topic's metadata
                if not found:
                    raise KafkaIOError(f"no metadata for {topic} after reading its end", retriable=True)
                self._topics[topic] = len(found)
            return end
        except KafkaError as exc:
            raise io_error(exc, f"reading the end of {topic}[{partition}]") from exc

    async def offsets(self, topic: str, partition: int) -> tuple[int, int]:
        consumer = self._started()
        tp = TopicPartition(topic, partition)
        end = await self.end_offset(topic, partition)
        try:
            return int((await consumer.beginning_offsets([tp]))[tp]), end
        except KafkaError as exc:
            raise io_error(exc, f"reading the start of {topic}[{partition}]") from exc

    async def partitions(self, topic: str) -> int | None:
        consumer = self._started()
        try:
            async with asyncio.timeout(METADATA_TIMEOUT_S):  # (fresh metadata of every topic: the consumer's
                cluster = await consumer._client.fetch_all_metadata()  # own cache holds only what it reads)
        except KafkaError as exc:
            raise io_error(exc, f"reading {topic}'s metadata") from exc
        except TimeoutError:
            raise KafkaIOError(f"no metadata within {METADATA_TIMEOUT_S:g} s: no broker answers",
                               retriable=True) from None
        found = cluster.partitions_for_topic(topic)
        if not found:
            return None
        self._topics.setdefault(topic, len(found))
        return len(found)

    async def committed(self, group: str, partitions: list[Partition]) -> dict[Partition, int]:
        self._started()
        try:
            async with asyncio.timeout(METADATA_TIMEOUT_S):
                if self._admin is None:
                    admin = AIOKafkaAdminClient(bootstrap_servers=self.settings.bootstrap,
                                                **kafka_client_options(self.settings))
                    try:
                        await admin.start()
                    except BaseException:
                        await close_client(admin)
                        raise
                    self._admin = admin
                found = await self._admin.list_consumer_group_offsets(
                    group, partitions=[TopicPartition(t, p) for t, p in partitions])
        except KafkaError as exc:
            raise io_error(exc, f"reading the offsets group {group} committed") from exc
        except TimeoutError:
            raise KafkaIOError(f"the offsets group {group} committed: no answer within {METADATA_TIMEOUT_S:g} s",
                               retriable=True) from None
        return {Partition(tp.topic, tp.partition): int(meta.offset) for tp, meta in found.items()
                if meta.offset >= 0}  # (-1: none committed)

    async def position(self, topic: str, partition: int) -> int:
        consumer = self._started()
        handed = self._positions.next.get((topic, partition))
        if handed is None:
            raise KafkaIOError(f"{topic}[{partition}] is not read", retriable=False)
        try:
            return max(handed, int(await consumer.position(TopicPartition(topic, partition))))
        except KafkaError as exc:
            raise io_error(exc, f"reading the position of {topic}[{partition}]") from exc

    def _started(self) -> AIOKafkaConsumer:
        if self.consumer is None:
            raise KafkaIOError("the reader is not started", retriable=False)
        return self.consumer

    def add(self, topic: str, partition: int, offset: int) -> None:
        consumer = self._started()
        if not self._positions.add(topic, partition, offset):
            return
        tp = TopicPartition(topic, partition)
        assigned = set(consumer.assignment())
        if tp not in assigned:
            count = self._topics.get(topic, partition + 1)
            every = assigned | {TopicPartition(topic, p) for p in range(max(count, partition + 1))}
            consumer.assign(list(every))
            for other in every:  # (``assign`` forgot every position: each read one goes back to its own)
                position = self._positions.next.get((other.topic, other.partition))
                if position is None:
                    consumer.pause(other)
                else:
                    consumer.seek(other, position)
            return
        consumer.seek(tp, offset)
        consumer.resume(tp)

    def drop(self, topic: str, partition: int) -> None:
        consumer = self._started()
        if self._positions.drop(topic, partition):
            consumer.pause(TopicPartition(topic, partition))

    def reading(self) -> set[tuple[str, int]]:
        return set(self._positions.next)

    async def read(self, timeout: float) -> list[Received]:
        consumer = self._started()
        if not self._positions.next:
            await asyncio.sleep(timeout)  # (getmany with nothing assigned would not wait)
            return []
        try:
            batches: dict[Any, list[Any]] = await consumer.getmany(timeout_ms=int(timeout * 1000))
        except KafkaError as exc:  # (no access, say: aiokafka retries what passes by itself)
            raise io_error(exc, "reading records") from exc
        admit = self._positions.admit
        records = []
        for messages in batches.values():
            for m in messages:
                record = Received(m.topic, m.partition, m.offset, m.key, m.value, list(m.headers), m.timestamp)
                if admit(record):
                    records.append(record)
        return records
