"""Audit on the logs at-least-once processing really writes, and on forged processor commands.

Built from the golden histories (tests/golden/) by moving and copying
messages as a redelivery, a rebalance or a lagging detector would.
"""

from __future__ import annotations

from dataclasses import replace

from arbiter.audit import audit
from arbiter.audit.checks import Findings, check_cycles
from arbiter.audit.log import Entry, Log, load_archive
from arbiter.schemas import (
    Cause,
    DeadlockDetected,
    LockRequested,
    LockRevokeRequested,
    WaitEdgeAdded,
    WaitEdgeRemoved,
)
from tests.conftest import REPO
from tests.golden.record import golden_settings

RING = REPO / "tests" / "golden" / "ring.jsonl"


def ring() -> Log:
    return load_archive(RING)


def renumber(log: Log, topic: str, partition: int, entries: list[Entry]) -> None:
    log.partitions[topic, partition] = [replace(e, offset=i) for i, e in enumerate(entries)]


async def findings(log: Log) -> list[dict[str, object]]:
    report = await audit(log, golden_settings(log))
    return report["findings"]  # type: ignore[no-any-return]


def busiest_events_partition(log: Log) -> tuple[int, list[Entry]]:
    topic = log.topics.resource_events
    partition, entries = max(((p, es) for (t, p), es in log.partitions.items() if t == topic), key=lambda x: len(x[1]))
    return partition, entries


async def test_interleaved_and_partial_redeliveries_are_not_violations() -> None:
    log = load_archive(RING.with_name("zombie.jsonl"))
    partition, entries = busiest_events_partition(log)
    # A decision of two events, A and B (the frozen lease expires, the waiter is granted).
    i = next(i for i in range(len(entries) - 1)
             if entries[i].record.cause == entries[i + 1].record.cause)  # type: ignore[union-attr]
    first, second = entries[i], entries[i + 1]
    # Two owners during a rebalance write the same decision: A, A, B, B; then a crash
    # mid-decision and a redelivery: A again, alone.
    moved = [*entries[:i], first, first, second, second, first, *entries[i + 2:]]
    renumber(log, log.topics.resource_events, partition, moved)
    assert await findings(log) == []


async def test_a_copy_that_differs_is_still_a_violation() -> None:
    log = ring()
    partition, entries = busiest_events_partition(log)
    first = entries[0]
    forged = replace(first, record=first.record.model_copy(update={"agent_id": "mallory"}))  # type: ignore[union-attr]
    renumber(log, log.topics.resource_events, partition, [first, forged, *entries[1:]])
    checks = {f["check"] for f in await findings(log)}
    assert "determinism" in checks


async def test_a_detection_logged_after_a_timeout_broke_the_cycle_is_no_violation() -> None:
    log = ring()
    topic = log.topics.wait_edges
    (partition,) = {p for (t, p) in log.partitions if t == topic}
    entries = log.partitions[topic, partition]
    detection = next(i for i, e in enumerate(entries) if isinstance(e.record, DeadlockDetected))
    closing = entries[detection].record.cause.offset  # type: ignore[union-attr]
    edge = next(e.record for e in entries[:closing + 1] if isinstance(e.record, WaitEdgeAdded)
                and e.record.waiter == "documentation")
    assert isinstance(edge, WaitEdgeAdded)
    # The victim's wait times out (its edge leaves) before the detector's notice lands.
    removal = Entry(topic, partition, -1, entries[closing].timestamp_ms, entries[closing].key, WaitEdgeRemoved(
        edge_id=edge.edge_id, waiter=edge.waiter, holder=edge.holder, source=edge.source, resource=edge.resource,
        at_ms=entries[closing].timestamp_ms))
    order = [*entries[:closing + 1], removal, *[e for i, e in enumerate(entries) if i > closing]]
    renumber(log, topic, partition, order)
    assert not [f for f in await findings(log) if f["check"] == "cycles_resolved"]


async def test_a_forged_revocation_is_caught() -> None:
    log = ring()
    topic = log.topics.resource_commands
    target = next(e for e in log.of(topic) if isinstance(e.record, LockRequested) and e.record.agent_id == "routing")
    partition, entries = target.partition, log.partitions[topic, target.partition]
    forged = LockRevokeRequested(request_id="forged|revoke", resource=target.record.resource,  # type: ignore[union-attr]
                                 agent_id="routing", token=None, reason="deadlock_victim",
                                 requested_by="deadlock-detector", at_ms=target.timestamp_ms)
    entry = Entry(topic, partition, -1, target.timestamp_ms, target.key, forged)
    renumber(log, topic, partition, [*entries, entry])
    found = [f for f in await findings(log) if f["check"] == "determinism"]
    assert any("no replayed decision sends it" in str(f["message"]) and f"{topic}[{partition}]@{len(entries)}"
               in f["where"] for f in found), found  # type: ignore[operator]


