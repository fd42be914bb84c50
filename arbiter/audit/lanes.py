"""The report's timeline, as the HTML page (``html``) draws it: a lane per resource (its leases, waits,
applied writes and rejected writes), the deadlocks, and a row per saga with its compensations.

Drawn from the recorded decisions only, each once (a redelivered copy draws once); a decision no
worker made is left out, so the page never shows a forged lease as if it had happened.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from arbiter.edge.settings import Settings
from arbiter.schemas import (
    Compensated,
    DeadlockDetected,
    LockCancelled,
    LockExpired,
    LockGranted,
    LockQueued,
    LockReleased,
    LockRenewed,
    LockRevoked,
    LockWaitTimedOut,
    SagaFinished,
    SagaStep,
    ToolApplied,
    ToolRejected,
)

from .log import Log, identity
from .replay import refused_positions

__all__ = ["timeline"]


def timeline(log: Log, settings: Settings, forged: Collection[str] = frozenset()) -> dict[str, Any]:
    """Leases, waits, writes and rejections per resource, deadlocks and sagas, for the HTML page.

    ``forged``: positions of recorded decisions no worker made (unsigned, signed by someone else,
    or decided by no input): not drawn as if they had happened; ``skipped_forged`` counts them.
    """
    start, end = log.span_ms()
    resources: dict[str, dict[str, Any]] = {}
    open_leases: dict[tuple[str, int], dict[str, Any]] = {}
    open_waits: dict[tuple[str, str], dict[str, Any]] = {}

    def lane(resource: str) -> dict[str, Any]:
        found = resources.get(resource)
        if found is None:
            found = resources[resource] = {"resource": resource, "leases": [], "waits": [], "rejections": [],
                                           "writes": []}
        return found

    seen: set[tuple[str, str]] = set()
    skipped = 0
    for entry in log.of(settings.topics.resource_events):
        e = entry.record
        if e is None:
            continue
        if forged and entry.where in forged:
            skipped += 1
            continue
        ident = identity(e)
        if ident in seen:
            continue  # redelivered copies draw once
        seen.add(ident)
        if isinstance(e, LockQueued):
            wait = {"agent": e.agent_id, "start_ms": e.at_ms, "end_ms": end, "end": "open"}
            lane(e.resource)["waits"].append(wait)
            open_waits[e.resource, e.request_id] = wait
        elif isinstance(e, LockGranted):
            lease = {"agent": e.agent_id, "token": e.token, "mode": e.mode, "start_ms": e.at_ms,
                     "end_ms": max(end, e.at_ms), "end": "open", "where": entry.where}
            lane(e.resource)["leases"].append(lease)
            open_leases[e.resource, e.token] = lease
            _close(open_waits.pop((e.resource, e.request_id), None), e.at_ms, "granted")
        elif isinstance(e, LockRenewed):
            continue
        elif isinstance(e, LockReleased | LockExpired | LockRevoked):
            how = {LockReleased: "released", LockExpired: "expired", LockRevoked: "revoked"}[type(e)]
            moment = e.expires_at_ms if isinstance(e, LockExpired) else e.at_ms
            _close(open_leases.pop((e.resource, e.token), None), moment, how)
        elif isinstance(e, LockCancelled | LockWaitTimedOut):
            how = "cancelled" if isinstance(e, LockCancelled) else "timed_out"
            _close(open_waits.pop((e.resource, e.request_id), None), e.at_ms, how)
        elif isinstance(e, ToolApplied):
            lane(e.resource)["writes"].append({"agent": e.agent_id, "at_ms": e.at_ms, "version": e.version,
                                               "tool": e.tool, "where": entry.where})
        elif isinstance(e, ToolRejected):
            token = _intent_token(log, e)
            lane(e.resource)["rejections"].append({"agent": e.agent_id, "at_ms": e.at_ms,
                                                   "reason": e.reason, "token": token, "where": entry.where})
    deadlocks = [{"at_ms": e.record.at_ms, "victim": e.record.victim, "cycle": list(e.record.cycle),
                  "where": e.where}
                 for e in log.of(settings.topics.wait_edges)
                 if isinstance(e.record, DeadlockDetected) and e.where not in forged]
    return {"start_ms": start, "end_ms": end, "resources": [resources[r] for r in sorted(resources)],
            "deadlocks": deadlocks, "sagas": _sagas(log, settings, end, forged), "skipped_forged": skipped}


def _close(item: dict[str, Any] | None, at_ms: int, how: str) -> None:
    if item is not None:
        item["end_ms"], item["end"] = at_ms, how


def _intent_token(log: Log, event: ToolRejected) -> int | None:
    found = log.find(event.cause.topic, event.cause.partition, event.cause.offset)
    return getattr(found.record, "token", None) if found is not None else None


def _sagas(log: Log, settings: Settings, end: int, forged: Collection[str]) -> list[dict[str, Any]]:
    sagas: dict[str, dict[str, Any]] = {}
    refused = refused_positions(log, settings)  # steps the trust gate refused started nothing
    for entry in log.of(settings.topics.saga_commands):
        r = entry.record
        if isinstance(r, SagaStep) and (entry.topic, entry.partition, entry.offset) not in refused:
            saga = sagas.setdefault(r.saga_id, {"saga_id": r.saga_id, "agent": r.agent_id,
                                                "start_ms": entry.timestamp_ms, "end_ms": end, "outcome": "open",
                                                "steps": set(), "compensations": []})
            if r.status != "saga_completed":
                saga["steps"].add(r.step)
    for entry in log.of(settings.topics.saga_events):
        if forged and entry.where in forged:
            continue
        r = entry.record
        found = sagas.get(getattr(r, "saga_id", ""))
        if found is None:
            continue
        if isinstance(r, Compensated) and all(c["step"] != r.step for c in found["compensations"]):
            found["compensations"].append({"step": r.step, "at_ms": r.at_ms})
        elif isinstance(r, SagaFinished) and found["outcome"] == "open":
            found["outcome"], found["end_ms"] = r.outcome, r.at_ms
    return [{**s, "steps": len(s["steps"])} for _, s in sorted(sagas.items())]
