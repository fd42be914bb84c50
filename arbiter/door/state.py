"""The front door's state: who is connected, with which key, and where their inbox goes.

Theory of operation
-------------------
An agent authenticates with an API key (``arbiter.schemas.identity.Signer.api_key``): a front-door
*credential* of the agent, a key pair of its own registered for the agent's name, never
the agent's own key (``arbiter agents api-key NAME`` issues one). The door checks it
against the registry on every call (a credential, active, not past its expiry, an
agent's, the name it claims) and signs the agent's commands with it, so a worker
verifies the credential's signature and applies its scope and the agent's rules
(``arbiter.streams.cores.trust``): the door adds no authority of its own, an agent reaches nothing
through it that it could not reach directly, and revoking one credential stops exactly
the calls made with it. Credentials live only in memory.

Each credential the door serves has one ``AgentState``: an ``ArbiterClient`` over the
process's shared Kafka clients (``arbiter.agents.hub``: one producer and one inbox reader for
the whole door, routing by key, so the cost of a decision does not grow with the number
of agents connected), the leases it acquired over HTTP, its sagas, its token bucket,
and its WebSocket sessions. Each inbox record for the agent goes to its client (which
answers the waiting call) and to each of its sessions' bounded queues; a session whose
queue is full is closed with a reason, never waited for.

A session can resume: it names the inbox offset after the last event it saw, and gets
every record of its agent from there on, read from the log (the inbox topic keeps
them), then the live ones, each offset once. That is how an agent whose door died
carries on at another door without missing a revocation.

An agent's state is dropped after ``door_idle_seconds`` with no call and no session;
its leases stay in the log, and a later call by token works as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

from arbiter.agents import ArbiterClient, Lease
from arbiter.agents.sagas import Saga
from arbiter.edge.clock import now_ms
from arbiter.edge.kafkaio import TopicPartition
from arbiter.edge.keys import anchors_for
from arbiter.edge.registryfeed import RegistryFeed
from arbiter.edge.settings import Settings
from arbiter.edge.tail import Tail
from arbiter.mcp.tools import AgentTools
from arbiter.schemas import LockExpired, LockReleased, LockRevoked, Record, SagaFinished
from arbiter.schemas.identity import ACTIVE, IdentityError, Registry, Signer
from arbiter.schemas.models import IdentityRegistered
from arbiter.schemas.partitioning import partition_for
from arbiter.schemas.roles import ROLE_AGENT
from arbiter.streams.runtime.livefeed import LiveFeed

from .errors import Refusal, unauthenticated
from .health import Readiness
from .session import Session

log = logging.getLogger(__name__)

ENDED_SAGAS = 1000
"""How many of an agent's ended sagas a door remembers, so ending one again answers how it ended."""
CATCH_UP_SECONDS = 5.0
"""How long a call with a key the door has not seen waits for the registry to be read to its end."""


class Bucket:
    """A token bucket: ``rate`` commands per second, ``burst`` at once."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate, self.burst = rate, float(burst)
        self.tokens = float(burst)
        self.at = time.monotonic()

    def take(self) -> float:
        """0.0 if a command may go now; else the seconds until one may."""
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate


def event_frame(offset: int, record: Record) -> str:
    """The JSON text a session gets for one inbox record: ``to_json(record)`` in an ``event`` frame.

    Serialized by pydantic's own JSON encoder (the same object ``json.dumps(to_json(record))``
    gives, a third of the CPU: this runs for every event of every session)."""
    fields = record.model_dump_json()
    return (f'{{"op":"event","offset":{int(offset)},"record":{{"type":"{type(record).__name__}"'
            f'{"," if fields != "{}" else ""}{fields[1:]}}}')


@dataclass
class AgentState:
    """What the door keeps for one connected agent."""

    name: str
    client: ArbiterClient
    bucket: Bucket
    sessions: set[Session] = field(default_factory=set)
    leases: dict[tuple[str, int], Lease] = field(default_factory=dict)
    """Leases acquired through this door's HTTP calls, by (resource, token)."""
    sagas: dict[str, Saga] = field(default_factory=dict)
    """Its sagas open on this door (started here, not ended yet), by id."""
    ended: OrderedDict[str, SagaFinished] = field(default_factory=OrderedDict)
    """How its sagas ended, the newest ``ENDED_SAGAS`` of them (ended here or anywhere: an operator's
    abort, another door), by id."""
    inflight: int = 0
    last_used: float = field(default_factory=time.monotonic)
    mcp: AgentTools | None = None
    """Its MCP tools (``/mcp``), made on its first MCP call: the leases they renew keep this state."""

    def on_forged(self, offset: int, why: str) -> None:
        """A record for this agent that no worker signed was dropped: tell its sessions."""
        frame = json.dumps({"op": "forged", "offset": offset, "detail": why})
        for session in tuple(self.sessions):
            session.push(offset, frame)

    def on_record(self, record: Record) -> None:
        """Every inbox record of this agent: forget leases and sagas that ended; push to every session."""
        if isinstance(record, SagaFinished):
            # However it ended (the agent, an operator's abort, a deadlock), it is open here no more.
            self.sagas.pop(record.saga_id, None)
            self.client.forget_saga(record)
            self.ended[record.saga_id] = record
            self.ended.move_to_end(record.saga_id)
            while len(self.ended) > ENDED_SAGAS:
                self.ended.popitem(last=False)
        if isinstance(record, LockExpired | LockRevoked | LockReleased):
            lease = self.leases.pop((record.resource, record.token), None)
            if lease is not None:
                lease.mark_lost("expired" if isinstance(record, LockExpired) else
                                "released" if isinstance(record, LockReleased) else f"revoked: {record.reason}")
                self.client.forget(lease)
        if self.sessions:
            offset = self.client.kafka.offset
            frame = event_frame(offset, record)
            for session in tuple(self.sessions):
                session.push(offset, frame)


