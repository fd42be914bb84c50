"""The pending acquire's machine (``arbiter.agents.requests``), alone: inbox records in, what to do out."""

from __future__ import annotations

from arbiter.agents.requests import Do, PendingAcquire, State
from arbiter.schemas import Cause, LockDenied, LockExpired, LockGranted, LockQueued, LockRevoked

CAUSE = Cause(topic="c", partition=0, offset=0)


def granted(token: int = 1) -> LockGranted:
    return LockGranted(request_id="r", agent_id="a", resource="x", token=token, mode="exclusive",
                       expires_at_ms=10_000, holders=[], resource_version=0, at_ms=0, cause=CAUSE)


def queued() -> LockQueued:
    return LockQueued(request_id="r", agent_id="a", resource="x", mode="exclusive", ttl_ms=1000, position=2, priority=0,
                      wait_deadline_ms=5000, blocking_agents=["b"], at_ms=0, cause=CAUSE)


def denied(reason: str = "busy") -> LockDenied:
    return LockDenied(request_id="r", agent_id="a", resource="x", reason=reason, detail="{}", at_ms=0,
                      cause=CAUSE)


def test_queued_then_granted_then_lost_counts_the_ttl_from_a_round_trip_before_the_grant() -> None:
    p = PendingAcquire("r", sent_at=100.0)
    assert p.feed(queued(), 100.2) is Do.QUEUED and p.state is State.QUEUED
    assert p.feed(queued(), 100.3) is Do.NOTHING
    assert p.feed(granted(), 130.0) is Do.ANSWER and p.state is State.GRANTED
    assert abs(p.ttl_from(130.0) - 129.8) < 1e-9
    assert p.feed(LockRevoked(request_id="r", agent_id="a", resource="x", token=1, reason="stuck",
                              at_ms=0, cause=CAUSE), 131.0) is Do.MARK_LOST
    assert p.state is State.LOST and p.lost_reason == "revoked: stuck"
    assert p.feed(LockExpired(request_id="r", agent_id="a", resource="x", token=1, expires_at_ms=0,
                              at_ms=0, cause=CAUSE), 132.0) is Do.NOTHING


def test_an_immediate_grant_counts_the_ttl_from_the_send() -> None:
    p = PendingAcquire("r", sent_at=5.0)
    assert p.feed(granted(), 5.01) is Do.ANSWER
    assert p.ttl_from(5.01) == 5.0


def test_the_first_answer_stands() -> None:
    p = PendingAcquire("r", sent_at=0.0)
    assert p.feed(granted(), 1.0) is Do.ANSWER
    assert p.feed(denied("misrouted"), 2.0) is Do.NOTHING  # a copy's refusal, after the grant
    assert isinstance(p.final, LockGranted) and p.state is State.GRANTED


def test_a_grant_after_the_caller_withdrew_is_given_back() -> None:
    p = PendingAcquire("r", sent_at=0.0)
    p.feed(queued(), 0.1)
    assert p.withdraw() is True and p.state is State.WITHDRAWN
    assert p.withdraw() is False
    assert p.feed(granted(7), 3.0) is Do.GIVE_BACK
    assert isinstance(p.final, LockGranted) and p.final.token == 7


def test_a_refused_request_cannot_be_withdrawn_and_ignores_later_records() -> None:
    p = PendingAcquire("r", sent_at=0.0)
    assert p.feed(denied(), 0.5) is Do.ANSWER and p.state is State.REFUSED
    assert p.withdraw() is False
    assert p.feed(granted(), 1.0) is Do.NOTHING
