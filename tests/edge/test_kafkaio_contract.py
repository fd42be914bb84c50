"""The Kafka seam's contract (``arbiter.edge.kafkaio``), against the real broker, for every client behind it.

What the SDK and the front door rely on: a send returns once the record is in the log, on the
partition Kafka's Java rule (and the workers) give its key; a read hands out each record of
the partitions added, from the offset given, once and in order, however partitions are added
and dropped around it; aborted transactions are never read; the end offset is where the next
record goes; refusals say whether trying again can help; no broker is a prompt error.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import aiokafka
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from arbiter.edge.kafkaio import CLIENTS, Fetch, KafkaIOError, Reader, Received, Sender, reader_for, sender_for
from arbiter.edge.settings import Settings
from arbiter.edge.tail import Tail, TopicPartition
from arbiter.schemas.partitioning import partition_for

pytestmark = pytest.mark.kafka

WAIT_S = 20.0


@pytest.fixture(params=CLIENTS)
def settings(request: pytest.FixtureRequest, kafka_settings: Settings) -> Settings:
    return kafka_settings.model_copy(update={"kafka_client": request.param})


@pytest.fixture
async def sender(settings: Settings) -> AsyncIterator[Sender]:
    each = sender_for(settings)
    await each.start()
    yield each
    await each.stop()


@pytest.fixture
async def reader(settings: Settings) -> AsyncIterator[Reader]:
    each = reader_for(settings)
    await each.start()
    yield each
    await each.stop()


async def read_until(reader: Reader, count: int, timeout: float = WAIT_S) -> list[Received]:
    """Read until ``count`` records came (or the time is up), then a little longer for any extra."""
    got: list[Received] = []
    deadline = time.monotonic() + timeout
    while len(got) < count and time.monotonic() < deadline:
        got.extend(await reader.read(0.2))
    got.extend(await reader.read(0.3))  # anything handed out twice or too many shows up here
    return got


def key_on(partition: int, prefix: str = "k") -> bytes:
    names = (f"{prefix}-{i}".encode() for i in range(1000))
    return next(name for name in names if partition_for(name, 2) == partition)


async def test_a_record_sent_is_read_back_whole_on_its_keys_partition(settings: Settings, sender: Sender,
                                                                     reader: Reader) -> None:
    topic = settings.topics.agent_inbox
    assert await sender.partitions(topic) == 2
    ends = {p: await reader.end_offset(topic, p) for p in (0, 1)}
    for p in (0, 1):
        reader.add(topic, p, ends[p])
    keys = [f"agent-{i}".encode() for i in range(20)]
    before = int(time.time() * 1000)
    for i, key in enumerate(keys):
        await sender.send(topic, key, f"value-{i}".encode(), [("sig", bytes([i])), ("empty", b"")])
    got = await read_until(reader, len(keys))
    assert sorted(r.key for r in got if r.key is not None) == sorted(keys)
    for r in got:
        assert r.key is not None and r.partition == partition_for(r.key, 2), "not Kafka's Java partitioner"
        i = keys.index(r.key)
        assert (r.topic, r.value, r.headers) == (topic, f"value-{i}".encode(), [("sig", bytes([i])), ("empty", b"")])
        assert before - 1000 <= r.timestamp <= int(time.time() * 1000) + 1000
    for p in (0, 1):
        offsets = [r.offset for r in got if r.partition == p]
        assert offsets == list(range(ends[p], ends[p] + len(offsets)))  # in order, none twice
        assert await reader.end_offset(topic, p) == ends[p] + len(offsets)


async def test_a_partition_is_read_from_the_offset_given_and_not_after_it_is_dropped(
        settings: Settings, sender: Sender, reader: Reader) -> None:
    topic = settings.topics.agent_inbox
    key = key_on(0)
    start = await reader.end_offset(topic, 0)
    for i in range(10):
        await sender.send(topic, key, str(i).encode(), None)
    reader.add(topic, 0, start + 4)
    assert reader.reading() == {(topic, 0)}
    assert [r.value for r in await read_until(reader, 6)] == [str(i).encode() for i in range(4, 10)]
    reader.add(topic, 0, start)  # read already: it keeps its position, nothing is repeated
    await sender.send(topic, key, b"10", None)
    assert [r.value for r in await read_until(reader, 1)] == [b"10"]
    reader.drop(topic, 0)
    assert reader.reading() == set()
    await sender.send(topic, key, b"while-dropped", None)
    assert await reader.read(0.5) == []
    again = await reader.end_offset(topic, 0)
    reader.add(topic, 0, again)
    await sender.send(topic, key, b"after", None)
    assert [r.value for r in await read_until(reader, 1)] == [b"after"]


async def test_adding_and_dropping_another_partition_neither_loses_nor_repeats_a_read_ones_records(
        settings: Settings, sender: Sender, reader: Reader) -> None:
    topic = settings.topics.agent_inbox
    steady, other = key_on(0), key_on(1)
    reader.add(topic, 0, await reader.end_offset(topic, 0))
    count, got = 200, []

    async def stream() -> None:
        for i in range(count):
            await sender.send(topic, steady, str(i).encode(), None)
            await sender.send(topic, other, b"x", None)

    writing = asyncio.create_task(stream())
    churns = 0
    while not writing.done():
        reader.add(topic, 1, await reader.end_offset(topic, 1))
        got.extend(await reader.read(0.01))
        reader.drop(topic, 1)
        got.extend(await reader.read(0.01))
        churns += 1
    await writing
    got.extend(await read_until(reader, count - len([r for r in got if r.partition == 0])))
    assert churns >= 5
    assert [r.value for r in got if r.partition == 0] == [str(i).encode() for i in range(count)]


async def test_aborted_transactions_are_never_read(settings: Settings, reader: Reader) -> None:
    topic = settings.topics.agent_inbox
    key = key_on(0)
    start = await reader.end_offset(topic, 0)
    reader.add(topic, 0, start)
    producer = AIOKafkaProducer(bootstrap_servers=settings.bootstrap, transactional_id=f"t-{uuid.uuid4().hex}")
    await producer.start()
    try:
        for outcome in ("aborted", "committed"):
            await producer.begin_transaction()
            await producer.send_and_wait(topic, key=key, value=outcome.encode())
            if outcome == "aborted":
                await producer.abort_transaction()
            else:
                await producer.commit_transaction()
    finally:
        await producer.stop()
    assert [r.value for r in await read_until(reader, 1)] == [b"committed"]


async def test_an_open_transaction_is_past_the_end_until_it_commits(settings: Settings, reader: Reader) -> None:
    topic = settings.topics.agent_inbox
    start = await reader.end_offset(topic, 0)
    producer = AIOKafkaProducer(bootstrap_servers=settings.bootstrap, transactional_id=f"t-{uuid.uuid4().hex}")
    await producer.start()
    try:
        await producer.begin_transaction()
        await producer.send_and_wait(topic, key=key_on(0), value=b"open")
        assert await reader.end_offset(topic, 0) == start  # the last stable offset
        await producer.commit_transaction()
    finally:
        await producer.stop()
    deadline = time.monotonic() + WAIT_S  # (the coordinator writes the commit marker after it answers)
    while (end := await reader.end_offset(topic, 0)) < start + 2 and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.02)  # (nothing to wait on but the offset itself)
    assert end == start + 2  # the record and its commit marker


async def committed_with_marker(settings: Settings, topic: str, key: bytes, values: list[bytes]) -> None:
    """``values`` in one committed transaction, returned once its commit marker is in the log."""
    producer = AIOKafkaProducer(bootstrap_servers=settings.bootstrap, transactional_id=f"t-{uuid.uuid4().hex}")
    await producer.start()
    try:
        await producer.begin_transaction()
        for value in values:
            await producer.send_and_wait(topic, key=key, value=value)
        await producer.commit_transaction()
    finally:
        await producer.stop()


async def test_the_position_of_a_partition_ending_in_a_commit_marker_is_its_end(settings: Settings,
                                                                               reader: Reader) -> None:
    topic = settings.topics.agent_inbox
    start = await reader.end_offset(topic, 0)
    reader.add(topic, 0, start)
    assert await reader.position(topic, 0) == start
    await committed_with_marker(settings, topic, key_on(0), [b"a", b"b"])
    end, got = start + 3, []  # two records and the marker
    deadline = time.monotonic() + WAIT_S
    while (await reader.end_offset(topic, 0) < end or await reader.position(topic, 0) < end) \
            and time.monotonic() < deadline:
        got.extend(await reader.read(0.1))  # (the position moves as the reader reads: waited on by reading)
    assert [r.value for r in got] == [b"a", b"b"]
    assert await reader.position(topic, 0) == end  # past the marker: a reader "to the end" stops
    with pytest.raises(KafkaIOError):
        await reader.position(topic, 1)  # not read


async def test_offsets_and_partitions_say_what_the_log_holds(settings: Settings, sender: Sender,
                                                             reader: Reader) -> None:
    topic = settings.topics.agent_inbox
    low, high = await reader.offsets(topic, 0)
    assert 0 <= low <= high == await reader.end_offset(topic, 0)
    await sender.send(topic, key_on(0), b"one more", None)
    assert await reader.offsets(topic, 0) == (low, high + 1)
    assert await reader.partitions(topic) == 2
    assert await reader.partitions(f"no-such-topic-{uuid.uuid4().hex}") is None


async def test_a_read_uncommitted_reader_sees_an_open_transaction(settings: Settings) -> None:
    topic = settings.topics.agent_inbox
    uncommitted = reader_for(settings, Fetch(isolation_level="read_uncommitted"))
    await uncommitted.start()
    producer = AIOKafkaProducer(bootstrap_servers=settings.bootstrap, transactional_id=f"t-{uuid.uuid4().hex}")
    await producer.start()
    try:
        start = await uncommitted.end_offset(topic, 0)
        uncommitted.add(topic, 0, start)
        await producer.begin_transaction()
        await producer.send_and_wait(topic, key=key_on(0), value=b"open")
        assert await uncommitted.end_offset(topic, 0) == start + 1  # the high watermark, not the stable offset
        assert [r.value for r in await read_until(uncommitted, 1)] == [b"open"]
        await producer.abort_transaction()
    finally:
        await producer.stop()
        await uncommitted.stop()


async def test_a_tail_reads_to_an_end_behind_a_commit_marker_and_from_a_start_clamped_to_the_log(
        settings: Settings, sender: Sender) -> None:
    topic = settings.topics.agent_inbox
    tp = TopicPartition(topic, 0)
    key = key_on(0)
    async with Tail(settings, [topic], start="end") as probe:
        before = (await probe.ends())[tp]
    await sender.send(topic, key, b"plain", None)
    await committed_with_marker(settings, topic, key, [b"in a transaction"])
    async with Tail(settings, [tp], start={tp: before}) as tail:
        assert tail.begun == {tp: before}
        ends = await tail.ends()
        assert ends[tp] == before + 3
        got = await asyncio.wait_for(tail.read_to_end(ends), WAIT_S)  # (ends behind the marker: still returns)
        assert [m.value for m, _ in got] == [b"plain", b"in a transaction"]
    async with Tail(settings, [tp], start={tp: -5}) as early, Tail(settings, [tp], start={tp: 10**12}) as late:
        low = (await early.starts())[tp]
        assert early.begun[tp] == low and late.begun[tp] == before + 3
        assert await asyncio.wait_for(late.read_to_end(), WAIT_S) == []


async def test_append_puts_a_record_on_the_partition_given_and_says_where(settings: Settings, sender: Sender,
                                                                        reader: Reader) -> None:
    topic = settings.topics.agent_inbox
    ends = {p: await reader.end_offset(topic, p) for p in (0, 1)}
    for p in (0, 1):
        reader.add(topic, p, ends[p])
    misdirected = await sender.append(topic, key_on(0), b"on 1", [("sig", b"s")], partition=1)
    own = await sender.append(topic, key_on(1, "own"), b"its key's", None)
    keyless = await sender.append(topic, None, b"no key", None)
    keyless_on_0 = await sender.append(topic, None, b"no key, on 0", None, partition=0)
    assert misdirected == (1, ends[1]) and own[0] == 1 and keyless[0] in (0, 1) and keyless_on_0[0] == 0
    got = {(r.partition, r.offset): r for r in await read_until(reader, 4)}
    assert set(got) == {misdirected, own, keyless, keyless_on_0}  # where each one said it went, once
    assert (got[misdirected].key, got[misdirected].value, got[misdirected].headers) == (key_on(0), b"on 1",
                                                                                          [("sig", b"s")])
    assert (got[own].value, got[keyless].key, got[keyless].value) == (b"its key's", None, b"no key")
    assert (got[keyless_on_0].key, got[keyless_on_0].value) == (None, b"no key, on 0")


async def test_committed_says_what_a_group_committed_and_nothing_where_it_did_not(settings: Settings, sender: Sender,
                                                                                 reader: Reader) -> None:
    topic, group = settings.topics.agent_inbox, f"g-{uuid.uuid4().hex}"
    for i in range(5):
        await sender.send(topic, key_on(0), str(i).encode(), None)
    tp0, tp1 = TopicPartition(topic, 0), TopicPartition(topic, 1)
    assert await reader.committed(group, [tp0, tp1]) == {}
    member = AIOKafkaConsumer(bootstrap_servers=settings.bootstrap, group_id=group, enable_auto_commit=False)
    await member.start()
    try:
        own = aiokafka.TopicPartition(topic, 0)
        member.assign([own])
        await member.commit({own: 3})
    finally:
        await member.stop()
    assert await reader.committed(group, [tp0, tp1]) == {tp0: 3}
    assert await reader.committed(group, [tp1]) == {}


async def test_a_record_too_large_is_refused_for_good(settings: Settings, sender: Sender) -> None:
    with pytest.raises(KafkaIOError) as caught:
        await sender.send(settings.topics.agent_inbox, b"k", b"x" * (2 * settings.max_message_bytes + 1), None)
    assert not caught.value.retriable, caught.value


async def test_a_topic_that_does_not_exist_is_an_error(settings: Settings, sender: Sender) -> None:
    with pytest.raises(KafkaIOError):
        await asyncio.wait_for(sender.partitions(f"no-such-topic-{uuid.uuid4().hex}"), WAIT_S)


@pytest.mark.parametrize("client", CLIENTS)
async def test_no_broker_is_a_prompt_error(client: str, tmp_path: object) -> None:
    nowhere = Settings(bootstrap="127.0.0.1:1", kafka_client=client, home=tmp_path)  # type: ignore[arg-type]
    sender, reader = sender_for(nowhere), reader_for(nowhere)
    started = time.monotonic()
    try:
        with pytest.raises(KafkaIOError):
            await sender.start()
            await sender.partitions("anything")
        with pytest.raises(KafkaIOError):
            await reader.start()
            await reader.end_offset("anything", 0)
    finally:
        await sender.stop()
        await reader.stop()
    assert time.monotonic() - started < 15


@pytest.mark.parametrize("client", CLIENTS)
def test_a_call_given_up_on_for_no_broker_does_not_hold_the_process(client: str, tmp_path: object) -> None:
    """Finding: with librdkafka, ``arbiter saga abort`` with no broker said so at once, then took 10 s to exit:
    ``asyncio.run`` waited for the metadata call the sender had given up on (in the loop's executor) to time out."""
    nowhere = Settings(bootstrap="127.0.0.1:1", kafka_client=client, home=tmp_path)  # type: ignore[arg-type]

    async def probe() -> None:
        sender = sender_for(nowhere)
        try:
            await sender.start()
            await sender.partitions("anything")
        finally:
            await sender.stop()

    started = time.monotonic()
    with pytest.raises(KafkaIOError):
        asyncio.run(probe())
    assert time.monotonic() - started < 5