def _edges_log(changes: list[tuple[str, str, str, int]]) -> Log:
    """A log of lock edges on one wait-edges partition: (kind, waiter, holder, cause offset) each."""
    log = ring()
    topic = log.topics.wait_edges
    commands = log.topics.resource_commands
    entries = []
    for offset, (kind, waiter, holder, cause) in enumerate(changes):
        edge = dict(edge_id=f"lock|doc:a|{waiter}", waiter=waiter, holder=holder, source="lock", resource="doc:a",
                    at_ms=1_000 + offset, cause=Cause(topic=commands, partition=3, offset=cause))
        record = (WaitEdgeAdded(waiter_priority=0, waiter_registered_at_ms=0, **edge) if kind == "add"
                  else WaitEdgeRemoved(**edge))
        entries.append(Entry(topic, 0, offset, 1_000 + offset, b"graph", record))
    log.partitions = {(topic, 0): entries}
    return log


def test_edges_a_redelivered_lease_book_sends_again_close_no_cycle() -> None:
    """Found by a worker-kill campaign: a worker of the lease books died before committing, and its successor,
    redelivered the inputs, sent their edges again. The audit's own graph folded the copies and saw ann and bob
    wait on each other for a moment (ann's edge re-added before its removal came again), a cycle "broken
    without a detection". The detector's graph skips such copies by their cause; the audit's does too."""
    honest = [("add", "ann", "bob", 458), ("del", "ann", "bob", 460), ("add", "bob", "ann", 462)]
    log = _edges_log([*honest, *honest, ("del", "bob", "ann", 465)])
    found = Findings()
    check_cycles(log, golden_settings(log), found)
    assert found.items == []
    # One decision changes an edge twice (ann queued behind bob, then behind cy as bob's lease ends in the same
    # tick): its removal is no copy of its addition, and no cycle is left behind (found by ./dev sim, seed 17).
    log = _edges_log([("add", "ann", "bob", 10), ("del", "ann", "bob", 10), ("add", "bob", "ann", 12),
                      ("del", "bob", "ann", 14)])
    found = Findings()
    check_cycles(log, golden_settings(log), found)
    assert found.items == []
    # A real cycle broken by a release, with no detection, is still one.
    log = _edges_log([("add", "ann", "bob", 458), ("add", "bob", "ann", 462), ("del", "bob", "ann", 465)])
    found = Findings()
    check_cycles(log, golden_settings(log), found)
    assert [f.check for f in found.items] == ["cycles_resolved"]


def _graph_log(changes: list[tuple[str, str, str] | DeadlockDetected]) -> Log:
    """A wait-edges partition of lock edges (kind, waiter, holder), each its own decision, and detections."""
    log = ring()
    topic = log.topics.wait_edges
    entries = []
    for offset, change in enumerate(changes):
        record: WaitEdgeAdded | WaitEdgeRemoved | DeadlockDetected
        if isinstance(change, DeadlockDetected):
            record = change
        else:
            kind, waiter, holder = change
            edge = dict(edge_id=f"lock|doc:a|{waiter}|{holder}", waiter=waiter, holder=holder, source="lock",
                        resource="doc:a", at_ms=1_000 + offset,
                        cause=Cause(topic=log.topics.resource_commands, partition=3, offset=offset))
            record = (WaitEdgeAdded(waiter_priority=0, waiter_registered_at_ms=0, **edge) if kind == "add"
                      else WaitEdgeRemoved(**edge))
        entries.append(Entry(topic, 0, offset, 1_000 + offset, b"graph", record))
    log.partitions = {(topic, 0): entries}
    return log


def test_a_detection_acts_at_the_edge_that_closed_its_cycle_not_where_it_is_logged() -> None:
    """Found by ./dev sim (churn, seed 191): the detector broke a cycle as it folded the edge that closed it
    (its victim's waits left its graph), and its detection landed a few edges later. Meanwhile a new edge
    closed a cycle through the victim's wait, which the audit's graph still held: a cycle "broken without a
    detection". The detector saw none, rightly; the audit now applies a detection at its cause too."""
    log = ring()
    detection = DeadlockDetected(detection_id="deadlock|x|0", victim="eve", cycle=["eve", "cy", "dan", "ann"],
                                 cycle_json="[]", message="", at_ms=1_003,
                                 cause=Cause(topic=log.topics.wait_edges, partition=0, offset=3))
    changes: list[tuple[str, str, str] | DeadlockDetected] = [
        ("add", "ann", "eve"), ("add", "cy", "dan"), ("add", "dan", "ann"),
        ("add", "eve", "cy"),  # closes eve -> cy -> dan -> ann -> eve: eve is the victim
        ("del", "dan", "ann"), ("del", "cy", "dan"),
        ("add", "cy", "ann"), ("del", "cy", "ann"),  # cy -> ann -> eve -> cy only while eve's wait is kept
        detection]
    found = Findings()
    check_cycles(_graph_log(changes), golden_settings(log), found)
    assert found.items == []
    # Without its detection, the first cycle is still reported.
    found = Findings()
    check_cycles(_graph_log(changes[:-1]), golden_settings(log), found)
    assert found.items and {f.check for f in found.items} == {"cycles_resolved"}
