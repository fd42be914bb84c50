"""A real worker process: round trips, and bad input dead-lettered without stalling."""

from __future__ import annotations

import asyncio
import hashlib
import time
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from arbiter.agents import ArbiterClient, ArbiterTimeout
from arbiter.edge.clock import now_ms
from arbiter.edge.keys import key_file, write_private_key
from arbiter.edge.settings import Settings
from arbiter.processes import WorkerPool, wait_until_served
from arbiter.schemas import Cause, DeadLetter, LockRequested, Ping, SagaFinished, default_codec
from arbiter.schemas.identity import ROLE_WORKER, Signer
from arbiter.schemas.partitioning import key_for_partition
from arbiter.streams.runtime.topics import ensure_topics
from tests.conftest import isolated_settings

pytestmark = pytest.mark.kafka


async def _produce(settings: Settings, key: bytes, values: list[bytes], signer: Signer | None = None,
                   unsigned: frozenset[int] = frozenset()) -> None:
    """Send ``values`` keyed ``key``, signed by ``signer`` except those whose index is in ``unsigned``."""
    producer = AIOKafkaProducer(bootstrap_servers=settings.bootstrap, max_request_size=4 * settings.max_message_bytes)
    await producer.start()
    topic = settings.topics.resource_commands
    try:
        for i, value in enumerate(values):
            headers = signer.sign(topic, key, value, now_ms()) if signer is not None and i not in unsigned else None
            await producer.send_and_wait(topic, key=key, value=value, headers=headers)
    finally:
        await producer.stop()


async def test_ping_round_trip_through_every_partition(kafka_settings: Settings, workers: WorkerPool) -> None:
    workers.start(1)
    keys = [key_for_partition(p, kafka_settings.partitions) for p in range(kafka_settings.partitions)]
    async with ArbiterClient("tester", kafka_settings) as client:
        await wait_until_served(client, workers, keys)
        for partition, key in enumerate(keys):
            result = await client.ping(key, timeout=10)
            assert result.partition == partition
            assert result.worker_id == "worker-1"


async def _read_dead_letters(settings: Settings, count: int, timeout: float = 30) -> list[DeadLetter]:
    codec = default_codec()
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.bootstrap, group_id=None, auto_offset_reset="earliest",
                                enable_auto_commit=False, isolation_level="read_committed")
    await consumer.start()
    try:
        consumer.assign([TopicPartition(settings.topics.dead_letter, p) for p in range(settings.partitions)])
        letters: list[DeadLetter] = []
        deadline = time.monotonic() + timeout
        while len(letters) < count and time.monotonic() < deadline:
            for messages in (await consumer.getmany(timeout_ms=1000)).values():
                letters.extend(codec.decode(m.value, DeadLetter) for m in messages)
        return sorted(letters, key=lambda letter: letter.source.offset)
    finally:
        await consumer.stop()


async def test_malformed_messages_are_dead_lettered_and_the_partition_keeps_flowing(
    bootstrap: str, tmp_path: Path
) -> None:
    limit = 64 * 1024
    settings = isolated_settings(bootstrap, tmp_path, partitions=1, max_message_bytes=limit)
    await ensure_topics(settings)
    codec = default_codec()
    good = codec.encode(Ping(request_id="x", agent_id="nobody", at_ms=0))
    # A well-formed message that belongs on another topic: no resource processor handles it.
    unsupported = codec.encode(SagaFinished(saga_id="s", outcome="COMPLETED", at_ms=0,
                                            cause=Cause(topic="x", partition=0, offset=0)))
    misrouted = codec.encode(LockRequested(request_id="r", agent_id="a", resource="doc:2", mode="exclusive",
                                           ttl_ms=1000, at_ms=0))
    oversized = good[:10] + b"\x00" * (limit + 1)
    bad = [
        (b"garbage", "not_single_object"),
        (good[:-2], "truncated"),
        (b"\xc3\x01" + b"\x00" * 8 + good[10:], "unknown_fingerprint"),
        (oversized, "too_large"),
        (unsupported, "unsupported_command"),
        (misrouted, "key_mismatch"),
        (misrouted, "unauthenticated"),  # the same, unsigned: refused at the trust gate before anything else
    ]
    # Signed with the workers' own key (which may send anything), so each reaches the check it is about;
    # the worker registers the key when it starts.
    worker_key = Signer.generate(ROLE_WORKER)
    write_private_key(key_file(settings.home, ROLE_WORKER), worker_key)
    await _produce(settings, b"doc:1", [value for value, _reason in bad], worker_key,
                   unsigned=frozenset({len(bad) - 1}))

    pool = WorkerPool(settings)
    pool.start(1)
    try:
        async with ArbiterClient("tester", settings) as client:
            # The bad messages sit before this ping in the only partition: an answer
            # proves the worker got past every one of them.
            await wait_until_served(client, pool, ["doc:1"])
            assert (await client.ping("doc:1", timeout=10)).partition == 0
        letters = await _read_dead_letters(settings, len(bad))
        pool.check_alive()
    finally:
        pool.stop()

    assert [letter.reason for letter in letters] == [reason for _value, reason in bad]
    for letter, (value, _reason) in zip(letters, bad, strict=True):
        assert letter.source.topic == settings.topics.resource_commands
        assert letter.processor == "resource"
        assert letter.key == b"doc:1"
        if letter.reason == "too_large":
            assert letter.value == value[: len(letter.value)]
            assert hashlib.sha256(value).hexdigest() in letter.detail
        else:
            assert letter.value == value
    assert [letter.source.offset for letter in letters] == list(range(len(bad)))


