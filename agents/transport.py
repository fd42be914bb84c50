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
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from contract import Codec, ContractError, Record
from contract.partitioning import partition_for
from contract.settings import Settings

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

    async def start(self) -> None:
        """Connect, and start reading this agent's inbox from its current end."""
        servers = self.settings.bootstrap
        self._producer = AIOKafkaProducer(bootstrap_servers=servers, acks="all", linger_ms=0,
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

    async def send(self, topic: str, key: str, record: Record) -> None:
        """Encode ``record`` and send it to ``topic`` under ``key``; return once the broker has it."""
        if self._producer is None:
            raise RuntimeError(_NOT_STARTED)
        await self._producer.send_and_wait(topic, key=key.encode(), value=self.codec.encode(record))

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
            self._on_record(record)
