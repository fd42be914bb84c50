"""The log's one live fold (``arbiter.streams.runtime.livefeed.LiveState``): the console, ``arbiter top`` and the
demo's view all read it, so what each shows is the same fold of the same log, and who holds what in it is the
lease core's own fold (``follow``)."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from arbiter.demo.view import SwarmView
from arbiter.schemas import (
    Cause,
    LockCancelRequested,
    LockDenied,
    LockGranted,
    LockQueued,
    LockReleased,
    LockReleaseRequested,
    LockRenewRequested,
    LockRequested,
    LockTick,
    ToolApplied,
)
from arbiter.streams.cores.leases import LeaseBook, new_book, step
from arbiter.streams.runtime.livefeed import LiveState

CAUSE = Cause(topic="arbiter.resource.commands", partition=0, offset=1)


def granted(agent: str, token: int, request: str) -> LockGranted:
    return LockGranted(request_id=request, agent_id=agent, resource="doc:a", token=token, mode="exclusive",
                       expires_at_ms=60_000, holders=[], resource_version=0, at_ms=1_000 + token, cause=CAUSE)


def test_a_copy_of_a_decision_is_folded_once_and_every_view_reads_the_same_fold() -> None:
    """A worker's outputs are at least once: a grant delivered twice is one grant, in the console's snapshot and
    in the demo's lines alike (the demo once folded the log apart, with a fold of its own)."""
    state = LiveState()
    queued = LockQueued(request_id="r2", agent_id="bob", resource="doc:a", mode="exclusive", ttl_ms=60_000,
                        position=0, priority=0, wait_deadline_ms=90_000, blocking_agents=["ann"],
                        at_ms=1_001, cause=CAUSE)
    for record in (granted("ann", 1, "r1"), queued, granted("ann", 1, "r1"),
                   LockReleased(request_id="x1", agent_id="ann", resource="doc:a", token=1, at_ms=1_002,
                                cause=CAUSE),
                   granted("bob", 2, "r2"), granted("bob", 2, "r2"),
                   LockDenied(request_id="r3", agent_id="cy", resource="doc:a", reason="busy", detail="",
                              at_ms=1_003, cause=CAUSE)):
        state.apply(record)
    assert state.counts["grants"] == 2 and state.counts["granted after waiting"] == 1, state.counts
    assert state.rejections == {"busy": 1}
    assert [h["agent"] for h in state.snapshot()["resources"]["doc:a"]["holders"]] == ["bob"]
    assert "token" not in json.dumps(state.snapshot()), "a page never gets a fencing token"
    assert {a: h["token"] for a, h in state.resources["doc:a"]["holders"].items()} == {"bob": 2}
    view = SwarmView(state)
    assert view.leases(["bob", "ann"]) == [("bob", "doc:a", 2)]
    assert "grants 2, writes 0, rejections: busy 1" in view.lines(1, 2, 0.5)


def test_the_demo_view_counts_writes_and_sagas_from_the_same_fold() -> None:
    view = SwarmView()
    view.feed(ToolApplied(intent_id="i1", agent_id="ann", resource="doc:a", tool="commit", version=1,
                          content_hash="h", result_json="{}", at_ms=1, cause=CAUSE))
    assert view.counts["writes"] == view.state.counts["writes"] == 1


AGENTS = ("ann", "bob", "cy")
OPS = st.lists(st.tuples(st.sampled_from(["acquire", "share", "release", "renew", "cancel", "tick"]),
                         st.sampled_from(AGENTS), st.integers(min_value=1, max_value=4_000)), max_size=60)


def _decided(ops: list[tuple[str, str, int]]) -> tuple[LeaseBook, list[Any]]:
    """Commands decided by the lease core (``step``), as a worker decides them; the book and every event."""
    book, events, now = new_book("doc:a"), [], 1_000
    for n, (op, agent, dt) in enumerate(ops):
        now += dt
        rid = f"r{n}"
        held = [lease.token for lease in book.holders.values() if lease.agent_id == agent]
        waiting = book.waiting.get(agent)
        command: Any
        if op in ("acquire", "share"):
            command = LockRequested(request_id=rid, agent_id=agent, resource="doc:a", at_ms=now, ttl_ms=2_000,
                                    wait_ms=3_000, mode="exclusive" if op == "acquire" else "shared")
        elif op == "release" and held:
            command = LockReleaseRequested(request_id=rid, agent_id=agent, resource="doc:a", token=held[0], at_ms=now)
        elif op == "renew" and held:
            command = LockRenewRequested(request_id=rid, agent_id=agent, resource="doc:a", token=held[0], at_ms=now)
        elif op == "cancel" and waiting is not None:
            command = LockCancelRequested(request_id=rid, agent_id=agent, resource="doc:a",
                                          target_request_id=waiting.request_id, at_ms=now)
        else:
            command = LockTick(request_id=rid, partition=0, at_ms=now)
        events.extend(step(book, command, now, Cause(topic="c", partition=0, offset=n)))
    return book, events


@settings(max_examples=150, deadline=None)
@given(ops=OPS, late=st.integers(min_value=0, max_value=200))
def test_the_live_fold_is_the_lease_cores_and_a_late_start_shows_nothing_false(ops: list[Any], late: int) -> None:
    """Fed a worker's every decision, the console's fold shows exactly the worker's book: its holders with their
    tokens, its queue in grant order. Started late (a window of the log), it fails on nothing (a renew or a release
    of a grant it never saw) and shows no one who does not hold or wait."""
    book, events = _decided(ops)
    whole, joined = LiveState(), LiveState()
    for event in events:
        whole.apply(event)
    for event in events[late:]:
        joined.apply(event)
    truth = {lease.agent_id: lease.token for lease in book.holders.values()}, [w.agent_id for w in book.queue]
    shown = whole.resources.get("doc:a", {"holders": {}, "queue": []})
    assert ({a: h["token"] for a, h in shown["holders"].items()}, shown["queue"]) == truth
    late_view = joined.resources.get("doc:a", {"holders": {}, "queue": []})
    assert {a: h["token"] for a, h in late_view["holders"].items()}.items() <= truth[0].items()
    assert set(late_view["queue"]) <= set(truth[1])
