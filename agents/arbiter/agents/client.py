"""``ArbiterClient``: sends commands to Arbiter and awaits the outcomes in the agent's inbox.

Theory of operation
-------------------
Commands go to the resource-command topic, keyed by resource (the processors decide
per key, in order). Outcomes come back on the agent-inbox topic, keyed by agent id.
The Kafka side of that (signing and sending, and this agent's inbox records, through
the producer and inbox reader every client in the process shares) is
``arbiter.agents.transport`` and ``arbiter.agents.hub``; this module is the facade. It hands each inbox
record to the route registered for its request id; a record for an id it does not
know is ignored. Nothing polls: a waiting call is a suspended future.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypedDict, Unpack

from arbiter.agents.errors import ArbiterError, ArbiterTimeout, LeaseDenied, SagaAborted
from arbiter.agents.httptransport import HttpTransport
from arbiter.agents.identities import ensure_credential
from arbiter.agents.leases import Lease, OnAcquired
from arbiter.agents.outcomes import Outcome, Snapshot
from arbiter.agents.requests import Do, PendingAcquire
from arbiter.agents.sagas import Saga, SagaMessage
from arbiter.agents.sandbox import Sandbox
from arbiter.agents.transport import KafkaTransport, Transport
from arbiter.edge.clock import now_ms
from arbiter.edge.settings import Settings, load_settings
from arbiter.schemas import (
    Codec,
    CompensationRequested,
    DeadlockDetected,
    LockCancelled,
    LockCancelRequested,
    LockDenied,
    LockGranted,
    LockQueued,
    LockReleased,
    LockReleaseRequested,
    LockRenewed,
    LockRenewRequested,
    LockRequested,
    LockWaitTimedOut,
    Ping,
    Pong,
    Record,
    ResourceSnapshot,
    SagaFinished,
    SnapshotRequested,
    ToolApplied,
    ToolIntent,
    ToolRejected,
    WaitEdgeAdded,
    WaitEdgeRemoved,
    default_codec,
)
from arbiter.schemas.identity import Signer
from arbiter.schemas.reasons import Reason, what_to_do

Plan = tuple[int, dict[str, Any]] | None
Replan = Callable[[Outcome], Plan | Awaitable[Plan]]
"""``replan(outcome)``, a plain function or a coroutine: the new ``(base_version, patch)``, or None to give up."""


class AcquireOptions(TypedDict, total=False):
    """``acquire``'s options, which ``lease`` and ``leases`` take too."""

    ttl: float
    mode: str
    priority: int
    wait: float
    saga_id: str | None
"""replan(conflict) -> (new base version, new patch), or None to give up."""


@dataclass(frozen=True)
class PingResult:
    """A round trip through a worker."""

    rtt_ms: float
    worker_id: str
    partition: int


Route = Callable[[Record], None]



def _new_id() -> str:
    return uuid.uuid4().hex


