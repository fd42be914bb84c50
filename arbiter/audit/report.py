"""One audit, start to finish: replay the log, run the checks, and make the report.

``audit_from`` replays every recorded input through the processors' own code (``replay``),
optionally resuming from a verified checkpoint, then runs the checks (``checks``) on what it
re-derived and on the recorded decisions, and returns the JSON-friendly report with an
``Audited``: what was re-derived, for the next checkpoint. Resumed, the report is the checkpoint's
audit plus the difference the new messages make (``_carry_over``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from arbiter.edge.settings import Settings
from arbiter.streams.shells import Rules

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
from .lanes import timeline
from .log import Entry, Log
from .replay import (
    Derived,
    Engine,
    announcements,
    gc_paused,
    new_engine,
    rederive,
    rules_of,
    settled_offsets,
    trust_anchors,
    verifies,
)

__all__ = ["Audited", "audit", "audit_from"]


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
    decided: list[tuple[Entry, list[Derived]]]
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


async def _audit(log: Log, settings: Settings, complete: bool, strict: bool, progress: Callable[[int], None] | None,
                 resume: Checkpoint | None, checkpointing: bool) -> tuple[dict[str, Any], Audited]:
    started = time.perf_counter()
    rules, rule_problems = rules_of(log, settings)
    engine = new_engine(log, settings)
    carried: list[tuple[Entry, list[Derived]]] = []
    context: frozenset[str] = frozenset()
    if resume is not None:
        carried, context = _resume_into(engine, log, settings, resume)
    settled = settled_offsets(log, settings) if checkpointing else None
    snapshots: list[dict[str, dict[str, str]]] = []
    engine, fresh = await rederive(log, settings, engine=engine, progress=progress,
                                   skip=resume.positions if resume is not None else (), settled=settled,
                                   at_settled=(lambda e: snapshots.append(snapshot(e))) if checkpointing else None)
    decided = carried + fresh
    replayed = time.perf_counter()
    judged = _judge(log, settings, decided, context)
    if resume is not None:
        judged = _carry_over(judged, log, settings, resume, context)
    for problem in rule_problems:
        judged.findings.add("determinism", problem, [])
    judged.stats["messages"] = judged.messages
    checked = time.perf_counter()
    # What the checkpoint keeps: the findings no later message can change.
    permanent = [f.to_dict() for f in judged.findings.items if f.severity != "open"]
    if complete:
        _count_open_as_violations(judged.findings)
    timing = {"replay_s": round(replayed - started, 4), "checks_s": round(checked - replayed, 4)}
    report = _report(log, settings, rules, judged, timing, complete=complete, strict=strict, resume=resume)
    done = Audited(log, engine, decided, permanent, {k: v for k, v in judged.stats.items() if k != "messages"},
                   judged.messages, judged.first_ms, horizon_of(rules.leases.id_window_ms), judged.refused,
                   judged.human_actions, snapshots[0] if snapshots else None, settled, resume)
    return report, done


def _resume_into(engine: Engine, log: Log, settings: Settings,
                 resume: Checkpoint) -> tuple[list[tuple[Entry, list[Derived]]], frozenset[str]]:
    """Restore ``resume``'s state into ``engine``; the decisions it carries (settled ones only) and the
    positions of the decisions its slice keeps only as context (``checks.check_determinism``)."""
    resume.restore(engine)
    carried = resume.decided_entries(log, settings, settled_only=True)
    inputs_carried = {e.where for e, _ in resume.decided_entries(log, settings)}
    # Decisions the slice keeps for their live state, whose inputs it no longer holds.
    in_slice = resume.slice_positions()
    context = frozenset(e.where for e in log.entries()
                        if e.where in in_slice and (cause := getattr(e.record, "cause", None)) is not None
                        and f"{cause.topic}[{cause.partition}]@{cause.offset}" not in inputs_carried)
    return carried, context


@dataclass
class _Judged:
    """What the checks made of a log, before the verdict: the findings and the figures the report lists."""

    findings: Findings
    stats: dict[str, int]
    human_actions: list[dict[str, Any]]
    refused: list[dict[str, Any]]
    messages: int
    first_ms: int


def _judge(log: Log, settings: Settings, decided: list[tuple[Entry, list[Derived]]],
           context: Collection[str]) -> _Judged:
    """Every check run on ``log`` and what the replay ``decided`` from it."""
    findings, stats, human_actions = _check(log, settings, decided, context)
    return _Judged(findings, stats, human_actions, refused_inputs(log, settings), len(log), log.span_ms()[0])


_Checked = tuple[Findings, dict[str, int], list[dict[str, Any]]]


def _check(log: Log, settings: Settings, decided: list[tuple[Entry, list[Derived]]],
           context: Collection[str]) -> _Checked:
    """Every check, in the order that lets ``authenticated`` set aside what the others must not judge."""
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


def _carry_over(judged: _Judged, log: Log, settings: Settings, resume: Checkpoint,
                context: Collection[str]) -> _Judged:
    """``judged`` (of the checkpoint's slice and the new messages) added to the checkpoint's own audit.

    What the slice alone shows was judged by the audit that wrote the checkpoint: the new
    messages' effect is the difference. Open items are judged again, here, with everything.
    """
    before_log = resume.slice_log(log)
    before, before_stats, before_actions = _check(before_log, settings,
                                                  resume.decided_entries(before_log, settings), context)
    already_judged = {_key(f) for f in before.items if f.severity != "open"}
    merged = [Finding(d["check"], d["severity"], d["message"], tuple(d["where"]), d.get("resource"),
                      d.get("at_ms")) for d in resume.findings]
    kept = {_key(f) for f in merged}
    merged += [f for f in judged.findings.items if _key(f) not in already_judged and _key(f) not in kept]
    judged.findings.items = merged
    stats = {k: resume.stats.get(k, 0) + judged.stats.get(k, 0) - before_stats.get(k, 0)
             for k in {*resume.stats, *judged.stats}}
    seen_actions = {a["where"] for a in before_actions}
    human_actions = resume.human_actions + [a for a in judged.human_actions if a["where"] not in seen_actions]
    already = {r["where"] for r in resume.refused_inputs}
    refused = resume.refused_inputs + [r for r in judged.refused if r["where"] not in already]
    messages = resume.messages + len(log) - len(before_log)
    first_ms = min(resume.first_ms, judged.first_ms) if resume.first_ms else judged.first_ms
    return _Judged(judged.findings, stats, human_actions, refused, messages, first_ms)


def _key(f: Finding) -> tuple[str, str, str, tuple[str, ...]]:
    return f.check, f.severity, f.message, f.where


def _count_open_as_violations(findings: Findings) -> None:
    """In a log meant to be complete, unfinished work is a violation. Determinism's open items stay open:
    they are decisions still being written when the log was read, not work left undone."""
    findings.items = [f if f.severity != "open" or f.check == "determinism"
                      else type(f)(f.check, "violation", f.message, f.where, f.resource, f.at_ms)
                      for f in findings.items]


def _report(log: Log, settings: Settings, rules: Rules, judged: _Judged, timing: dict[str, float], *,
            complete: bool, strict: bool, resume: Checkpoint | None) -> dict[str, Any]:
    """The report ``audit`` returns, which the terminal summary, ``--json`` and the HTML page render."""
    findings = judged.findings
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
        "messages": judged.messages,
        "span_ms": [judged.first_ms if resume is not None else span[0], span[1]],
        "checks": {name: {"description": CHECKS[name], **table[name]} for name in CHECKS},
        "stats": judged.stats,
        "rules": {"source": "announced by the workers in the log" if announcements(log, settings)
                  else "not in the log: this auditor's settings", **rules.to_dict()},
        "timing": timing,
        "findings": [f.to_dict() for f in ordered],
        "signatures": "verified against the admin public keys" if verifies(log, settings)
                      else "not checked: the log's workers did not verify signatures",
        "human_actions": judged.human_actions,
        "refused_inputs": judged.refused,
        "timeline": timeline(log, settings, findings.forged | findings.intrusions),
    }
    if resume is not None:
        # ``judged.messages`` is the checkpoint's count plus what came after its slice (``_carry_over``).
        report["checkpoint"] = {"resumed": True, "messages_before": resume.messages,
                                "slice_messages": len(resume.slice_lines),
                                "new_messages": judged.messages - resume.messages,
                                "made_at_ms": resume.created_at_ms}
    return report
