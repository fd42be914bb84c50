"""The trust boundary against real workers: each class of attack is refused, and nothing changes.

The attacker, mallory, has topic access and a key of her own, registered for her own prefixes
only (``account:mallory``, ``ticket:mallory``). She writes raw records with ``AIOKafkaProducer``:
unsigned, signed with her key, signed with a key nobody registered, or signed with her key under
another identity's name. Every test asserts the refusal (the answer in the named agent's inbox
and the dead letter, with its reason) and that no state moved: leases keep their tokens, sagas
keep their course, the ledger keeps its balances.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from arbiter.agents import ArbiterClient, LeaseDenied
from arbiter.agents.identities import Operator, Registrar
from arbiter.edge.clock import now_ms
from arbiter.edge.settings import Settings
from arbiter.processes import WorkerPool
from arbiter.schemas import (
    Cause,
    CompensationRequested,
    DeadLetter,
    DeadlockDetected,
    Holder,
    LockDenied,
    LockGranted,
    LockQueued,
    LockReleased,
    LockReleaseRequested,
    LockRenewed,
    LockRenewRequested,
    LockRequested,
    LockRevoked,
    LockRevokeRequested,
    LockTick,
    Record,
    SagaFinished,
    SagaStep,
    SnapshotRequested,
    ToolApplied,
    ToolIntent,
    ToolRejected,
    WaitEdgeAdded,
    default_codec,
)
from arbiter.schemas.identity import Signer
from arbiter.schemas.partitioning import partition_for
from arbiter.streams.tools.ledger import Ledger
from tests.conftest import assert_clean_audit

pytestmark = pytest.mark.kafka

CODEC = default_codec()
MALLORY_PREFIXES = ["account:mallory", "ticket:mallory"]
TICK_KEY = b"__tick__"  # the workers' tick key (arbiter.streams.shells.pipeline.TICK_KEY)
UNAUTHENTICATED, FORBIDDEN = "unauthenticated", "forbidden"
WAIT_S = 30.0


def fresh(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


# -- the attacker's wire -------------------------------------------------------------


class Wire:
    """A raw producer: what anyone with write access to the topics can send."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.producer = AIOKafkaProducer(bootstrap_servers=settings.bootstrap, acks="all", linger_ms=0)

    async def __aenter__(self) -> Wire:
        await self.producer.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.producer.stop()

    async def send(self, topic: str, key: bytes | None, record: Record, signer: Signer | None, *,
                   partition: int | None = None) -> bytes:
        """Encode ``record``, sign it with ``signer`` (None: unsigned), send it; the value bytes."""
        value = CODEC.encode(record)
        headers = signer.sign(topic, key, value, now_ms()) if signer is not None else None
        await self.send_raw(topic, key, value, headers, partition=partition)
        return value

    async def send_raw(self, topic: str, key: bytes | None, value: bytes,
                       headers: Sequence[tuple[str, bytes]] | None, *, partition: int | None = None) -> None:
        await self.producer.send_and_wait(topic, value, key=key, partition=partition,
                                          headers=list(headers) if headers else None)

    async def to_inbox(self, agent: str, record: Record, signer: Signer | None) -> bytes:
        """Put ``record`` in ``agent``'s inbox partition (the one its SDK reads)."""
        topic = self.settings.topics.agent_inbox
        partitions = await self.producer.partitions_for(topic)
        return await self.send(topic, agent.encode(), record, signer,
                               partition=partition_for(agent.encode(), len(partitions)))


# -- reading the log -----------------------------------------------------------------


@dataclass(frozen=True)
class Message:
    """One message of a topic, decoded when it decodes."""

    partition: int
    offset: int
    key: bytes | None
    value: bytes
    headers: tuple[tuple[str, bytes], ...]
    record: Record | None


async def read_topic(settings: Settings, topic: str, until: Callable[[list[Message]], bool] | None = None,
                     timeout: float = WAIT_S) -> list[Message]:
    """Every message of ``topic`` from the start: up to its current end (``until`` None), or until
    ``until(messages so far)`` holds (waiting on the log, at most ``timeout`` seconds)."""
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.bootstrap, group_id=None, enable_auto_commit=False,
                                auto_offset_reset="earliest", isolation_level="read_committed")
    await consumer.start()
    try:
        cluster = await consumer._client.fetch_all_metadata()
        tps = [TopicPartition(topic, p) for p in sorted(cluster.partitions_for_topic(topic) or ())]
        assert tps, f"no topic {topic}"
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends = await consumer.end_offsets(tps)
        seen: list[Message] = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            if until is None:
                if all([await consumer.position(tp) >= ends[tp] for tp in tps]):
                    return seen
            elif until(seen):
                return seen
            if loop.time() > deadline:
                kinds = [type(m.record).__name__ for m in seen][-20:]
                raise AssertionError(f"the awaited record did not appear on {topic} within {timeout}s; "
                                     f"last seen: {kinds}")
            for batch in (await consumer.getmany(*tps, timeout_ms=200)).values():
                for m in batch:
                    try:
                        record: Record | None = CODEC.decode(m.value) if m.value is not None else None
                    except Exception:
                        record = None
                    seen.append(Message(m.partition, m.offset, m.key, m.value or b"",
                                        tuple((k, bytes(v)) for k, v in (m.headers or ())), record))
    finally:
        await consumer.stop()


