"""Following the registry topic: the one Kafka reader the ground holds.

Workers, SDK clients, the CLI and the audit all need the same view of who holds which key
(``contract.identity.Registry``), so the reader lives beside the registry itself instead of
being copied into each face. It reads every partition of the compacted registry topic from
the start, applies each admin-signed record, and keeps following. ``catch_up`` returns once
everything written before it was called has been applied: a process that meets an unknown
key asks for it before refusing, so a key registered a moment ago is never refused.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition

from .codec import Codec, ContractError
from .identity import Registry
from .models import IdentityRegistered

log = logging.getLogger(__name__)


class RegistryFeed:
    """Keeps ``registry`` up to date from ``topic``. ``start`` before use, ``stop`` after."""

    def __init__(self, registry: Registry, topic: str, bootstrap: str, codec: Codec, **kafka: Any) -> None:
        self.registry = registry
        self.topic = topic
        self._bootstrap = bootstrap
        self._codec = codec
        self._kafka = kafka
        self._consumer: AIOKafkaConsumer | None = None
        self._task: asyncio.Task[None] | None = None
        self._applied = asyncio.Condition()
        self._positions: dict[TopicPartition, int] = {}

    async def start(self, timeout: float = 30.0) -> None:
        """Connect, read the whole registry, then keep following it in the background."""
        consumer = AIOKafkaConsumer(bootstrap_servers=self._bootstrap, enable_auto_commit=False, group_id=None,
                                    fetch_max_wait_ms=100, isolation_level="read_committed", **self._kafka)
        await consumer.start()
        self._consumer = consumer
        # The topic's own partitions: a metadata request for this one topic (not the whole
        # cluster's, which is large on a broker with many topics).
        client = consumer._client
        await client.add_topic(self.topic)
        await client.force_metadata_update()
        partitions = client.cluster.partitions_for_topic(self.topic)
        if not partitions:
            await consumer.stop()
            self._consumer = None
            raise RuntimeError(f"the registry topic {self.topic} does not exist; run 'arbiter topics create'")
        tps = [TopicPartition(self.topic, p) for p in sorted(partitions)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        self._task = asyncio.create_task(self._follow(), name="arbiter-registry-feed")
        await self.catch_up(timeout)

    async def stop(self) -> None:
        """Stop following."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._consumer is not None:
            await self._consumer.stop()
            self._consumer = None

    async def catch_up(self, timeout: float = 10.0) -> bool:
        """Wait until every registry record written before this call is applied (False: timed out)."""
        consumer = self._consumer
        if consumer is None:
            return False
        ends = await consumer.end_offsets(list(consumer.assignment()))

        def reached() -> bool:
            return all(self._positions.get(tp, 0) >= end for tp, end in ends.items())

        async with self._applied:
            try:
                await asyncio.wait_for(self._applied.wait_for(reached), timeout)
            except TimeoutError:
                return False
        return True

    async def _follow(self) -> None:
        consumer = self._consumer
        assert consumer is not None
        while True:
            batches = await consumer.getmany(timeout_ms=200)
            for messages in batches.values():
                for message in messages:
                    self.apply(message.topic, message.key, message.value, message.headers)
            async with self._applied:
                for tp in consumer.assignment():
                    self._positions[tp] = await consumer.position(tp)
                self._applied.notify_all()

    def apply(self, topic: str, key: bytes | None, value: bytes | None, headers: Any) -> None:
        """Apply one registry message (what does not decode or verify is logged and skipped)."""
        if value is None:
            return
        try:
            record = self._codec.decode(value, IdentityRegistered)
        except ContractError as error:
            log.warning("registry record at %s does not decode: %s", topic, error)
            return
        problem = self.registry.apply(topic, key, value, headers, record)
        if problem is not None:
            log.warning("registry record for %r refused: %s", record.name, problem.detail)
