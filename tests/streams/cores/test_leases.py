"""The lease book's rules, one story at a time (pure core, no I/O)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from arbiter.schemas import (
    Cause,
    LockCancelled,
    LockCancelRequested,
    LockDenied,
    LockExpired,
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
    LockWaitTimedOut,
    WaitEdgeAdded,
    WaitEdgeRemoved,
)
from arbiter.streams.cores.leases import LeaseBook, LeaseRules, LockEvent, decide, evolve, new_book, step
from arbiter.streams.runtime.common import TABLES

RES = "account:482"
BOOKS = TABLES["books"]


class Harness:
    """Feeds commands through ``decide`` + ``evolve`` and checks ``step`` agrees."""

    def __init__(self, rules: LeaseRules | None = None) -> None:
        self.rules = rules or LeaseRules()
        self.book = new_book(RES)
        self.shadow = new_book(RES)
        self.offset = 0
        self.n = 0
        self.sent: list[Any] = []
        self.head = b""
        self.rows: dict[bytes, bytes | None] = {}

    def send(self, command: Any, now: int, *, as_sent: bool = False) -> list[LockEvent]:
        """Decide ``command`` at ``now``; a ``at_ms`` of 0 means "sent now" unless ``as_sent``."""
        if not as_sent and getattr(command, "at_ms", None) == 0:
            command = command.model_copy(update={"at_ms": now})  # a sender whose clock is the broker's
        self.sent.append(command)
        cause = Cause(topic="cmds", partition=0, offset=self.offset)
        self.offset += 1
        before, indexed = self.book.to_dict(), list(self.book.deadlines)
        events = decide(self.book, command, now, cause, self.rules)
        assert self.book.to_dict() == before, "decide must not change the book"
        assert self.book.deadlines == indexed, "decide must not change the book's indexes"
        assert_indexed(self.book)
        for event in events:
            evolve(self.book, event, self.rules)
        # A step that is undone (an input the processor quarantines) leaves the book exactly as it was.
        shadow_before = self.shadow.to_dict()
        undo = self.shadow.begin()
        assert step(self.shadow, command, now, cause, self.rules) == events
        self.shadow.end()
        undo()
        assert self.shadow.to_dict() == shadow_before, "an undone step must leave the book as it was"
        assert_indexed(self.shadow)
        assert step(self.shadow, command, now, cause, self.rules) == events
        assert self.shadow.to_dict() == self.book.to_dict()
        assert_indexed(self.shadow)
        assert LeaseBook.from_dict(json.loads(json.dumps(self.book.to_dict()))).to_dict() == self.book.to_dict()
        self._through_the_changelog()
        return events

    def _through_the_changelog(self) -> None:
        """What the worker's changelog writes of the decision (the head, the id rows it changed), applied to a
        compacted copy of that changelog, restores the book as it is: its id memory in the same order."""
        rows = BOOKS.rows
        assert rows is not None
        self.head = rows.head(self.shadow)
        for item, value in rows.take(self.shadow):
            self.rows.pop(item, None)  # compaction keeps a key's last record, at its place in the log
            self.rows[item] = value
        restored = BOOKS.loads(self.head)
        rows.attach(restored, [(item, value) for item, value in self.rows.items() if value is not None])
        assert restored.to_dict() == self.book.to_dict(), "the changelog does not restore the book"
        assert restored.id_next == self.shadow.id_next


    def rid(self) -> str:
        self.n += 1
        return f"req-{self.n}"

    def acquire(self, agent: str, now: int, *, mode: str = "exclusive", ttl: int = 30_000, wait: int = 0,
                priority: int = 0, held: list[str] | None = None, request_id: str | None = None,
                resource: str = RES) -> list[LockEvent]:
        return self.send(LockRequested(request_id=request_id or self.rid(), agent_id=agent, resource=resource,
                                       mode=mode, ttl_ms=ttl, wait_ms=wait, priority=priority,
                                       held_resources=held or [], at_ms=0), now)

    def release(self, agent: str, token: int, now: int) -> list[LockEvent]:
        return self.send(LockReleaseRequested(request_id=self.rid(), agent_id=agent, resource=RES, token=token,
                                              at_ms=0), now)

    def renew(self, agent: str, token: int, now: int, ttl: int | None = None) -> list[LockEvent]:
        return self.send(LockRenewRequested(request_id=self.rid(), agent_id=agent, resource=RES, token=token,
                                            ttl_ms=ttl, at_ms=0), now)

    def tick(self, now: int) -> list[LockEvent]:
        return self.send(LockTick(request_id=self.rid(), partition=0, at_ms=0), now)


def assert_indexed(book: LeaseBook) -> None:
    """The derived indexes hold exactly the queue: every waiter's deadline, and nothing of a waiter gone."""
    assert book.queued == {w.request_id: w for w in book.queue}
    assert book.waiting == {w.agent_id: w for w in book.queue}
    assert book.deadlines == sorted((w.deadline_ms, w.seq, w.request_id) for w in book.queue)
    assert all((request_id, owner) in book.seen for request_id, owner in book.owners.items())


