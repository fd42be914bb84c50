"""Sagas as an agent sees them: steps with compensations, undone together on abort.

``async with client.saga("refund-ticket") as saga:`` opens a saga; each
``await saga.step(lease, tool, args, compensate=(tool, args))`` runs one write
through the gateway and, once applied, registers how to undo it. The saga ends
``COMPLETED`` when the block exits normally. It ends ``COMPENSATED`` when the block
raises (an explicit ``saga.abort()``, a rejection the agent gave up on), or when the
deadlock detector chose this agent as a victim: the saga processor then undoes the
completed steps in reverse order, each at most once, fenced by its own leases, even
across worker crashes. Exiting the block waits for that outcome.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

from arbiter.agents.errors import SagaAborted, SagaStepRejected
from arbiter.agents.leases import Lease, OnAcquired
from arbiter.agents.outcomes import Outcome
from arbiter.edge.clock import now_ms
from arbiter.schemas import CompensationRequested, SagaStep

Compensation = tuple[str, dict[str, Any]]
"""(tool, arguments) that undo a step."""

SagaMessage = SagaStep | CompensationRequested
"""What a saga tells the saga processor: a step's result, completion, or a request to compensate."""

SendSagaMessage = Callable[[str, SagaMessage], Awaitable[None]]
"""send(saga_id, message): sends one message to the saga processor, keyed by the saga's id."""


class SagaHost(Protocol):
    """What a ``Saga`` needs from the client that runs it (``ArbiterClient`` is one).

    Kept here, below the client, so this module never imports it.
    """

    @property
    def agent_id(self) -> str: ...

    async def execute(self, lease: Lease | str, tool: str, args: dict[str, Any], *, base_version: int | None = ...,
                      saga_id: str | None = ..., step: int | None = ..., token: int | None = ...) -> Outcome: ...

    def delegate(self, to: str, task: str = ..., priority: int = ...,
                 saga_id: str | None = ...) -> AbstractAsyncContextManager[None]: ...

    def lease(self, resource: str, *, ttl: float = ..., mode: str = ..., priority: int = ..., wait: float = ...,
              saga_id: str | None = ..., on_acquired: OnAcquired | None = ...,
              renew: bool = ...) -> AbstractAsyncContextManager[Lease]: ...


class Saga:
    """A running saga. Created by ``ArbiterClient.saga``."""

    def __init__(self, client: SagaHost, saga_id: str, send: SendSagaMessage) -> None:
        self.client = client
        self.saga_id = saga_id
        self.steps = 0
        self.abort_reason: str | None = None
        self._send = send

    async def step(self, lease: Lease | str, tool: str, args: dict[str, Any], *,
                   compensate: Compensation | Callable[[Outcome], Compensation] | None = None,
                   base_version: int | None = None, token: int | None = None) -> Outcome:
        """Run one step through the gateway; raise ``SagaStepRejected`` if it is not applied.

        ``compensate`` is ``(tool, args)``, or a function of the step's outcome that
        returns them (for an undo that names what the step created). ``token`` fences a
        step on a resource named by string (a lease held elsewhere).
        """
        if self.abort_reason is not None:
            raise SagaAborted(self.saga_id, self.abort_reason)
        step = self.steps
        self.steps += 1
        fenced = {} if token is None else {"token": token}  # hosts without a token parameter keep working
        outcome = await self.client.execute(lease, tool, args, base_version=base_version, saga_id=self.saga_id,
                                            step=step, **fenced)
        resource = lease.resource if isinstance(lease, Lease) else lease
        undo = compensate(outcome) if callable(compensate) else compensate
        comp_tool, comp_args = undo if undo else (None, None)
        await self._send(self.saga_id, SagaStep(
            saga_id=self.saga_id, step=step, agent_id=self.client.agent_id,
            status="completed" if outcome.applied else "failed", intent_id=outcome.intent_id, resource=resource,
            tool=tool, arguments_json=json.dumps(args, sort_keys=True), compensate_tool=comp_tool,
            compensate_arguments_json=None if comp_args is None else json.dumps(comp_args, sort_keys=True),
            at_ms=now_ms()))
        if not outcome.applied:
            raise SagaStepRejected(outcome)
        return outcome

    def delegate(self, to: str, task: str = "", priority: int = 0) -> AbstractAsyncContextManager[None]:
        """Wait on another agent as part of this saga: if that deadlocks, the saga is compensated."""
        return self.client.delegate(to, task=task, priority=priority, saga_id=self.saga_id)

    def lease(self, resource: str, **options: Any) -> AbstractAsyncContextManager[Lease]:
        """``client.lease`` as part of this saga (its waits name the saga)."""
        return self.client.lease(resource, saga_id=self.saga_id, **options)

    async def abort(self, reason: str = "aborted_by_agent", requested_by: str | None = None) -> None:
        """Ask for compensation of every completed step (idempotent)."""
        if self.abort_reason is None:
            self.abort_reason = reason
        await self._send(self.saga_id, CompensationRequested(
            saga_id=self.saga_id, reason=reason, requested_by=requested_by or self.client.agent_id, at_ms=now_ms()))

    async def complete(self) -> None:
        """Tell the saga processor every step is done, so the saga ends ``COMPLETED``.

        ``ArbiterClient.saga`` calls this when its block exits normally (and was not aborted).
        """
        await self._send(self.saga_id, SagaStep(
            saga_id=self.saga_id, step=-1, agent_id=self.client.agent_id, status="saga_completed", intent_id="",
            resource="", tool="", arguments_json="{}", at_ms=now_ms()))
