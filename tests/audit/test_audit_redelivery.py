"""Audit on the logs at-least-once processing really writes, and on forged processor commands.

Built from the golden histories (tests/golden/) by moving and copying
messages as a redelivery, a rebalance or a lagging detector would.
"""

from __future__ import annotations

from dataclasses import replace

from arbiter.audit import audit
from arbiter.audit.log import Entry, Log, load_archive
from arbiter.schemas import DeadlockDetected, LockRequested, LockRevokeRequested, WaitEdgeAdded, WaitEdgeRemoved
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