def only(events: list[LockEvent], kind: type) -> list[Any]:
    return [e for e in events if isinstance(e, kind)]


def test_the_zombie_story() -> None:
    """Alpha stalls past its TTL; Beta gets N+1; Alpha's renew and release are refused."""
    h = Harness()
    (alpha,) = h.acquire("alpha", 0, ttl=30_000)
    assert isinstance(alpha, LockGranted)
    n = alpha.token
    beta_events = h.acquire("beta", 35_000)
    assert [type(e) for e in beta_events] == [LockExpired, LockGranted]
    beta = beta_events[1]
    assert beta.token == n + 1 and beta.agent_id == "beta"

    (renew,) = h.renew("alpha", n, 36_000)
    assert isinstance(renew, LockDenied) and renew.reason == "stale_fencing_token"
    diagnostic = json.loads(renew.detail)
    assert diagnostic["current"]["high_water_token"] == n + 1
    assert diagnostic["current"]["holders"][0]["agent_id"] == "beta"
    assert "re-acquire" in diagnostic["what_to_do"]
    (release,) = h.release("alpha", n, 36_001)
    assert isinstance(release, LockDenied) and release.reason == "stale_fencing_token"
    assert list(h.book.holders) == [n + 1]
    assert h.book.holders[n + 1].expires_at_ms == 35_000 + 30_000


def test_dead_lease_with_nobody_newer_is_not_live() -> None:
    h = Harness()
    (g,) = h.acquire("alpha", 0, ttl=1000)
    assert [type(e) for e in h.tick(1000)] == [LockExpired]
    (denied,) = h.renew("alpha", g.token, 1001)
    assert denied.reason == "lease_not_live"


def test_tokens_strictly_increase_even_after_the_book_empties() -> None:
    h = Harness()
    tokens = []
    for i in range(5):
        (g,) = h.acquire(f"a{i}", i * 10)
        tokens.append(g.token)
        h.release(f"a{i}", g.token, i * 10 + 1)
        assert h.book.is_idle()
    assert tokens == sorted(tokens) and len(set(tokens)) == 5


def test_shared_leases_coexist_each_with_its_own_token_and_exclusive_waits() -> None:
    h = Harness()
    (s1,) = h.acquire("s1", 0, mode="shared")
    (s2,) = h.acquire("s2", 1, mode="shared")
    assert s2.token == s1.token + 1
    assert {x.agent_id for x in s2.holders} == {"s1", "s2"}
    events = h.acquire("x", 2, wait=10_000)
    (queued,) = only(events, LockQueued)
    assert queued.blocking_agents == ["s1", "s2"]
    assert {(e.waiter, e.holder) for e in only(events, WaitEdgeAdded)} == {("x", "s1"), ("x", "s2")}
    # A later shared request must not barge past the queued exclusive one.
    (q2,) = only(h.acquire("s3", 3, mode="shared", wait=10_000), LockQueued)
    assert q2.position == 2


