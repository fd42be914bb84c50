"""The runtime (``arbiter.streams.runtime.worker``): its changelogged tables, and workers that come and go.

The Kafka tests run real ``arbiter worker`` processes on the default runtime and check
what a user relies on through a rebalance: every request is answered exactly once, the
tokens of every resource go 1, 2, 3, ... with no gap and no repeat, and the audit of the
whole log passes, under both processing guarantees.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import pytest
from aiokafka import TopicPartition

from arbiter.agents import ArbiterClient, ArbiterTimeout
from arbiter.audit.log import read_log
from arbiter.edge.settings import Settings
from arbiter.processes import WorkerPool, wait_until_served
from arbiter.schemas import LockDenied, LockGranted
from arbiter.schemas.partitioning import key_for_partition
from arbiter.streams.runtime.common import TABLES
from arbiter.streams.runtime.topics import ensure_topics
from arbiter.streams.runtime.worker import ChangelogTable
from tests.conftest import assert_clean_audit, isolated_settings, share_broker_jars

# -- the tables (no broker) ---------------------------------------------------------------


def test_a_table_writes_each_changed_key_once_to_the_partition_that_changed_it() -> None:
    table = ChangelogTable(TABLES["graphs"], "app-waitedges-changelog")
    table.partition = 2
    table[b"g\x00e1"] = b"row1"
    table[b"g\x00e1"] = b"row1-again"
    table[b"g\x00e2"] = b"row2"
    table.partition = 0
    table[b"h\x00e3"] = b"row3"
    del table[b"g\x00e2"]  # deleted from partition 0's input: its tombstone goes there too
    topic = "app-waitedges-changelog"
    assert table.take_changes({2}) == [(topic, 2, b"g\x00e1", b"row1-again"), (topic, 2, b"g\x00e2", None)]
    assert table.take_changes() == [(topic, 0, b"h\x00e3", b"row3"), (topic, 0, b"g\x00e2", None)]
    assert table.take_changes() == []


def test_a_table_forgets_dropped_partitions_and_restores_from_records() -> None:
    table = ChangelogTable(TABLES["graphs"], "app-waitedges-changelog")
    table.load(1, b"a", b"1")
    table.load(3, b"b", b"2")
    table.load(3, b"c", b"3")
    table.load(3, b"c", None)  # a tombstone
    table.load(1, None, b"ignored")  # a record without a key names nothing
    assert dict(table) == {b"a": b"1", b"b": b"2"}
    table.partition = 3
    table[b"d"] = b"4"
    table.drop({3})
    assert dict(table) == {b"a": b"1"}
    assert table.take_changes() == [], "changes of a dropped partition are not written by its next owner's worker"


def test_a_table_stores_objects_and_writes_their_changelog_form() -> None:
    from arbiter.streams.cores.leases import new_book

    table = ChangelogTable(TABLES["books"], "app-leases-changelog")
    table.partition = 0
    book = new_book("doc:1")
    table[b"doc:1"] = book
    assert table[b"doc:1"] is book
    [(topic, partition, key, value)] = table.take_changes()
    assert (topic, partition, key) == ("app-leases-changelog", 0, b"doc:1")
    assert value is not None
    table.load(0, b"doc:2", value)
    assert table[b"doc:2"].to_dict() | {"resource": "doc:1"} == book.to_dict()


def _grant_and_release(book: object, n: int, agent: str = "a") -> None:
    from arbiter.schemas import Cause, LockReleaseRequested, LockRequested
    from arbiter.streams.cores.leases import LeaseBook, step

    assert isinstance(book, LeaseBook)
    at = 1_000 + 10 * n
    cause = Cause(topic="cmds", partition=0, offset=n)
    [granted] = step(book, LockRequested(request_id=f"acq-{n}", agent_id=agent, resource=book.resource,
                                         mode="exclusive", ttl_ms=30_000, wait_ms=0, at_ms=at), at, cause)
    step(book, LockReleaseRequested(request_id=f"rel-{n}", agent_id=agent, resource=book.resource,
                                    token=granted.token, at_ms=at), at + 1, cause)  # type: ignore[attr-defined]


def test_a_books_changelog_writes_what_a_decision_changed_whatever_the_resources_history() -> None:
    """Each decision used to re-encode the whole book, its id memory included (up to 256 ids), so its
    changelog cost grew with the resource's history: a quarter of a worker's CPU at 64 clients. Now it
    writes the book's record (live state, the newest ids) and a chunk of 16 ids when one fills, and the
    table restores the book from them."""
    from arbiter.streams.cores.leases import new_book

    table = ChangelogTable(TABLES["books"], "leases")
    table.partition = 1
    rows = TABLES["books"].rows
    assert rows is not None
    book = new_book("doc:busy")
    log: dict[bytes, bytes | None] = {}  # the changelog partition, compacted
    written: list[int] = []
    per_decision: list[list[tuple[str, int, bytes, bytes | None]]] = []
    for n in range(400):
        _grant_and_release(book, n)
        table[b"doc:busy"] = book
        records = table.take_changes()
        per_decision.append(records)
        written.append(sum(len(key) + len(value or b"") for _topic, _p, key, value in records))
        # A chunk of ids before the record that counts on it, a tombstone after the record that no longer does.
        kinds = ["row" if not rows.is_row(key) else "chunk" if value else "tombstone" for _t, _p, key, value in records]
        assert kinds == sorted(kinds, key=["chunk", "row", "tombstone"].index) and kinds.count("row") == 1, kinds
        for _topic, _partition, key, value in records:
            log.pop(key, None)
            log[key] = value
    assert len(book.seen) == 256, "the memory is full: every decision now also forgets an id"
    # Flat: the same over 32 decisions early and late (the whole book, re-encoded, was ~10 KB each by then).
    early, late = sum(written[40:72]) / 32, sum(written[-32:]) / 32
    assert late <= 1.15 * early, f"a decision's changelog grew with history: {early:.0f} -> {late:.0f} bytes"
    assert max(written) < 2_000, max(written)
    restored = ChangelogTable(TABLES["books"], "leases")
    for key, value in log.items():
        if not rows.is_row(key):
            restored.load(1, key, value)
    restored.load_rows(1, [(key, value) for key, value in log.items() if rows.is_row(key)])
    assert restored[b"doc:busy"].to_dict() == book.to_dict()
    assert list(restored[b"doc:busy"].seen) == list(book.seen)
    # A book that goes takes its rows with it.
    assert max(len(r) for r in per_decision[5:]) <= 3 and sum(len(r) for r in per_decision[-16:]) <= 16 + 2 * 2, \
        "each write is the book's record, and a chunk of ids (and a tombstone) one time in 16 ids"
    del table[b"doc:busy"]
    gone = table.take_changes()
    assert {v for _t, _p, _k, v in gone} == {None} and len(gone) >= 1 + 256 // 16


# -- workers that come and go (real Kafka) -------------------------------------------------

class _Consumer:
    """The consumer calls ``Worker.revoked``/``assigned`` make, over a committed offset that stands still."""

    def __init__(self, committed: dict[TopicPartition, int]) -> None:
        self.offsets = committed
        self.seeks: dict[TopicPartition, int] = {}

    async def committed(self, tp: TopicPartition) -> int | None:
        return self.offsets.get(tp)

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self.seeks[tp] = offset

    def assignment(self) -> set[TopicPartition]:
        return set(self.offsets)


async def test_a_batch_not_committed_before_a_rebalance_is_not_skipped_by_the_partitions_kept(
        tmp_path: Path) -> None:
    """The fuzz test once stalled a partition 150 inputs short for good: its last batch before a rebalance
    was decided (positions moved past it) but its commit failed, and the rebalance kept the partition here
    "untouched" (its commit had not moved) and went on past the batch, which stayed uncommitted. Kept
    partitions with a batch not committed are restored and go back to their last commit instead."""
    from aiokafka.errors import KafkaConnectionError

    from arbiter.edge.keys import key_file, write_private_key
    from arbiter.schemas.identity import Signer
    from arbiter.streams.runtime.worker import Worker

    settings = isolated_settings("127.0.0.1:1", tmp_path)
    write_private_key(key_file(tmp_path, "worker"), Signer.generate("worker"))
    worker = Worker(settings)
    clean, dirty = (TopicPartition(settings.topics.wait_edges, p) for p in (0, 1))
    consumer = _Consumer({clean: 10, dirty: 10})
    worker.consumer = consumer  # type: ignore[assignment]
    restored: list[set[TopicPartition]] = []

    async def restore(tps: set[TopicPartition]) -> int:
        restored.append(set(tps))
        return 0

    worker._restore = restore  # type: ignore[method-assign]
    worker.owned = {clean, dirty}
    worker.next = {clean: 10, dirty: 10}
    worker.decided_to = {clean: 10, dirty: 160}  # 150 inputs of ``dirty`` decided, their commit in flight

    async def commit_fails() -> None:
        raise KafkaConnectionError("the commit did not reach the coordinator")

    worker._inflight = asyncio.ensure_future(commit_fails())
    await worker.revoked({clean, dirty})
    await worker.assigned({clean, dirty})
    assert restored == [{clean, dirty}]
    assert worker.next[dirty] == worker.decided_to[dirty] == 10, "it must go back to its last commit"
    assert dirty not in consumer.seeks or consumer.seeks[dirty] == 10
    # A rebalance with every batch committed keeps its partitions as they are.
    worker.next, worker.decided_to = {clean: 10, dirty: 10}, {clean: 10, dirty: 10}
    await worker.revoked({clean, dirty})
    await worker.assigned({clean, dirty})
    assert restored[1:] == [set()], "nothing to restore after a clean rebalance"
    await worker.feed.stop()


async def _churn(settings: Settings, pool: WorkerPool, change: str) -> dict[str, list[int]]:
    """Agents acquire and release 16 resources in a loop while ``change`` happens to the workers
    (``join``: a second one joins, then the first leaves; ``kill``: the first is SIGKILLed after the
    second joined). Returns the tokens each resource was granted, from the event log."""
    parts = settings.partitions
    keys = [key_for_partition(p, parts) for p in range(parts)]
    resources = [key_for_partition(p, parts, prefix=f"churn:{i}-") for p in range(parts) for i in range(4)]
    done: dict[str, int] = defaultdict(int)
    stop = asyncio.Event()

    async def agent(name: str, client: ArbiterClient) -> None:
        while not stop.is_set():
            # A SIGKILLed worker's partitions wait for its session to time out (10 s): answers may
            # take that long (the fault-tolerance issue shortens it).
            lease = await client.acquire(name, ttl=60, wait=60)
            await client.release(lease, timeout=60)
            done[name] += 1

    pool.start(1)
    async with ArbiterClient("churner", settings) as client:
        await wait_until_served(client, pool, keys)
        tasks = [asyncio.create_task(agent(name, client)) for name in resources]
        try:
            await _until(lambda: sum(done.values()) >= 50, pool, tasks)
            pool.start(1)  # worker-2 joins: a rebalance under load
            await wait_until_served(client, pool, keys)
            before = sum(done.values())
            await _until(lambda: sum(done.values()) >= before + 50, pool, tasks)
            first = pool.workers[0]
            if change == "kill":
                first.kill()
            else:
                assert first.stop() == 0, "an orderly stop exits 0"
            pool.workers.remove(first)
            before = sum(done.values())
            await _until(lambda: sum(done.values()) >= before + 50, pool, tasks)
        finally:
            stop.set()
            await asyncio.wait_for(asyncio.gather(*tasks), timeout=120)
    log = await read_log(settings)
    tokens: dict[str, list[int]] = defaultdict(list)
    for entry in log.of(settings.topics.resource_events):
        if isinstance(entry.record, LockGranted):
            tokens[entry.record.resource].append(entry.record.token)
    assert sorted(tokens) == sorted(resources)
    return tokens


async def _until(condition: Callable[[], bool], pool: WorkerPool, tasks: list[asyncio.Task[None]],
                 timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        pool.check_alive()
        for task in tasks:
            if task.done() and (error := task.exception()) is not None:
                raise error
        assert time.monotonic() < deadline, "the agents stopped making progress"
        await asyncio.sleep(0.05)


def _assert_one_decision_per_token(tokens: dict[str, list[int]], redelivery_allowed: bool) -> None:
    for resource, granted in tokens.items():
        distinct = sorted(set(granted))
        assert distinct == list(range(1, len(distinct) + 1)), f"{resource}: tokens skip or go back: {granted}"
        if not redelivery_allowed:
            assert granted == distinct, f"{resource}: a grant was written twice: {granted}"


@pytest.mark.kafka
@pytest.mark.parametrize("guarantee", ["at_least_once", "exactly_once"])
async def test_a_worker_joining_then_leaving_under_load_loses_nothing(bootstrap: str, tmp_path: Path,
                                                                      guarantee: str) -> None:
    settings = isolated_settings(bootstrap, tmp_path, processing_guarantee=guarantee)
    await ensure_topics(settings)
    pool = WorkerPool(settings)
    try:
        tokens = await _churn(settings, pool, "join")
    finally:
        pool.stop()
    # An orderly hand-over commits before it lets go: nothing is decided twice, under either guarantee.
    _assert_one_decision_per_token(tokens, redelivery_allowed=False)
    await assert_clean_audit(settings)


@pytest.mark.kafka
@pytest.mark.parametrize("guarantee", ["at_least_once", "exactly_once"])
async def test_a_worker_killed_under_load_loses_nothing(bootstrap: str, tmp_path: Path, guarantee: str) -> None:
    settings = isolated_settings(bootstrap, tmp_path, processing_guarantee=guarantee)
    await ensure_topics(settings)
    pool = WorkerPool(settings)
    try:
        tokens = await _churn(settings, pool, "kill")
    finally:
        pool.stop()
    # A SIGKILL may redeliver the last uncommitted batch under at_least_once: the same decisions
    # again (same tokens), never new ones. Under exactly_once the aborted transaction is never read.
    _assert_one_decision_per_token(tokens, redelivery_allowed=guarantee == "at_least_once")
    await assert_clean_audit(settings)


@pytest.mark.kafka
async def test_an_orderly_stop_hands_its_partitions_over_before_the_session_times_out(
        bootstrap: str, tmp_path: Path) -> None:
    """SIGTERM leaves the group at once: the survivor owns everything well before a dead member
    would have been noticed (``session_timeout``, raised to 60 s here to tell the two apart)."""
    settings = isolated_settings(bootstrap, tmp_path, session_timeout=60.0)
    await ensure_topics(settings)
    keys = [key_for_partition(p, settings.partitions) for p in range(settings.partitions)]
    pool = WorkerPool(settings)
    try:
        pool.start(2)
        async with ArbiterClient("prober", settings) as client:
            await wait_until_served(client, pool, keys)
            leaving = pool.workers[0]
            started = time.monotonic()
            assert leaving.stop() == 0
            pool.workers.remove(leaving)
            owners: dict[str, str] = {}
            while len(owners) < len(keys):
                assert time.monotonic() - started < 30, f"no takeover within 30 s: {owners}"
                for key in keys:
                    with contextlib.suppress(ArbiterTimeout):
                        owners[key] = (await client.ping(key, timeout=1)).worker_id
    finally:
        pool.stop()
    assert set(owners.values()) == {"worker-2"}


# -- the broker dies under a busy worker ---------------------------------------------------


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        sock.settimeout(0.2)
        return sock.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.e2e
@pytest.mark.kafka
async def test_a_busy_worker_carries_on_after_its_broker_is_killed_and_restarted(tmp_path: Path) -> None:
    """kill -9 of the (only) broker in the middle of a burst: the worker's writes and commits fail,
    it rewinds to its last commit and retries until the broker is back, without restarting; then
    every request is granted, each with the token it would have had anyway, and the audit passes."""
    import os
    import signal
    import socket

    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

    from arbiter.edge.clock import now_ms
    from arbiter.edge.keys import signer_for
    from arbiter.kafka import LocalKafka
    from arbiter.schemas import LockRequested, default_codec
    from arbiter.schemas.identity import ROLE_WORKER

    def free_port() -> int:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return int(sock.getsockname()[1])

    port = free_port()
    own = Settings(home=tmp_path / "broker", kafka_port=port, kafka_controller_port=free_port(),
                   bootstrap=f"127.0.0.1:{port}", kafka_heap="384m")
    share_broker_jars(own.home)
    broker = LocalKafka(own)
    await asyncio.to_thread(broker.up)  # (LocalKafka runs event loops of its own)
    settings = isolated_settings(own.bootstrap, tmp_path / "arbiter")
    pool = WorkerPool(settings)
    total = 12_000
    try:
        await ensure_topics(settings)
        pool.start(1)
        keys = [key_for_partition(p, settings.partitions) for p in range(settings.partitions)]
        async with ArbiterClient("prober", settings) as client:
            await wait_until_served(client, pool, keys)
        codec = default_codec()
        signer = signer_for(settings.home, ROLE_WORKER)  # may send for any agent: the burst passes the gate
        topic = settings.topics.resource_commands
        producer = AIOKafkaProducer(bootstrap_servers=own.bootstrap, linger_ms=5, acks="all")
        await producer.start()
        sent = now_ms()
        for i in range(total):
            key = f"burst:{i}".encode()
            value = codec.encode(LockRequested(request_id=f"r{i}", agent_id=f"agent-{i % 50}", resource=key.decode(),
                                               mode="exclusive", ttl_ms=600_000, at_ms=sent))
            await producer.send(topic, value, key=key, headers=signer.sign(topic, key, value, now_ms()))
        await producer.flush()
        await producer.stop()

        events = AIOKafkaConsumer(bootstrap_servers=own.bootstrap, group_id=None, enable_auto_commit=False,
                                  auto_offset_reset="earliest")
        await events.start()
        tps = [TopicPartition(settings.topics.resource_events, p) for p in range(settings.partitions)]
        events.assign(tps)
        granted: dict[str, list[int]] = defaultdict(list)

        async def read_grants(until: Callable[[], bool], timeout: float) -> None:
            deadline = time.monotonic() + timeout
            while not until():
                pool.check_alive()
                assert time.monotonic() < deadline, f"{len(granted)} of {total} granted after {timeout:.0f} s"
                for messages in (await events.getmany(timeout_ms=200)).values():
                    for message in messages:
                        record = codec.decode(message.value)
                        if isinstance(record, LockGranted):
                            granted[record.resource].append(record.token)

        await read_grants(lambda: len(granted) >= total // 6, 60)  # the worker is busy deciding
        pid = broker.pid()
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        await events.stop()
        deadline = time.monotonic() + 30
        while _listening(own.kafka_port) or _listening(own.kafka_controller_port):  # until the kill is done
            assert time.monotonic() < deadline, "the killed broker still listens"
            await asyncio.sleep(0.1)
        await asyncio.to_thread(broker.up)  # the same data directory: nothing acknowledged is lost
        events = AIOKafkaConsumer(bootstrap_servers=own.bootstrap, group_id=None, enable_auto_commit=False,
                                  auto_offset_reset="earliest")
        await events.start()
        events.assign(tps)
        await events.seek_to_beginning(*tps)
        granted.clear()
        await read_grants(lambda: len(granted) >= total, 180)
        pool.check_alive()  # carried on by itself: the same process throughout
        assert all(set(tokens) == {1} for tokens in granted.values()), "a redelivered request got another token"

        # Every book must be in the changelog, not only in the worker's memory: a fresh worker
        # restores them, and a rival's request on each resource is refused as held, never granted.
        pool.workers[0].kill()
        pool.workers.clear()
        pool.start(1)
        async with ArbiterClient("prober", settings) as client:
            await wait_until_served(client, pool, keys)
        producer = AIOKafkaProducer(bootstrap_servers=own.bootstrap, linger_ms=5, acks="all")
        await producer.start()
        sent = now_ms()
        for i in range(total):
            key = f"burst:{i}".encode()
            value = codec.encode(LockRequested(request_id=f"rival{i}", agent_id="rival", resource=key.decode(),
                                               mode="exclusive", ttl_ms=600_000, wait_ms=0, at_ms=sent))
            await producer.send(topic, value, key=key, headers=signer.sign(topic, key, value, now_ms()))
        await producer.flush()
        await producer.stop()
        answers: dict[str, str] = {}
        deadline = time.monotonic() + 120
        while len(answers) < total:
            pool.check_alive()
            assert time.monotonic() < deadline, f"{len(answers)} of {total} rival requests answered"
            for messages in (await events.getmany(timeout_ms=200)).values():
                for message in messages:
                    record = codec.decode(message.value)
                    if isinstance(record, LockGranted | LockDenied) and record.agent_id == "rival":
                        answers[record.resource] = type(record).__name__
        await events.stop()
        assert set(answers.values()) == {"LockDenied"}, "a book was lost: a rival got a resource that was held"
        await assert_clean_audit(settings)
    finally:
        pool.stop()
        await asyncio.to_thread(broker.down)
