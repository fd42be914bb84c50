"""Hypothesis drives the lease book with random commands and checks its invariants."""

from __future__ import annotations

from collections import defaultdict

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from arbiter.schemas import (
    LockCancelled,
    LockCancelRequested,
    LockDenied,
    LockGranted,
    LockQueued,
    LockRevokeRequested,
    LockWaitTimedOut,
    WaitEdgeAdded,
    WaitEdgeRemoved,
)
from arbiter.schemas.reasons import Reason
from arbiter.streams.cores.leases import LeaseRules, LockEvent, LockTick
from tests.streams.cores.test_leases import Harness

AGENTS = ["a", "b", "c", "d", "e"]


class LeaseBookMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        # A short id window and a small memory, so that ids are forgotten within a run.
        self.h = Harness(LeaseRules(id_window_ms=120, clock_skew_ms=10, max_remembered_ids=6))
        self.now = 0
        self.last_token = 0
        self.outcomes: dict[str, list[str]] = defaultdict(list)  # acquire id -> final outcomes
        self.acquires: dict[str, tuple[str, int]] = {}  # id -> (agent, priority)
        self.queue_order: list[str] = []  # queued request ids, in the order they queued
        self.edges: set[str] = set()

    def feed(self, events: list[LockEvent]) -> None:
        for e in events:
            if isinstance(e, LockGranted):
                assert e.token > self.last_token, "tokens must strictly increase"
                self.last_token = e.token
                if e.request_id in self.queue_order:
                    # FIFO per class: nobody of equal or higher priority that queued earlier still waits.
                    prio = self.acquires[e.request_id][1]
                    ahead = self.queue_order[: self.queue_order.index(e.request_id)]
                    waiting = {w.request_id for w in self.h.book.queue}
                    assert not [r for r in ahead if r in waiting and self.acquires[r][1] >= prio]
                    self.queue_order.remove(e.request_id)
                self.outcomes[e.request_id].append("granted")
            elif isinstance(e, LockQueued):
                self.queue_order.append(e.request_id)
            elif isinstance(e, LockDenied) and e.request_id in self.acquires:
                self.outcomes[e.request_id].append("denied")
            elif isinstance(e, LockCancelled | LockWaitTimedOut):
                self.outcomes[e.request_id].append(type(e).__name__)
                self.queue_order.remove(e.request_id)
            elif isinstance(e, WaitEdgeAdded):
                assert e.edge_id not in self.edges
                self.edges.add(e.edge_id)
            elif isinstance(e, WaitEdgeRemoved):
                self.edges.remove(e.edge_id)

    @rule(agent=st.sampled_from(AGENTS), mode=st.sampled_from(["exclusive", "shared"]),
          ttl=st.integers(1, 50), wait=st.integers(0, 60), priority=st.integers(0, 2), dt=st.integers(0, 20))
    def acquire(self, agent: str, mode: str, ttl: int, wait: int, priority: int, dt: int) -> None:
        self.now += dt
        rid = self.h.rid()
        self.acquires[rid] = (agent, priority)
        self.feed(self.h.acquire(agent, self.now, mode=mode, ttl=ttl, wait=wait, priority=priority,
                                 request_id=rid))

    @precondition(lambda self: bool(self.h.book.holders))
    @rule(data=st.data(), dt=st.integers(0, 20))
    def release_or_renew(self, data: st.DataObject, dt: int) -> None:
        self.now += dt
        lease = data.draw(st.sampled_from(sorted(self.h.book.holders.values(), key=lambda x: x.token)))
        if data.draw(st.booleans()):
            self.feed(self.h.release(lease.agent_id, lease.token, self.now))
        else:
            self.feed(self.h.renew(lease.agent_id, lease.token, self.now, ttl=data.draw(st.integers(1, 50))))

    @rule(agent=st.sampled_from(AGENTS), token=st.integers(0, 30), dt=st.integers(0, 20))
    def stale_or_foreign_release(self, agent: str, token: int, dt: int) -> None:
        self.now += dt
        # Time first (expiries, hand-offs): the release is judged against the book as it is then.
        self.feed(self.h.tick(self.now))
        live = self.h.book.holders.get(token)
        events = self.h.release(agent, token, self.now)
        self.feed(events)
        if live is None or live.agent_id != agent:
            # Time may expire others first, but the release itself is refused, last.
            assert isinstance(events[-1], LockDenied)

    @precondition(lambda self: bool(self.h.book.queue))
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        w = data.draw(st.sampled_from(self.h.book.queue))
        self.feed(self.h.send(LockCancelRequested(request_id=self.h.rid(), agent_id=w.agent_id, resource="account:482",
                                                  target_request_id=w.request_id, at_ms=0), self.now))

    @rule(agent=st.sampled_from(AGENTS))
    def revoke(self, agent: str) -> None:
        self.feed(self.h.send(LockRevokeRequested(request_id=self.h.rid(), resource="account:482", agent_id=agent,
                                                  reason="test", requested_by="operator:test", at_ms=0),
                              self.now))

    @rule(dt=st.integers(0, 40))
    def tick(self, dt: int) -> None:
        self.now += dt
        self.feed(self.h.tick(self.now))

    @precondition(lambda self: bool(self.h.sent))
    @rule(data=st.data())
    def redeliver(self, data: st.DataObject) -> None:
        """Any command, sent again at any later moment, is never decided a second time."""
        command = data.draw(st.sampled_from(self.h.sent))
        if isinstance(command, LockTick):
            return
        before = self.h.book.to_dict()
        events = self.h.send(command, self.now, as_sent=True)
        if events:
            # Forgotten: refused as expired (after whatever time alone did), never decided again.
            assert isinstance(events[-1], LockDenied) and events[-1].reason == Reason.REQUEST_EXPIRED, events
            assert not [e for e in events if getattr(e, "request_id", None) == command.request_id
                        and not isinstance(e, LockDenied)]
        else:
            assert self.h.book.to_dict() == before
        self.feed([e for e in events if not isinstance(e, LockDenied)])

    @invariant()
    def exclusion(self) -> None:
        modes = [x.mode for x in self.h.book.holders.values()]
        assert modes.count("exclusive") <= 1
        assert not ("exclusive" in modes and len(modes) > 1)

    @invariant()
    def edges_match_the_book(self) -> None:
        """The edges sent are exactly the model's: a waiter waits on the nearest waiter ahead that it
        conflicts with (either exclusive), else on the holders it conflicts with."""
        book = self.h.book
        want = set()
        for i, w in enumerate(book.queue):
            ahead = next((a for a in reversed(book.queue[:i]) if "exclusive" in (a.mode, w.mode)), None)
            if ahead is not None:
                blockers = {ahead.agent_id}
            else:
                blockers = {h.agent_id for h in book.holders.values() if "exclusive" in (h.mode, w.mode)}
            want |= {f"lock|{book.resource}|{w.request_id}|{a}" for a in blockers if a != w.agent_id}
        assert self.edges == want

    @invariant()
    def each_acquire_has_at_most_one_outcome(self) -> None:
        for rid, outs in self.outcomes.items():
            assert len(outs) <= 1, (rid, outs)

    def teardown(self) -> None:
        # Time runs out for everyone: every acquire ends in exactly one outcome. (Twice: a waiter
        # handed the lease at an expiry the first tick reaches holds it past that tick.)
        self.feed(self.h.tick(self.now + 10_000))
        self.feed(self.h.tick(self.now + 20_000))
        for rid in self.acquires:
            assert len(self.outcomes[rid]) == 1, (rid, self.outcomes[rid])
        assert self.h.book.is_idle() and not self.edges


LeaseBookMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=30, deadline=None)
TestLeaseBook = LeaseBookMachine.TestCase