def test_release_hands_off_to_a_run_of_shared_waiters_or_one_exclusive() -> None:
    h = Harness()
    (x,) = h.acquire("x", 0)
    h.acquire("s1", 1, mode="shared", wait=60_000)
    h.acquire("s2", 2, mode="shared", wait=60_000)
    h.acquire("y", 3, wait=60_000)
    h.acquire("s3", 4, mode="shared", wait=60_000)
    events = h.release("x", x.token, 10)
    granted = only(events, LockGranted)
    assert [g.agent_id for g in granted] == ["s1", "s2"]
    assert [g.token for g in granted] == [x.token + 1, x.token + 2]
    # y now waits on the two shared holders (it waited on s2, the nearest conflicting waiter ahead of
    # it, and now on s1 too); s3 waits behind y.
    assert {(e.waiter, e.holder) for e in only(events, WaitEdgeAdded)} == {("y", "s1")}
    assert {e.waiter for e in only(events, WaitEdgeRemoved)} >= {"s1", "s2"}
    assert {w.agent_id: w.blockers for w in h.book.queue} == {"y": ("s1", "s2"), "s3": ("y",)}
    h.release("s1", granted[0].token, 11)
    events = h.release("s2", granted[1].token, 12)
    assert [g.agent_id for g in only(events, LockGranted)] == ["y"]


def test_priority_classes_then_fifo() -> None:
    h = Harness()
    (x,) = h.acquire("x", 0)
    h.acquire("low1", 1, wait=60_000, priority=0)
    h.acquire("high1", 2, wait=60_000, priority=5)
    h.acquire("low2", 3, wait=60_000, priority=0)
    (q,) = only(h.acquire("high2", 4, wait=60_000, priority=5), LockQueued)
    assert q.position == 2
    order = []
    token = x.token
    agent = "x"
    for now in range(10, 14):
        (g,) = only(h.release(agent, token, now), LockGranted)
        order.append(g.agent_id)
        agent, token = g.agent_id, g.token
    assert order == ["high1", "high2", "low1", "low2"]


def test_waiter_times_out_and_leaves_the_queue() -> None:
    h = Harness()
    h.acquire("x", 0, ttl=60_000)
    h.acquire("y", 1, wait=5_000)
    events = h.tick(5_001)
    assert [type(e) for e in events] == [WaitEdgeRemoved, LockWaitTimedOut]
    assert events[1].waited_ms == 5_000
    assert h.book.queue == []


def test_cancel_removes_the_waiter_and_may_unblock_those_behind() -> None:
    h = Harness()
    h.acquire("s1", 0, mode="shared")
    h.acquire("x", 1, wait=60_000, request_id="x-req")
    h.acquire("s2", 2, mode="shared", wait=60_000)
    events = h.send(LockCancelRequested(request_id="c1", agent_id="x", resource=RES, target_request_id="x-req",
                                        at_ms=0), 3)
    assert [type(e) for e in events][:2] == [WaitEdgeRemoved, LockCancelled]
    assert [g.agent_id for g in only(events, LockGranted)] == ["s2"]
    (denied,) = h.send(LockCancelRequested(request_id="c2", agent_id="x", resource=RES,
                                           target_request_id="x-req", at_ms=0), 4)
    assert denied.reason == "not_waiting"


def test_revoke_takes_leases_and_waits_and_hands_off() -> None:
    h = Harness()
    (v,) = h.acquire("victim", 0)
    h.acquire("other", 1, wait=60_000)
    events = h.send(LockRevokeRequested(request_id="rv", resource=RES, agent_id="victim", reason="deadlock_victim",
                                        requested_by="deadlock-detector", at_ms=0), 2)
    (revoked,) = only(events, LockRevoked)
    assert revoked.token == v.token and revoked.reason == "deadlock_victim"
    (g,) = only(events, LockGranted)
    assert g.agent_id == "other" and g.token == v.token + 1
    (denied,) = h.renew("victim", v.token, 3)
    assert denied.reason == "stale_fencing_token"


def test_non_holder_cannot_renew_or_release() -> None:
    h = Harness()
    (g,) = h.acquire("alpha", 0)
    (d1,) = h.renew("mallory", g.token, 1)
    (d2,) = h.release("mallory", g.token, 1)
    assert d1.reason == d2.reason == "not_holder"
    assert list(h.book.holders) == [g.token]


def test_renew_extends_from_now() -> None:
    h = Harness()
    (g,) = h.acquire("alpha", 0, ttl=10_000)
    (r,) = h.renew("alpha", g.token, 9_000)
    assert isinstance(r, LockRenewed) and r.expires_at_ms == 19_000
    assert h.tick(12_000) == []
    (r2,) = h.renew("alpha", g.token, 12_000, ttl=1_000)
    assert r2.expires_at_ms == 13_000


