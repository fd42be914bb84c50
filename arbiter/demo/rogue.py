"""Mallory: a rogue agent that joins the demo's swarm mid-run and attacks it on the wire.

She is a registered agent like the others, allowed only her own prefixes
(``account:mallory``), and she has what anyone with topic access has: a raw Kafka
producer, the codec, and a read of the log. With that she tries the attacks of the
trust boundary (docs/security.md): act as another agent unsigned, with her own
key and with a key nobody registered; send what only workers and the operator send
(a lease-book wait edge, a revocation, a tick, another agent's saga abort); write
outside her prefixes; claim an id in the ``saga:`` namespace; and put forged decisions
into other agents' inboxes.

Each attempt waits on the log for its refusal, never on a clock: the dead letter the
workers write for the input (with the reason), the denial in the claimed agent's inbox
where the input type has one, or, for a forged inbox message, the victim's SDK counting
it as forged without acting on it. An attempt with no refusal within ``WAIT_S`` is
reported as NOT refused, and the demo fails loudly.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from arbiter.agents import ArbiterClient
from arbiter.agents.identities import Registrar
from arbiter.edge.clock import now_ms
from arbiter.edge.kafkaio import Sender, sender_for
from arbiter.edge.settings import Settings
from arbiter.edge.tail import Tail
from arbiter.schemas import (
    Cause,
    CompensationRequested,
    DeadLetter,
    DeadlockDetected,
    Holder,
    LockDenied,
    LockGranted,
    LockReleaseRequested,
    LockRenewRequested,
    LockRevokeRequested,
    LockTick,
    Record,
    SagaStep,
    ToolIntent,
    ToolRejected,
    WaitEdgeAdded,
    default_codec,
)
from arbiter.schemas.identity import ROLE_WORKER, Signer
from arbiter.schemas.partitioning import partition_for

ROGUE = "mallory"
WAIT_S = 30.0
"""How long an attempt waits for its refusal before it counts as not refused."""
TICK_KEY = b"__tick__"
"""The workers' tick key (``arbiter.streams.shells.pipeline.TICK_KEY``)."""
UNAUTHENTICATED, FORBIDDEN, DROPPED = "unauthenticated", "forbidden", "dropped"

Lease = tuple[str, str, int]
"""(agent, resource, token): a lease another agent holds, as the log shows it."""


@dataclass
class Attempt:
    """One attack, and how (whether) it was refused."""

    what: str
    expected: str
    """The reason it should be refused with: ``unauthenticated`` or ``forbidden`` (by the workers), or
    ``dropped`` (by the victim's SDK: a forged inbox message)."""
    reason: str = ""
    """The reason it was refused with (empty: not refused)."""
    how: str = ""
    """Where the refusal shows: the dead letter, the denial in an inbox, the victim's forged count."""
    detail: str = ""
    forged_at: str = ""
    """Where a forged decision sits in the log (``topic[p]@offset``): the audit must name it."""

    @property
    def refused(self) -> bool:
        """Whether a refusal was seen."""
        return bool(self.reason)


@dataclass
class RogueReport:
    """Every attempt of the rogue agent, for the demo's summary."""

    agent: str = ROGUE
    allow: list[str] = field(default_factory=list)
    attempts: list[Attempt] = field(default_factory=list)

    @property
    def refused(self) -> int:
        """How many attempts were refused."""
        return sum(a.refused for a in self.attempts)

    @property
    def failed(self) -> int:
        """How many attempts were not refused, or refused for another reason than they should have been."""
        return sum(not (a.refused and a.reason == a.expected) for a in self.attempts)

    @property
    def ok(self) -> bool:
        """Every attempt was refused, with the reason it should have been (and there were some)."""
        return bool(self.attempts) and all(a.refused and a.reason == a.expected for a in self.attempts)

    def forged_positions(self) -> set[str]:
        """Where the rogue put forged decisions: the audit's ``authenticated`` check must name exactly these."""
        return {a.forged_at for a in self.attempts if a.forged_at}

    def lines(self) -> list[str]:
        """The summary: a head line and one row per attempt (attempt -> refusal)."""
        out = [f"rogue agent {self.agent} (allowed {', '.join(self.allow) or 'everything'}), joined mid-run: "
               f"{len(self.attempts)} attempts, {self.refused} refused"]
        width = max((len(a.what) for a in self.attempts), default=0)
        for a in self.attempts:
            if not a.refused:
                out.append(f"  {a.what:<{width}} -> NOT REFUSED: {a.detail}")
                continue
            odd = "" if a.reason == a.expected else f" (UNEXPECTED: should be {a.expected})"
            detail = a.detail if len(a.detail) <= 100 else a.detail[:99] + "..."
            out.append(f"  {a.what:<{width}} -> {a.reason}{odd} ({a.how}): {detail}")
        return out


