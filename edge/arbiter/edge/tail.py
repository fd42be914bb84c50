"""One way to read Arbiter's topics as they are written: from their end (or their start, or given
offsets) on, with no consumer group and nothing committed.

``Tail`` pins its start before ``start`` returns (a record written after that is always seen),
decodes each record with the contract's codec (a record that does not decode comes with
``None``: not the reader's to judge; the workers dead-letter it), and either hands records to
the caller batch by batch (``read``, ``read_to_end``) or, given ``on_message``, follows in the
background and wakes ``wait_for`` after each batch. The front door's session replay, chaos,
the demo, the audit and the registry feed all read through it, on the Kafka seam's reader
(:mod:`arbiter.edge.kafkaio`: librdkafka unless ``kafka_client`` says aiokafka).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Literal

from arbiter.edge.kafkaio import Fetch, KafkaIOError, Reader, Received, TopicPartition, reader_for
from arbiter.edge.settings import Settings
from arbiter.schemas import ContractError, Record, default_codec

Start = Literal["end", "beginning"] | Mapping[TopicPartition, int]
Message = tuple[Received, Record | None]
"""A record as Kafka holds it, and its decoded value (None: it does not decode)."""

__all__ = ["Message", "Start", "Tail", "TopicMissing", "TopicPartition", "topic_partitions"]


class TopicMissing(RuntimeError):
    """A topic to read does not exist."""


async def topic_partitions(settings: Settings, topics: list[str]) -> dict[str, int]:
    """How many partitions each of ``topics`` has on the broker (one missing is left out)."""
    reader = reader_for(settings)
    await reader.start()
    try:
        counts = {t: await reader.partitions(t) for t in topics}
    finally:
        await reader.stop()
    return {t: n for t, n in counts.items() if n}


class Tail:
    """Read ``where`` (topic names: every partition of each; or topic partitions) from ``start`` on."""

    def __init__(self, settings: Settings, where: Iterable[str | tuple[str, int]], *, start: Start = "end",
                 isolation_level: str = "read_committed", fetch_max_wait_ms: int = 100,
                 on_message: Callable[[Received, Record | None], None] | None = None,
                 decode: bool = True, fetch_min_bytes: int | None = None,
                 max_partition_fetch_bytes: int | None = None) -> None:
        """A topic named is read on every partition the broker has for it (asked once, at ``start``: a
        missing topic is ``TopicMissing``, not a reader that waits forever). A ``start`` mapping's offset
        outside what the log holds is moved to its nearer end."""
        self.settings = settings
        self.where = list(where)
        self.tps = sorted(TopicPartition(*w) for w in self.where if not isinstance(w, str))
        self.start_at = start
        self.on_message = on_message
        self.decode = decode
        self.codec = default_codec(settings.max_message_bytes)
        self.fetch = Fetch(isolation_level=isolation_level, max_wait_ms=fetch_max_wait_ms, min_bytes=fetch_min_bytes,
                           max_partition_bytes=max_partition_fetch_bytes)
        self._reader: Reader | None = None
        self.changed = asyncio.Condition()
        """Notified after each batch the background reader handed to ``on_message``."""
        self.positions: dict[TopicPartition, int] = {}
        """Per partition, the offset after the last record the background reader handed over."""
        self.begun: dict[TopicPartition, int] = {}
        """Per partition, the offset it was read from (after ``start``)."""
        self._follower: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Tail:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def reader(self) -> Reader:
        """The reader (after ``start``)."""
        if self._reader is None:
            raise RuntimeError("the tail is not started")
        return self._reader

    async def start(self) -> None:
        """Connect, assign, and pin the start of every partition; follow in the background if asked. A start
        that fails closes what it opened."""
        self._reader = reader_for(self.settings, self.fetch)
        try:
            await self._reader.start()
            await self._pin()
        except BaseException:
            await self.stop()
            raise
        if self.on_message is not None:
            self._follower = asyncio.create_task(self._follow(), name="arbiter-tail")

    async def _pin(self) -> None:
        reader = self.reader
        names = sorted({w for w in self.where if isinstance(w, str)})
        if names:
            counts = {n: await reader.partitions(n) for n in names}
            missing = [n for n in names if not counts[n]]
            if missing:
                raise TopicMissing(f"no topic {', '.join(missing)} at {self.settings.bootstrap}: create the topics "
                                   "with 'arbiter topics create' (or check ARBITER_TOPICS__*)")
            self.tps = sorted({*self.tps, *(TopicPartition(n, p) for n in names for p in range(counts[n] or 0))})
        for tp in self.tps:  # each start is an offset before ``start`` returns: what is written later is seen
            low, high = await reader.offsets(*tp)
            if self.start_at == "end":
                at = high
            elif self.start_at == "beginning":
                at = low
            else:
                at = min(max(self.start_at.get(tp, low), low), high)
            reader.add(tp.topic, tp.partition, at)
            self.begun[tp] = at

    async def stop(self) -> None:
        """Stop following and disconnect."""
        if self._follower is not None:
            self._follower.cancel()
            await asyncio.gather(self._follower, return_exceptions=True)
            self._follower = None
        reader, self._reader = self._reader, None
        if reader is not None:
            await reader.stop()

    def seek(self, tp: tuple[str, int], offset: int) -> None:
        """Read ``tp`` from ``offset`` on instead, ahead of what was read of it (never back: a batch
        fetched before the seek could then be handed out ahead of the records before it)."""
        reader = self.reader
        tp = TopicPartition(*tp)
        if tp not in self.tps:
            raise ValueError(f"{tp.topic}[{tp.partition}] is not read by this tail")
        reader.drop(tp.topic, tp.partition)
        reader.add(tp.topic, tp.partition, offset)

    async def ends(self) -> dict[TopicPartition, int]:
        """Every partition's end offset now."""
        return {tp: await self.reader.end_offset(*tp) for tp in self.tps}

    async def starts(self) -> dict[TopicPartition, int]:
        """Every partition's first offset still in the log."""
        return {tp: (await self.reader.offsets(*tp))[0] for tp in self.tps}

    async def offsets_of(self, tps: Iterable[tuple[str, int]]) -> dict[TopicPartition, tuple[int, int]]:
        """Any partitions' (first offset still in the log, end offset), read or not."""
        return {TopicPartition(*tp): await self.reader.offsets(*tp) for tp in tps}

    async def read(self, timeout_ms: int = 200) -> list[Message]:
        """What has arrived (waiting up to ``timeout_ms`` for something), in order per partition."""
        return [(m, self._decoded(m)) for m in await self.reader.read(timeout_ms / 1000)]

    async def read_to_end(self, ends: Mapping[TopicPartition, int] | None = None,
                          progress: Callable[[int], None] | None = None) -> list[Message]:
        """Every record up to ``ends`` (default: the end offsets now), then stop."""
        reader = self.reader
        ends = {TopicPartition(*tp): end for tp, end in (ends.items() if ends is not None
                                                         else (await self.ends()).items())}
        remaining = {tp for tp in self.tps if ends.get(tp, 0) > await reader.position(*tp)}
        for tp in self.tps:
            if tp not in remaining:
                reader.drop(*tp)  # (read to its end already: fetch nothing more of it)
        out: list[Message] = []
        while remaining:
            for m in await reader.read(0.5):
                if m.offset < ends[TopicPartition(m.topic, m.partition)]:
                    out.append((m, self._decoded(m)))
            for tp in list(remaining):
                if await reader.position(*tp) >= ends[tp]:
                    remaining.discard(tp)
                    reader.drop(*tp)
            if progress is not None:
                progress(len(out))
        return out

    async def caught_up(self, timeout: float) -> bool:
        """Wait until the background reader has handed over every record written before this call; False
        after ``timeout`` seconds (asking for the end offsets included: with no broker, that waits)."""
        deadline = time.monotonic() + timeout
        try:
            ends = await asyncio.wait_for(self.ends(), timeout)
        except (TimeoutError, KafkaIOError):
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

    def _decoded(self, message: Received) -> Record | None:
        if not self.decode or message.value is None:
            return None
        try:
            return self.codec.decode(message.value)
        except ContractError:
            return None

    async def _follow(self) -> None:
        assert self.on_message is not None
        reader = self.reader
        while True:
            messages = await self.read()
            for message, record in messages:
                self.on_message(message, record)
            async with self.changed:
                for tp in self.tps:
                    self.positions[tp] = await reader.position(*tp)
                self.changed.notify_all()
