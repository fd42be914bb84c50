"""What-if: the same agents' commands under other rules, and what would have differed."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from arbiter.edge.settings import Settings
from arbiter.schemas import (
    DeadlockDetected,
    LockDenied,
    LockExpired,
    LockGranted,
    LockQueued,
    LockWaitTimedOut,
    Record,
    ToolApplied,
    ToolRejected,
)

from .log import Log, identity
from .replay import Policy, simulate

ZOMBIE_REASONS = ("stale_fencing_token", "lease_not_live")


def measure(records: Iterable[Record | None]) -> dict[str, Any]:
    """The figures a policy changes, from a stream of decisions (copies counted once)."""
    seen: set[tuple[str, str]] = set()
    queued_at: dict[tuple[str, str], int] = {}
    figures: dict[str, Any] = {"grants": 0, "expiries": 0, "zombie_rejections": 0, "writes_applied": 0,
                               "wait_timeouts": 0, "deadlock_victims": 0, "victims": [], "longest_wait_ms": 0}
    for record in records:
        if record is None:
            continue
        ident = identity(record)
        if ident in seen:
            continue
        seen.add(ident)
        if isinstance(record, LockQueued):
            queued_at[record.resource, record.request_id] = record.at_ms
        elif isinstance(record, LockGranted):
            figures["grants"] += 1
            since = queued_at.pop((record.resource, record.request_id), None)
            if since is not None:
                figures["longest_wait_ms"] = max(figures["longest_wait_ms"], record.at_ms - since)
        elif isinstance(record, LockExpired):
            figures["expiries"] += 1
        elif isinstance(record, LockWaitTimedOut):
            figures["wait_timeouts"] += 1
            figures["longest_wait_ms"] = max(figures["longest_wait_ms"], record.waited_ms)
        elif isinstance(record, ToolRejected | LockDenied) and record.reason in ZOMBIE_REASONS:
            figures["zombie_rejections"] += 1
        elif isinstance(record, ToolApplied):
            figures["writes_applied"] += 1
        elif isinstance(record, DeadlockDetected):
            figures["deadlock_victims"] += 1
            figures["victims"].append(record.victim)
    figures["victims"] = sorted(figures["victims"])
    return figures


async def compare(log: Log, settings: Settings, policy: Policy) -> dict[str, Any]:
    """Recorded figures beside the figures under ``policy``, and their differences."""
    topics = settings.topics
    watched = (topics.resource_events, topics.wait_edges)
    recorded = measure(e.record for topic in watched for e in log.of(topic))
    produced = await simulate(log, settings, policy)
    what_if = measure(e.record for topic in watched for e in produced.of(topic))
    return {
        "policy": {"ttl_ms": policy.ttl_ms, "victim": policy.victim},
        "recorded": recorded,
        "what_if": what_if,
        "differences": {name: {"recorded": recorded[name], "what_if": what_if[name]}
                        for name in recorded if recorded[name] != what_if[name]},
        "note": "Open loop: agents send the commands they sent in the recording, at the same times, whatever "
                "the answers; a what-if cannot re-run the agents' reasoning.",
    }
