"""The Python SDK over both transports, against real workers: the same API gives the same answers.

Each scenario runs twice: once with ``ArbiterClient(name, settings)`` (Kafka directly) and once
with ``ArbiterClient(name, settings, url=door.url)`` (a WebSocket session with a real
``arbiter serve``), and ends with the audit of the whole log passing. Then what only the door
path has: an agent cannot act as another through it, and an agent given several doors carries
on at the next one when its door dies, missing nothing (resume from its inbox offset), and a
command in flight at the moment of the crash fails as retriable, never as a raw socket error.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import urllib.request
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import WebSocketException

from arbiter.agents import ArbiterClient, LeaseDenied
from arbiter.agents.errors import ArbiterError, ArbiterUnavailable, DoorRefused
from arbiter.agents.httptransport import HttpTransport, session_urls
from arbiter.agents.identities import Operator, ensure_credential, ensure_identity
from arbiter.audit.log import Entry, read_log
from arbiter.edge.clock import now_ms
from arbiter.edge.settings import Settings
from arbiter.processes import DoorProcess, WorkerPool, free_port
from arbiter.schemas import (
    LockCancelRequested,
    LockReleased,
    LockRequested,
    LockRevoked,
    Record,
    ResourceSnapshot,
    SagaFinished,
    SnapshotRequested,
)
from arbiter.schemas.identity import Signer
from arbiter.schemas.jsonwire import from_json, to_json
from arbiter.schemas.models import MODELS
from arbiter.streams.tools.ledger import Ledger
from tests.conftest import assert_clean_audit

pytestmark = pytest.mark.kafka

WAIT_S = 30.0


# -- the two transports ----------------------------------------------------------------


@dataclass
class Via:
    """How a test's agents reach Arbiter: ``kind`` "kafka" (directly) or "door" (through ``url``)."""

    kind: str
    settings: Settings
    url: str | None = None

    def client(self, name: str) -> ArbiterClient:
        if self.url is None:
            return ArbiterClient(name, self.settings)
        return ArbiterClient(name, self.settings, url=self.url)


@pytest.fixture(params=["kafka", "door"])
async def via(request: pytest.FixtureRequest, kafka_settings: Settings, worker: WorkerPool) -> AsyncIterator[Via]:
    """Each scenario over Kafka directly, and over a real front door (started only for that one)."""
    if request.param == "kafka":
        yield Via("kafka", kafka_settings)
        return
    door = DoorProcess(kafka_settings)
    await asyncio.to_thread(door.start)
    try:
        yield Via("door", kafka_settings, door.url)
    finally:
        await asyncio.to_thread(door.stop)


def check_transport(via: Via, *clients: ArbiterClient) -> None:
    """The clients really use the transport the scenario names."""
    for client in clients:
        assert isinstance(client.transport, HttpTransport) is (via.kind == "door"), (via.kind, client.transport)


# -- reading the log ---------------------------------------------------------------------


async def topic_entries(settings: Settings, topic: str) -> list[Entry]:
    """Every message of ``topic`` (all partitions), up to its current end."""
    log = await read_log(settings, only=[(topic, p) for p in range(settings.partitions)])
    return list(log.of(topic))


async def until_in_log(settings: Settings, topic: str, found: Callable[[Record], bool],
                       timeout: float = WAIT_S) -> Record:
    """Wait until a record for which ``found`` holds is on ``topic``; return it."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        for entry in await topic_entries(settings, topic):
            if entry.record is not None and found(entry.record):
                return entry.record
        if loop.time() > deadline:
            raise AssertionError(f"no such record on {topic} within {timeout}s")
        await asyncio.sleep(0.1)


async def eventually(check: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    """Wait until ``check()`` holds (SDK state, which has no log to wait on)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not check():
        if loop.time() > deadline:
            raise AssertionError(f"not within {timeout}s: {what}")
        await asyncio.sleep(0.01)


def seeded_ledger(settings: Settings, balances: dict[str, int]) -> Ledger:
    """The worker's ledger (SQLite in the test home), started over with ``balances``."""
    ledger = Ledger(settings.ledger_url())
    ledger.seed(balances)
    return ledger


