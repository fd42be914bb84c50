"""The saga: an agent's multi-step task, which ends COMPLETED or COMPENSATED, never half-way.

Theory of operation
-------------------
A saga is an ordered list of steps; each step is a tool intent through the gateway,
optionally with a compensation (another tool and its arguments). The agent reports
its steps as it runs them (``SagaStep`` started / completed / failed). On an abort
(``CompensationRequested``: the agent gave up on a rejection, was chosen as a
deadlock victim, or aborted explicitly) the saga undoes its completed steps in
reverse order, one at a time, and then finishes ``COMPENSATED``.

Compensations stay fenced like any other write. The saga acts as an agent of its own,
whose id is the saga id: for each step to undo it acquires an exclusive lease on the
step's resource, sends the compensation intent with that lease's token and the
resource version the grant reported, then releases the lease. A zombie compensation
from before a crash therefore carries a dead token and the gateway refuses it.

Each compensation runs at most once: its intent id is derived from the saga, the step
and the attempt, and an attempt is only retried (with the next attempt number) after
the gateway said it applied nothing. A restart resumes from the recorded state.

Never stuck, never looping: a compensation's lease request that ends without a grant (refused,
timed out, or taken out of the queue as a deadlock victim) is tried again like a refused write; a
refusal that cannot change by retrying (an unknown tool,
no write policy, bad arguments, a lease the configuration refuses) ends the saga at
once, and any other refusal is retried at most ``MAX_COMPENSATION_ATTEMPTS`` times; then
the saga ends ``COMPENSATION_FAILED`` with what it could and could not undo, for a
human. A step reported after the saga was aborted (a write in flight when the detector
chose the agent) is undone too, even if the saga had already finished ``COMPENSATED``.

Everything that decides sagas lives in this file, as pure functions:

    decide(saga, message, now_ms, cause) -> list[output]
    evolve(saga, output_or_message) -> saga
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from arbiter.schemas import (
    Cause,
    Compensated,
    CompensationRequested,
    LockCancelled,
    LockDenied,
    LockGranted,
    LockReleased,
    LockReleaseRequested,
    LockRequested,
    LockWaitTimedOut,
    Record,
    SagaFinished,
    SagaStep,
    ToolApplied,
    ToolIntent,
    ToolRejected,
)
from arbiter.schemas.reasons import Reason

RUNNING, COMPENSATING, COMPLETED, COMPENSATED = "RUNNING", "COMPENSATING", "COMPLETED", "COMPENSATED"
COMPENSATION_FAILED = "COMPENSATION_FAILED"
FINAL = (COMPLETED, COMPENSATED, COMPENSATION_FAILED)
MAX_COMPENSATION_ATTEMPTS = 5
"""Attempts per step (a lease and a write each) before the saga gives up on it."""
PERMANENT = frozenset({
    Reason.UNKNOWN_TOOL, Reason.NO_POLICY, Reason.INVALID_ARGUMENTS, Reason.INVALID_INTENT,
    Reason.ARGUMENTS_TOO_LARGE, Reason.TOKEN_REQUIRED, Reason.BASE_VERSION_REQUIRED, Reason.INVALID_TTL,
    Reason.INVALID_WAIT, Reason.INVALID_RESOURCE, Reason.INVALID_MODE, Reason.INVALID_AGENT,
    Reason.REQUEST_ID_TAKEN, Reason.CLOCK_SKEW,
})
"""Refusals that the same compensation, tried again, would get again."""
COMPENSATION_TTL_MS = 60_000
COMPENSATION_WAIT_MS = 600_000
COMPENSATION_PRIORITY = 1_000_000
"""Compensations jump the queue: undoing work must not wait behind new work."""


@dataclass(slots=True)
class StepRecord:
    """What the saga knows about one step."""

    step: int
    intent_id: str
    resource: str
    tool: str
    arguments_json: str
    compensate_tool: str | None
    compensate_arguments_json: str | None
    status: str  # started | completed | failed


@dataclass(slots=True)
class Undo:
    """The compensation in progress: which step, which attempt, and how far it got."""

    step: int
    attempt: int
    phase: str  # acquiring | executing
    lock_request_id: str
    token: int | None = None
    intent_id: str | None = None


@dataclass(slots=True)
class Saga:
    """One saga's state."""

    saga_id: str
    status: str = RUNNING
    agent_id: str = ""
    reason: str = ""
    steps: dict[int, StepRecord] = field(default_factory=dict)
    compensated: list[int] = field(default_factory=list)
    undo: Undo | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly snapshot (the saga table's changelog format)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Saga:
        """Inverse of ``to_dict``."""
        return cls(
            saga_id=data["saga_id"], status=data["status"], agent_id=data["agent_id"], reason=data["reason"],
            steps={int(k): StepRecord(**v) for k, v in data["steps"].items()},
            compensated=list(data["compensated"]),
            undo=None if data["undo"] is None else Undo(**data["undo"]),
        )

    def to_compensate(self) -> list[int]:
        """Completed steps with a compensation not yet run, latest first."""
        return sorted((s.step for s in self.steps.values()
                       if s.status == "completed" and s.compensate_tool and s.step not in self.compensated),
                      reverse=True)


SagaInput = (SagaStep | CompensationRequested | LockGranted | LockDenied | LockWaitTimedOut | LockCancelled
             | LockReleased | ToolApplied | ToolRejected)
SagaOutput = LockRequested | LockReleaseRequested | ToolIntent | Compensated | SagaFinished | CompensationRequested


def _lock_id(saga: Saga, step: int, attempt: int) -> str:
    return f"{saga.saga_id}|undo|{step}|{attempt}|lock"


def _intent_id(saga: Saga, step: int, attempt: int) -> str:
    return f"{saga.saga_id}|undo|{step}|{attempt}"


def _start_undo(saga: Saga, step: int, attempt: int, now_ms: int) -> LockRequested:
    record = saga.steps[step]
    return LockRequested(
        request_id=_lock_id(saga, step, attempt), agent_id=saga.saga_id, resource=record.resource,
        mode="exclusive", ttl_ms=COMPENSATION_TTL_MS, priority=COMPENSATION_PRIORITY,
        wait_ms=COMPENSATION_WAIT_MS, saga_id=saga.saga_id, at_ms=now_ms,
    )


def _next(saga: Saga, done: list[int], now_ms: int, cause: Cause | None) -> list[SagaOutput]:
    """Start the next compensation, or finish when none is left."""
    remaining = [s for s in saga.to_compensate() if s not in done]
    if remaining:
        return [_start_undo(saga, remaining[0], 1, now_ms)]
    return [SagaFinished(saga_id=saga.saga_id, outcome=COMPENSATED, at_ms=now_ms,
                         cause=cause or Cause(topic="", partition=-1, offset=-1))]


def _failed(saga: Saga, step: int, attempt: int, reason: str, now_ms: int, cause: Cause) -> SagaFinished:
    """The end of a saga whose compensation of ``step`` failed for good."""
    done = set(saga.compensated)
    detail = {"failed_step": step, "attempts": attempt, "last_reason": reason,
              "compensated": sorted(done), "not_compensated": [s for s in saga.to_compensate() if s not in done],
              "what_to_do": "A human must undo the steps not compensated (see the saga's steps), then close it."}
    return SagaFinished(saga_id=saga.saga_id, outcome=COMPENSATION_FAILED, detail=json.dumps(detail, sort_keys=True),
                        at_ms=now_ms, cause=cause)


def _retry(saga: Saga, undo: Undo, reason: str, now_ms: int, cause: Cause) -> SagaOutput:
    """Try ``undo``'s step again, or give up when retrying cannot help or has been tried enough."""
    if reason in PERMANENT or undo.attempt >= MAX_COMPENSATION_ATTEMPTS:
        return _failed(saga, undo.step, undo.attempt, reason, now_ms, cause)
    return _start_undo(saga, undo.step, undo.attempt + 1, now_ms)


def _late_undo(saga: Saga, step: SagaStep, now_ms: int) -> LockRequested:
    """Undo a step reported after the saga finished COMPENSATED."""
    return LockRequested(
        request_id=_lock_id(saga, step.step, 1), agent_id=saga.saga_id, resource=step.resource, mode="exclusive",
        ttl_ms=COMPENSATION_TTL_MS, priority=COMPENSATION_PRIORITY, wait_ms=COMPENSATION_WAIT_MS,
        saga_id=saga.saga_id, at_ms=now_ms,
    )


def decide(saga: Saga, message: SagaInput, now_ms: int, cause: Cause) -> list[SagaOutput]:
    """What the saga does next. Does not change ``saga``."""
    if saga.status == COMPENSATED:
        known = saga.steps.get(message.step) if isinstance(message, SagaStep) else None
        if (isinstance(message, SagaStep) and message.status == "completed" and message.compensate_tool
                and (known is None or known.status != "completed") and message.step not in saga.compensated):
            return [_late_undo(saga, message, now_ms)]
        return []
    if saga.status in FINAL:
        return []
    if isinstance(message, SagaStep):
        if message.status == "saga_completed" and saga.status == RUNNING:
            return [SagaFinished(saga_id=saga.saga_id, outcome=COMPLETED, at_ms=now_ms, cause=cause)]
        return []
    if isinstance(message, CompensationRequested):
        if saga.status != RUNNING:
            return []  # already undoing: a second abort changes nothing
        return _next(saga, [], now_ms, cause)
    undo = saga.undo
    if undo is None or saga.status != COMPENSATING:
        return []
    record = saga.steps[undo.step]
    if isinstance(message, LockGranted) and message.request_id == undo.lock_request_id and undo.phase == "acquiring":
        return [ToolIntent(
            intent_id=_intent_id(saga, undo.step, undo.attempt), agent_id=saga.saga_id, resource=record.resource,
            token=message.token, base_version=message.resource_version, tool=record.compensate_tool or "",
            arguments_json=record.compensate_arguments_json or "{}", saga_id=saga.saga_id, step=undo.step,
            is_compensation=True, at_ms=now_ms,
        )]
    ended = LockDenied | LockWaitTimedOut | LockCancelled
    if isinstance(message, ended) and message.request_id == undo.lock_request_id and undo.phase == "acquiring":
        # Every way a lease request ends without a grant: refused, waited too long, or taken out of the queue
        # (a deadlock victim, whose cycle may be made of compensations only). Left unanswered, the saga would
        # wait in COMPENSATING for a grant that never comes.
        reason = message.reason if isinstance(message, LockDenied | LockCancelled) else Reason.WAIT_TIMED_OUT.value
        return [_retry(saga, undo, reason, now_ms, cause)]  # try for the lease again, or give up
    if isinstance(message, ToolApplied | ToolRejected) and message.intent_id == undo.intent_id:
        release = LockReleaseRequested(request_id=f"{undo.intent_id}|release", agent_id=saga.saga_id,
                                       resource=record.resource, token=undo.token or 0, at_ms=now_ms)
        if isinstance(message, ToolApplied):
            done = Compensated(saga_id=saga.saga_id, step=undo.step, compensation_intent_id=message.intent_id,
                               tool=message.tool, at_ms=now_ms, cause=cause)
            return [release, done, *_next(saga, [undo.step], now_ms, cause)]
        # Refused or failed: nothing was applied, so another attempt cannot run it twice.
        return [release, _retry(saga, undo, message.reason, now_ms, cause)]
    return []


def evolve(saga: Saga, item: Record) -> Saga:
    """Fold an input or an output into the saga (in place) and return it."""
    if isinstance(item, SagaStep):
        if item.status == "saga_completed":
            return saga
        saga.agent_id = saga.agent_id or item.agent_id
        saga.steps[item.step] = StepRecord(item.step, item.intent_id, item.resource, item.tool, item.arguments_json,
                                           item.compensate_tool, item.compensate_arguments_json, item.status)
    elif isinstance(item, CompensationRequested):
        if saga.status == RUNNING:
            saga.status = COMPENSATING
            saga.reason = item.reason
    elif isinstance(item, LockRequested):
        step, attempt = _parse_lock_id(item.request_id)
        saga.undo = Undo(step, attempt, "acquiring", item.request_id)
        if saga.status == COMPENSATED:
            saga.status = COMPENSATING  # reopened for a step reported late
    elif isinstance(item, ToolIntent) and saga.undo is not None:
        saga.undo.phase, saga.undo.token, saga.undo.intent_id = "executing", item.token, item.intent_id
    elif isinstance(item, Compensated):
        if item.step not in saga.compensated:
            saga.compensated.append(item.step)
        saga.undo = None
    elif isinstance(item, SagaFinished):
        saga.status = item.outcome
        saga.undo = None
    return saga


def _parse_lock_id(request_id: str) -> tuple[int, int]:
    parts = request_id.split("|")
    return int(parts[-3]), int(parts[-2])


def diagnostic(saga: Saga) -> str:
    """The saga's state as JSON, for operators and audit."""
    return json.dumps({"saga_id": saga.saga_id, "status": saga.status, "reason": saga.reason,
                       "steps": sorted(saga.steps), "compensated": saga.compensated,
                       "in_progress": None if saga.undo is None else saga.undo.step}, sort_keys=True)
