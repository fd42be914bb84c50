"""The guarantees against records nobody honest writes, on real workers and a real broker.

- A validly signed command on a partition its key does not hash to is refused ``misrouted``
  wherever it lands (two workers: the partitions have different owners), nothing is granted,
  and the audit names it and passes.
- Records whose signature headers are broken in every way (sizes, encodings, numbers out of
  range, duplicates), signed by an agent's or a worker's key, are dead-lettered; both workers
  keep running and the audit finishes.
- Forged grants and writes on the events topic fail the audit's ``authenticated`` check, and
  no other.
- A snapshot outside the agent's prefixes is refused at once.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from arbiter.agents import ArbiterClient, LeaseDenied
from arbiter.agents.identities import Registrar
from arbiter.audit import audit
from arbiter.audit.log import read_log
from arbiter.edge.clock import now_ms
from arbiter.edge.keys import read_private_key
from arbiter.edge.settings import Settings
from arbiter.processes import WorkerPool, wait_until_served
from arbiter.schemas import (
    Cause,
    DeadLetter,
    LockDenied,
    LockGranted,
    LockRequested,
    LockTick,
    SagaStep,
    ToolApplied,
    WaitEdgeAdded,
)
from arbiter.schemas.identity import HEADER_AT, HEADER_KEY_ID, HEADER_PROOF, HEADER_SIG, Signer
from arbiter.schemas.partitioning import key_for_partition, partition_for
from arbiter.streams.runtime.topics import ensure_topics
from tests.conftest import isolated_settings
from tests.streams.shells.test_trust_kafka import CODEC, TICK_KEY, Message, Wire, fresh, read_topic

pytestmark = pytest.mark.kafka

PARTITIONS = 4


@pytest.fixture
async def two_workers(bootstrap: str, tmp_path: Path) -> AsyncIterator[tuple[Settings, WorkerPool]]:
    """Four partitions served by two real workers (so neighbouring partitions have different owners)."""
    settings = isolated_settings(bootstrap, tmp_path, partitions=PARTITIONS)
    await ensure_topics(settings)
    pool = WorkerPool(settings)
    pool.start(2)
    try:
        async with ArbiterClient("warmup", settings) as client:
            await wait_until_served(client, pool, [key_for_partition(p, PARTITIONS) for p in range(PARTITIONS)])
        yield settings, pool
    finally:
        pool.stop()


async def letters_at(settings: Settings, wanted: set[tuple[int, int]]) -> dict[tuple[int, int], DeadLetter]:
    """The dead letters of the command-topic records at ``wanted`` (partition, offset), waiting for all."""

    def found(seen: list[Message]) -> dict[tuple[int, int], DeadLetter]:
        out = {}
        for m in seen:
            letter = m.record
            if isinstance(letter, DeadLetter) and (letter.source.partition, letter.source.offset) in wanted:
                out[(letter.source.partition, letter.source.offset)] = letter
        return out

    seen = await read_topic(settings, settings.topics.dead_letter, until=lambda s: wanted <= set(found(s)))
    return found(seen)


async def produce(wire: Wire, topic: str, key: bytes | None, value: bytes, headers: list[tuple[str, bytes]] | None,
                  partition: int) -> tuple[int, int]:
    meta = await (await wire.producer.send(topic, value, key=key, partition=partition, headers=headers))
    return meta.partition, meta.offset


# -- 1. a record is decided only on its key's partition -------------------------------


async def test_a_signed_command_on_any_wrong_partition_is_refused_misrouted_and_nothing_is_granted(
        two_workers: tuple[Settings, WorkerPool]) -> None:
    settings, pool = two_workers
    topic = settings.topics.resource_commands
    alice = await Registrar(settings).add("alice")
    resource = fresh("account:split")
    home = partition_for(resource.encode(), PARTITIONS)
    wrong = [p for p in range(PARTITIONS) if p != home]
    request = LockRequested(request_id=uuid.uuid4().hex, agent_id="alice", resource=resource, mode="exclusive",
                            ttl_ms=60_000, wait_ms=0, at_ms=now_ms())
    value = CODEC.encode(request)
    headers = alice.sign(topic, resource.encode(), value, now_ms())
    others = [request.model_copy(update={"request_id": uuid.uuid4().hex}) for _ in wrong]
    async with Wire(settings) as wire:
        # The same signed request on its own partition and, byte for byte, on every other one; and a
        # distinct signed request on each wrong partition alone.
        right = await produce(wire, topic, resource.encode(), value, headers, home)
        copies = {await produce(wire, topic, resource.encode(), value, headers, p) for p in wrong}
        alone = set()
        for p, other in zip(wrong, others, strict=True):
            other_value = CODEC.encode(other)
            alone.add(await produce(wire, topic, resource.encode(), other_value,
                                    alice.sign(topic, resource.encode(), other_value, now_ms()), p))
        # A worker's clock tick, copied to another partition, would expire leases there. (A tick is written
        # only where a deadline is due: a lease of a second makes one.)
        async with ArbiterClient("alice", settings) as alice_sdk:
            await alice_sdk.acquire(fresh("account:tick"), ttl=1, wait=5)
        ticks = await read_topic(settings, topic, until=lambda s: any(isinstance(m.record, LockTick) for m in s))
        tick = next(m for m in ticks if isinstance(m.record, LockTick))
        moved_tick = await produce(wire, topic, TICK_KEY, tick.value, list(tick.headers),
                                   (tick.partition + 1) % PARTITIONS)
    letters = await letters_at(settings, copies | alone | {moved_tick})
    assert {letter.reason for letter in letters.values()} == {"misrouted"}, letters
    assert all(f"partition {home}" in letters[c].detail for c in copies)
    # Alice hears of each refused request at once, in her inbox; the copy of the granted one changes nothing.
    inbox = await read_topic(settings, settings.topics.agent_inbox, until=lambda s: {o.request_id for o in others}
                             <= {m.record.request_id for m in s if isinstance(m.record, LockDenied)})
    denied = {m.record.request_id: m.record for m in inbox if isinstance(m.record, LockDenied)}
    assert all(denied[o.request_id].reason == "misrouted" for o in others)
    events = [m.record for m in await read_topic(settings, settings.topics.resource_events)
              if m.key == resource.encode()]
    grants = [e for e in events if isinstance(e, LockGranted)]
    assert [(g.request_id, g.token, g.cause.partition) for g in grants] == [(request.request_id, 1, home)]
    assert right[0] == home
    pool.check_alive()
    # The audit names every refused copy and passes: they were refused, and changed nothing.
    report = await audit(await read_log(settings), settings)
    assert report["verdict"] == "pass", [f for f in report["findings"] if f["severity"] == "violation"]
    named = {r["where"] for r in report["refused_inputs"] if r["reason"] == "misrouted"}
    assert {f"{topic}[{p}]@{o}" for p, o in copies | alone | {moved_tick}} <= named
    assert report["stats"]["misrouted_commands"] >= len(copies | alone)


# -- 2. every header, every stage, inside the guard ------------------------------------


def _mutations(headers: list[tuple[str, bytes]]) -> list[tuple[str, list[tuple[str, bytes]] | None]]:
    """Ways to break good signature headers (kid, at, sig)."""
    kid, at, sig = (dict(headers)[h] for h in (HEADER_KEY_ID, HEADER_AT, HEADER_SIG))
    rand = os.urandom(64)

    def only(changes: dict[str, bytes | None]) -> list[tuple[str, bytes]]:
        values: dict[str, bytes | None] = {HEADER_KEY_ID: kid, HEADER_AT: at, HEADER_SIG: sig, **changes}
        return [(k, v) for k, v in values.items() if v is not None]

    return [
        ("a 40-digit signing time, a random signature", only({HEADER_AT: b"1" * 40, HEADER_SIG: rand})),
        ("a signing time past a signed 64-bit integer", only({HEADER_AT: b"9" * 19})),
        ("a negative signing time", only({HEADER_AT: b"-5"})),
        ("an empty signing time", only({HEADER_AT: b""})),
        ("a signing time in Arabic-Indic digits", only({HEADER_AT: "١٢٣٤".encode()})),
        ("a signing time with spaces", only({HEADER_AT: b" 17 "})),
        ("a signing time that is not UTF-8", only({HEADER_AT: b"\xff\xfe12"})),
        ("a key id that is not hex", only({HEADER_KEY_ID: b"zz" * 16})),
        ("a key id in upper case", only({HEADER_KEY_ID: kid.upper()})),
        ("a key id of 200 kB", only({HEADER_KEY_ID: b"a" * 200_000})),
        ("an empty key id", only({HEADER_KEY_ID: b""})),
        ("a signature of 63 bytes", only({HEADER_SIG: sig[:63]})),
        ("a signature of 200 kB", only({HEADER_SIG: b"\x00" * 200_000})),
        ("an empty signature", only({HEADER_SIG: b""})),
        ("no signing time", only({HEADER_AT: None})),
        ("two key ids", [*headers, (HEADER_KEY_ID, kid)]),
        ("two signatures, the good one first", [*headers, (HEADER_SIG, rand)]),
        ("two signing times", [(HEADER_AT, b"1"), *headers]),
        ("a batch proof of garbage", [*headers, (HEADER_PROOF, os.urandom(50))]),
        ("a batch proof of 40 steps", [*headers, (HEADER_PROOF, os.urandom(33 * 40))]),
        ("an empty batch proof", [*headers, (HEADER_PROOF, b"")]),
        ("a hundred unrelated headers, a random signature",
         [*only({HEADER_SIG: rand}), *((f"x-{i}", os.urandom(10)) for i in range(100))]),
    ]


async def test_broken_signature_headers_of_every_kind_are_dead_lettered_and_no_worker_or_audit_stops(
        two_workers: tuple[Settings, WorkerPool]) -> None:
    settings, pool = two_workers
    t = settings.topics
    alice = await Registrar(settings).add("alice")
    worker_key = read_private_key(settings.home / "keys" / "worker.key", "worker")
    resource = fresh("account:fuzz")
    saga_id = f"saga:alice/{uuid.uuid4().hex}"
    records = [
        (t.resource_commands, resource.encode(),
         LockRequested(request_id=uuid.uuid4().hex, agent_id="alice", resource=resource, mode="exclusive",
                       ttl_ms=60_000, wait_ms=0, at_ms=now_ms())),
        (t.wait_edges, settings.graph_key.encode(),
         WaitEdgeAdded(edge_id=f"delegation|alice|bob|{uuid.uuid4().hex}", waiter="alice", holder="bob",
                       source="delegation", resource=None, waiter_priority=0, waiter_registered_at_ms=0,
                       at_ms=now_ms())),
        (t.saga_commands, saga_id.encode(),
         SagaStep(saga_id=saga_id, step=1, agent_id="alice", status="applied", intent_id=uuid.uuid4().hex,
                  resource=resource, tool="refund", arguments_json="{}", at_ms=now_ms())),
    ]
    sent: dict[tuple[str, int, int], str] = {}
    async with Wire(settings) as wire:
        for signer in (alice, worker_key):
            for topic, key, record in records:
                value = CODEC.encode(record)
                for what, headers in _mutations(signer.sign(topic, key, value, now_ms())):
                    meta = await (await wire.producer.send(topic, value, key=key, headers=headers))
                    sent[(topic, meta.partition, meta.offset)] = f"{what} ({signer.name}, {type(record).__name__})"

    def letters(seen: list[Message]) -> dict[tuple[str, int, int], DeadLetter]:
        return {(m.record.source.topic, m.record.source.partition, m.record.source.offset): m.record
                for m in seen if isinstance(m.record, DeadLetter)}

    try:
        seen = await read_topic(settings, t.dead_letter, until=lambda s: set(sent) <= set(letters(s)), timeout=60)
    except AssertionError:
        seen = await read_topic(settings, t.dead_letter)
    found = letters(seen)
    assert not set(sent) - set(found), [sent[w] for w in set(sent) - set(found)]
    wrong = {sent[where]: found[where].reason for where in sent if found[where].reason != "unauthenticated"}
    assert not wrong, wrong
    pool.check_alive()  # both workers still running
    async with ArbiterClient("carol", settings) as carol:
        lease = await carol.acquire(fresh("account:after"), ttl=10, wait=5)
        assert lease.token == 1
    started = time.monotonic()
    report = await audit(await read_log(settings), settings)
    assert time.monotonic() - started < 60
    assert report["verdict"] == "pass", [f for f in report["findings"] if f["severity"] == "violation"]
    assert report["stats"]["refused_commands"] >= len(sent)


# -- 3. the audit's safety checks see only admitted records ---------------------------


async def test_forged_grants_and_writes_on_the_events_topic_fail_only_authenticated(
        two_workers: tuple[Settings, WorkerPool]) -> None:
    settings, _pool = two_workers
    t = settings.topics
    mallory = await Registrar(settings).add("mallory", allow=["account:mallory"])
    resource = fresh("account:held")
    async with ArbiterClient("alice", settings) as alice:
        lease = await alice.acquire(resource, ttl=60, wait=5)
        cause = Cause(topic=t.resource_commands, partition=partition_for(resource.encode(), PARTITIONS), offset=0)
        forged_grant = LockGranted(request_id=uuid.uuid4().hex, agent_id="mallory", resource=resource, token=999,
                                   mode="exclusive", expires_at_ms=now_ms() + 3_600_000, holders=[],
                                   resource_version=0, at_ms=now_ms(), cause=cause)
        forged_write = ToolApplied(intent_id=uuid.uuid4().hex, agent_id="mallory", resource=resource, tool="refund",
                                   token=999, version=99, content_hash="f" * 32, result_json="{}",
                                   at_ms=now_ms(), cause=cause)
        async with Wire(settings) as wire:
            for record, signer in ((forged_grant, mallory), (forged_grant, None), (forged_write, mallory),
                                   (forged_write, Signer.generate("worker"))):
                await wire.send(t.resource_events, resource.encode(), record, signer)
        await alice.release(lease)
    log = await read_log(settings)
    report = await audit(log, settings)
    # Named under `authenticated` as intrusions detected, and nowhere else: no other check sees them.
    assert report["verdict"] == "pass", [f for f in report["findings"] if f["severity"] == "violation"]
    assert {name for name, row in report["checks"].items() if row["violations"] or row["intrusions"]} \
        == {"authenticated"}
    assert report["checks"]["authenticated"]["intrusions"] == 4 and report["violations"] == 0
    strict = await audit(log, settings, strict=True)
    assert strict["verdict"] == "fail" and strict["intrusions"] == 4


# -- 4. refusals answer ------------------------------------------------------------------


async def test_a_snapshot_outside_the_agents_prefixes_is_refused_at_once(
        two_workers: tuple[Settings, WorkerPool]) -> None:
    settings, _pool = two_workers
    await Registrar(settings).add("mallory", allow=["account:mallory"])
    async with ArbiterClient("mallory", settings) as mallory:
        await mallory.snapshot("account:mallory/own")  # warm: her own prefix answers
        started = time.monotonic()
        with pytest.raises(LeaseDenied) as refused:
            await mallory.snapshot(fresh("account:alice"))
        assert time.monotonic() - started < 1.0
    assert refused.value.reason == "forbidden" and "what_to_do" in refused.value.diagnostic


def test_a_tick_names_its_partition() -> None:
    """(The rule the workers apply to ticks, without a broker: a tick decides only its own partition.)"""
    from arbiter.streams.shells.pipeline import RawInput, route_problem

    tick = LockTick(request_id="t", partition=2, at_ms=0)
    at = RawInput("commands", 2, 0, TICK_KEY, b"", (), 1)
    assert route_problem(at, tick, 4) is None
    assert route_problem(RawInput("commands", 3, 0, TICK_KEY, b"", (), 1), tick, 4) is not None
    assert route_problem(RawInput("commands", 2, 0, b"other", b"", (), 1), tick, 4) is not None