# -- 1. queueing ---------------------------------------------------------------------------


async def test_a_queued_agent_is_granted_on_release_and_tokens_increase(via: Via) -> None:
    resource = "doc:shared-plan"
    async with via.client("alpha") as alpha, via.client("beta") as beta, via.client("gamma") as gamma:
        check_transport(via, alpha, beta, gamma)
        first = await alpha.acquire(resource, ttl=30, wait=0)
        assert first.token == 1 and not first.lost
        with pytest.raises(LeaseDenied) as busy:
            await gamma.acquire(resource, ttl=30, wait=0)
        assert busy.value.reason == "busy" and busy.value.retriable
        queued = asyncio.Event()
        waiting = asyncio.create_task(beta.acquire(resource, ttl=30, wait=WAIT_S,
                                                   on_queued=lambda _e: queued.set()))
        await asyncio.wait_for(queued.wait(), WAIT_S)
        assert not waiting.done(), "granted while alpha still holds the lease"
        await alpha.release(first)
        assert first.lost_reason == "released"
        second = await asyncio.wait_for(waiting, WAIT_S)
        assert second.token == first.token + 1
        await beta.release(second)
        third = await gamma.acquire(resource, ttl=30, wait=0)
        assert third.token == second.token + 1
        await gamma.release(third)
    await assert_clean_audit(via.settings)


# -- 2. zombies ----------------------------------------------------------------------------


async def test_a_zombie_write_is_refused_and_the_lease_is_lost_by_the_pushed_event(via: Via) -> None:
    ledger = seeded_ledger(via.settings, {"a": 5_000, "b": 5_000})
    resource = "account:a"
    async with via.client("alpha") as alpha, via.client("beta") as beta:
        check_transport(via, alpha, beta)
        base = (await alpha.snapshot(resource)).version
        stalled = await alpha.acquire(resource, ttl=1.0, wait=0)  # alpha never renews: it stalls
        fresh = await beta.acquire(resource, ttl=30, wait=20)  # queued until alpha's lease expires
        assert fresh.token == stalled.token + 1
        assert await asyncio.wait_for(stalled.wait_lost(), 10) == "expired"  # the LockExpired, pushed
        assert stalled.lost
        zombie = await alpha.execute(stalled, "transfer", {"to": "b", "amount": 100}, base_version=base)
        assert not zombie.applied and zombie.reason == "stale_fencing_token"
        assert zombie.diagnostic["current"]["high_water_token"] == fresh.token
        assert zombie.diagnostic["current"]["holder"]["agent_id"] == "beta"
        live = await beta.execute(fresh, "transfer", {"to": "b", "amount": 100}, base_version=base)
        assert live.applied and live.version == base + 1

        # Revoked by an operator: the holder is told at once, and its token writes nothing after.
        await Operator(via.settings).revoke(resource, "beta", "operator_says_so")
        assert await asyncio.wait_for(fresh.wait_lost(), 10) == "revoked: operator_says_so"
        assert fresh.lost
        late = await beta.execute(fresh, "transfer", {"to": "b", "amount": 100}, base_version=base + 1)
        assert not late.applied and late.reason == "lease_not_live"
    assert ledger.balances()["a"] == 4_900 and ledger.balances()["b"] == 5_100
    await assert_clean_audit(via.settings)


# -- 3. deadlocks --------------------------------------------------------------------------