def test_a_command_seen_before_has_no_second_effect() -> None:
    h = Harness()
    first = h.acquire("alpha", 0, request_id="same")
    assert h.acquire("alpha", 1, request_id="same") == []
    (g,) = first
    assert h.release("alpha", g.token, 2)[0].__class__ is LockReleased
    # The lease is gone, yet the same acquire id still does nothing.
    assert h.acquire("alpha", 3, request_id="same") == []


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"resource": ""}, "invalid_resource"),
        ({"resource": "x" * 257}, "invalid_resource"),
        ({"resource": "é" * 129}, "invalid_resource"),
        ({"ttl": 0}, "invalid_ttl"),
        ({"ttl": -5}, "invalid_ttl"),
        ({"ttl": 3_600_001}, "invalid_ttl"),
        ({"mode": "sharedish"}, "invalid_mode"),
        ({"wait": -1}, "invalid_wait"),
    ],
)
def test_bad_input_is_denied_with_a_reason_and_changes_nothing(kwargs: dict[str, Any], reason: str) -> None:
    h = Harness()
    (denied,) = h.acquire("alpha", 0, **kwargs)
    assert isinstance(denied, LockDenied) and denied.reason == reason
    assert json.loads(denied.detail)["reason"] == reason
    assert h.book.is_idle() and h.book.last_token == 0


def test_busy_when_trying_once() -> None:
    h = Harness()
    h.acquire("alpha", 0)
    (denied,) = h.acquire("beta", 1, wait=0)
    assert denied.reason == "busy"


def test_reacquire_and_double_wait_are_refused() -> None:
    h = Harness()
    h.acquire("alpha", 0)
    assert h.acquire("alpha", 1)[0].reason == "already_holder"
    h.acquire("beta", 2, wait=1000)
    assert h.acquire("beta", 3, wait=1000)[0].reason == "already_waiting"


def test_lock_order_warn_and_reject() -> None:
    warn = Harness(LeaseRules(lock_order="warn"))
    (g,) = warn.acquire("alpha", 0, held=["zzz:later"])
    assert isinstance(g, LockGranted) and "lock order" in g.warnings[0]
    reject = Harness(LeaseRules(lock_order="reject"))
    (d,) = reject.acquire("alpha", 0, held=["zzz:later"])
    assert d.reason == "lock_order_violation"
    (ok,) = reject.acquire("alpha", 0, held=["aaa:earlier"])
    assert isinstance(ok, LockGranted) and ok.warnings == []


def test_the_clock_never_goes_back() -> None:
    h = Harness()
    (g,) = h.acquire("alpha", 10_000, ttl=5_000)
    # A command stamped earlier than the book's clock is decided at the book's clock.
    (r,) = h.renew("alpha", g.token, 1)
    assert r.at_ms == 10_000 and r.expires_at_ms == 15_000


def test_every_event_names_its_cause() -> None:
    h = Harness()
    h.acquire("alpha", 0)
    events = h.acquire("beta", 1, wait=100)
    assert {e.cause.offset for e in events if e.cause is not None} == {1}


def test_a_tick_decides_in_time_order_a_waiter_due_after_the_expiry_is_granted() -> None:
    """Holder expires at 1,000; the waiter's deadline is 1,500. A tick at 2,000 must expire the holder
    first (at 1,000 the waiter was still waiting) and hand the lease on, not time the waiter out."""
    h = Harness()
    h.acquire("holder", 0, ttl=1_000)
    h.acquire("waiter", 0, wait=1_500)
    events = h.tick(2_000)
    assert [type(e).__name__ for e in events if not isinstance(e, WaitEdgeAdded | WaitEdgeRemoved)] == \
        ["LockExpired", "LockGranted"]
    assert only(events, LockGranted)[0].agent_id == "waiter"


def test_another_agents_request_id_is_refused_not_ignored() -> None:
    h = Harness()
    h.acquire("alice", 0, request_id="same-id")
    (refused,) = h.acquire("mallory", 1, request_id="same-id")
    assert isinstance(refused, LockDenied) and refused.reason == "request_id_taken"
    assert h.acquire("alice", 2, request_id="same-id") == [], "the owner's repeat has no second effect"


