"""Audit and replay: rebuild, verify and explain everything from the event log.

``audit(log, settings)`` replays every recorded input through the processors' own
code (``replay``), compares the re-derived decisions with the recorded ones, runs
the independent invariant checks (``checks``) and returns one JSON-friendly report,
which the terminal summary, ``--json`` and the HTML page (``html``) all render.

A log whose workers verified signatures needs the admin public keys (the trust
anchors: ``ARBITER_ADMIN_PUBLIC_KEYS`` or ``<home>/keys/admin.pub``), never read from
the log; without them ``audit`` raises ``TrustAnchorsMissing``, saying what to set.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
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

from .checks import (
    CHECKS,
    Findings,
    check_authenticated,
    check_cycles,
    check_determinism,
    check_leases_and_writes,
    check_outcomes,
    check_sagas,
    refused_inputs,
    refused_positions,
    summarize,
)
from .log import Log, identity
from .replay import TrustAnchorsMissing, gc_paused, rederive, rules_of, trust_anchors, verifies

__all__ = ["TrustAnchorsMissing", "audit", "timeline"]


async def audit(log: Log, settings: Settings, *, complete: bool = True,
                progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Everything audit knows about ``log``: verdict, checks, findings, figures and timeline.

    ``complete=False`` (a log cut short, e.g. by Ctrl-C) reports unfinished work as
    open items; ``complete=True`` counts it as violations too.
    """
    with gc_paused():
        return await _audit(log, settings, complete, progress)


async def _audit(log: Log, settings: Settings, complete: bool,
                 progress: Callable[[int], None] | None) -> dict[str, Any]:
    started = time.perf_counter()
    _engine, decided = await rederive(log, settings, progress=progress)
    replayed = time.perf_counter()
    findings = Findings()
    rules, rule_problems = rules_of(log, settings)
    for problem in rule_problems:
        findings.add("determinism", problem, [])
    stats: dict[str, int] = {"messages": len(log)}
    # ``authenticated`` first: what it names (forgeries, refused commands) is left out of the rest.
    authenticated, human_actions = check_authenticated(
        log, settings, trust_anchors(settings) if verifies(log, settings) else [], findings)
    stats |= check_determinism(log, settings, decided, findings)
    del decided, _engine
    stats |= authenticated
    stats |= check_leases_and_writes(log, settings, findings)
    stats |= check_outcomes(log, settings, findings)
    stats |= check_sagas(log, settings, findings)
    stats |= check_cycles(log, settings, findings)
    checked = time.perf_counter()
    if complete:
        findings.items = [f if f.severity == "violation" or f.check == "determinism"
                          else type(f)(f.check, "violation", f.message, f.where, f.resource, f.at_ms)
                          for f in findings.items]
    table = summarize(findings)
    verdict = "fail" if any(row["violations"] for row in table.values()) else "pass"
    ordered = sorted(findings.items, key=lambda f: (f.severity != "violation", f.check, f.where))
    return {
        "verdict": verdict,
        "source": log.source,
        "complete": complete,
        "messages": len(log),
        "span_ms": list(log.span_ms()),
        "checks": {name: {"description": CHECKS[name], **table[name]} for name in CHECKS},
        "stats": stats,
        "rules": {"source": "announced by the workers in the log" if log.announced_rules()
                  else "not in the log: this auditor's settings", **rules.to_dict()},
        "timing": {"replay_s": round(replayed - started, 4), "checks_s": round(checked - replayed, 4)},
        "findings": [f.to_dict() for f in ordered],
        "signatures": "verified against the admin public keys" if verifies(log, settings)
                      else "not checked: the log's workers did not verify signatures",
        "human_actions": human_actions,
        "refused_inputs": refused_inputs(log, settings),
        "timeline": timeline(log, settings, findings.forged | findings.intrusions),
    }


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
            wait = {"agent": e.agent_id, "start_ms": e.decided_at_ms, "end_ms": end, "end": "open"}
            lane(e.resource)["waits"].append(wait)
            open_waits[e.resource, e.request_id] = wait
        elif isinstance(e, LockGranted):
            lease = {"agent": e.agent_id, "token": e.token, "mode": e.mode, "start_ms": e.decided_at_ms,
                     "end_ms": max(end, e.decided_at_ms), "end": "open", "where": entry.where}
            lane(e.resource)["leases"].append(lease)
            open_leases[e.resource, e.token] = lease
            _close(open_waits.pop((e.resource, e.request_id), None), e.decided_at_ms, "granted")
        elif isinstance(e, LockRenewed):
            continue
        elif isinstance(e, LockReleased | LockExpired | LockRevoked):
            how = {LockReleased: "released", LockExpired: "expired", LockRevoked: "revoked"}[type(e)]
            moment = e.expired_at_ms if isinstance(e, LockExpired) else e.decided_at_ms
            _close(open_leases.pop((e.resource, e.token), None), moment, how)
        elif isinstance(e, LockCancelled | LockWaitTimedOut):
            how = "cancelled" if isinstance(e, LockCancelled) else "timed_out"
            _close(open_waits.pop((e.resource, e.request_id), None), e.decided_at_ms, how)
        elif isinstance(e, ToolApplied):
            lane(e.resource)["writes"].append({"agent": e.agent_id, "at_ms": e.decided_at_ms, "version": e.version,
                                               "tool": e.tool, "where": entry.where})
        elif isinstance(e, ToolRejected):
            token = _intent_token(log, e)
            lane(e.resource)["rejections"].append({"agent": e.agent_id, "at_ms": e.decided_at_ms,
                                                   "reason": e.reason, "token": token, "where": entry.where})
    deadlocks = [{"at_ms": e.record.decided_at_ms, "victim": e.record.victim, "cycle": list(e.record.cycle),
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
