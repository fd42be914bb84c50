"""One process's SDK clients share one producer, one registry feed and one inbox reader (``arbiter.agents.hub``).

Against the real broker: the sharing itself, that every agent still gets exactly its own
records from its start on while others join and leave, and that a worker grants to
clients on every partition through the shared reader.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer

from arbiter.agents import ArbiterClient
from arbiter.agents import hub as hubs
from arbiter.agents.identities import ensure_identity
from arbiter.agents.transport import KafkaTransport
from arbiter.edge.clock import now_ms
from arbiter.edge.kafkaconn import close_client
from arbiter.edge.settings import Settings
from arbiter.processes import WorkerPool
from arbiter.schemas import Cause, Codec, Pong, Record, default_codec
from arbiter.schemas.identity import Signer
from arbiter.schemas.partitioning import partition_for

pytestmark = pytest.mark.kafka

WAIT_S = 20.0


def agent_on(partition: int, prefix: str, partitions: int = 2, skip: int = 0) -> str:
    """An agent id whose inbox lands on ``partition`` (the ``skip``-th such name)."""
    names = (f"{prefix}-{i}" for i in range(1000))
    return [name for name in names if partition_for(name.encode(), partitions) == partition][skip]


def pong(request_id: str, agent: str) -> Pong:
    return Pong(request_id=request_id, agent_id=agent, worker_id="w1", at_ms=2,
                cause=Cause(topic="t", partition=0, offset=0))


class Inbox:
    """An ``on_record`` callback that keeps the ping ids it is handed."""

    def __init__(self) -> None:
        self.ids: list[str] = []

    def __call__(self, record: Record) -> None:
        assert isinstance(record, Pong)
        self.ids.append(record.request_id)


class CountingCodec(Codec):
    """The shipped codec, counting what it decodes."""

    def __init__(self) -> None:
        super().__init__()
        self.decodes = 0

    def decode(self, data: bytes, expected: Any = None) -> Any:
        self.decodes += 1
        return super().decode(data, expected)


class Wire:
    """Writes straight to the inbox topic: as the worker (signed with the workers' key) or unsigned."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.codec = default_codec()
        self.producer = AIOKafkaProducer(bootstrap_servers=settings.bootstrap, acks="all")
        self.worker: Signer | None = None

    async def __aenter__(self) -> Wire:
        await self.producer.start()
        self.worker = await ensure_identity(self.settings, "worker", role="worker")
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.producer.stop()

    async def to_inbox(self, agent: str, request_id: str, signed: bool = True) -> None:
        inbox, key = self.settings.topics.agent_inbox, agent.encode()
        value = self.codec.encode(pong(request_id, agent))
        headers = self.worker.sign(inbox, key, value, now_ms()) if signed and self.worker is not None else None
        await self.producer.send_and_wait(inbox, key=key, value=value, headers=headers)


async def eventually(check: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not check():
        if loop.time() > deadline:
            raise AssertionError(f"not within {timeout}s: {what}")
        await asyncio.sleep(0.02)


def transport(settings: Settings, agent: str, inbox: Inbox | None = None, codec: Codec | None = None) -> KafkaTransport:
    return KafkaTransport(agent, settings, codec or default_codec(), inbox or Inbox())


def this_loops_hubs() -> dict[hubs.HubKey, hubs.InboxHub]:
    return hubs._HUBS.get(asyncio.get_running_loop(), {})


# -- sharing ---------------------------------------------------------------------------


async def test_clients_with_one_set_of_settings_share_one_producer_feed_and_reader(kafka_settings: Settings) -> None:
    a, b = transport(kafka_settings, agent_on(0, "a")), transport(kafka_settings, agent_on(1, "b"))
    same_partition = transport(kafka_settings, agent_on(0, "a", skip=1))
    unverified = transport(kafka_settings.model_copy(update={"verify_signatures": False}), agent_on(0, "u"))
    await a.start()
    try:
        hub = a.hub
        assert hub is not None and hub.refs == 1
        assert hub.assignment() == {hub.partition_of(a.agent_id)}
        await b.start()
        await same_partition.start()
        await unverified.start()
        assert b.hub is hub and same_partition.hub is hub and hub.refs == 3
        assert hub.sender is not None and hub.feed is not None and hub.reader is not None
        assert {p for _, p in hub.assignment()} == {0, 1}  # the union of its agents' partitions
        assert unverified.hub is not hub and unverified.hub is not None and unverified.hub.feed is None
        assert len(this_loops_hubs()) == 2
    finally:
        for each in (a, b, same_partition, unverified):
            await each.close()
    assert hub.refs == 0 and this_loops_hubs() == {}
    assert hub.closed  # the last one out closed the Kafka clients, and their threads ended
    assert not [t.name for t in threading.enumerate() if t.name.startswith("arbiter-kafka")]
    fresh = transport(kafka_settings, "again")
    await fresh.start()
    try:
        assert fresh.hub is not None and fresh.hub is not hub  # a closed hub is never reused
    finally:
        await fresh.close()


async def test_clients_started_together_start_one_hub(kafka_settings: Settings) -> None:
    clients = [transport(kafka_settings, f"crowd-{i}") for i in range(12)]
    await asyncio.gather(*(client.start() for client in clients))
    try:
        assert len({id(client.hub) for client in clients}) == 1
        assert len(this_loops_hubs()) == 1
    finally:
        await asyncio.gather(*(client.close() for client in clients))
    assert this_loops_hubs() == {}


def test_each_event_loop_has_hubs_of_its_own(kafka_settings: Settings) -> None:
    first_loop = asyncio.new_event_loop()
    first = transport(kafka_settings, "looped")
    try:
        first_loop.run_until_complete(first.start())

        async def in_another_loop() -> hubs.InboxHub | None:
            other = transport(kafka_settings, "looped")
            await other.start()
            try:
                return other.hub
            finally:
                await other.close()

        assert asyncio.run(in_another_loop()) is not first.hub
    finally:
        first_loop.run_until_complete(first.close())
        first_loop.close()


# -- every agent gets exactly its own records, from its start on ------------------------


async def test_each_agent_gets_only_its_own_records_and_others_are_never_decoded(kafka_settings: Settings) -> None:
    a, b, stranger = agent_on(0, "a"), agent_on(0, "b"), agent_on(0, "stranger")
    inbox_a, inbox_b, codec_a, codec_b = Inbox(), Inbox(), CountingCodec(), CountingCodec()
    ta, tb = transport(kafka_settings, a, inbox_a, codec_a), transport(kafka_settings, b, inbox_b, codec_b)
    async with Wire(kafka_settings) as wire:
        await ta.start()
        await tb.start()
        try:
            for i in range(20):
                await wire.to_inbox(stranger, f"s{i}")  # on their partition, for an agent not in this process
            await wire.to_inbox(a, "a0")
            await wire.to_inbox(b, "b0")
            await wire.to_inbox(a, "a1")
            await eventually(lambda: len(inbox_a.ids) == 2 and len(inbox_b.ids) == 1, "a and b get theirs")
            await asyncio.sleep(0.3)  # anything wrongly handed on would show up by now
        finally:
            await ta.close()
            await tb.close()
    assert (inbox_a.ids, inbox_b.ids) == (["a0", "a1"], ["b0"])
    assert (codec_a.decodes, codec_b.decodes) == (2, 1)  # the stranger's 20 were skipped by key


async def test_a_forged_message_is_counted_for_its_agent_only(kafka_settings: Settings) -> None:
    a, b = agent_on(0, "a"), agent_on(0, "b")
    inbox_a, inbox_b = Inbox(), Inbox()
    ta, tb = transport(kafka_settings, a, inbox_a), transport(kafka_settings, b, inbox_b)
    async with Wire(kafka_settings) as wire:
        await ta.start()
        await tb.start()
        try:
            await wire.to_inbox(a, "forged", signed=False)
            await ta.send(kafka_settings.topics.agent_inbox, a, pong("self-signed", a))  # signed by an agent
            await wire.to_inbox(b, "real")
            await eventually(lambda: ta.forged == 2 and inbox_b.ids == ["real"], "two forgeries and b's record")
        finally:
            await ta.close()
            await tb.close()
    assert (ta.forged, tb.forged, inbox_a.ids) == (2, 0, [])


async def test_a_joiner_gets_nothing_from_before_its_start_even_from_a_lagging_reader(
        kafka_settings: Settings) -> None:
    """The reader is held inside a record for ``a`` while ``b`` (same partition) starts: the record for
    ``b`` appended before that start is behind the reader's position, and must not reach ``b``."""
    a, b = agent_on(0, "a"), agent_on(0, "b")
    held, reached = asyncio.Event(), asyncio.Event()

    class Slow(KafkaTransport):
        async def deliver(self, message: Any) -> None:
            reached.set()
            await held.wait()
            await super().deliver(message)

    inbox_a, inbox_b = Inbox(), Inbox()
    ta = Slow(a, kafka_settings, default_codec(), inbox_a)
    tb = transport(kafka_settings, b, inbox_b)
    async with Wire(kafka_settings) as wire:
        await ta.start()
        try:
            await wire.to_inbox(a, "a0")
            await asyncio.wait_for(reached.wait(), WAIT_S)  # the reader is stuck in a0
            await wire.to_inbox(b, "before-b-started")
            await tb.start()
            await wire.to_inbox(b, "after-b-started")
            held.set()
            await eventually(lambda: inbox_b.ids != [], "b gets a record")
            await asyncio.sleep(0.3)
        finally:
            held.set()
            await tb.close()
            await ta.close()
    assert (inbox_a.ids, inbox_b.ids) == (["a0"], ["after-b-started"])


async def test_clients_joining_and_leaving_other_partitions_neither_lose_nor_repeat_a_readers_records(
        kafka_settings: Settings) -> None:
    """Each join or leave on the other partition reassigns the one consumer; ``a`` must still get
    every record of a steady stream exactly once, in order. The stream runs until the other partition was
    joined and left five times (it once ended, on a fast client, before a second join)."""
    a = agent_on(0, "a")
    inbox_a = Inbox()
    ta = transport(kafka_settings, a, inbox_a)
    rounds, least = 5, 300
    async with Wire(kafka_settings) as wire:
        await ta.start()
        hub = ta.hub
        assert hub is not None
        try:
            async def churn() -> None:
                for turn in range(rounds):
                    other = transport(kafka_settings, agent_on(1, "churn", skip=turn))
                    await other.start()
                    assert len(hub.assignment()) == 2
                    await other.close()
                    assert len(hub.assignment()) == 1

            async def stream() -> int:
                sent = 0
                while not churning.done() or sent < least:
                    await wire.to_inbox(a, str(sent))
                    sent += 1
                    await asyncio.sleep(0.002)  # a steady stream, not a burst that ends before the churn
                return sent

            churning = asyncio.create_task(churn())
            count = await stream()
            await churning
            await eventually(lambda: len(inbox_a.ids) >= count, f"a gets all {count} records")
            await asyncio.sleep(0.3)
        finally:
            await ta.close()
    assert inbox_a.ids == [str(i) for i in range(count)]


# -- through a worker --------------------------------------------------------------------


async def test_clients_on_every_partition_get_their_grants(kafka_settings: Settings, worker: WorkerPool) -> None:
    names = [agent_on(p, "agent", skip=i) for p in (0, 1) for i in range(4)]
    clients = [ArbiterClient(name, kafka_settings) for name in names]
    await asyncio.gather(*(client.start() for client in clients))
    try:
        hub = clients[0]._transport.hub
        assert hub is not None and all(client._transport.hub is hub for client in clients)
        assert {p for _, p in hub.assignment()} == {0, 1}

        async def work(client: ArbiterClient) -> int:
            tokens = []
            for i in range(5):
                lease = await client.acquire(f"ticket:{client.agent_id}:{i}", ttl=30, wait=0)
                tokens.append(lease.token)
                await client.release(lease)
            return len(tokens)

        assert await asyncio.gather(*(work(client) for client in clients)) == [5] * len(clients)
    finally:
        await asyncio.gather(*(client.close() for client in clients))
    assert all(client.forged_messages == 0 for client in clients)


async def test_a_client_started_while_the_reader_runs_gets_every_outcome(kafka_settings: Settings,
                                                                       worker: WorkerPool) -> None:
    """While ``busy`` keeps the reader fetching, new clients on its partition and on the other one
    start and at once send commands: each gets every outcome. Closing them leaves ``busy`` working."""
    busy = ArbiterClient(agent_on(0, "busy"), kafka_settings)
    await busy.start()
    stop = asyncio.Event()

    async def keep_busy() -> int:
        done = 0
        while not stop.is_set():
            lease = await busy.acquire(f"ticket:busy:{done}", ttl=30, wait=0)
            await busy.release(lease)
            done += 1
        return done

    busy_work = asyncio.create_task(keep_busy())
    try:
        for round_ in range(6):
            name = agent_on(round_ % 2, "joiner", skip=round_)
            async with ArbiterClient(name, kafka_settings) as joiner:
                assert joiner._transport.hub is busy._transport.hub
                lease = await joiner.acquire(f"ticket:{name}", ttl=30, wait=0)  # sent right after start
                pong_ = await joiner.ping(f"ticket:{name}")
                await joiner.release(lease)
                assert pong_.rtt_ms > 0
        await asyncio.sleep(0.2)
        assert not busy_work.done()
    finally:
        stop.set()
        acquired = await asyncio.wait_for(busy_work, WAIT_S)
        await busy.close()
    assert acquired > 0
    assert busy.forged_messages == 0


async def test_the_last_client_to_leave_right_after_a_reassignment_closes_the_hub(kafka_settings: Settings) -> None:
    """aiokafka's ``consumer.stop()`` right after ``assign`` changed could hang for good (its fetch
    routine swallowed its own cancellation); ``close_client``, which the hub closes it with, always ends,
    with the routine stopped."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    inbox = kafka_settings.topics.agent_inbox
    for turn in range(30):
        consumer = AIOKafkaConsumer(bootstrap_servers=kafka_settings.bootstrap, group_id=None,
                                    enable_auto_commit=False)
        await consumer.start()
        consumer.assign([TopicPartition(inbox, 0), TopicPartition(inbox, 1)])
        await consumer.getmany(timeout_ms=50)
        consumer.assign([TopicPartition(inbox, 0)])  # what a leaving agent's hub does
        for _ in range(turn % 4):
            await asyncio.sleep(0)
        await asyncio.wait_for(close_client(consumer), WAIT_S)
        assert consumer._fetcher._fetch_task.done(), f"turn {turn}: the fetch routine runs on"