def test_a_grant_handed_on_by_a_tick_reports_the_current_version() -> None:
    h = Harness()
    h.acquire("holder", 0, ttl=1_000)
    h.acquire("waiter", 0, wait=5_000)
    events = step(h.book, LockTick(request_id="t", partition=0, at_ms=0), 2_000,
                  Cause(topic="cmds", partition=0, offset=99), h.rules, version=7)
    assert only(events, LockGranted)[0].resource_version == 7


def test_a_refusal_names_other_agents_leases_without_their_tokens_when_tokens_are_hidden() -> None:
    for hide in (False, True):
        h = Harness(LeaseRules(hide_tokens=hide))
        h.acquire("alice", 1_000, mode="shared")
        h.acquire("carol", 1_001, mode="shared")
        denied = h.acquire("carol", 1_002, mode="shared")[-1]  # carol already holds it: refused
        assert isinstance(denied, LockDenied)
        holders = {x["agent_id"]: x for x in json.loads(denied.detail)["current"]["holders"]}
        assert ("token" in holders["alice"]) is not hide, holders  # never another agent's token
        assert holders["carol"]["token"] == 2, holders  # the refused agent sees its own


# -- the id memory: an id is its sender's, a refusal is an answer, a send time is recorded once --


def test_a_cancels_and_a_revokes_id_belongs_to_its_sender() -> None:
    h = Harness()
    h.acquire("holder", 0)
    h.acquire("waiter", 1, wait=60_000)
    (waiter,) = h.book.queue
    h.send(LockCancelRequested(request_id="cancel-1", agent_id="waiter", resource=RES,
                               target_request_id=waiter.request_id, at_ms=0), 2)
    h.send(LockRevokeRequested(request_id="revoke-1", resource=RES, agent_id="holder", reason="stuck",
                               requested_by="admin", at_ms=0), 3)
    for taken in ("cancel-1", "revoke-1"):
        (denied,) = h.acquire("other", 4, request_id=taken)
        assert isinstance(denied, LockDenied) and denied.reason == "request_id_taken", taken
    # The senders' own commands, sent again, are repeats: no second decision.
    assert h.send(h.sent[2], 5, as_sent=True) == []
    assert h.send(h.sent[3], 5, as_sent=True) == []


def test_a_refusal_is_remembered_so_its_redelivery_is_never_decided() -> None:
    h = Harness(LeaseRules(max_remembered_ids=3))
    (granted,) = h.acquire("owner", 0, request_id="x")
    h.release("owner", granted.token, 1)
    (denied,) = h.acquire("taker", 2, request_id="x")
    assert denied.reason == "request_id_taken"
    refused = h.sent[-1]
    h.acquire("a", 3)
    h.release("a", 2, 4)  # the owner's id is forgotten now; the taker's refusal is not
    assert ("x", "owner") not in h.book.seen and ("x", "taker") in h.book.seen
    assert h.send(refused, 5, as_sent=True) == [], "the taker was told 'refused': it must never be granted"


def test_a_waiter_handed_the_lease_keeps_the_send_time_of_its_request() -> None:
    h = Harness(LeaseRules(max_remembered_ids=2))
    (held,) = h.acquire("holder", 0)
    h.acquire("waiter", 10, wait=60_000)
    h.acquire("x", 20)  # busy: the holder's id is forgotten
    h.acquire("y", 30)  # busy: the waiter's id is forgotten while it waits
    release = LockReleaseRequested(request_id=h.rid(), agent_id="holder", resource=RES, token=held.token,
                                   at_ms=32)
    events = h.send(release, 40, as_sent=True)  # the hand-off is decided at 40
    assert [type(e) for e in events if isinstance(e, LockGranted)] == [LockGranted]
    h.acquire("z", 50)
    h.acquire("w", 60)  # everything before is forgotten now
    assert h.book.forgotten_sent_ms is not None and h.book.forgotten_sent_ms < 40, \
        "the floor of forgotten ids moved to the hand-off's time"
    late = LockRequested(request_id=h.rid(), agent_id="late", resource=RES, mode="exclusive", ttl_ms=1000,
                         wait_ms=0, at_ms=36)
    (answer,) = h.send(late, 70, as_sent=True)
    assert isinstance(answer, LockDenied) and answer.reason == "busy", answer