class Door:
    """One front door's agents and Kafka clients. ``start`` before serving, ``stop`` after."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.id = f"door-{uuid.uuid4().hex[:8]}"
        self.agents: dict[str, AgentState] = {}
        """By credential (its key id): each signs the commands of the calls that presented it."""
        self._buckets: dict[str, Bucket] = {}
        """By agent: an agent's credentials share its rate limit."""
        self._starting: dict[str, asyncio.Future[AgentState]] = {}
        self._keys: OrderedDict[bytes, Signer] = OrderedDict()
        self.registry: Registry | None = None
        self._feed: RegistryFeed | None = None
        self._last_catch_up = 0.0
        self._catching_up = asyncio.Lock()
        self._reaper: asyncio.Task[None] | None = None
        self._replays = asyncio.Semaphore(4)
        self.partitions = 0
        self.started_at = time.time()
        self.readiness = Readiness(settings)
        """What ``/healthz`` answers: Kafka reachable, a worker in the group."""
        self._tasks: set[asyncio.Future[Any]] = set()
        self._live: LiveFeed | None = None
        self._live_lock = asyncio.Lock()

    async def live(self) -> LiveFeed:
        """The console's feed of the log, started on first use (one per door, shared by its pages)."""
        async with self._live_lock:
            if self._live is None:
                feed = LiveFeed(self.settings)
                await feed.start()
                self._live = feed
            return self._live

    def spawn(self, work: Awaitable[Any]) -> None:
        """Run ``work`` in the background (kept referenced until it ends)."""
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def start(self) -> None:
        """Follow the registry (to check keys) and learn the inbox's partitions."""
        settings = self.settings
        if settings.verify_signatures:
            self.registry = Registry(anchors_for(settings.home, settings.admin_public_keys))
            self._feed = RegistryFeed(self.registry, settings)
            await self._feed.start()
        else:
            log.warning("signature verification is off (development only): the door trusts every well-formed "
                        "API key's name")
        async with Tail(settings, [settings.topics.agent_inbox]) as inbox:
            self.partitions = len(inbox.tps)
        if not self.partitions:
            raise RuntimeError(f"the inbox topic {settings.topics.agent_inbox} does not exist; "
                               "run 'arbiter topics create'")
        self._reaper = asyncio.create_task(self._reap(), name="arbiter-door-reaper")

    async def stop(self) -> None:
        """Close every session and client."""
        if self._reaper is not None:
            self._reaper.cancel()
            await asyncio.gather(self._reaper, return_exceptions=True)
        for state in list(self.agents.values()):
            for session in tuple(state.sessions):
                session.close("the front door is shutting down; reconnect (to another door) and resume")
        await asyncio.gather(*(self._drop(key_id) for key_id in list(self.agents)), return_exceptions=True)
        if self._feed is not None:
            await self._feed.stop()
        if self._live is not None:
            await self._live.stop()
        await self.readiness.close()

    # -- authentication -----------------------------------------------------------------

    async def authenticate(self, authorization: str | None) -> tuple[Signer, IdentityRegistered]:
        """The agent an ``Authorization: Bearer`` header names, with its registry entry; else ``Refusal``."""
        if not authorization:
            raise unauthenticated("no API key: the request has no Authorization header")
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise unauthenticated("the Authorization header is not 'Bearer <API key>'")
        return await self.identify(token.strip())

    async def identify(self, api_key: str) -> tuple[Signer, IdentityRegistered]:
        """The agent ``api_key`` belongs to, if the registry says it is an active agent key."""
        digest = hashlib.sha256(api_key.encode()).digest()
        signer = self._keys.get(digest)
        if signer is None:
            try:
                signer = Signer.from_api_key(api_key)
            except IdentityError as exc:
                raise unauthenticated(str(exc)) from None
            self._keys[digest] = signer
            if len(self._keys) > 100_000:
                self._keys.popitem(last=False)
        else:
            self._keys.move_to_end(digest)
        if self.registry is None:  # development without verification
            return signer, IdentityRegistered(key_id=signer.key_id, name=signer.name, role=ROLE_AGENT,
                                              public_key=signer.public_raw, status=ACTIVE, valid_from_ms=0, at_ms=0)
        entry = self.registry.entries.get(signer.key_id)
        if entry is None:
            entry = await self._look_again(signer.key_id)
        if entry is None:
            raise unauthenticated(f"the key {signer.key_id[:16]} is not in the registry: issue a credential with "
                                   f"'arbiter agents api-key {signer.name}'")
        if entry.name != signer.name:
            raise unauthenticated(f"the key is registered to {entry.name!r}, not {signer.name!r}")
        if not entry.credential:
            raise unauthenticated(f"this API key carries {entry.name!r}'s own signing key, which must never travel: "
                                   f"issue a front-door credential with 'arbiter agents api-key {entry.name}' and "
                                   f"rotate the key ('arbiter agents rotate {entry.name}'), as it has left its holder")
        if entry.valid_until_ms is not None and now_ms() >= entry.valid_until_ms:
            how = "expired" if entry.status == ACTIVE else f"was {entry.status}"
            raise unauthenticated(f"the credential {entry.credential!r} of {entry.name!r} {how}")
        if entry.role != ROLE_AGENT:
            raise Refusal(403, "forbidden", f"{entry.name!r} is a {entry.role}; the front door serves agents only",
                          "Register an agent for this work ('arbiter agents add NAME').")
        return signer, entry

    async def _look_again(self, key_id: str) -> IdentityRegistered | None:
        """A key registered a moment ago: read the registry up to its end as of now. Lookups that
        arrive together share one read (a flood of unknown keys costs one request at a time), and
        each waits for a read that started after it arrived, so a key registered before the
        call is always found."""
        assert self.registry is not None and self._feed is not None
        await self.refuse_if_unreachable()  # an unknown key is not known to be bad while the registry is unreadable
        arrived = time.monotonic()
        async with self._catching_up:
            if key_id not in self.registry.entries and self._last_catch_up <= arrived:
                self._last_catch_up = time.monotonic()
                if not await self._feed.catch_up(timeout=CATCH_UP_SECONDS) and key_id not in self.registry.entries:
                    raise Refusal(503, "unavailable", f"the registry could not be read to its end within "
                                  f"{CATCH_UP_SECONDS:g} s to check this key", "Retry shortly.",
                                  headers={"Retry-After": "1"})
        return self.registry.entries.get(key_id)

    # -- agents -------------------------------------------------------------------------

    async def agent(self, signer: Signer) -> AgentState:
        """The state of the credential ``signer`` is (its client connected on first use)."""
        state = self.agents.get(signer.key_id)
        if state is not None:
            state.last_used = time.monotonic()
            return state
        starting = self._starting.get(signer.key_id)
        if starting is None:
            starting = self._starting[signer.key_id] = asyncio.ensure_future(self._connect(signer))
            starting.add_done_callback(lambda _: self._starting.pop(signer.key_id, None))
        return await asyncio.shield(starting)

    async def _connect(self, signer: Signer) -> AgentState:
        client = ArbiterClient(signer.name, self.settings, signer=signer)
        await client.start()
        bucket = self._buckets.get(signer.name)
        if bucket is None:
            bucket = self._buckets[signer.name] = Bucket(self.settings.door_rate, self.settings.door_burst)
        state = AgentState(signer.name, client, bucket)
        client.subscribe(state.on_record)
        client.kafka.on_forged = state.on_forged
        self.agents[signer.key_id] = state
        return state

    async def _drop(self, key_id: str) -> None:
        state = self.agents.pop(key_id, None)
        if state is not None:
            if state.mcp is not None:
                await state.mcp.close()
            for lease in state.leases.values():
                state.client.forget(lease)
            await state.client.close()
            if not any(s.name == state.name for s in self.agents.values()):
                self._buckets.pop(state.name, None)

    async def _reap(self) -> None:
        idle = self.settings.door_idle_seconds
        while True:
            await asyncio.sleep(min(5.0, idle / 2))
            now = time.monotonic()
            for key_id, state in list(self.agents.items()):
                holding = state.mcp is not None and state.mcp.holding()
                if (not state.sessions and state.inflight == 0 and not state.sagas and not holding
                        and now - state.last_used > idle):
                    await self._drop(key_id)

    def admit(self, state: AgentState) -> None:
        """Charge one command to the agent's rate limit; ``Refusal`` (429) when it is spent."""
        wait = state.bucket.take()
        if wait > 0:
            raise Refusal(429, "rate_limited",
                          f"{state.name!r} sent more than {self.settings.door_rate:g} commands/s "
                          f"(burst {self.settings.door_burst})",
                          f"Retry after {wait:.3f} s.", headers={"Retry-After": str(max(1, round(wait + 0.5)))})

    async def refuse_if_unreachable(self) -> None:
        """``Refusal`` 503 (``Retry-After``) while Kafka does not answer (``readiness``, checked at most once a
        second): a call would only wait out its send deadline to get the same answer."""
        ready = await self.readiness.check()
        if ready.kafka == "unreachable":
            raise Refusal(503, "unavailable", ready.why, "Retry shortly: Kafka is down or unreachable from this door.",
                          headers={"Retry-After": "1"})

    @contextlib.asynccontextmanager
    async def call(self, signer: Signer, charge: bool = True) -> Any:
        """``async with door.call(signer) as state``: one rate-limited HTTP call of an authenticated agent
        (503 at once while Kafka does not answer)."""
        await self.refuse_if_unreachable()
        state = await self.agent(signer)
        if state.inflight >= self.settings.door_max_inflight_per_agent:
            raise Refusal(429, "too_many_calls", f"{state.name!r} has {state.inflight} calls in progress here",
                          "Wait for some to finish (a waiting acquire counts), or use a WebSocket session.",
                          headers={"Retry-After": "1"})
        if charge:
            self.admit(state)
        state.inflight += 1
        try:
            yield state
        finally:
            state.inflight -= 1
            state.last_used = time.monotonic()

    # -- sessions -----------------------------------------------------------------------

    def open_session(self, state: AgentState, since: int) -> Session:
        """A new session for ``state``'s agent, forwarding events from inbox offset ``since`` on."""
        if len(state.sessions) >= self.settings.door_max_sessions_per_agent:
            raise Refusal(429, "too_many_sessions",
                          f"{state.name!r} already has {len(state.sessions)} sessions on this door",
                          "Close one, or share one session between the agent's tasks.")
        session = Session(state.name, self.settings.door_session_buffer, since)
        state.sessions.add(session)
        return session

    def close_session(self, state: AgentState, session: Session) -> None:
        """Forget ``session``."""
        state.sessions.discard(session)
        state.last_used = time.monotonic()

    def inbox_partition(self, agent: str) -> TopicPartition:
        """Where ``agent``'s inbox records are."""
        return TopicPartition(self.settings.topics.agent_inbox, partition_for(agent.encode(), self.partitions))

    async def end_offset(self, state: AgentState) -> int:
        """The offset the next inbox record of ``state``'s agent's partition will get."""
        return await state.client.kafka.inbox_end()

    async def replay(self, state: AgentState, session: Session, since: int, until: int) -> None:
        """Forward ``state``'s agent's inbox records in [since, until) from the log, then the live ones."""
        if since < until:
            async with self._replays:
                await self._replay(state, session, since, until)
        session.live()

    async def _replay(self, state: AgentState, session: Session, since: int, until: int) -> None:
        tp = self.inbox_partition(state.name)
        key = state.name.encode()
        kafka = state.client.kafka
        async with Tail(self.settings, [tp], start={tp: since}, decode=False) as tail:
            for message, _ in await tail.read_to_end({tp: until}):
                if session.closed_because is not None:
                    return
                if message.key != key:
                    continue
                record = await kafka.verify(message)
                if record is not None:
                    await session.replayed(message.offset, event_frame(message.offset, record))