async def test_two_workers_share_the_partitions(kafka_settings: Settings, workers: WorkerPool) -> None:
    workers.start(2)
    keys = [key_for_partition(p, kafka_settings.partitions) for p in range(kafka_settings.partitions)]
    async with ArbiterClient("tester", kafka_settings) as client:
        owners: set[str] = set()
        deadline = time.monotonic() + 90
        while owners != {"worker-1", "worker-2"}:
            assert time.monotonic() < deadline, f"partitions never spread over both workers: {owners}"
            workers.check_alive()
            owners = set()
            for key in keys:
                try:
                    owners.add((await client.ping(key, timeout=2)).worker_id)
                except ArbiterTimeout:
                    await asyncio.sleep(0)


async def test_exactly_once_worker_answers_and_dead_letters(bootstrap: str, tmp_path: Path) -> None:
    """faust's Kafka-transaction mode is an option, so it is tested, not assumed."""
    settings = isolated_settings(bootstrap, tmp_path, partitions=1, processing_guarantee="exactly_once")
    await ensure_topics(settings)
    await _produce(settings, b"doc:1", [b"garbage"])
    pool = WorkerPool(settings)
    pool.start(1)
    try:
        async with ArbiterClient("tester", settings) as client:
            await wait_until_served(client, pool, ["doc:1"])
        letters = await _read_dead_letters(settings, 1)
    finally:
        pool.stop()
    assert [letter.reason for letter in letters] == ["not_single_object"]


async def test_the_time_to_stop_in_the_log_counts_from_the_stop_request(bootstrap: str, tmp_path: Path) -> None:
    """Finding: the worker's log said '(0.1 s to stop)' for a process that took 2 s: the figure counted only
    the closing of its clients, not the batch under way when SIGTERM came. Here a refund waits on a row
    another transaction holds (PostgreSQL shows it waiting), so the batch cannot finish: the worker cuts it
    short after its budget, and the time it logs covers that wait."""
    import re
    import signal

    import psycopg

    from arbiter.streams.runtime.worker import STOP_BUDGET
    from arbiter.streams.tools.ledger import Ledger
    from tests.conftest import fresh_postgres_schema

    dsn = fresh_postgres_schema()
    settings = isolated_settings(bootstrap, tmp_path, ledger_dsn=dsn)
    await ensure_topics(settings)
    ledger = Ledger(dsn)
    ledger.seed({"a": 1_000})
    ledger.close()
    pool = WorkerPool(settings)
    pool.start(1)
    worker = pool.workers[0]
    holder = psycopg.connect(dsn)
    try:
        async with ArbiterClient("alice", settings) as alice:
            keys = [key_for_partition(p, settings.partitions) for p in range(settings.partitions)]
            await wait_until_served(alice, pool, keys)
            holder.execute("SELECT balance FROM accounts WHERE id = 'a' FOR UPDATE")  # its transaction stays open
            lease = await alice.acquire("account:a", ttl=60)
            base = (await alice.snapshot("account:a")).version
            refund = asyncio.create_task(alice.execute(lease, "refund", {"order_id": "o-1", "amount": 100},
                                                       base_version=base, timeout=60))
            with psycopg.connect(dsn, autocommit=True) as watch:
                deadline = time.monotonic() + 30
                while not watch.execute("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                                        "AND query LIKE 'UPDATE accounts%'").fetchone()[0]:  # type: ignore[index]
                    assert time.monotonic() < deadline and not refund.done(), "the refund never waited on the row"
                    await asyncio.sleep(0.05)  # polling PostgreSQL for the waiting UPDATE
            asked = time.monotonic()
            worker.proc.send_signal(signal.SIGTERM)
            while "did not finish within" not in worker.log.read_text():
                assert worker.proc.poll() is None and time.monotonic() - asked < STOP_BUDGET, worker.log.read_text()
                await asyncio.sleep(0.05)  # the worker's log says it cut the batch short
            holder.rollback()  # the stuck refund's thread may end now, and the process with it
            await asyncio.to_thread(worker.proc.wait, 30)
            took = time.monotonic() - asked
            refund.cancel()
    finally:
        holder.close()
        pool.stop()
    found = re.search(r"stopped after \d+ decisions \((\d+\.\d) s to stop", worker.log.read_text())
    assert found is not None, worker.log.read_text()[-2000:]
    logged = float(found.group(1))
    assert STOP_BUDGET / 4 - 0.1 <= logged <= took + 0.05, (logged, took)