def test_a_live_waiters_request_sent_again_is_a_repeat_even_after_its_id_is_forgotten() -> None:
    h = Harness(LeaseRules(max_remembered_ids=2))
    h.acquire("holder", 0)
    h.acquire("waiter", 10, wait=60_000)
    queued = h.sent[-1]
    h.acquire("x", 20)
    h.acquire("y", 30)
    assert not [k for k in h.book.seen if k[1] == "waiter"]
    assert h.send(queued, 40, as_sent=True) == [], "a waiter's own request, redelivered, was decided again"


def _live(book: LeaseBook, command: Any) -> bool:
    """Whether ``command`` is still a repeat to ``book``: its id remembered, or its request a live one."""
    sender = command.requested_by if isinstance(command, LockRevokeRequested) else command.agent_id
    return ((command.request_id, sender) in book.seen or command.request_id in book.queued
            or any(lease.request_id == command.request_id for lease in book.holders.values()))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 30), st.booleans()), min_size=20, max_size=40),
       st.integers(1, 4))
def test_a_burst_of_stale_re_sends_leaves_the_memory_and_the_floor_as_they_were(
        steps: list[tuple[int, int, bool]], copies: int) -> None:
    """A busy resource forgets ids early (a memory of 5); then every command it forgot is sent again,
    ``copies`` times over, as anyone who reads the log can. Each is refused ``request_expired`` and
    decides nothing; the book is as it was (the same ids remembered, the same floor: a remembered
    refusal used to push live ids out and raise the floor), and each id it remembers is still a repeat."""
    h = Harness(LeaseRules(id_window_ms=60_000, max_remembered_ids=5))
    now = 0
    for agent, dt, release in steps:
        now += dt
        held = next((lease for lease in h.book.holders.values() if lease.agent_id == f"a{agent}"), None)
        if release and held is not None:
            h.release(held.agent_id, held.token, now)
        else:
            h.acquire(f"a{agent}", now, wait=20)
    h.tick(now)  # what time alone does now is done: the burst below meets the book as it stands
    before = h.book.to_dict()
    forgotten = [c for c in h.sent if not isinstance(c, LockTick) and not _live(h.book, c)]
    assert forgotten and h.book.forgotten_sent_ms is not None
    for command in forgotten * copies:
        assert command.at_ms <= h.book.forgotten_sent_ms
        (refused,) = h.send(command, now, as_sent=True)
        assert isinstance(refused, LockDenied) and refused.reason == "request_expired", refused
        assert h.book.to_dict() == before
    for command in list(h.sent):  # (sending appends to it)
        if not isinstance(command, LockTick) and _live(h.book, command):
            assert h.send(command, now, as_sent=True) == [], "a live id was decided again"


def test_a_command_sent_far_ahead_is_refused_and_never_raises_the_floor() -> None:
    """One command sent ten years ahead is refused ``clock_skew`` and not remembered: remembered, it
    was forgotten early like any id, and the floor rose to its send time, refusing every command on
    the resource for ten years. Sent again in time, it is decided, as its refusal advises."""
    h = Harness(LeaseRules(max_remembered_ids=4, clock_skew_ms=60_000))
    ahead = LockRequested(request_id="ahead", agent_id="skewed", resource=RES, mode="exclusive", ttl_ms=1_000,
                          wait_ms=0, at_ms=10 * 365 * 86_400_000)
    (refused,) = h.send(ahead, 0, as_sent=True)
    assert isinstance(refused, LockDenied) and refused.reason == "clock_skew"
    now = 0
    for _ in range(10):
        now += 2_000
        (granted,) = only(h.acquire("a", now, ttl=1_000), LockGranted)
        assert isinstance(h.release("a", granted.token, now + 1)[-1], LockReleased)
    assert (h.book.forgotten_sent_ms or 0) <= now
    (again,) = h.send(ahead.model_copy(update={"at_ms": now + 10}), now + 10, as_sent=True)
    assert isinstance(again, LockGranted) and again.request_id == "ahead"


