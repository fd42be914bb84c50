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
from dataclasses import dataclass
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

from .checkpoint import Checkpoint, horizon_of, snapshot
from .checkpoint import make as make_checkpoint
from .checks import (
    CHECKS,
    Finding,
    Findings,
    check_authenticated,
    check_cycles,
    check_determinism,
    check_leases_and_writes,
    check_merges,
    check_outcomes,
    check_sagas,
    count_denials,
    refused_inputs,
    summarize,
)
from .log import Entry, Log, identity
from .replay import (
    Engine,
    Output,
    TrustAnchorsMissing,
    announcements,
    gc_paused,
    new_engine,
    rederive,
    refused_positions,
    rules_of,
    settled_offsets,
    trust_anchors,
    verifies,
)

__all__ = ["Audited", "Checkpoint", "TrustAnchorsMissing", "audit", "audit_from", "timeline"]


async def audit(log: Log, settings: Settings, *, complete: bool = True, strict: bool = False,
                progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Everything audit knows about ``log``: verdict, checks, findings, figures and timeline.

    The verdict is ``fail`` when a safety rule was broken; an intrusion detected (a forged or
    unauthorized message no worker acted on) is reported and fails the verdict only when
    ``strict``. ``complete=False`` (a log cut short, e.g. by Ctrl-C) reports unfinished work as
    open items; ``complete=True`` counts it as violations too.
    """
    return (await audit_from(log, settings, complete=complete, strict=strict, progress=progress))[0]


@dataclass
class Audited:
    """What an audit re-derived, for the checkpoint it may leave (``checkpoint.make``)."""

    log: Log
    engine: Engine
    decided: list[tuple[Entry, list[Output]]]
    findings: list[dict[str, Any]]
    stats: dict[str, int]
    messages: int
    first_ms: int
    horizon_ms: int
    refused_inputs: list[dict[str, Any]]
    human_actions: list[dict[str, Any]]
    snapshot: dict[str, dict[str, str]] | None = None
    """The engine's state after the settled inputs (``replay.settled_offsets``), if asked for."""
    settled: dict[tuple[str, int], int] | None = None
    resumed: Checkpoint | None = None

    def checkpoint(self, settings: Settings, admin: Any) -> Checkpoint:
        """A signed checkpoint of this audit (``admin``: the admin ``Signer``); the audit must have been
        run with ``checkpointing``."""
        if self.snapshot is None or self.settled is None:
            raise ValueError("this audit was not run to make a checkpoint (audit_from(..., checkpointing=True))")
        return make_checkpoint(self.log, settings, self.snapshot, self.settled, self.decided, self.findings,
                               self.stats, self.messages, self.first_ms, self.horizon_ms, self.refused_inputs,
                               self.human_actions, admin, self.resumed)


async def audit_from(log: Log, settings: Settings, resume: Checkpoint | None = None, *, complete: bool = True,
                     strict: bool = False, progress: Callable[[int], None] | None = None,
                     checkpointing: bool = False) -> tuple[dict[str, Any], Audited]:
    """``audit``, optionally resumed from a verified checkpoint (``log``: its slice and what came after,
    ``Checkpoint.continue_with``); also what the next checkpoint is made from (``checkpointing``)."""
    with gc_paused():
        return await _audit(log, settings, complete, strict, progress, resume, checkpointing)


_Checked = tuple[Findings, dict[str, int], list[dict[str, Any]]]


def _check(log: Log, settings: Settings, decided: list[tuple[Entry, list[Output]]],
           context: Collection[str]) -> _Checked:
    findings = Findings()
    stats: dict[str, int] = {}
    # ``authenticated`` first: what it names (forgeries, refused commands) is left out of the rest.
    authenticated, human_actions = check_authenticated(
        log, settings, trust_anchors(settings) if verifies(log, settings) else [], findings)
    stats |= check_determinism(log, settings, decided, findings, context)
    stats |= authenticated
    stats |= check_leases_and_writes(log, settings, findings)
    stats |= count_denials(log, settings, findings)
    stats |= check_outcomes(log, settings, findings)
    stats |= check_merges(log, settings, findings)
    stats |= check_sagas(log, settings, findings)
    stats |= check_cycles(log, settings, findings)
    return findings, stats, human_actions


def _key(f: Finding) -> tuple[str, str, str, tuple[str, ...]]:
    return f.check, f.severity, f.message, f.where


async def _audit(log: Log, settings: Settings, complete: bool, strict: bool, progress: Callable[[int], None] | None,
                 resume: Checkpoint | None, checkpointing: bool) -> tuple[dict[str, Any], Audited]:
    started = time.perf_counter()
    rules, rule_problems = rules_of(log, settings)
    engine = new_engine(log, settings)
    carried: list[tuple[Entry, list[Output]]] = []
    context: frozenset[str] = frozenset()
    if resume is not None:
        resume.restore(engine)
        carried = resume.decided_entries(log, settings, settled_only=True)
        inputs_carried = {e.where for e, _ in resume.decided_entries(log, settings)}
        # Decisions the slice keeps for their live state, whose inputs it no longer holds.
        in_slice = resume.slice_positions()
        context = frozenset(e.where for e in log.entries()
                            if e.where in in_slice and (cause := getattr(e.record, "cause", None)) is not None
                            and f"{cause.topic}[{cause.partition}]@{cause.offset}" not in inputs_carried)
    settled = settled_offsets(log, settings) if checkpointing else None
    snapshots: list[dict[str, dict[str, str]]] = []
    engine, fresh = await rederive(log, settings, engine=engine, progress=progress,
                                   skip=resume.positions if resume is not None else (), settled=settled,
                                   at_settled=(lambda e: snapshots.append(snapshot(e))) if checkpointing else None)
    decided = carried + fresh
    replayed = time.perf_counter()
    findings, stats, human_actions = _check(log, settings, decided, context)
    refused = refused_inputs(log, settings)
    messages = len(log)
    first_ms = log.span_ms()[0]
    if resume is not None:
        # What the slice alone shows was judged by the audit that wrote the checkpoint: the new
        # messages' effect is the difference. Open items are judged again, here, with everything.
        before_log = resume.slice_log(log)
        before, before_stats, before_actions = _check(before_log, settings,
                                                      resume.decided_entries(before_log, settings), context)
        judged = {_key(f) for f in before.items if f.severity != "open"}
        merged = [Finding(d["check"], d["severity"], d["message"], tuple(d["where"]), d.get("resource"),
                          d.get("at_ms")) for d in resume.findings]
        kept = {_key(f) for f in merged}
        merged += [f for f in findings.items if _key(f) not in judged and _key(f) not in kept]
        findings.items = merged
        stats = {k: resume.stats.get(k, 0) + stats.get(k, 0) - before_stats.get(k, 0)
                 for k in {*resume.stats, *stats}}
        seen_actions = {a["where"] for a in before_actions}
        human_actions = resume.human_actions + [a for a in human_actions if a["where"] not in seen_actions]
        already = {r["where"] for r in resume.refused_inputs}
        refused = resume.refused_inputs + [r for r in refused if r["where"] not in already]
        messages = resume.messages + len(log) - len(before_log)
        first_ms = min(resume.first_ms, first_ms) if resume.first_ms else first_ms
    for problem in rule_problems:
        findings.add("determinism", problem, [])
    stats["messages"] = messages
    checked = time.perf_counter()
    permanent = [f.to_dict() for f in findings.items if f.severity != "open"]
    if complete:
        findings.items = [f if f.severity != "open" or f.check == "determinism"
                          else type(f)(f.check, "violation", f.message, f.where, f.resource, f.at_ms)
                          for f in findings.items]
    table = summarize(findings)
    violations = sum(row["violations"] for row in table.values())
    intrusions = sum(row["intrusions"] for row in table.values())
    verdict = "fail" if violations or (strict and intrusions) else "pass"
    order = {"violation": 0, "intrusion": 1, "open": 2}
    ordered = sorted(findings.items, key=lambda f: (order[f.severity], f.check, f.where))
    span = log.span_ms()
    report = {
        "verdict": verdict,
        "violations": violations,
        "intrusions": intrusions,
        "strict": strict,
        "source": log.source,
        "complete": complete,
        "messages": messages,
        "span_ms": [first_ms if resume is not None else span[0], span[1]],
        "checks": {name: {"description": CHECKS[name], **table[name]} for name in CHECKS},
        "stats": stats,
        "rules": {"source": "announced by the workers in the log" if announcements(log, settings)
                  else "not in the log: this auditor's settings", **rules.to_dict()},
        "timing": {"replay_s": round(replayed - started, 4), "checks_s": round(checked - replayed, 4)},
        "findings": [f.to_dict() for f in ordered],
        "signatures": "verified against the admin public keys" if verifies(log, settings)
                      else "not checked: the log's workers did not verify signatures",
        "human_actions": human_actions,
        "refused_inputs": refused,
        "timeline": timeline(log, settings, findings.forged | findings.intrusions),
    }
    if resume is not None:
        report["checkpoint"] = {"resumed": True, "messages_before": resume.messages,
                                "slice_messages": len(resume.slice_lines), "new_messages": len(log) - len(before_log),
                                "made_at_ms": resume.created_at_ms}
    done = Audited(log, engine, decided, permanent, {k: v for k, v in stats.items() if k != "messages"},
                   messages, first_ms, horizon_of(rules.leases.id_window_ms), refused, human_actions,
                   snapshots[0] if snapshots else None, settled, resume)
    return report, done


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
