"""The log's one live fold (``arbiter.edge.livefeed.LiveState``): the console, ``arbiter top`` and the demo's view
all read it, so what each shows is the same fold of the same log."""

from __future__ import annotations

from arbiter.demo.view import SwarmView
from arbiter.edge.livefeed import LiveState
from arbiter.schemas import Cause, LockDenied, LockGranted, LockQueued, LockReleased, ToolApplied

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
    holders = state.snapshot()["resources"]["doc:a"]["holders"]
    assert [(h["agent"], h["token"]) for h in holders] == [("bob", 2)]
    view = SwarmView(state)
    assert view.leases(["bob", "ann"]) == [("bob", "doc:a", 2)]
    assert "grants 2, writes 0, rejections: busy 1" in view.lines(1, 2, 0.5)


def test_the_demo_view_counts_writes_and_sagas_from_the_same_fold() -> None:
    view = SwarmView()
    view.feed(ToolApplied(intent_id="i1", agent_id="ann", resource="doc:a", tool="commit", version=1,
                          content_hash="h", result_json="{}", at_ms=1, cause=CAUSE))
    assert view.counts["writes"] == view.state.counts["writes"] == 1