async def dead_letters(settings: Settings, values: Sequence[bytes]) -> list[DeadLetter]:
    """The dead letter of each forged value (in ``values`` order), waiting until all are there."""

    def letters(seen: list[Message]) -> dict[bytes, DeadLetter]:
        return {m.record.value: m.record for m in seen if isinstance(m.record, DeadLetter)}

    seen = await read_topic(settings, settings.topics.dead_letter, until=lambda s: set(values) <= set(letters(s)))
    found = letters(seen)
    return [found[v] for v in values]


def answer_id(record: Record | None) -> str | None:
    """The request or intent id a command carries, or an answer answers."""
    if isinstance(record, ToolIntent | ToolApplied | ToolRejected):
        return record.intent_id
    value = getattr(record, "request_id", None)
    return value if isinstance(value, str) else None


async def inbox_answers(settings: Settings, agent: str, ids: Sequence[str]) -> dict[str, Record]:
    """The refusal (LockDenied / ToolRejected) each id got in ``agent``'s inbox, waiting for all."""

    def answers(seen: list[Message]) -> dict[str, Record]:
        found: dict[str, Record] = {}
        for m in seen:
            i = answer_id(m.record)
            if i is not None and i in ids and m.key == agent.encode() \
                    and isinstance(m.record, LockDenied | ToolRejected):
                found[i] = m.record
        return found

    seen = await read_topic(settings, settings.topics.agent_inbox, until=lambda s: set(ids) <= set(answers(s)))
    return answers(seen)


async def events_on(settings: Settings, resource: str) -> list[Record]:
    """Every decision on the resource-event topic for ``resource``, in log order."""
    return [m.record for m in await read_topic(settings, settings.topics.resource_events)
            if m.key == resource.encode() and m.record is not None]


async def saga_finished(settings: Settings, saga_id: str) -> SagaFinished:
    def done(seen: list[Message]) -> bool:
        return any(isinstance(m.record, SagaFinished) and m.record.saga_id == saga_id for m in seen)

    seen = await read_topic(settings, settings.topics.saga_events, until=done)
    (finished,) = [m.record for m in seen if isinstance(m.record, SagaFinished) and m.record.saga_id == saga_id]
    return finished


