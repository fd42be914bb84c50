"""One way to read Arbiter's topics as they are written: from their end (or their start, or given
offsets) on, with no consumer group and nothing committed.

``Tail`` pins its start before ``start`` returns (a record written after that is always seen),
decodes each record with the contract's codec (a record that does not decode comes with
``None``: not the reader's to judge; the workers dead-letter it), and either hands records to
the caller batch by batch (``read``, ``read_to_end``) or, given ``on_message``, follows in the
background and wakes ``wait_for`` after each batch. The front door's session replay, chaos,
the demo, the audit and the registry feed all read through it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.structs import ConsumerRecord

from arbiter.edge.kafkaauth import kafka_client_options
from arbiter.edge.kafkaconn import close_client, started
from arbiter.edge.settings import Settings
from arbiter.schemas import ContractError, Record, default_codec

Start = Literal["end", "beginning"] | Mapping[TopicPartition, int]
Message = tuple[ConsumerRecord, Record | None]
"""A record as Kafka holds it, and its decoded value (None: it does not decode)."""


class TopicMissing(RuntimeError):
    """A topic to read does not exist."""


async def topic_partitions(settings: Settings, topics: list[str]) -> dict[str, int]:
    """How many partitions each of ``topics`` has on the broker (one missing is left out)."""
    async with started(AIOKafkaAdminClient(bootstrap_servers=settings.bootstrap,
                                           **kafka_client_options(settings))) as admin:
        return {t["topic"]: len(t["partitions"]) for t in await admin.describe_topics(topics)
                if t.get("error_code", 0) == 0 and t["partitions"]}


class Tail:
    """Read ``where`` (topic names: every partition of each; or topic partitions) from ``start`` on."""

    def __init__(self, settings: Settings, where: Iterable[str | TopicPartition], *, start: Start = "end",
                 isolation_level: str = "read_committed", fetch_max_wait_ms: int = 100,
                 on_message: Callable[[ConsumerRecord, Record | None], None] | None = None,
                 decode: bool = True, **consumer: Any) -> None:
        """A topic named is read on every partition the broker has for it (asked once, at ``start``: a
        missing topic is ``TopicMissing``, not a reader that waits forever)."""
        self.settings = settings
        self.where = list(where)
        self.tps = sorted(w for w in self.where if isinstance(w, TopicPartition))
        self.start_at = start
        self.on_message = on_message
        self.decode = decode
        self.codec = default_codec(settings.max_message_bytes)
        self._options: dict[str, Any] = {
            "bootstrap_servers": settings.bootstrap, "group_id": None, "enable_auto_commit": False,
            "isolation_level": isolation_level, "fetch_max_wait_ms": fetch_max_wait_ms,
            "auto_offset_reset": "earliest", **kafka_client_options(settings), **consumer}
        self._consumer: AIOKafkaConsumer | None = None
        self.changed = asyncio.Condition()
        """Notified after each batch the background reader handed to ``on_message``."""
        self.positions: dict[TopicPartition, int] = {}
        """Per partition, the offset after the last record the background reader handed over."""
        self._reader: asyncio.Task[None] | None = None
        self._started = False

    async def __aenter__(self) -> Tail:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def consumer(self) -> AIOKafkaConsumer:
        """The consumer (after ``start``)."""
        if self._consumer is None:
            raise RuntimeError("the tail is not started")
        return self._consumer

    async def start(self) -> None:
        """Connect, assign, and pin the start of every partition; follow in the background if asked. A start
        that fails closes what it opened."""
        self._consumer = AIOKafkaConsumer(**self._options)  # (aiokafka wants the running loop)
        self._started = True
        try:
            await self._consumer.start()
            await self._pin()
        except BaseException:
            await self.stop()
            raise
        if self.on_message is not None:
            self._reader = asyncio.create_task(self._follow(), name="arbiter-tail")

    async def _pin(self) -> None:
        names = sorted({w for w in self.where if isinstance(w, str)})
        if names:
            counts = await topic_partitions(self.settings, names)
            missing = [n for n in names if n not in counts]
            if missing:
                raise TopicMissing(f"no topic {', '.join(missing)} at {self.settings.bootstrap}: create the topics "
                                   "with 'arbiter topics create' (or check ARBITER_TOPICS__*)")
            self.tps = sorted({*self.tps, *(TopicPartition(n, p) for n in names for p in range(counts[n]))})
        self.consumer.assign(self.tps)
        if self.start_at == "end":
            await self.consumer.seek_to_end(*self.tps)
        elif self.start_at == "beginning":
            await self.consumer.seek_to_beginning(*self.tps)
        else:
            for tp, offset in self.start_at.items():
                self.consumer.seek(tp, offset)
        for tp in self.tps:
            await self.consumer.position(tp)  # resolve the seek now: what is written from here on is seen

    async def stop(self) -> None:
        """Stop following and disconnect."""
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
            self._reader = None
        if self._started:
            self._started = False
            await close_client(self.consumer)
        self._consumer = None

    async def ends(self) -> dict[TopicPartition, int]:
        """Every partition's end offset now."""
        return dict(await self.consumer.end_offsets(self.tps))

    async def starts(self) -> dict[TopicPartition, int]:
        """Every partition's first offset still in the log."""
        return dict(await self.consumer.beginning_offsets(self.tps))

    async def read(self, timeout_ms: int = 200, max_records: int | None = None) -> list[Message]:
        """What has arrived (waiting up to ``timeout_ms`` for something), in order per partition."""
        batch = await self.consumer.getmany(timeout_ms=timeout_ms, max_records=max_records)
        return [(m, self._decoded(m)) for tp in sorted(batch) for m in batch[tp]]

    async def read_to_end(self, ends: Mapping[TopicPartition, int] | None = None, max_records: int = 10_000,
                          progress: Callable[[int], None] | None = None) -> list[Message]:
        """Every record up to ``ends`` (default: the end offsets now), then stop."""
        ends = dict(ends) if ends is not None else await self.ends()
        remaining = {tp for tp in self.tps if ends.get(tp, 0) > await self.consumer.position(tp)}
        out: list[Message] = []
        while remaining:
            batch = await self.consumer.getmany(*remaining, timeout_ms=500, max_records=max_records)
            for tp in sorted(batch):
                out.extend((m, self._decoded(m)) for m in batch[tp] if m.offset < ends[tp])
            for tp in list(remaining):
                if await self.consumer.position(tp) >= ends[tp]:
                    remaining.discard(tp)
            if progress is not None:
                progress(len(out))
        return out

    async def caught_up(self, timeout: float) -> bool:
        """Wait until the background reader has handed over every record written before this call; False
        after ``timeout`` seconds (asking for the end offsets included: with no broker, that waits)."""
        deadline = time.monotonic() + timeout
        try:
            ends = await asyncio.wait_for(self.ends(), timeout)
        except TimeoutError:
            return False
        return await self.wait_for(lambda: all(self.positions.get(tp, 0) >= end for tp, end in ends.items()),
                                   max(0.0, deadline - time.monotonic()))

    async def wait_for(self, done: Callable[[], bool], timeout: float) -> bool:
        """Wait (on the background reader's batches) until ``done()``; False after ``timeout`` seconds."""
        async with self.changed:
            try:
                await asyncio.wait_for(self.changed.wait_for(done), timeout)
            except TimeoutError:
                return False
        return True

    def _decoded(self, message: ConsumerRecord) -> Record | None:
        if not self.decode or message.value is None:
            return None
        try:
            return self.codec.decode(message.value)
        except ContractError:
            return None

    async def _follow(self) -> None:
        assert self.on_message is not None
        while True:
            messages = await self.read()
            for message, record in messages:
                self.on_message(message, record)
            async with self.changed:
                for tp in self.tps:
                    self.positions[tp] = await self.consumer.position(tp)
                self.changed.notify_all()