async def test_a_deadlock_between_two_agents_denies_the_victim(via: Via) -> None:
    async with via.client("alpha") as alpha, via.client("beta") as beta:
        check_transport(via, alpha, beta)
        a_on_x = await alpha.acquire("res:x", ttl=60, wait=0)
        b_on_y = await beta.acquire("res:y", ttl=60, wait=0)
        alpha_queued = asyncio.Event()
        alpha_wants_y = asyncio.create_task(alpha.acquire("res:y", ttl=60, wait=60,
                                                          on_queued=lambda _e: alpha_queued.set()))
        await asyncio.wait_for(alpha_queued.wait(), WAIT_S)  # alpha queues first: beta is the younger waiter
        with pytest.raises(LeaseDenied) as victim:
            await beta.acquire("res:x", ttl=60, wait=60)
        assert victim.value.reason == "deadlock_victim"
        assert victim.value.diagnostic["message"] == "Circular dependency detected with alpha. Aborting subtask."
        assert {e["waiter"] for e in victim.value.diagnostic["cycle"]} == {"alpha", "beta"}
        assert [d.victim for d in beta.deadlocks] == ["beta"]
        granted = await asyncio.wait_for(alpha_wants_y, WAIT_S)
        assert granted.token > b_on_y.token, "the waiter gets a new token; the victim's is stale"
        assert await asyncio.wait_for(b_on_y.wait_lost(), 10) == "revoked: deadlock_victim"
        assert not a_on_x.lost and alpha.deadlocks == []
        await alpha.release(granted)
        await alpha.release(a_on_x)
    await assert_clean_audit(via.settings)


# -- 4. sagas ------------------------------------------------------------------------------


async def test_a_saga_whose_block_raises_is_compensated(via: Via) -> None:
    ledger = seeded_ledger(via.settings, {"alice": 10_000})
    told: list[SagaFinished] = []
    async with via.client("alice") as alice:
        check_transport(via, alice)
        alice.subscribe(lambda r: told.append(r) if isinstance(r, SagaFinished) else None)
        with pytest.raises(RuntimeError, match="alice gives up"):
            async with alice.saga("undo") as saga:
                async with saga.lease("account:alice", ttl=60) as lease:
                    base = (await alice.snapshot("account:alice")).version
                    step = await saga.step(lease, "refund", {"order_id": "o-undo", "amount": 200},
                                           base_version=base,
                                           compensate=lambda o: ("reverse_refund", {"refund_intent_id": o.intent_id}))
                    assert step.applied
                assert ledger.balances()["alice"] == 10_000 - 200
                raise RuntimeError("alice gives up")
    # The block's exception was raised once the saga ended; the agent was told how.
    await until_in_log(via.settings, via.settings.topics.resource_events,  # the compensation's own lease, released
                       lambda r: isinstance(r, LockReleased) and r.agent_id == saga.saga_id)
    assert [(f.saga_id, f.outcome) for f in told] == [(saga.saga_id, "COMPENSATED")]
    [refund] = ledger.refunds()
    assert refund["order_id"] == "o-undo" and refund["reversed_by"], "the step was compensated"
    assert ledger.balances()["alice"] == 10_000
    assert ledger.invariants()["ok"]
    await assert_clean_audit(via.settings)


# -- 5. impersonation through the door -------------------------------------------------------