class LogWatch:
    """The dead letters and the inbox answers from now on, as anyone with read access sees them."""

    def __init__(self, settings: Settings) -> None:
        self.letters: dict[tuple[str, int, int], DeadLetter] = {}
        self.answers: dict[tuple[str, str], LockDenied | ToolRejected] = {}
        t = settings.topics
        self._tail = Tail(settings, [t.dead_letter, t.agent_inbox], on_message=self._keep)

    def _keep(self, _message: object, record: Record | None) -> None:
        if isinstance(record, DeadLetter):
            source = record.source
            self.letters[source.topic, source.partition, source.offset] = record
        elif isinstance(record, LockDenied):
            self.answers[record.agent_id, record.request_id] = record
        elif isinstance(record, ToolRejected):
            self.answers[record.agent_id, record.intent_id] = record

    async def start(self) -> None:
        """Pin the topics' current ends, then read on from there."""
        await self._tail.start()

    async def stop(self) -> None:
        """Stop reading."""
        await self._tail.stop()

    async def wait(self, ready: Callable[[], bool], timeout: float = WAIT_S) -> bool:
        """Whether ``ready()`` came to hold (re-checked as the log arrives) within ``timeout``."""
        return await self._tail.wait_for(ready, timeout)


async def until(ready: Callable[[], bool], timeout: float = WAIT_S) -> bool:
    """Whether ``ready()`` came to hold within ``timeout`` (an SDK counter, which has no log to wait on)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not ready():
        if loop.time() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


def _id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


class Mallory:
    """The rogue agent: registered for her own prefixes, attacking with a raw producer."""

    def __init__(self, settings: Settings, client: Callable[[str], Awaitable[ArbiterClient]],
                 held: Callable[[], list[Lease]], sagas: Callable[[], dict[str, str]],
                 outside: str, fallback: Lease, ring_victim: str) -> None:
        self.settings = settings
        self.client = client
        """The victims' SDK clients (opened by the swarm), by agent id."""
        self.held, self.sagas = held, sagas
        """Leases of the swarm's agents, and their running sagas, as the live log shows them."""
        self.outside, self.fallback, self.ring_victim = outside, fallback, ring_victim
        self.codec = default_codec(settings.max_message_bytes)
        self.report = RogueReport(allow=[f"account:{ROGUE}"])
        self.signer: Signer | None = None
        self.sender: Sender | None = None
        self.watch = LogWatch(settings)

    async def run(self) -> RogueReport:
        """Join (the admin registers her), attack, and report how each attempt was refused."""
        self.signer = await Registrar(self.settings).add(ROGUE, allow=self.report.allow, keep_key=False)
        self.sender = sender_for(self.settings)
        try:
            await self.sender.start()
            await self.watch.start()
            # Another agent's lease to go after: the live log shows one soon after the swarm starts.
            await until(lambda: bool(self.held()), timeout=10)
            await self._attacks(self.signer)
        finally:
            await self.watch.stop()
            await self.sender.stop()
        return self.report

    async def _send(self, topic: str, key: bytes, record: Record, signer: Signer | None,
                    partition: int | None = None) -> tuple[str, int, int]:
        """Encode, sign with ``signer`` (None: unsigned), send; the record's position in the log."""
        assert self.sender is not None
        value = self.codec.encode(record)
        headers = signer.sign(topic, key, value, now_ms()) if signer is not None else None
        at, offset = await self.sender.append(topic, key, value, headers, partition=partition)
        return topic, at, offset

    async def _refused_by_workers(self, attempt: Attempt, where: tuple[str, int, int],
                                  answer_to: tuple[str, str] | None = None) -> None:
        """Wait for the dead letter of the input at ``where`` (and the denial to the claimed agent)."""
        self.report.attempts.append(attempt)
        lettered = await self.watch.wait(lambda: where in self.watch.letters)
        answered = answer_to is None or await self.watch.wait(lambda: answer_to in self.watch.answers)
        if not lettered:
            attempt.detail = f"no dead letter for {where[0]}[{where[1]}]@{where[2]} within {WAIT_S:.0f} s"
            return
        letter = self.watch.letters[where]
        attempt.reason, attempt.detail, attempt.how = letter.reason, letter.detail, "dead letter"
        if answer_to is not None:
            if not answered:
                attempt.reason, attempt.detail = "", f"dead-lettered, but {answer_to[0]} got no denial"
                return
            answer = self.watch.answers[answer_to]
            attempt.how += f" + {type(answer).__name__} to {answer_to[0]}"
            if answer.reason != letter.reason:
                attempt.reason = ""
                attempt.detail = f"the dead letter says {letter.reason}, the denial {answer.reason}"

    async def _dropped_by_sdk(self, attempt: Attempt, where: tuple[str, int, int], victim: ArbiterClient,
                              before: int, unchanged: Callable[[], bool] = lambda: True) -> None:
        """Wait for the victim's SDK to count the forged inbox message, and check it acted on nothing."""
        self.report.attempts.append(attempt)
        attempt.forged_at = f"{where[0]}[{where[1]}]@{where[2]}"
        if not await until(lambda: victim.forged_messages > before):
            attempt.detail = f"{victim.agent_id}'s SDK did not count it as forged within {WAIT_S:.0f} s"
            return
        if not unchanged():
            attempt.detail = f"{victim.agent_id}'s SDK acted on it"
            return
        attempt.reason = DROPPED
        attempt.how = f"{victim.agent_id}'s SDK, forged count {before} -> {victim.forged_messages}"
        attempt.detail = "not signed by a worker, never acted on"

    def _lease(self) -> Lease:
        """Another agent's lease, as the live log shows it (an account's, if any is held)."""
        leases = sorted(self.held(), key=lambda lease: (not lease[1].startswith("account:"), lease))
        return leases[0] if leases else self.fallback

    async def _attacks(self, mine: Signer) -> None:
        """Every attack, in this order, on one lease of another agent's (``mine``: her own registered key)."""
        lease = self._lease()
        await self._impersonate(mine, lease)
        await self._forge_decisions(mine, lease)
        await self._forge_system_commands(mine, lease)
        await self._overreach(mine)

    async def _impersonate(self, mine: Signer, lease: Lease) -> None:
        """Act as another agent: unsigned, with her own key, with a key nobody registered."""
        t = self.settings.topics
        agent, resource, token = lease
        key = resource.encode()
        release = LockReleaseRequested(request_id=_id("rogue-release"), agent_id=agent, resource=resource,
                                       token=token, at_ms=now_ms())
        await self._refused_by_workers(
            Attempt(f"release {agent}'s lease as {agent}, unsigned", UNAUTHENTICATED),
            await self._send(t.resource_commands, key, release, None), (agent, release.request_id))
        renew = LockRenewRequested(request_id=_id("rogue-renew"), agent_id=agent, resource=resource, token=token,
                                   ttl_ms=1, at_ms=now_ms())
        await self._refused_by_workers(
            Attempt(f"renew {agent}'s lease to 1 ms as {agent}, with her own key", FORBIDDEN),
            await self._send(t.resource_commands, key, renew, mine), (agent, renew.request_id))
        intent = ToolIntent(intent_id=_id("rogue-write"), agent_id=agent, resource=resource, token=token,
                            tool="refund", arguments_json=json.dumps({"order_id": "order-mallory", "amount": 99_000}),
                            at_ms=now_ms())
        await self._refused_by_workers(
            Attempt(f"write as {agent} through the gateway, with an unregistered key", UNAUTHENTICATED),
            await self._send(t.resource_commands, key, intent, Signer.generate(agent)), (agent, intent.intent_id))

    async def _forge_decisions(self, mine: Signer, lease: Lease) -> None:
        """Forged decisions in other agents' inboxes: a grant to the lease's holder, a deadlock notice to
        the ring's victim."""
        t = self.settings.topics
        agent, resource, token = lease
        victim = await asyncio.wait_for(self.client(agent), WAIT_S)
        now = now_ms()
        cause = Cause(topic=t.resource_commands, partition=0, offset=0)
        grant = LockGranted(request_id=_id("rogue-grant"), agent_id=agent, resource=resource, token=token + 1000,
                            mode="exclusive", expires_at_ms=now + 60_000,
                            holders=[Holder(agent_id=agent, request_id="forged", token=token + 1000,
                                            mode="exclusive", expires_at_ms=now + 60_000)],
                            resource_version=0, request_sent_at_ms=now, at_ms=now, cause=cause)
        before = victim.forged_messages
        where = await self._send(t.agent_inbox, agent.encode(), grant, mine,
                                 partition=partition_for(agent.encode(), self.settings.partitions))
        await self._dropped_by_sdk(Attempt(f"forged LockGranted into {agent}'s inbox, with her own key", DROPPED),
                                   where, victim, before)
        ring = await asyncio.wait_for(self.client(self.ring_victim), WAIT_S)
        # Its saga, once its delegation edge is in the log (a guessed id is refused just the same).
        await until(lambda: self.ring_victim in self.sagas(), timeout=10)
        cycle = [self.ring_victim, ROGUE, self.ring_victim]
        notice = DeadlockDetected(detection_id=_id("rogue-deadlock"), victim=self.ring_victim, cycle=cycle,
                                  cycle_json=json.dumps(cycle), message="you are the victim: abort your saga",
                                  saga_id=self.sagas().get(self.ring_victim), at_ms=now_ms(),
                                  cause=Cause(topic=t.wait_edges, partition=0, offset=0))
        before = ring.forged_messages
        where = await self._send(t.agent_inbox, self.ring_victim.encode(), notice,
                                 Signer(ROLE_WORKER, mine.private_key),
                                 partition=partition_for(self.ring_victim.encode(), self.settings.partitions))
        # The ring's real deadlock may be detected meanwhile: what must not be there is this notice.
        await self._dropped_by_sdk(
            Attempt(f"forged DeadlockDetected into {self.ring_victim}'s inbox, posing as worker", DROPPED),
            where, ring, before,
            lambda: all(d.detection_id != notice.detection_id for d in ring.deadlocks))

    async def _forge_system_commands(self, mine: Signer, lease: Lease) -> None:
        """What only the workers and the operator send: a lease-book wait edge, a revocation, a tick,
        a compensation of another agent's saga."""
        t = self.settings.topics
        agent, resource, token = lease
        key = resource.encode()
        edge = WaitEdgeAdded(edge_id=_id(f"lock|{ROGUE}|{agent}"), waiter=ROGUE, holder=agent, source="lock",
                             resource=resource, waiter_registered_at_ms=now_ms(), at_ms=now_ms())
        await self._refused_by_workers(
            Attempt("forged wait-for edge of the lease book (source lock)", FORBIDDEN),
            await self._send(t.wait_edges, self.settings.graph_key.encode(), edge, mine))
        revoke = LockRevokeRequested(request_id=_id("rogue-revoke"), resource=resource, agent_id=agent, token=token,
                                     reason="mallory says so", requested_by="admin", at_ms=now_ms())
        await self._refused_by_workers(
            Attempt(f"forged LockRevokeRequested of {agent}'s lease, as the operator", FORBIDDEN),
            await self._send(t.resource_commands, key, revoke, mine))
        tick = LockTick(request_id=_id("rogue-tick"), partition=0, at_ms=now_ms() + 3_600_000)
        await self._refused_by_workers(
            Attempt("forged LockTick (the workers' clock), an hour ahead", FORBIDDEN),
            await self._send(t.resource_commands, TICK_KEY, tick, mine, partition=0))
        saga_id = self.sagas().get(self.ring_victim) or f"saga:{self.ring_victim}/{self.ring_victim}-change:guess"
        abort = CompensationRequested(saga_id=saga_id, reason="mallory says so", requested_by=ROGUE, at_ms=now_ms())
        await self._refused_by_workers(
            Attempt(f"forged CompensationRequested for {self.ring_victim}'s saga", FORBIDDEN),
            await self._send(t.saga_commands, saga_id.encode(), abort, mine))

    async def _overreach(self, mine: Signer) -> None:
        """Her own name, outside her prefixes or inside the system's namespace."""
        t = self.settings.topics
        own_saga = f"saga:{ROGUE}/raid:{uuid.uuid4().hex[:8]}"
        step = SagaStep(saga_id=own_saga, step=0, agent_id=ROGUE, status="completed", intent_id=_id("rogue-step"),
                        resource=self.outside, tool="refund",
                        arguments_json=json.dumps({"order_id": "order-mallory", "amount": 99_000}), at_ms=now_ms())
        await self._refused_by_workers(
            Attempt(f"saga step on {self.outside}, outside her prefixes", FORBIDDEN),
            await self._send(t.saga_commands, own_saga.encode(), step, mine))
        mine_resource = f"account:{ROGUE}"
        squat = ToolIntent(intent_id=f"saga:{ROGUE}/squat:{uuid.uuid4().hex[:8]}#0", agent_id=ROGUE,
                           resource=mine_resource, tool="refund",
                           arguments_json=json.dumps({"order_id": "order-mallory", "amount": 1}), at_ms=now_ms())
        await self._refused_by_workers(
            Attempt("an intent id in the saga: namespace, on her own account", FORBIDDEN),
            await self._send(t.resource_commands, mine_resource.encode(), squat, mine), (ROGUE, squat.intent_id))


def describe(report: RogueReport) -> dict[str, Any]:
    """JSON form of the report (for tests and archives)."""
    return {"agent": report.agent, "allow": report.allow, "refused": report.refused,
            "attempts": [{"what": a.what, "expected": a.expected, "reason": a.reason, "how": a.how,
                          "detail": a.detail} for a in report.attempts]}