async def eventually(check: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    """Wait until ``check()`` holds (an SDK counter, which has no log to wait on)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not check():
        if loop.time() > deadline:
            raise AssertionError(f"not within {timeout}s: {what}")
        await asyncio.sleep(0.05)


def assert_refused(letter: DeadLetter, reason: str, *, detail: str = "") -> None:
    assert (letter.reason, detail in letter.detail) == (reason, True), (letter.reason, letter.detail)


# -- the cast ------------------------------------------------------------------------


async def register_mallory(settings: Settings) -> Signer:
    """Mallory: a registered agent, restricted to her own prefixes (her key file is in the home)."""
    return await Registrar(settings).add("mallory", allow=MALLORY_PREFIXES)


def seeded_ledger(settings: Settings, balances: dict[str, int]) -> Ledger:
    """The worker's ledger (SQLite in the test home), started over with ``balances``."""
    ledger = Ledger(settings.ledger_url())
    ledger.seed(balances)
    return ledger


def inbox_cause(settings: Settings) -> Cause:
    return Cause(topic=settings.topics.resource_commands, partition=0, offset=0)


# -- 1. impersonation ----------------------------------------------------------------


async def test_impersonation_is_refused_and_alice_keeps_her_lease_and_her_money(
        kafka_settings: Settings, worker: WorkerPool) -> None:
    settings = kafka_settings
    ledger = seeded_ledger(settings, {"alice": 10_000, "mallory": 0})
    mallory = await register_mallory(settings)
    signers: list[tuple[str, Signer | None, str, str]] = [
        ("unsigned", None, UNAUTHENTICATED, "not signed"),
        ("mallory", mallory, FORBIDDEN, "acts as 'alice'"),
        ("unregistered", Signer.generate("alice"), UNAUTHENTICATED, "unknown signing key"),
        # mallory's own key, signing under alice's name: the signature covers the signer's name.
        ("posing", Signer("alice", mallory.private_key), UNAUTHENTICATED, "does not match"),
    ]
    resource = "account:alice"
    commands = settings.topics.resource_commands
    async with ArbiterClient("alice", settings) as alice, Wire(settings) as wire:
        lease = await alice.acquire(resource, ttl=60, wait=0)
        base = (await alice.snapshot(resource)).version
        before = ledger.balances()
        sent: list[tuple[bytes, str, str, str]] = []  # value, answered id, reason, detail
        for label, signer, reason, detail in signers:
            release = LockReleaseRequested(request_id=fresh(f"release-{label}"), agent_id="alice", resource=resource,
                                           token=lease.token, at_ms=now_ms())
            renew = LockRenewRequested(request_id=fresh(f"renew-{label}"), agent_id="alice", resource=resource,
                                       token=lease.token, ttl_ms=1, at_ms=now_ms())  # would end it at once
            for command in (release, renew):
                value = await wire.send(commands, resource.encode(), command, signer)
                sent.append((value, command.request_id, reason, detail))
        # Through the gateway as alice, with her token and the right base: only the signature is wrong.
        for label, signer, reason, detail in signers[:2]:
            intent = ToolIntent(intent_id=fresh(f"steal-{label}"), agent_id="alice", resource=resource,
                                token=lease.token, base_version=base, tool="transfer",
                                arguments_json=json.dumps({"to": "mallory", "amount": 5_000}), at_ms=now_ms())
            value = await wire.send(commands, resource.encode(), intent, signer)
            sent.append((value, intent.intent_id, reason, detail))
        # Mallory may not even read a resource outside her prefixes (no answer; the dead letter says why).
        peek = SnapshotRequested(request_id=fresh("peek"), agent_id="mallory", resource=resource, at_ms=now_ms())
        peek_value = await wire.send(commands, resource.encode(), peek, mallory)

        letters = await dead_letters(settings, [value for value, *_ in sent] + [peek_value])
        for (_, _, reason, detail), letter in zip(sent, letters, strict=False):
            assert_refused(letter, reason, detail=detail)
        assert_refused(letters[-1], FORBIDDEN, detail="may act only on resources starting with")
        answers = await inbox_answers(settings, "alice", [answered for _, answered, *_ in sent])
        for _, answered, reason, _ in sent:
            assert getattr(answers[answered], "reason", None) == reason, answers[answered]
        assert alice._transport.forged == 0  # the refusals are the workers' own answers

        # Nothing changed: one grant, no release, renewal or write; her lease works with the same token.
        kinds = [type(e).__name__ for e in await events_on(settings, resource)]
        assert kinds == ["LockGranted"], kinds
        assert ledger.balances() == before
        await alice.renew(lease, ttl=60)
        assert not lease.lost
        mine = await alice.snapshot(resource)
        assert [(h["agent_id"], h["token"]) for h in mine.holders] == [("alice", lease.token)]
        await alice.release(lease)
    assert ledger.balances() == before


async def test_a_snapshot_does_not_show_other_agents_tokens(kafka_settings: Settings, worker: WorkerPool) -> None:
    settings = kafka_settings
    await register_mallory(settings)
    shared = "ticket:mallory-shared"  # under mallory's prefix; alice (no prefixes) may hold it too
    async with ArbiterClient("alice", settings) as alice, ArbiterClient("mallory", settings) as mallory:
        lease = await alice.acquire(shared, ttl=60, wait=0)
        own = await alice.snapshot(shared)
        assert [(h["agent_id"], h["token"]) for h in own.holders] == [("alice", lease.token)]
        seen = await mallory.snapshot(shared)
        assert [h["agent_id"] for h in seen.holders] == ["alice"]
        assert [h["token"] for h in seen.holders] == [0], (
            f"mallory's snapshot shows alice's fencing token {seen.holders[0]['token']}: another agent's holders "
            "must carry token 0")
        await alice.release(lease)


# -- 2. forged decisions -------------------------------------------------------------


async def test_forged_decisions_in_alices_inbox_are_ignored(kafka_settings: Settings, worker: WorkerPool) -> None:
    settings = kafka_settings
    mallory = await register_mallory(settings)
    resource = "ticket:alice-queue"
    async with ArbiterClient("alice", settings) as alice, ArbiterClient("bob", settings) as bob, \
            Wire(settings) as wire:
        held = await bob.acquire(resource, ttl=60, wait=0)
        queued: asyncio.Future[LockQueued] = asyncio.get_running_loop().create_future()

        def on_queued(q: LockQueued) -> None:
            if not queued.done():
                queued.set_result(q)

        pending = asyncio.create_task(alice.acquire(resource, ttl=30, wait=60, on_queued=on_queued))
        request_id = (await asyncio.wait_for(queued, WAIT_S)).request_id  # mallory reads it off the inbox
        now = now_ms()
        grant = LockGranted(request_id=request_id, agent_id="alice", resource=resource, token=held.token + 100,
                            mode="exclusive", expires_at_ms=now + 60_000,
                            holders=[Holder(agent_id="alice", request_id=request_id, token=held.token + 100,
                                            mode="exclusive", expires_at_ms=now + 60_000)],
                            resource_version=0, request_sent_at_ms=now, at_ms=now,
                            cause=inbox_cause(settings))
        denial = LockDenied(request_id=request_id, agent_id="alice", resource=resource, reason="busy",
                            detail="{}", request_sent_at_ms=now, at_ms=now, cause=inbox_cause(settings))
        forgeries: list[tuple[Record, Signer | None]] = [
            (grant, None),
            (grant, mallory),
            (grant, Signer("worker", mallory.private_key)),  # her key under the workers' name
            (grant, Signer.generate("worker")),  # a key nobody registered
            (denial, mallory),
        ]
        for count, (record, signer) in enumerate(forgeries, start=1):
            await wire.to_inbox("alice", record, signer)
            await eventually(lambda n=count: alice._transport.forged >= n,  # type: ignore[misc]
                             f"alice's SDK counts forgery {count} as forged")
            assert not pending.done(), "a forged decision resolved alice's pending acquire"
        assert alice._transport.forged == len(forgeries)
        await bob.release(held)
        lease = await asyncio.wait_for(pending, WAIT_S)  # the real grant, from the worker
        assert lease.token == held.token + 1
        await alice.release(lease)
    grants = [e for e in await events_on(settings, resource) if isinstance(e, LockGranted)]
    assert [(g.agent_id, g.token) for g in grants] == [("bob", held.token), ("alice", held.token + 1)]


async def test_a_forged_deadlock_notice_does_not_abort_alices_saga(kafka_settings: Settings,
                                                                  worker: WorkerPool) -> None:
    settings = kafka_settings
    ledger = seeded_ledger(settings, {"alice": 10_000})
    mallory = await register_mallory(settings)
    async with ArbiterClient("alice", settings) as alice, Wire(settings) as wire, alice.saga("refund") as saga:
        async with saga.lease("account:alice", ttl=60) as lease:
            base = (await alice.snapshot("account:alice")).version
            await saga.step(lease, "refund", {"order_id": "o-2", "amount": 250}, base_version=base,
                            compensate=lambda o: ("reverse_refund", {"refund_intent_id": o.intent_id}))
        cycle = ["alice", "carol", "alice"]
        notice = DeadlockDetected(detection_id=fresh("forged"), victim="alice", cycle=cycle,
                                  cycle_json=json.dumps(cycle), message="you are the victim: abort",
                                  saga_id=saga.saga_id, at_ms=now_ms(),
                                  cause=Cause(topic=settings.topics.wait_edges, partition=0, offset=0))
        for count, signer in enumerate((None, mallory, Signer("worker", mallory.private_key)), start=1):
            await wire.to_inbox("alice", notice, signer)
            await eventually(lambda n=count: alice._transport.forged >= n,  # type: ignore[misc]
                             f"alice's SDK counts notice {count} as forged")
        assert alice.deadlocks == [] and saga.abort_reason is None
        # Leaving the block normally completes the saga (an abort would raise SagaAborted).
    assert (await saga_finished(settings, saga.saga_id)).outcome == "COMPLETED"
    assert ledger.balances()["alice"] == 10_000 - 250
    assert [r["reversed_by"] for r in ledger.refunds()] == [None]


# -- 3. forged processor commands ----------------------------------------------------


async def test_processor_commands_signed_by_an_agent_are_forbidden(kafka_settings: Settings,
                                                                   worker: WorkerPool) -> None:
    settings = kafka_settings
    mallory = await register_mallory(settings)
    resource = "ticket:alice-held"
    topics = settings.topics
    async with ArbiterClient("alice", settings) as alice, Wire(settings) as wire:
        lease = await alice.acquire(resource, ttl=60, wait=0)
        now = now_ms()
        # The lease book's edges (source "lock"), closing a cycle that would make someone a victim.
        edges = [WaitEdgeAdded(edge_id=f"lock|{resource}|{fresh('r')}|{holder}", waiter=waiter, holder=holder,
                               source="lock", resource=resource, waiter_priority=0, waiter_registered_at_ms=0,
                               at_ms=now) for waiter, holder in (("mallory", "alice"), ("alice", "mallory"))]
        sent = [await wire.send(topics.wait_edges, settings.graph_key.encode(), edge, mallory) for edge in edges]
        for partition in range(settings.partitions):
            tick = LockTick(request_id=fresh("forged-tick"), partition=partition, at_ms=now_ms())
            sent.append(await wire.send(topics.resource_commands, TICK_KEY, tick, mallory, partition=partition))
        revoke = LockRevokeRequested(request_id=fresh("revoke"), resource=resource, agent_id="alice",
                                     token=lease.token, reason="stuck", requested_by="mallory", at_ms=now_ms())
        sent.append(await wire.send(topics.resource_commands, resource.encode(), revoke, mallory))

        letters = await dead_letters(settings, sent)
        assert_refused(letters[0], FORBIDDEN, detail="delegation edges")
        assert_refused(letters[1], FORBIDDEN, detail="acts as 'alice'")
        for letter in letters[2:]:
            assert_refused(letter, FORBIDDEN, detail="sent only by workers or an admin")

        detections = [m.record for m in await read_topic(settings, topics.wait_edges)
                      if isinstance(m.record, DeadlockDetected)]
        assert detections == [] and alice.deadlocks == []
        kinds = [type(e).__name__ for e in await events_on(settings, resource)]
        assert kinds == ["LockGranted"], kinds  # no revocation, expiry or release
        await alice.renew(lease, ttl=60)
        assert not lease.lost and lease.lost_reason is None
        await alice.release(lease)


async def test_saga_commands_forged_by_mallory_are_forbidden_and_the_ledger_is_unchanged(
        kafka_settings: Settings, worker: WorkerPool) -> None:
    settings = kafka_settings
    ledger = seeded_ledger(settings, {"alice": 10_000, "carol": 10_000, "mallory": 0})
    mallory = await register_mallory(settings)
    sagas = settings.topics.saga_commands

    def refund_undo(outcome: object) -> tuple[str, dict[str, str]]:
        return "reverse_refund", {"refund_intent_id": getattr(outcome, "intent_id", "")}

    def theft(saga_id: str, step: int, agent: str) -> SagaStep:
        """A completed step on carol's account whose 'compensation' pays mallory."""
        return SagaStep(saga_id=saga_id, step=step, agent_id=agent, status="completed", intent_id=fresh("i"),
                        resource="account:carol", tool="transfer",
                        arguments_json=json.dumps({"to": "carol", "amount": 1}), compensate_tool="transfer",
                        compensate_arguments_json=json.dumps({"to": "mallory", "amount": 5_000}), at_ms=now_ms())

    async with ArbiterClient("alice", settings) as alice, Wire(settings) as wire:
        # (a) An abort of alice's saga, in her name and in mallory's: refused; the saga completes.
        async with alice.saga("keep") as kept:
            async with kept.lease("account:alice", ttl=60) as lease:
                base = (await alice.snapshot("account:alice")).version
                await kept.step(lease, "refund", {"order_id": "o-keep", "amount": 100}, base_version=base,
                                compensate=refund_undo)
            aborts = [CompensationRequested(saga_id=kept.saga_id, reason="mallory says so", requested_by=by,
                                            at_ms=now_ms()) for by in ("alice", "mallory")]
            sent = [await wire.send(sagas, kept.saga_id.encode(), abort, mallory) for abort in aborts]
            letters = await dead_letters(settings, sent)
            assert_refused(letters[0], FORBIDDEN, detail="acts as 'alice'")
            assert_refused(letters[1], FORBIDDEN, detail="is not 'mallory''s")
        assert (await saga_finished(settings, kept.saga_id)).outcome == "COMPLETED"

        # (b) Steps injected into alice's saga (as mallory, as alice): refused; her abort undoes only her step.
        with pytest.raises(RuntimeError, match="alice gives up"):
            async with alice.saga("undo") as undone:
                async with undone.lease("account:alice", ttl=60) as lease:
                    base = (await alice.snapshot("account:alice")).version
                    await undone.step(lease, "refund", {"order_id": "o-undo", "amount": 200}, base_version=base,
                                      compensate=refund_undo)
                injected = [theft(undone.saga_id, 1, "mallory"), theft(undone.saga_id, 2, "alice")]
                sent = [await wire.send(sagas, undone.saga_id.encode(), step, mallory) for step in injected]
                letters = await dead_letters(settings, sent)
                assert_refused(letters[0], FORBIDDEN, detail="is not 'mallory''s")
                assert_refused(letters[1], FORBIDDEN, detail="acts as 'alice'")
                raise RuntimeError("alice gives up")
        assert (await saga_finished(settings, undone.saga_id)).outcome == "COMPENSATED"

    # (c) Mallory's own sagas: one whose id is not hers, one of hers on carol's account; then she aborts it.
    heist = f"saga:mallory/heist:{uuid.uuid4().hex}"
    async with Wire(settings) as wire:
        not_hers = SagaStep(saga_id="saga:heist-1", step=0, agent_id="mallory", status="completed",
                            intent_id=fresh("i"), resource="account:mallory", tool="transfer",
                            arguments_json="{}", at_ms=now_ms())
        sent = [await wire.send(sagas, b"saga:heist-1", not_hers, mallory),
                await wire.send(sagas, heist.encode(), theft(heist, 0, "mallory"), mallory)]
        letters = await dead_letters(settings, sent)
        assert_refused(letters[0], FORBIDDEN, detail="is not 'mallory''s")
        assert_refused(letters[1], FORBIDDEN, detail="not on 'account:carol'")
        # Her abort of her own saga is hers to send: accepted, and there is nothing to compensate.
        abort = CompensationRequested(saga_id=heist, reason="abort", requested_by="mallory", at_ms=now_ms())
        await wire.send(sagas, heist.encode(), abort, mallory)
    assert (await saga_finished(settings, heist)).outcome == "COMPENSATED"

    compensated = [m.record for m in await read_topic(settings, settings.topics.saga_events)
                   if m.record is not None and type(m.record).__name__ == "Compensated"]
    assert [(getattr(c, "saga_id", ""), getattr(c, "step", -1)) for c in compensated] == [(undone.saga_id, 0)]
    balances = ledger.balances()
    assert (balances["alice"], balances["carol"], balances["mallory"]) == (10_000 - 100, 10_000, 0)
    assert ledger.invariants()["ok"]


# -- 4. predictable ids --------------------------------------------------------------


async def test_ids_in_the_derived_saga_namespace_are_forbidden(kafka_settings: Settings, worker: WorkerPool) -> None:
    settings = kafka_settings
    ledger = seeded_ledger(settings, {"mallory": 1_000, "carol": 0})
    signer = await register_mallory(settings)
    resource = "account:mallory"
    async with ArbiterClient("mallory", settings) as mallory, Wire(settings) as wire:
        lease = await mallory.acquire(resource, ttl=60, wait=0)
        base = (await mallory.snapshot(resource)).version
        # The id alice's saga would derive for its first compensation: pre-claimed, it would shadow it.
        claimed = f"saga:alice/refund:{uuid.uuid4().hex}|undo|0|1"
        refused = await mallory.execute(lease, "transfer", {"to": "carol", "amount": 100}, base_version=base,
                                        intent_id=claimed)
        assert (refused.applied, refused.reason) == (False, FORBIDDEN), refused
        assert "namespace" in refused.diagnostic.get("detail", ""), refused.diagnostic
        lock = LockRequested(request_id=f"{claimed}|lock", agent_id="mallory", resource="ticket:mallory-1",
                             mode="exclusive", ttl_ms=30_000, wait_ms=0, at_ms=now_ms())
        value = await wire.send(settings.topics.resource_commands, lock.resource.encode(), lock, signer)
        (letter,) = await dead_letters(settings, [value])
        assert_refused(letter, FORBIDDEN, detail="namespace only the system derives")
        answer = (await inbox_answers(settings, "mallory", [lock.request_id]))[lock.request_id]
        assert isinstance(answer, LockDenied) and answer.reason == FORBIDDEN
        # The same write with an id of her own is hers to make.
        applied = await mallory.execute(lease, "transfer", {"to": "carol", "amount": 100}, base_version=base)
        assert applied.applied, applied
        await mallory.release(lease)
    decided = await events_on(settings, resource)
    assert [e.intent_id for e in decided if isinstance(e, ToolApplied)] == [applied.intent_id]
    assert not any(isinstance(e, LockGranted) and e.request_id.startswith("saga:")
                   for e in await events_on(settings, "ticket:mallory-1"))
    assert (ledger.balances()["mallory"], ledger.balances()["carol"]) == (900, 100)


# -- 5. key rotation -----------------------------------------------------------------


async def test_after_rotation_the_old_key_is_refused_and_the_new_one_works(kafka_settings: Settings,
                                                                           worker: WorkerPool) -> None:
    settings = kafka_settings
    resource, other = "ticket:alice-5", "ticket:alice-5b"
    async with ArbiterClient("alice", settings) as old:
        lease = await old.acquire(resource, ttl=60, wait=0)
        rotated = await Registrar(settings).rotate("alice")  # returns once the old key has ended
        with pytest.raises(LeaseDenied) as denied:
            await old.acquire(other, ttl=30, wait=0)
        assert denied.value.reason == UNAUTHENTICATED, denied.value.diagnostic
        stale = await old.renew_token(resource, lease.token, ttl=60)
        assert isinstance(stale, LockDenied) and stale.reason == UNAUTHENTICATED
        assert "rotated" in stale.detail, stale.detail
        async with ArbiterClient("alice", settings) as new:
            assert new._transport._signer is not None and new._transport._signer.key_id == rotated.key_id
            renewed = await new.renew_token(resource, lease.token, ttl=60)  # her lease outlives her old key
            assert isinstance(renewed, LockRenewed), renewed
            fresh_lease = await new.acquire(other, ttl=30, wait=0)
            await new.release(fresh_lease)
            released = await new.release_token(resource, lease.token)
            assert isinstance(released, LockReleased), released
    grants = [e for e in await events_on(settings, other) if isinstance(e, LockGranted)]
    assert [g.token for g in grants] == [fresh_lease.token]


# -- 6. revocation -------------------------------------------------------------------


async def test_after_revocation_bobs_commands_are_refused(kafka_settings: Settings, worker: WorkerPool) -> None:
    settings = kafka_settings
    resource = "ticket:bob-6"
    async with ArbiterClient("bob", settings) as bob:
        lease = await bob.acquire(resource, ttl=30, wait=0)  # bob works before
        await bob.release(lease)
        await Registrar(settings).revoke("bob", "left the team")
        with pytest.raises(LeaseDenied) as denied:
            await bob.acquire(resource, ttl=30, wait=0)
        assert denied.value.reason == UNAUTHENTICATED, denied.value.diagnostic
    async with ArbiterClient("bob", settings) as again:  # a new client reads the same, revoked key
        with pytest.raises(LeaseDenied) as denied_again:
            await again.acquire(resource, ttl=30, wait=0)
        assert denied_again.value.reason == UNAUTHENTICATED
        assert "revoked" in str(denied_again.value.diagnostic), denied_again.value.diagnostic
    grants = [e for e in await events_on(settings, resource) if isinstance(e, LockGranted)]
    assert [g.token for g in grants] == [lease.token]


# -- 7. the admin's override ---------------------------------------------------------


async def test_an_admin_override_is_accepted_and_the_same_revocation_by_an_agent_is_not(
        kafka_settings: Settings, worker: WorkerPool) -> None:
    settings = kafka_settings
    mallory = await register_mallory(settings)
    resource = "ticket:alice-7"
    async with ArbiterClient("alice", settings) as alice, Wire(settings) as wire:
        lease = await alice.acquire(resource, ttl=60, wait=0)
        alice_signer = alice._transport._signer
        assert alice_signer is not None
        sent = []
        for signer, by in ((mallory, "admin"), (mallory, "mallory"), (alice_signer, "alice")):
            revoke = LockRevokeRequested(request_id=fresh("override"), resource=resource, agent_id="alice",
                                         token=lease.token, reason="stuck", requested_by=by, at_ms=now_ms())
            sent.append(await wire.send(settings.topics.resource_commands, resource.encode(), revoke, signer))
        for letter in await dead_letters(settings, sent):
            assert_refused(letter, FORBIDDEN, detail="sent only by workers or an admin")
        assert not lease.lost
        await alice.renew(lease, ttl=60)  # still hers, same token

        by_admin = await Operator(settings).revoke(resource, "alice", "stuck")
        assert await asyncio.wait_for(lease.wait_lost(), WAIT_S) == "revoked: stuck"
    revocations = [e for e in await events_on(settings, resource) if isinstance(e, LockRevoked)]
    assert [(r.token, r.by_request_id) for r in revocations] == [(lease.token, by_admin)]


# -- 8. replay -----------------------------------------------------------------------


async def test_a_replayed_signed_command_is_not_decided_twice(kafka_settings: Settings, worker: WorkerPool) -> None:
    settings = kafka_settings
    ledger = seeded_ledger(settings, {"alice": 10_000, "carol": 0})
    commands = settings.topics.resource_commands
    ticket, account = "ticket:alice-8", "account:alice"
    async with ArbiterClient("alice", settings) as alice, Wire(settings) as wire:
        lease = await alice.acquire(ticket, ttl=60, wait=0)
        await alice.release(lease)
        money = await alice.acquire(account, ttl=60, wait=0)
        base = (await alice.snapshot(account)).version
        paid = await alice.execute(money, "transfer", {"to": "carol", "amount": 300}, base_version=base)
        assert paid.applied, paid
        await alice.release(money)
        after = ledger.balances()

        # Mallory copies alice's signed commands off the topic, bytes and headers, and sends them again.
        log = await read_topic(settings, commands)
        originals = [m for m in log if answer_id(m.record) in (lease.request_id, paid.intent_id)]
        assert len(originals) == 2 and all(m.headers for m in originals)
        for m in originals:
            await wire.send_raw(commands, m.key, m.value, m.headers)
        # A snapshot after them in each resource's order: once it answers, the replays were decided.
        assert (await alice.snapshot(ticket)).holders == []
        assert (await alice.snapshot(account)).holders == []

    replayed = [m for m in await read_topic(settings, commands) if answer_id(m.record) in (lease.request_id,
                                                                                         paid.intent_id)]
    assert len(replayed) == 4, "the replays are on the log"
    grants = [e for e in await events_on(settings, ticket) if isinstance(e, LockGranted)]
    assert [g.request_id for g in grants] == [lease.request_id]
    applied = [e for e in await events_on(settings, account) if isinstance(e, ToolApplied)]
    assert [a.intent_id for a in applied] == [paid.intent_id]
    assert ledger.balances() == after and (after["alice"], after["carol"]) == (10_000 - 300, 300)


# -- the audit -----------------------------------------------------------------------


async def test_the_audit_passes_a_log_full_of_refused_attacks(kafka_settings: Settings, worker: WorkerPool) -> None:
    settings = kafka_settings
    seeded_ledger(settings, {"alice": 10_000, "carol": 10_000, "mallory": 0})
    mallory = await register_mallory(settings)
    topics = settings.topics
    resource = "account:alice"
    async with ArbiterClient("alice", settings) as alice, Wire(settings) as wire:
        lease = await alice.acquire(resource, ttl=60, wait=0)
        base = (await alice.snapshot(resource)).version
        sent: list[bytes] = []
        for signer in (None, mallory, Signer.generate("alice")):
            release = LockReleaseRequested(request_id=fresh("release"), agent_id="alice", resource=resource,
                                           token=lease.token, at_ms=now_ms())
            sent.append(await wire.send(topics.resource_commands, resource.encode(), release, signer))
        intent = ToolIntent(intent_id=fresh("steal"), agent_id="alice", resource=resource, token=lease.token,
                            base_version=base, tool="transfer", arguments_json=json.dumps({"to": "mallory",
                                                                                           "amount": 1}),
                            at_ms=now_ms())
        sent.append(await wire.send(topics.resource_commands, resource.encode(), intent, mallory))
        revoke = LockRevokeRequested(request_id=fresh("revoke"), resource=resource, agent_id="alice",
                                     token=lease.token, reason="stuck", requested_by="admin", at_ms=now_ms())
        sent.append(await wire.send(topics.resource_commands, resource.encode(), revoke, mallory))
        tick = LockTick(request_id=fresh("tick"), partition=0, at_ms=now_ms())
        sent.append(await wire.send(topics.resource_commands, TICK_KEY, tick, mallory, partition=0))
        edge = WaitEdgeAdded(edge_id=fresh("lock|x"), waiter="mallory", holder="alice", source="lock",
                             resource=resource, waiter_registered_at_ms=0, at_ms=now_ms())
        sent.append(await wire.send(topics.wait_edges, settings.graph_key.encode(), edge, mallory))
        heist = f"saga:mallory/heist:{uuid.uuid4().hex}"
        step = SagaStep(saga_id=heist, step=0, agent_id="mallory", status="completed", intent_id=fresh("i"),
                        resource="account:carol", tool="transfer", arguments_json="{}", compensate_tool="transfer",
                        compensate_arguments_json=json.dumps({"to": "mallory", "amount": 5_000}), at_ms=now_ms())
        sent.append(await wire.send(topics.saga_commands, heist.encode(), step, mallory))
        claimed = ToolIntent(intent_id=f"saga:alice/x:{uuid.uuid4().hex}|undo|0|1", agent_id="mallory",
                             resource="account:mallory", tool="transfer", arguments_json="{}", at_ms=now_ms())
        sent.append(await wire.send(topics.resource_commands, b"account:mallory", claimed, mallory))
        letters = await dead_letters(settings, sent)
        assert {letter.reason for letter in letters} == {UNAUTHENTICATED, FORBIDDEN}
        await alice.release(lease)
    await assert_clean_audit(settings)