class ArbiterClient:
    """An AI agent's connection to Arbiter. Use as ``async with ArbiterClient(...)``."""

    def __init__(self, agent_id: str, settings: Settings | None = None, codec: Codec | None = None, *,
                 url: str | Sequence[str] | None = None, api_key: str | None = None,
                 signer: Signer | None = None) -> None:
        """``url`` (one front door, a list, or a comma-separated list; default ``ARBITER_URL``) talks to
        Arbiter through ``arbiter serve`` with ``api_key`` (default ``ARBITER_API_KEY``: a front-door
        credential from ``arbiter agents api-key NAME``; the agent's own key never goes to a door);
        without one, the client talks to Kafka directly, signing with ``signer`` or the agent's key
        file. The API is the same either way."""
        if not agent_id:
            raise ValueError("agent_id must not be empty")
        self.agent_id = agent_id
        self.settings = settings or load_settings()
        self.codec = codec or default_codec(self.settings.max_message_bytes)
        url = url or self.settings.url or None
        self._transport: Transport
        if url:
            key = api_key or self.settings.api_key
            self._transport = HttpTransport(agent_id, url, key, self._on_inbox,
                                            max_message_bytes=2 * self.settings.max_message_bytes)
        else:
            self._transport = KafkaTransport(agent_id, self.settings, self.codec, self._on_inbox, signer=signer)
        self._listeners: list[Route] = []
        self._routes: dict[str, Route] = {}
        self._held: dict[str, Lease] = {}
        self.registered_at_ms = now_ms()
        """When this agent connected: the younger agent loses a deadlock between equals."""
        self.deadlocks: list[DeadlockDetected] = []
        """Every deadlock this agent was chosen to break, newest last."""
        self._deadlock_seen = asyncio.Event()
        self._sagas: dict[str, Saga] = {}
        self._saga_ends: dict[str, asyncio.Future[Record]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False

    @property
    def forged_messages(self) -> int:
        """Inbox messages for this agent that no worker signed: dropped, never acted on (each is logged)."""
        return self._transport.forged

    async def __aenter__(self) -> ArbiterClient:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    # -- connection ------------------------------------------------------------------

    async def start(self) -> None:
        """Connect, and start reading this agent's inbox from now on."""
        transport = self._transport
        if isinstance(transport, HttpTransport) and not transport.api_key and self.settings.auto_enroll:
            transport.api_key = (await ensure_credential(self.settings, self.agent_id)).api_key()
        await self._transport.start()
        self._closed = False

    async def close(self) -> None:
        """Stop reading and disconnect. Held leases are left to expire, and so are requests still queued."""
        self._closed = True
        self._routes.clear()
        await self._transport.close()

    def subscribe(self, listener: Route) -> Callable[[], None]:
        """Also hand every inbox record of this agent to ``listener`` (it must not block); returns
        the function that unsubscribes it. The front door pushes them to the agent's WebSockets."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener) if listener in self._listeners else None

    def forget(self, lease: Lease) -> None:
        """Stop tracking ``lease`` (it is gone, or someone else tracks it) without releasing it."""
        if self._held.get(lease.resource) is lease:
            del self._held[lease.resource]
        self._routes.pop(lease.request_id, None)

    @property
    def transport(self) -> Transport:
        """How this client reaches Arbiter (the front door sends an agent's raw commands through it)."""
        return self._transport

    @property
    def kafka(self) -> KafkaTransport:
        """The Kafka transport, for what a front door needs of it (inbox offsets, the forged-message
        callback, verifying a record read back from the log); ``TypeError`` over a front door."""
        if not isinstance(self._transport, KafkaTransport):
            raise TypeError(f"{self.agent_id!r} talks to a front door, not to Kafka")
        return self._transport

    def _on_inbox(self, record: Record) -> None:
        """Hand one inbox record to the route waiting for it (the transport's callback)."""
        for listener in tuple(self._listeners):
            listener(record)
        if isinstance(record, DeadlockDetected):
            self.deadlocks.append(record)
            self._deadlock_seen.set()
            for running in list(self._sagas.values()):
                # A deadlock victim aborts its subtask: compensation starts at once.
                self._background(running.abort("deadlock_victim"))
            return
        key: str | None
        if isinstance(record, Pong):
            key = record.request_id
        elif isinstance(record, ToolApplied | ToolRejected):
            key = record.intent_id
        elif isinstance(record, SagaFinished):
            key = record.saga_id
        else:
            key = getattr(record, "request_id", None)
        route = self._routes.get(key) if isinstance(key, str) else None
        if route is not None:
            route(record)

    async def _send(self, key: str, record: Record) -> None:
        await self._transport.send(self.settings.topics.resource_commands, key, record)

    async def _call(self, key: str, command: Record, request_id: str, timeout: float,
                    final: tuple[type[Record], ...]) -> Record:
        """Send one command and await the first inbox event of a ``final`` type for it."""
        future: asyncio.Future[Record] = asyncio.get_running_loop().create_future()

        def route(record: Record) -> None:
            if isinstance(record, final) and not future.done():
                future.set_result(record)

        self._routes[request_id] = route
        try:
            await self._send(key, command)
            async with asyncio.timeout(timeout):
                return await future
        except TimeoutError:
            raise ArbiterTimeout(f"no answer to {type(command).__name__} on {key!r} within {timeout}s: "
                                 "is a worker running?") from None
        finally:
            self._routes.pop(request_id, None)

    # -- health ----------------------------------------------------------------------

    async def ping(self, key: str | None = None, timeout: float = 10.0) -> PingResult:
        """Send a Ping through the worker that owns ``key``'s partition and await the Pong."""
        request_id = _new_id()
        started = time.perf_counter()
        try:
            pong = await self._call(key or f"ping:{request_id}", Ping(request_id=request_id, agent_id=self.agent_id,
                                                                   at_ms=now_ms()), request_id, timeout,
                                    (Pong, LockDenied))
        except ArbiterTimeout:
            raise ArbiterTimeout(f"no Pong within {timeout}s: is a worker running?") from None
        if isinstance(pong, LockDenied):
            raise LeaseDenied.from_event(pong)  # refused by the trust gate: unsigned, unknown key, misrouted
        assert isinstance(pong, Pong)
        return PingResult((time.perf_counter() - started) * 1000, pong.worker_id, pong.cause.partition)

    # -- leases ----------------------------------------------------------------------

    async def acquire(
        self,
        resource: str,
        *,
        ttl: float = 30.0,
        mode: str = "exclusive",
        priority: int = 0,
        wait: float = 60.0,
        saga_id: str | None = None,
        on_queued: Callable[[LockQueued], None] | None = None,
    ) -> Lease:
        """Acquire a lease, waiting in the queue up to ``wait`` seconds. Does not renew it.

        Raises ``LeaseDenied`` (with the JSON diagnostic) when it is not granted, and
        ``ArbiterTimeout`` when no decision arrives at all.
        """
        command = LockRequested(
            request_id=_new_id(), agent_id=self.agent_id, resource=resource, mode=mode, ttl_ms=round(ttl * 1000),
            priority=priority, wait_ms=round(wait * 1000), saga_id=saga_id, held_resources=sorted(self._held),
            at_ms=now_ms(),
        )
        pending = PendingAcquire(command.request_id, time.monotonic())
        answered: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        granted: list[Lease] = []
        self._routes[command.request_id] = lambda record: self._follow(pending, record, answered, granted,
                                                                        resource, on_queued)
        try:
            await self._send(resource, command)
            async with asyncio.timeout(wait + self.settings.session_timeout + 10):
                await answered
        except BaseException as exc:
            await self._withdraw(pending, resource)
            if isinstance(exc, asyncio.TimeoutError):
                raise ArbiterTimeout(f"no decision on {resource!r} within {wait}s plus grace: "
                                     "is a worker running?") from None
            raise
        lease = await self._lease_of(pending, command)
        granted.append(lease)
        self._held[resource] = lease
        return lease

    def _follow(self, pending: PendingAcquire, record: Record, answered: asyncio.Future[None],
                granted: list[Lease], resource: str, on_queued: Callable[[LockQueued], None] | None) -> None:
        """One inbox record of a pending acquire: do what its machine says."""
        do = pending.feed(record, time.monotonic())
        if do is Do.QUEUED and on_queued is not None:
            assert isinstance(record, LockQueued)
            on_queued(record)
        elif do is Do.ANSWER and not answered.done():
            answered.set_result(None)
        elif do is Do.MARK_LOST and granted:
            granted[0].mark_lost(pending.lost_reason or "lost")
        elif do is Do.GIVE_BACK:
            assert isinstance(record, LockGranted)
            self._background(self.release_token(resource, record.token))

    async def _withdraw(self, pending: PendingAcquire, resource: str) -> None:
        """The caller stopped waiting (timed out, cancelled): withdraw the request; a late grant is given back."""
        if pending.withdraw() and not self._closed:  # (closed: nothing to send with; its wait runs out)
            with contextlib.suppress(ArbiterError):  # (not reachable: the worker's expiry ends it anyway)
                await asyncio.shield(self._send(resource, LockCancelRequested(
                    request_id=_new_id(), agent_id=self.agent_id, resource=resource,
                    target_request_id=pending.request_id, at_ms=now_ms())))

    async def _lease_of(self, pending: PendingAcquire, command: LockRequested) -> Lease:
        """The lease a final answer grants; or its refusal raised."""
        outcome = pending.final
        if not isinstance(outcome, LockGranted):
            self._routes.pop(command.request_id, None)
            assert isinstance(outcome, LockDenied | LockWaitTimedOut | LockCancelled)
            denied = LeaseDenied.from_event(outcome)
            raise (await self._with_deadlock(denied)) if denied.reason == "deadlock_victim" else denied
        lease = Lease(resource=command.resource, agent_id=self.agent_id, request_id=command.request_id,
                      token=outcome.token, mode=outcome.mode, ttl_ms=command.ttl_ms,
                      expires_at_ms=outcome.expires_at_ms, resource_version=outcome.resource_version,
                      warnings=list(outcome.warnings))
        lease.extended(pending.ttl_from(time.monotonic()), outcome.expires_at_ms, command.ttl_ms)
        return lease

    async def _with_deadlock(self, denied: LeaseDenied) -> LeaseDenied:
        """Add the detector's message and cycle to a deadlock victim's refusal."""
        if not self.deadlocks:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._deadlock_seen.wait(), 2.0)
        if not self.deadlocks:
            return denied
        notice = self.deadlocks[-1]
        return LeaseDenied(denied.reason, {**denied.diagnostic, "message": notice.message,
                                           "cycle": json.loads(notice.cycle_json),
                                           "what_to_do": what_to_do(Reason.DEADLOCK_VICTIM)})

    @contextlib.asynccontextmanager
    async def waiting_on(self, other: str, *, priority: int = 0, task: str = "",
                         saga_id: str | None = None) -> AsyncIterator[None]:
        """``async with client.waiting_on("testing-agent")``: say "I wait on that agent" while inside.

        The deadlock detector sees the edge; if it closes a cycle and this agent is the
        victim, ``wait_for_deadlock`` returns the notice and the agent should abort.
        """
        edge_id = f"delegation|{self.agent_id}|{other}|{_new_id()}"
        key = self.settings.graph_key
        await self._transport.send(self.settings.topics.wait_edges, key, WaitEdgeAdded(
            edge_id=edge_id, waiter=self.agent_id, holder=other, source="delegation", resource=None,
            waiter_priority=priority, waiter_registered_at_ms=self.registered_at_ms, saga_id=saga_id,
            at_ms=now_ms()))
        try:
            yield
        finally:
            await asyncio.shield(self._transport.send(self.settings.topics.wait_edges, key, WaitEdgeRemoved(
                edge_id=edge_id, waiter=self.agent_id, holder=other, source="delegation", resource=None,
                at_ms=now_ms())))

    def delegate(self, to: str, task: str = "", priority: int = 0,
                 saga_id: str | None = None) -> contextlib.AbstractAsyncContextManager[None]:
        """``async with client.delegate(to="testing", task=...)``: wait on the agent you handed work to."""
        return self.waiting_on(to, priority=priority, task=task, saga_id=saga_id)

    def _background(self, work: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send_saga(self, saga_id: str, record: SagaMessage) -> None:
        await self._transport.send(self.settings.topics.saga_commands, saga_id, record)

    def sandbox(self, repository: str, base: str = "main", *, keep: bool | None = None, ttl: float = 60.0,
                wait: float = 600.0) -> contextlib.AbstractAsyncContextManager[Sandbox]:
        """``async with client.sandbox("app") as box``: this agent's sandbox (a clone) of repository ``app``
        (``repo:app``, configured on the workers as ``ARBITER_REPOS=app=PATH``), from branch ``base``;
        ``box.path``, ``box.base``, ``await box.merge(message, check=...)``, ``await box.rebase()``. Left
        when everything in it merged, it is discarded; with unmerged commits it is kept (``keep``)."""
        from arbiter.agents.sandbox import sandbox

        return sandbox(self, repository, base, keep=keep, ttl=ttl, wait=wait)

    @contextlib.asynccontextmanager
    async def saga(self, name: str, timeout: float = 120.0) -> AsyncIterator[Saga]:
        """``async with client.saga(name) as saga``: a task that completes or is compensated as a whole.

        Leaving the block normally completes it; an exception aborts it (compensating
        the completed steps) and is re-raised once the saga is ``COMPENSATED``. If the
        agent was chosen as a deadlock victim meanwhile, leaving raises ``SagaAborted``.
        """
        saga = self.open_saga(name)
        try:
            yield saga
        except BaseException as exc:
            await asyncio.shield(self.finish_saga(saga, saga.abort_reason or f"{type(exc).__name__}: {exc}"[:200],
                                                  timeout))
            raise
        outcome = await self.finish_saga(saga, None, timeout)
        if outcome.outcome != "COMPLETED":
            raise SagaAborted(saga.saga_id, saga.abort_reason or "aborted")

    def open_saga(self, name: str) -> Saga:
        """Start a saga (``saga`` does this for a block); end it with ``finish_saga``."""
        saga = Saga(self, f"saga:{self.agent_id}/{name}:{_new_id()}", self._send_saga)
        finished: asyncio.Future[Record] = asyncio.get_running_loop().create_future()

        def route(record: Record) -> None:
            if isinstance(record, SagaFinished) and not finished.done():
                finished.set_result(record)

        self._routes[saga.saga_id] = route
        self._sagas[saga.saga_id] = saga
        self._saga_ends[saga.saga_id] = finished
        return saga

    async def abort_saga(self, saga_id: str, reason: str = "aborted_by_agent") -> None:
        """Abort this agent's saga ``saga_id`` by its id, wherever it was opened (a process that is gone,
        another door): its completed steps are compensated, and its end (``SagaFinished``) comes to the
        inbox. Aborting a saga that is undoing or has ended changes nothing."""
        await self._send_saga(saga_id, CompensationRequested(saga_id=saga_id, reason=reason,
                                                             requested_by=self.agent_id, at_ms=now_ms()))

    def forget_saga(self, finished: SagaFinished) -> None:
        """The saga ``finished`` names ended without ``finish_saga`` (an operator aborted it, say): a call
        awaiting its end gets ``finished``, and this client stops tracking it."""
        end = self._saga_ends.pop(finished.saga_id, None)
        if end is not None and not end.done():
            end.set_result(finished)
        self._sagas.pop(finished.saga_id, None)
        self._routes.pop(finished.saga_id, None)

    async def finish_saga(self, saga: Saga, abort: str | None, timeout: float = 120.0) -> SagaFinished:
        """Complete ``saga`` (``abort`` None, unless it was aborted meanwhile) or abort it with that
        reason (its completed steps are compensated); await and return how it ended."""
        finished = self._saga_ends[saga.saga_id]
        try:
            if abort is not None:
                await saga.abort(abort)
            elif saga.abort_reason is None:
                await saga.complete()
            try:
                outcome = await asyncio.wait_for(asyncio.shield(finished), timeout)
            except TimeoutError:
                raise ArbiterTimeout(f"saga {saga.saga_id} did not end within {timeout}s: "
                                     "is a worker running?") from None
            assert isinstance(outcome, SagaFinished)
            return outcome
        finally:
            self._sagas.pop(saga.saga_id, None)
            self._routes.pop(saga.saga_id, None)
            self._saga_ends.pop(saga.saga_id, None)

    async def wait_for_deadlock(self, timeout: float | None = None) -> DeadlockDetected:
        """Suspend until this agent is chosen as a deadlock victim; returns the notice."""
        await asyncio.wait_for(self._deadlock_seen.wait(), timeout)
        return self.deadlocks[-1]

    async def renew(self, lease: Lease, ttl: float | None = None, timeout: float = 10.0) -> None:
        """Extend ``lease``. A refusal marks it lost and raises ``LeaseDenied``."""
        sent_at = time.monotonic()
        outcome = await self.renew_token(lease.resource, lease.token,
                                         None if ttl is None else ttl, timeout=timeout)
        if isinstance(outcome, LockRenewed):
            lease.extended(sent_at, outcome.expires_at_ms, outcome.expires_at_ms - outcome.at_ms)
            return
        lease.mark_lost(f"renewal refused: {outcome.reason}")
        raise LeaseDenied.from_event(outcome)

    async def release(self, lease: Lease, timeout: float = 10.0) -> None:
        """Give ``lease`` back. Releasing a lease that is already gone is not an error."""
        self._held.pop(lease.resource, None)
        self._routes.pop(lease.request_id, None)
        if lease.lost_reason not in (None, "ttl_elapsed_locally"):
            return  # the broker said it is gone (expired, revoked, renewal refused, released)
        # Lost only by the local clock (a conservative bound): the broker may still hold it for us,
        # so give it back; a refusal because it is already gone is fine.
        outcome = await self.release_token(lease.resource, lease.token, timeout=timeout)
        lease.mark_lost("released")
        if isinstance(outcome, LockDenied) and outcome.reason not in {"lease_not_live", "stale_fencing_token"}:
            raise LeaseDenied.from_event(outcome)

    async def renew_token(self, resource: str, token: int, ttl: float | None = None,
                          timeout: float = 10.0) -> LockRenewed | LockDenied:
        """Low level: renew by token (for tools that are not Python; see ``arbiter lock``)."""
        request_id = _new_id()
        outcome = await self._call(resource, LockRenewRequested(
            request_id=request_id, agent_id=self.agent_id, resource=resource, token=token,
            ttl_ms=None if ttl is None else round(ttl * 1000), at_ms=now_ms(),
        ), request_id, timeout, (LockRenewed, LockDenied))
        assert isinstance(outcome, LockRenewed | LockDenied)
        return outcome

    async def release_token(self, resource: str, token: int, timeout: float = 10.0) -> LockReleased | LockDenied:
        """Low level: release by token."""
        request_id = _new_id()
        outcome = await self._call(resource, LockReleaseRequested(
            request_id=request_id, agent_id=self.agent_id, resource=resource, token=token, at_ms=now_ms(),
        ), request_id, timeout, (LockReleased, LockDenied))
        assert isinstance(outcome, LockReleased | LockDenied)
        return outcome

    @contextlib.asynccontextmanager
    async def lease(self, resource: str, *, on_acquired: OnAcquired | None = None, renew: bool = True,
                    **options: Unpack[AcquireOptions]) -> AsyncIterator[Lease]:
        """``async with client.lease(name, ttl=30) as lease``: acquire (``options`` as ``acquire``'s), renew in
        the background, release.

        ``on_acquired(lease)`` runs after the grant and before the body, so the agent
        refreshes its context with what it holds now, not what it saw before queueing.
        """
        held = await self.acquire(resource, **options)
        renewer = asyncio.create_task(self._keep_renewed(held)) if renew else None
        try:
            if on_acquired is not None:
                await on_acquired(held)
            yield held
        finally:
            if renewer is not None:
                renewer.cancel()
                await asyncio.gather(renewer, return_exceptions=True)
            await asyncio.shield(self.release(held))

    async def _keep_renewed(self, lease: Lease) -> None:
        while lease.lost_reason is None:
            await asyncio.sleep(lease.ttl_ms / 3000)
            if lease.lost_reason is not None:
                return
            try:
                await self.renew(lease, ttl=lease.ttl_ms / 1000, timeout=max(1.0, lease.ttl_ms / 3000))
            except LeaseDenied:
                return
            except ArbiterTimeout:
                continue  # the lease may still be live; the local deadline decides

    @contextlib.asynccontextmanager
    async def leases(self, resources: Iterable[str], **options: Any) -> AsyncIterator[dict[str, Lease]]:
        """Acquire several leases in the global order (sorted names); release in reverse.

        Every agent acquiring in one order cannot deadlock on these leases.
        """
        async with contextlib.AsyncExitStack() as stack:
            held: dict[str, Lease] = {}
            for name in sorted(set(resources)):
                held[name] = await stack.enter_async_context(self.lease(name, **options))
            yield held

    # -- the gateway -----------------------------------------------------------------

    async def execute(
        self,
        lease: Lease | str,
        tool: str,
        args: dict[str, Any],
        *,
        base_version: int | None = None,
        base_hash: str | None = None,
        intent_id: str | None = None,
        saga_id: str | None = None,
        step: int | None = None,
        is_compensation: bool = False,
        timeout: float = 30.0,
        token: int | None = None,
    ) -> Outcome:
        """Ask the gateway to run ``tool`` on a resource; await the outcome.

        Pass the ``Lease`` (its token fences the write) or, for optimistic resources,
        the resource name with ``base_version`` (or a lease's ``token`` held elsewhere, as the
        front door does). Reusing an ``intent_id`` returns the original outcome; the tool never
        runs twice.
        """
        resource = lease.resource if isinstance(lease, Lease) else lease
        token = lease.token if isinstance(lease, Lease) else token
        intent_id = intent_id or _new_id()
        intent = ToolIntent(
            intent_id=intent_id, agent_id=self.agent_id, resource=resource, token=token,
            base_version=base_version, base_hash=base_hash, tool=tool,
            arguments_json=json.dumps(args, sort_keys=True), saga_id=saga_id, step=step,
            is_compensation=is_compensation, at_ms=now_ms(),
        )
        event = await self._call(resource, intent, intent_id, timeout, (ToolApplied, ToolRejected))
        assert isinstance(event, ToolApplied | ToolRejected)
        return Outcome.from_event(event)

    async def commit(self, resource: str, base_version: int, patch: dict[str, Any], *,
                     lease: Lease | None = None, intent_id: str | None = None) -> Outcome:
        """Optimistic write: apply a JSON merge ``patch`` to a document at ``base_version``."""
        return await self.execute(lease or resource, "commit", {"patch": patch}, base_version=base_version,
                                  intent_id=intent_id)

    async def snapshot(self, resource: str, timeout: float = 10.0, *, content: bool = False) -> Snapshot:
        """The resource's current version, content hash and live holders; with ``content=True`` also
        its content (``Snapshot.content``: a document's revision and body, an account's balance), read
        in the resource's order, so it is the content at that version. A refusal (a resource outside
        the agent's prefixes: ``forbidden``) raises ``LeaseDenied`` with the JSON diagnostic."""
        request_id = _new_id()
        event = await self._call(resource, SnapshotRequested(
            request_id=request_id, agent_id=self.agent_id, resource=resource, at_ms=now_ms(),
            with_content=content,
        ), request_id, timeout, (ResourceSnapshot, LockDenied))
        if isinstance(event, LockDenied):
            raise LeaseDenied.from_event(event)  # e.g. forbidden: the resource is outside the agent's prefixes
        assert isinstance(event, ResourceSnapshot)
        return Snapshot.from_event(event)

    async def commit_rebasing(self, resource: str, base_version: int, patch: dict[str, Any], replan: Replan, *,
                              lease: Lease | None = None, max_attempts: int = 3) -> Outcome:
        """``commit``; on a version conflict call ``replan(outcome)`` and retry, up to ``max_attempts``.

        ``replan`` reads ``outcome.diagnostic["changes_since_base"]`` (or re-reads the
        resource when ``base_too_old``) and returns the new base and patch, or None to
        give up. Every attempt is a new intent.
        """
        outcome = await self.commit(resource, base_version, patch, lease=lease)
        attempts = 1
        while outcome.conflict and attempts < max_attempts:
            plan = replan(outcome)
            if inspect.isawaitable(plan):
                plan = await plan
            if plan is None:
                break
            base_version, patch = plan
            outcome = await self.commit(resource, base_version, patch, lease=lease)
            attempts += 1
        return outcome
