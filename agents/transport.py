"""The SDK's Kafka transport: one producer for every command, one reader for the agent's inbox.

Theory of operation
-------------------
``send(topic, key, record)`` encodes a record and waits until every in-sync replica
has it (``acks="all"``, no lingering). The processors decide per key, in order, so the
caller names the key: the resource, the saga, the wait graph.

Outcomes come back on the agent-inbox topic, keyed by agent id. The transport reads
only the inbox partition the agent id lands on (``contract.partitioning``, the rule
the workers use too), from its end, committed records only, and pins that position
before ``start`` returns, so no outcome of a command sent afterwards is missed. Each
record keyed by this agent that the codec understands goes to ``on_record``; what it
means is the facade's business (``agents.client``).

Trust: every command is signed with the agent's key (``contract.identity``), and an inbox
record reaches ``on_record`` only when a worker identity signed it; anything else is
counted in ``forged``, logged, and never acted on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from contract import Codec, ContractError, Record
from contract.clock import now_ms
from contract.identity import ROLE_WORKER, Refused, Registry, Signer, anchors_for, key_file, signer_for
from contract.kafkaauth import kafka_client_options
from contract.partitioning import partition_for
from contract.registryfeed import RegistryFeed
from contract.settings import Settings

from .identities import ensure_identity

log = logging.getLogger(__name__)

OnRecord = Callable[[Record], None]
"""Called, in inbox order, with each record for this agent. It must not block."""

_NOT_STARTED = "ArbiterClient is not started; use 'async with ArbiterClient(...)'"


class KafkaTransport:
    """Sends records to Arbiter's topics and reads one agent's inbox. ``start`` before, ``close`` after."""

    def __init__(self, agent_id: str, settings: Settings, codec: Codec, on_record: OnRecord) -> None:
        self.agent_id = agent_id
        self.settings = settings
        self.codec = codec
        self._on_record = on_record
        self._producer: AIOKafkaProducer | None = None
        self._consumer: AIOKafkaConsumer | None = None
        self._reader: asyncio.Task[None] | None = None
        self._signer: Signer | None = None
        self._feed: RegistryFeed | None = None
        self.forged = 0
        """Inbox records for this agent that no worker signed (dropped, never acted on)."""

    async def _identity(self) -> Signer | None:
        settings = self.settings
        key_text = settings.identity_key if settings.identity in ("", self.agent_id) else ""
        if not key_text and settings.auto_enroll and not key_file(settings.home, self.agent_id).exists():
            log.warning("auto_enroll (development only): issuing a key to agent %r with this home's admin key",
                        self.agent_id)
            return await ensure_identity(settings, self.agent_id)
        if not settings.verify_signatures and not key_text and not key_file(settings.home, self.agent_id).exists():
            return None  # development without verification: unsigned
        return signer_for(settings.home, self.agent_id, key_text)

    async def start(self) -> None:
        """Connect, and start reading this agent's inbox from its current end."""
        self._signer = await self._identity()
        if self.settings.verify_signatures:
            registry = Registry(anchors_for(self.settings.home, self.settings.admin_public_keys))
            self._feed = RegistryFeed(registry, self.settings.topics.registry, self.settings.bootstrap, self.codec,
                                      **kafka_client_options(self.settings))
            await self._feed.start()
        servers = self.settings.bootstrap
        kafka = kafka_client_options(self.settings)
        self._producer = AIOKafkaProducer(bootstrap_servers=servers, acks="all", linger_ms=0, **kafka,
                                          max_request_size=2 * self.settings.max_message_bytes)
        await self._producer.start()
        inbox = self.settings.topics.agent_inbox
        partitions = await self._producer.partitions_for(inbox)
        partition = partition_for(self.agent_id.encode(), len(partitions))
        self._consumer = AIOKafkaConsumer(
            bootstrap_servers=servers,
            enable_auto_commit=False,
            fetch_max_wait_ms=50,
            group_id=None,
            # Under exactly_once, workers write in transactions: never act on an aborted one.
            isolation_level="read_committed",
            **kafka,
        )
        await self._consumer.start()
        tp = TopicPartition(inbox, partition)
        self._consumer.assign([tp])
        await self._consumer.seek_to_end(tp)
        await self._consumer.position(tp)  # pin the position before any command is sent
        self._reader = asyncio.create_task(self._read_inbox(), name=f"arbiter-inbox-{self.agent_id}")

    async def close(self) -> None:
        """Stop reading and disconnect."""
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
            self._reader = None
        if self._consumer is not None:
            await self._consumer.stop()
            self._consumer = None
        if self._producer is not None:
            await self._producer.stop()
            self._producer = None
        if self._feed is not None:
            await self._feed.stop()
            self._feed = None

    async def send(self, topic: str, key: str, record: Record) -> None:
        """Encode ``record`` and send it to ``topic`` under ``key``; return once the broker has it."""
        if self._producer is None:
            raise RuntimeError(_NOT_STARTED)
        value = self.codec.encode(record)
        raw_key = key.encode()
        headers = self._signer.sign(topic, raw_key, value, now_ms()) if self._signer is not None else None
        await self._producer.send_and_wait(topic, key=raw_key, value=value, headers=headers)

    async def _read_inbox(self) -> None:
        assert self._consumer is not None
        own_key = self.agent_id.encode()
        async for message in self._consumer:
            if message.key != own_key or message.value is None:
                continue
            try:
                record: Record = self.codec.decode(message.value)
            except ContractError:
                continue  # not for a client this version understands; the workers dead-letter
            if self._feed is not None and not await self._from_worker(message):
                continue
            self._on_record(record)

    async def _from_worker(self, message: Any) -> bool:
        """Whether a worker identity signed this inbox message (else it is counted and dropped)."""
        assert self._feed is not None
        registry = self._feed.registry
        args = (message.topic, message.key, message.value, message.headers, message.timestamp)
        verdict = registry.verify(*args)
        if isinstance(verdict, Refused) and verdict.unknown_key:
            await self._feed.catch_up(timeout=5.0)  # a worker registered a moment ago
            verdict = registry.verify(*args)
        if isinstance(verdict, Refused) or verdict.role != ROLE_WORKER:
            self.forged += 1
            why = verdict.detail if isinstance(verdict, Refused) else f"signed by {verdict.role} {verdict.name!r}"
            log.warning("dropped a forged inbox message for %s at %s[%d]@%d: %s", self.agent_id, message.topic,
                        message.partition, message.offset, why)
            return False
        return True