def bearer(api_key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"}


async def frames_until(ws: ClientConnection, done: Callable[[list[dict[str, Any]]], bool]) -> list[dict[str, Any]]:
    """Read frames from ``ws`` until ``done(frames so far)``."""
    frames: list[dict[str, Any]] = []
    async with asyncio.timeout(WAIT_S):
        while not done(frames):
            frames.append(json.loads(await ws.recv()))
    return frames


async def test_an_agent_cannot_act_as_another_through_the_door(kafka_settings: Settings,
                                                               door: DoorProcess) -> None:
    settings = kafka_settings
    alice = await ensure_credential(settings, "alice")
    await ensure_identity(settings, "bob")
    resource = "doc:bobs-plan"
    [url] = session_urls(door.url)
    async with connect(url, additional_headers=bearer(alice.api_key())) as ws:
        hello = json.loads(await ws.recv())
        assert (hello["op"], hello["agent"]) == ("hello", "alice")
        forged = LockRequested(request_id=f"forged-{uuid.uuid4().hex}", agent_id="bob", resource=resource,
                               mode="exclusive", ttl_ms=30_000, wait_ms=0, at_ms=now_ms())
        await ws.send(json.dumps({"op": "send", "id": 1, "key": resource, "record": to_json(forged)}))
        [refusal] = await frames_until(ws, lambda f: len(f) == 1)
        assert (refusal["op"], refusal["id"], refusal["status"]) == ("error", 1, 403), refusal
        assert refusal["reason"] == "forbidden" and "'bob'" in refusal["detail"], refusal
        # Alice's own command on the same resource and session, after it: sent, decided and answered.
        own = SnapshotRequested(request_id=f"own-{uuid.uuid4().hex}", agent_id="alice", resource=resource,
                                at_ms=now_ms())
        await ws.send(json.dumps({"op": "send", "id": 2, "key": resource, "record": to_json(own)}))

        def answered(frames: list[dict[str, Any]]) -> bool:
            acked = any(f["op"] == "ack" and f["id"] == 2 for f in frames)
            return acked and any(f["op"] == "event" and f["record"].get("request_id") == own.request_id
                                 for f in frames)

        frames = await frames_until(ws, answered)
        [event] = [f for f in frames if f["op"] == "event"]
        snapshot = from_json(event["record"], MODELS)
        assert isinstance(snapshot, ResourceSnapshot) and snapshot.holders == []
        assert not any(f["op"] == "error" for f in frames), frames

    # Commands on one resource are decided in order: the forged one would be before alice's.
    commands = await topic_entries(settings, settings.topics.resource_commands)
    assert [getattr(e.record, "request_id", None) for e in commands if e.key == resource.encode()] \
        == [own.request_id], "the forged command reached the log"
    decisions = [e.record for e in await topic_entries(settings, settings.topics.resource_events)
                 if e.key == resource.encode()]
    assert decisions == [], decisions
    inbox = [e.record for e in await topic_entries(settings, settings.topics.agent_inbox)]
    assert not [r for r in inbox if getattr(r, "request_id", None) == forged.request_id]

    # A key presented under another name than the one it is registered to: 401, before anything.
    posing = Signer("bob", alice.private_key).api_key()
    async with connect(url, additional_headers=bearer(posing)) as ws:
        first = json.loads(await ws.recv())
        assert (first["op"], first["status"], first["reason"]) == ("error", 401, "unauthenticated"), first
        assert "registered to 'alice'" in first["detail"], first
        await ws.wait_closed()
        assert ws.close_code == 4401
    with pytest.raises(DoorRefused) as refused:
        async with ArbiterClient("bob", settings, url=door.url, api_key=posing):
            pass
    assert (refused.value.status, refused.value.reason, refused.value.retriable) == (401, "unauthenticated", False)
    assert "registered to 'alice'" in refused.value.detail
    # Alice's credential, presented as bob's: the door says whose key it is, and the SDK refuses it.
    with pytest.raises(DoorRefused) as mismatch:
        async with ArbiterClient("bob", settings, url=door.url, api_key=alice.api_key()):
            pass
    assert mismatch.value.status == 401 and "'alice'" in mismatch.value.detail
    await assert_clean_audit(settings)


# -- 6, 7. several doors --------------------------------------------------------------------


@dataclass
class Doors:
    first: DoorProcess
    second: DoorProcess

    @property
    def url(self) -> str:
        """The agent's door list: the first one, then the second."""
        return f"{self.first.url},{self.second.url}"


@pytest.fixture
async def doors(kafka_settings: Settings, worker: WorkerPool) -> AsyncIterator[Doors]:
    """Two front doors on the same settings, each on its own port; only the first is started."""
    pair = Doors(DoorProcess(kafka_settings), DoorProcess(kafka_settings, port=free_port()))
    await asyncio.to_thread(pair.first.start)
    try:
        yield pair
    finally:
        for door in (pair.first, pair.second):
            if door.proc is not None:
                with contextlib.suppress(ProcessLookupError):
                    door.proc.send_signal(signal.SIGCONT)  # a door a test stopped must hear the SIGTERM
            await asyncio.to_thread(door.stop)


def door_id(door: DoorProcess) -> str:
    with urllib.request.urlopen(f"{door.url}/livez", timeout=5) as answer:
        return str(json.load(answer)["door"])


async def test_a_revocation_missed_while_the_door_was_down_arrives_once_from_the_next_door(
        kafka_settings: Settings, doors: Doors) -> None:
    settings = kafka_settings
    resource = "ticket:cust_8492"
    seen: list[Record] = []
    async with ArbiterClient("alice", settings, url=doors.url) as alice:
        alice.subscribe(seen.append)
        transport = alice.transport
        assert isinstance(transport, HttpTransport)
        assert transport.door == await asyncio.to_thread(door_id, doors.first)
        lease = await alice.acquire(resource, ttl=60, wait=0)

        await asyncio.to_thread(doors.first.kill)  # SIGKILL: no goodbye
        # While alice has no door at all, an operator revokes her lease; the log has it.
        await Operator(settings).revoke(resource, "alice", "operator_says_so")
        await until_in_log(settings, settings.topics.agent_inbox,
                           lambda r: isinstance(r, LockRevoked) and r.agent_id == "alice" and r.token == lease.token)
        assert not lease.lost and transport.reconnects == 0
        # The second door starts only now, after the revocation: alice can get it only from the log.
        await asyncio.to_thread(doors.second.start)
        assert await asyncio.wait_for(lease.wait_lost(), WAIT_S) == "revoked: operator_says_so"
        assert transport.reconnects == 1
        assert transport.door == await asyncio.to_thread(door_id, doors.second)

        again = await alice.acquire(resource, ttl=60, wait=0)  # through the second door
        assert again.token == lease.token + 1
        await alice.release(again)
    # Every inbox record once, in order: the grant before the crash is not replayed, the revocation
    # is delivered once (from the log), then the new lease's grant and release.
    kinds = [(type(r).__name__, getattr(r, "token", None)) for r in seen]
    assert kinds == [("LockGranted", lease.token), ("LockRevoked", lease.token),
                     ("LockGranted", again.token), ("LockReleased", again.token)], kinds
    await assert_clean_audit(settings)


async def test_a_send_in_flight_when_its_door_dies_raises_a_retriable_arbiter_error(
        kafka_settings: Settings, doors: Doors) -> None:
    settings = kafka_settings
    await asyncio.to_thread(doors.second.start)
    resource = "doc:in-flight"
    async with ArbiterClient("alice", settings, url=doors.url) as alice:
        transport = alice.transport
        assert isinstance(transport, HttpTransport)
        assert transport.door == await asyncio.to_thread(door_id, doors.first)
        await alice.ping(resource)  # the session works
        assert doors.first.proc is not None
        doors.first.proc.send_signal(signal.SIGSTOP)  # the door hangs: it reads nothing, answers nothing
        acquiring = asyncio.create_task(alice.acquire(resource, ttl=30, wait=0))
        await eventually(lambda: bool(transport._pending), "the command is sent, unacknowledged")
        assert not acquiring.done()
        await asyncio.to_thread(doors.first.kill)  # and dies with the command in flight
        with pytest.raises(ArbiterError) as failed:
            await asyncio.wait_for(acquiring, WAIT_S)
        assert isinstance(failed.value, ArbiterUnavailable), repr(failed.value)
        assert not isinstance(failed.value, WebSocketException | OSError)
        assert failed.value.retriable is True
        # Retrying is safe: the client is at the second door, and the lost command was never decided.
        lease = await alice.acquire(resource, ttl=30, wait=0)
        assert lease.token == 1
        assert transport.door == await asyncio.to_thread(door_id, doors.second)
        await alice.release(lease)
    # The lost command never reached the log; the SDK withdrew it anyway (its cancel finds nothing).
    commands = [e.record for e in await topic_entries(settings, settings.topics.resource_commands)
                if e.key == resource.encode()]
    [withdrawn] = [r.target_request_id for r in commands if isinstance(r, LockCancelRequested)]
    assert [r.request_id for r in commands if isinstance(r, LockRequested)] == [lease.request_id]
    assert withdrawn != lease.request_id
    decisions = [(type(e.record).__name__, getattr(e.record, "reason", None))
                 for e in await topic_entries(settings, settings.topics.resource_events) if e.key == resource.encode()]
    assert decisions == [("LockDenied", "not_waiting"), ("LockGranted", None), ("LockReleased", None)], decisions
    await assert_clean_audit(settings)
