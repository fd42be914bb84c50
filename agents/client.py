"""``ArbiterClient``: sends commands to Arbiter and awaits the outcomes in the agent's inbox.

Theory of operation
-------------------
Commands go to the resource-command topic, keyed by resource (the processors decide
per key, in order). Outcomes come back on the agent-inbox topic, keyed by agent id.
The client reads only the inbox partition its agent id hashes to (the producer's
murmur2 partitioner, the same one the workers use), starting at the end, and
routes each message to the coroutine awaiting it by correlation id. Nothing polls:
a waiting call is a suspended future.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from types import TracebackType

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.partitioner import DefaultPartitioner

from arbiter.contract import Codec, ContractError, Ping, Pong, Record, default_codec
from arbiter.settings import Settings, load_settings


class ArbiterTimeout(TimeoutError):
    """No outcome arrived in time. Retriable: the command may or may not have been decided."""

    retriable = True


@dataclass(frozen=True)
class PingResult:
    """A round trip through a worker."""

    rtt_ms: float
    worker_id: str
    partition: int


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


class ArbiterClient:
    """An AI agent's connection to Arbiter. Use as ``async with ArbiterClient(...)``."""

    def __init__(self, agent_id: str, settings: Settings | None = None, codec: Codec | None = None) -> None:
        if not agent_id:
            raise ValueError("agent_id must not be empty")
        self.agent_id = agent_id
        self.settings = settings or load_settings()
        self.codec = codec or default_codec(self.settings.max_message_bytes)
        self._producer: AIOKafkaProducer | None = None
        self._consumer: AIOKafkaConsumer | None = None
        self._reader: asyncio.Task[None] | None = None
        self._waiters: dict[str, asyncio.Future[Record]] = {}

    async def __aenter__(self) -> ArbiterClient:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def start(self) -> None:
        """Connect, and start reading this agent's inbox from now on."""
        servers = self.settings.bootstrap
        self._producer = AIOKafkaProducer(bootstrap_servers=servers, acks="all", linger_ms=0)
        await self._producer.start()
        inbox = self.settings.topics.agent_inbox
        partitions = sorted(await self._producer.partitions_for(inbox))
        partition = DefaultPartitioner()(self.agent_id.encode(), partitions, partitions)
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
        """Stop reading and disconnect. Pending calls fail with ``ArbiterTimeout``."""
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
            self._reader = None
        for future in self._waiters.values():
            if not future.done():
                future.set_exception(ArbiterTimeout("client closed"))
        self._waiters.clear()
        if self._consumer is not None:
            await self._consumer.stop()
            self._consumer = None
        if self._producer is not None:
            await self._producer.stop()
            self._producer = None

    async def _read_inbox(self) -> None:
        assert self._consumer is not None
        async for message in self._consumer:
            if message.key != self.agent_id.encode() or message.value is None:
                continue
            try:
                record: Record = self.codec.decode(message.value)
            except ContractError:
                continue  # not for a client this version understands; the workers dead-letter
            key = _correlation_id(record)
            future = self._waiters.get(key) if key else None
            if future is not None and not future.done():
                future.set_result(record)

    async def _send(self, resource_key: str, record: Record) -> None:
        if self._producer is None:
            raise RuntimeError("ArbiterClient is not started; use 'async with ArbiterClient(...)'")
        await self._producer.send_and_wait(
            self.settings.topics.resource_commands, key=resource_key.encode(), value=self.codec.encode(record)
        )

    async def ping(self, key: str | None = None, timeout: float = 10.0) -> PingResult:
        """Send a Ping through the worker that owns ``key``'s partition and await the Pong."""
        ping_id = uuid.uuid4().hex
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Record] = loop.create_future()
        self._waiters[ping_id] = future
        started = time.perf_counter()
        try:
            await self._send(key or f"ping:{ping_id}", Ping(ping_id=ping_id, agent_id=self.agent_id,
                                                            sent_at_ms=_now_ms()))
            pong = await asyncio.wait_for(future, timeout)
        except TimeoutError:
            raise ArbiterTimeout(f"no Pong within {timeout}s: is a worker running?") from None
        finally:
            self._waiters.pop(ping_id, None)
        assert isinstance(pong, Pong)
        return PingResult((time.perf_counter() - started) * 1000, pong.worker_id, pong.cause.partition)


def _correlation_id(record: Record) -> str | None:
    if isinstance(record, Pong):
        return record.ping_id
    return None