def test_rules_recorded_before_remember_a_refusal_for_its_send_time_as_they_did() -> None:
    """Logs decided before ``forget_window_refusals`` replay as decided: the refusal of a stale
    re-send was remembered, and so its next copy had no answer at all."""
    for forget in (False, True):
        h = Harness(LeaseRules(max_remembered_ids=2, forget_window_refusals=forget))
        (granted,) = h.acquire("owner", 0, request_id="x")
        h.release("owner", granted.token, 1)
        h.acquire("b", 2)
        h.acquire("c", 3)  # busy; the owner's id is forgotten now
        stale = h.sent[0]
        (refused,) = h.send(stale, 4, as_sent=True)
        assert isinstance(refused, LockDenied) and refused.reason == "request_expired"
        assert (("x", "owner") in h.book.seen) is not forget
        again = h.send(stale, 5, as_sent=True)
        assert [e.reason for e in only(again, LockDenied)] == (["request_expired"] if forget else [])


def test_a_book_with_a_long_history_comes_back_from_its_changelog_as_it_was() -> None:
    """Hundreds of ids through a memory of 40 (chunks filled, forgotten, tombstoned), each decision
    restored through the changelog (``Harness._through_the_changelog``), refusals and hand-offs included."""
    h = Harness(LeaseRules(max_remembered_ids=40))
    now = 0
    for _ in range(150):
        now += 10
        [granted] = h.acquire("a", now)
        h.acquire("b", now + 1, wait=60_000)
        h.release("a", granted.token, now + 2)  # hands off to b
        h.acquire("a", now + 3)  # busy: refused, remembered too
        h.release("b", granted.token + 1, now + 4)
    assert len(h.book.seen) == 40 and h.book.id_next > 600


# -- nothing in a book grows with its history --


def _book_size(book: LeaseBook) -> dict[str, int]:
    """How much a book holds, structure by structure, derived indexes included."""
    return {"holders": len(book.holders), "queue": len(book.queue), "seen": len(book.seen),
            "owners": len(book.owners), "queued": len(book.queued), "waiting": len(book.waiting),
            "deadlines": len(book.deadlines)}


def _hand_offs(rounds: int, fused: bool, rules: LeaseRules) -> LeaseBook:
    """``rounds`` hand-offs: the holder releases, the waiter ahead is granted, the releaser queues
    again ahead of a low-priority waiter that stays at the back, with the earliest deadline (so an
    index cleaned lazily from its earliest deadline keeps the entry of every waiter gone). Through
    ``step``, or through ``decide`` then ``evolve`` as a caller of the public functions would (each
    command ``decide``d twice, as a dry run does first)."""
    book, cause = new_book(RES), Cause(topic="cmds", partition=0, offset=0)

    def send(command: Any) -> list[LockEvent]:
        now = command.at_ms
        if fused:
            return step(book, command, now, cause, rules)
        decide(book, command, now, cause, rules)
        events = decide(book, command, now, cause, rules)
        for event in events:
            evolve(book, event, rules)
        return events

    def queue_up(agent: str, at: int, priority: int = 1, wait: int = 600_000) -> list[LockEvent]:
        return send(LockRequested(request_id=f"q{at}", agent_id=agent, resource=RES, mode="exclusive",
                                  ttl_ms=600_000, wait_ms=wait, priority=priority, at_ms=at))

    queue_up("a", 0)
    queue_up("patient", 1, priority=0, wait=500_000)
    queue_up("b", 2)
    for r in range(rounds):
        holder, at = ("a", "b")[r % 2], 3 + 2 * r
        events = send(LockReleaseRequested(request_id=f"x{r}", agent_id=holder, resource=RES, token=r + 1,
                                           at_ms=at))
        assert [(e.agent_id, e.token) for e in only(events, LockGranted)] == [(("b", "a")[r % 2], r + 2)]
        assert only(queue_up(holder, at + 1), LockQueued)
    return book


@pytest.mark.parametrize("fused", [False, True], ids=["decide-evolve", "step"])
def test_nothing_in_a_book_grows_with_its_history(fused: bool) -> None:
    """After 2,000 hand-offs a book holds what it held after 50: one holder, two waiters and their
    indexes, and an id memory at its bound. (The waiting-deadline heap used to keep an entry per
    waiter ever queued, and under ``decide`` each decision went through them all.)"""
    rules = LeaseRules(max_remembered_ids=32)
    early, late = _hand_offs(50, fused, rules), _hand_offs(2_000, fused, rules)
    assert _book_size(early) == _book_size(late)
    assert _book_size(late)["deadlines"] == 2 and _book_size(late)["seen"] == 32
