"""Sagas end COMPLETED or COMPENSATED: reverse order, fenced, each compensation at most once."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from arbiter.schemas import (
    Cause,
    Compensated,
    CompensationRequested,
    Holder,
    LockGranted,
    LockReleaseRequested,
    LockRequested,
    Record,
    SagaFinished,
    SagaStep,
    ToolApplied,
    ToolIntent,
    ToolRejected,
)
from arbiter.streams.cores.saga import (
    COMPENSATED,
    COMPENSATION_FAILED,
    COMPLETED,
    MAX_COMPENSATION_ATTEMPTS,
    Saga,
    decide,
    evolve,
)

CAUSE = Cause(topic="saga", partition=0, offset=0)
SAGA = "saga:refactor-7"


class Runner:
    """Feeds a saga and keeps everything it emitted."""

    def __init__(self) -> None:
        self.saga = Saga(SAGA)
        self.out: list[Record] = []
        self.token = 100

    def feed(self, message: Any) -> list[Record]:
        outputs = decide(self.saga, message, 0, CAUSE)
        evolve(self.saga, message)
        for o in outputs:
            evolve(self.saga, o)
        # Survives a restart at any point: the state round-trips through its changelog form.
        self.saga = Saga.from_dict(json.loads(json.dumps(self.saga.to_dict())))
        self.out.extend(outputs)
        return outputs

    def step(self, n: int, status: str = "completed", compensate: bool = True) -> None:
        self.feed(SagaStep(saga_id=SAGA, step=n, agent_id="refactoring", status=status, intent_id=f"i{n}",
                           resource=f"account:{n}", tool="transfer", arguments_json='{"to": "x", "amount": 5}',
                           compensate_tool="transfer" if compensate else None,
                           compensate_arguments_json='{"to": "y", "amount": 5}' if compensate else None, at_ms=0))

    def grant(self, lock: LockRequested) -> list[Record]:
        self.token += 1
        return self.feed(LockGranted(request_id=lock.request_id, agent_id=SAGA, resource=lock.resource,
                                     token=self.token, mode="exclusive", expires_at_ms=1, resource_version=3,
                                     holders=[Holder(agent_id=SAGA, request_id=lock.request_id, token=self.token,
                                                     mode="exclusive", expires_at_ms=1)],
                                     at_ms=0, cause=CAUSE))

    def applied(self, intent: ToolIntent) -> list[Record]:
        return self.feed(ToolApplied(intent_id=intent.intent_id, agent_id=SAGA, resource=intent.resource,
                                     tool=intent.tool, token=intent.token, version=4, content_hash="h",
                                     result_json="{}", at_ms=0, cause=CAUSE))

    def rejected(self, intent: ToolIntent, reason: str = "tool_failed") -> list[Record]:
        return self.feed(ToolRejected(intent_id=intent.intent_id, agent_id=SAGA, resource=intent.resource,
                                      tool=intent.tool, reason=reason, diagnostic_json="{}", at_ms=0,
                                      cause=CAUSE))


def abort(reason: str = "deadlock_victim") -> CompensationRequested:
    return CompensationRequested(saga_id=SAGA, reason=reason, requested_by="deadlock-detector", at_ms=0)


def test_completed_steps_are_undone_in_reverse_order_each_fenced() -> None:
    r = Runner()
    for n in (0, 1, 2):
        r.step(n)
    (lock,) = r.feed(abort())
    assert isinstance(lock, LockRequested) and lock.resource == "account:2" and lock.agent_id == SAGA
    order = []
    while True:
        (intent,) = r.grant(lock)
        assert isinstance(intent, ToolIntent) and intent.is_compensation
        assert intent.token == r.token and intent.base_version == 3, "compensations are fenced writes"
        outputs = r.applied(intent)
        release, done = outputs[0], outputs[1]
        assert isinstance(release, LockReleaseRequested) and release.token == intent.token
        assert isinstance(done, Compensated)
        order.append(done.step)
        if isinstance(outputs[-1], SagaFinished):
            assert outputs[-1].outcome == COMPENSATED
            break
        lock = outputs[-1]
    assert order == [2, 1, 0]
    assert r.saga.status == COMPENSATED
    assert r.feed(abort()) == [] and r.feed(r.out[0]) == []


def test_steps_without_compensation_or_not_completed_are_skipped() -> None:
    r = Runner()
    r.step(0, compensate=False)
    r.step(1)
    r.step(2, status="failed")
    (lock,) = r.feed(abort())
    assert lock.resource == "account:1"
    (intent,) = r.grant(lock)
    outputs = r.applied(intent)
    assert isinstance(outputs[-1], SagaFinished) and outputs[-1].outcome == COMPENSATED


def test_nothing_to_undo_finishes_at_once() -> None:
    r = Runner()
    (done,) = r.feed(abort("explicit"))
    assert isinstance(done, SagaFinished) and done.outcome == COMPENSATED and r.saga.reason == "explicit"


def test_a_refused_compensation_is_retried_under_a_new_attempt_and_runs_once() -> None:
    r = Runner()
    r.step(0)
    (lock,) = r.feed(abort())
    (first,) = r.grant(lock)
    _release, relock = r.rejected(first, "lease_not_live")
    assert isinstance(relock, LockRequested) and relock.request_id != lock.request_id
    (second,) = r.grant(relock)
    assert second.intent_id != first.intent_id
    assert r.rejected(first) == [], "a late answer to an old attempt changes nothing"
    outputs = r.applied(second)
    assert [type(o) for o in outputs] == [LockReleaseRequested, Compensated, SagaFinished]
    assert r.applied(second) == [] and r.saga.compensated == [0]


def test_completion_and_abort_race_first_one_wins() -> None:
    r = Runner()
    r.step(0)
    (done,) = r.feed(SagaStep(saga_id=SAGA, step=-1, agent_id="a", status="saga_completed", intent_id="",
                              resource="", tool="", arguments_json="{}", at_ms=0))
    assert isinstance(done, SagaFinished) and done.outcome == COMPLETED
    assert r.feed(abort()) == [] and r.saga.status == COMPLETED


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 5), st.lists(st.sampled_from(["apply", "reject", "dup_grant", "dup_apply", "abort"]),
                                    min_size=1, max_size=60))
def test_any_interleaving_ends_compensated_with_each_step_undone_once(steps: int, script: list[str]) -> None:
    r = Runner()
    for n in range(steps):
        r.step(n)
    pending = r.feed(abort())
    last_intent: ToolIntent | None = None
    last_lock: LockRequested | None = None
    for action in [*script, *["apply"] * (3 * steps)]:
        if r.saga.status in (COMPENSATED, COMPENSATION_FAILED):
            break
        lock = next((o for o in pending if isinstance(o, LockRequested)), None)
        if lock is not None:
            last_lock = lock
            pending = r.grant(lock)
            continue
        intent = next((o for o in pending if isinstance(o, ToolIntent)), None)
        if action == "dup_grant" and last_lock is not None:
            r.grant(last_lock)
        elif action == "dup_apply" and last_intent is not None:
            r.applied(last_intent)
        elif action == "abort":
            r.feed(abort())
        if intent is None:
            continue
        last_intent = intent
        pending = r.applied(intent) if action != "reject" else r.rejected(intent)
    undone = [o.step for o in r.out if isinstance(o, Compensated)]
    (finished,) = [o for o in r.out if isinstance(o, SagaFinished)]
    if r.saga.status == COMPENSATION_FAILED:
        # Given up after a bounded number of refusals of one step, never looping; what was undone stays undone.
        detail = json.loads(finished.detail or "{}")
        assert detail["attempts"] == MAX_COMPENSATION_ATTEMPTS and detail["last_reason"] == "tool_failed"
        assert undone == list(range(steps - 1, detail["failed_step"], -1))
        assert detail["not_compensated"] == list(range(detail["failed_step"], -1, -1))
        return
    assert r.saga.status == COMPENSATED
    assert undone == list(range(steps - 1, -1, -1)), "reverse order, each step exactly once"


def test_a_compensation_that_cannot_succeed_ends_the_saga_at_once_for_a_human() -> None:
    r = Runner()
    r.step(0)
    (lock,) = r.feed(abort())
    (intent,) = r.grant(lock)
    release, finished = r.rejected(intent, reason="unknown_tool")
    assert isinstance(release, LockReleaseRequested)
    assert isinstance(finished, SagaFinished) and finished.outcome == COMPENSATION_FAILED
    assert json.loads(finished.detail or "{}")["not_compensated"] == [0]
    assert r.saga.status == COMPENSATION_FAILED and r.feed(abort()) == []


def test_a_lease_the_configuration_refuses_ends_the_saga_instead_of_looping() -> None:
    from arbiter.schemas import LockDenied

    r = Runner()
    r.step(0)
    (lock,) = r.feed(abort())
    (finished,) = r.feed(LockDenied(request_id=lock.request_id, agent_id=SAGA, resource=lock.resource,
                                    reason="invalid_ttl", detail="{}", at_ms=0, cause=CAUSE))
    assert isinstance(finished, SagaFinished) and finished.outcome == COMPENSATION_FAILED


def test_a_step_reported_after_the_saga_was_compensated_is_undone_too() -> None:
    r = Runner()
    r.step(0)
    (lock,) = r.feed(abort())
    (intent,) = r.grant(lock)
    r.applied(intent)
    assert r.saga.status == COMPENSATED
    r.step(1)  # a write that was in flight when the saga was aborted reports now
    (late,) = [o for o in r.out[-1:] if isinstance(o, LockRequested)]
    assert late.resource == "account:1"
    (intent,) = r.grant(late)
    r.applied(intent)
    assert [o.step for o in r.out if isinstance(o, Compensated)] == [0, 1]
    assert r.saga.status == COMPENSATED


def test_a_compensation_taken_out_of_the_queue_asks_again_then_gives_up_for_a_human() -> None:
    """A waiting compensation chosen as a deadlock victim (LockCancelled) is another attempt, bounded like
    a refused write; an answer about a lease request already granted changes nothing."""
    from arbiter.schemas import LockCancelled, LockDenied

    r = Runner()
    r.step(0)
    (lock,) = r.feed(abort())
    for attempt in range(1, MAX_COMPENSATION_ATTEMPTS + 1):
        assert lock.request_id.split("|")[-2] == str(attempt)
        (lock,) = r.feed(LockCancelled(request_id=lock.request_id, agent_id=SAGA, resource=lock.resource,
                                       reason="deadlock_victim", by_request_id="v", by_agent_id="deadlock-detector",
                                       at_ms=0, cause=CAUSE))
        if isinstance(lock, SagaFinished):
            break
    assert isinstance(lock, SagaFinished) and lock.outcome == COMPENSATION_FAILED
    assert json.loads(lock.detail or "{}")["last_reason"] == "deadlock_victim"

    r = Runner()
    r.step(0)
    (lock,) = r.feed(abort())
    (intent,) = r.grant(lock)
    late = LockDenied(request_id=lock.request_id, agent_id=SAGA, resource=lock.resource, reason="request_id_taken",
                      detail="{}", at_ms=0, cause=CAUSE)
    assert r.feed(late) == [], "the lease was granted: a refusal of its request id again ends nothing"
    outputs = r.applied(intent)
    assert isinstance(outputs[-1], SagaFinished) and outputs[-1].outcome == COMPENSATED
