"""The safety rules audit verifies, each checked from the recorded log.

Two kinds of check:

- **determinism** compares what the replay re-derives (``replay.rederive``) with what
  the log recorded, decision by decision, grouped by the input that caused it;
- the **invariants** read only the recorded decisions and share no code with the
  processors, so a bug in a decision core cannot hide itself, and a forged or edited
  decision in the log is caught even where it is self-consistent.

- **authenticated** checks every message's signature (``arbiter.schemas.identity``) against
  the registry the admin signed and the admin public keys this auditor trusts, and who
  may write where: decisions only by workers, commands by an identity allowed to send
  them (or else refused by the workers), registry records only by an admin. It runs
  first: a message it names (a forgery, or a command the workers refused) appears under
  ``authenticated`` and nowhere else, so anyone who can write a topic cannot make an
  honest log fail its other checks.

Every finding names the log positions (``topic[partition]@offset``) that prove it.
A finding is a ``violation`` (a rule was broken), an ``intrusion`` (a message someone
forged or was not allowed to write, which no worker acted on: a decision no worker
signed, a registry record no admin signed; it left a trace and changed nothing), or
``open`` (unfinished work at the end of the log: a saga still running, a request still
queued; a violation only when the log is meant to be complete). A command that should
have been refused and was decided anyway is a violation, never an intrusion.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Collection, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from arbiter.edge.settings import Settings
from arbiter.schemas import (
    CheckVerdict,
    CompensationRequested,
    ContractError,
    DeadLetter,
    DeadlockDetected,
    IdentityRegistered,
    LockCancelled,
    LockDenied,
    LockExpired,
    LockGranted,
    LockQueued,
    LockReleased,
    LockRenewed,
    LockRequested,
    LockRevoked,
    LockRevokeRequested,
    LockWaitTimedOut,
    MergeQueued,
    Record,
    SagaFinished,
    SagaStep,
    ToolApplied,
    ToolIntent,
    ToolRejected,
    WaitEdgeAdded,
    WaitEdgeRemoved,
)
from arbiter.schemas.codec import Codec, default_codec
from arbiter.schemas.identity import ROLE_ADMIN, ROLE_WORKER, Refused, Registry, Verified
from arbiter.schemas.reasons import OUT_OF_WINDOW, Reason
from arbiter.streams.cores.trust import authorize

from .log import Entry, Log, identity
from .replay import (
    NO_ANCHORS,
    REFUSALS,
    Derived,
    dead_letters,
    from_outside,
    refused_positions,
    rules_of,
    verifies,
)

CHECKS: dict[str, str] = {
    "determinism": "re-derived decisions equal the recorded ones",
    "mutual_exclusion": "no overlapping exclusive grants on any resource",
    "monotonic_tokens": "per resource, tokens strictly increase",
    "fenced_writes": "no accepted write with a stale or dead-lease token",
    "fresh_bases": "no accepted commit on a stale base version",
    "sagas_finished": "every saga ended COMPLETED or COMPENSATED",
    "cycles_resolved": "every wait-for cycle was resolved by a detection",
    "one_outcome": "every command got exactly one final outcome",
    "checked_merges": "every merge landed on a runner's passing verdict of exactly what landed",
    "authenticated": "every message is signed by an identity allowed to write it, or was refused or ignored",
}


@dataclass(frozen=True)
class Finding:
    """One broken rule (or unfinished piece of work), with the positions that prove it."""

    check: str
    severity: str
    message: str
    where: tuple[str, ...]
    resource: str | None = None
    at_ms: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        data = asdict(self)
        data["where"] = list(self.where)
        return data


@dataclass
class Findings:
    """Findings collected by the checks."""

    items: list[Finding] = field(default_factory=list)
    forged: set[str] = field(default_factory=set)
    """Positions of recorded decisions that no input decides: reported once (determinism) and
    not folded into the invariant checks, so one forgery does not make every later write look wrong."""
    intrusions: set[str] = field(default_factory=set)
    """Positions ``authenticated`` names (decisions no worker signed, commands the workers refused):
    left out of every other check."""

    def excluded(self, entry: Entry) -> bool:
        """Whether ``entry`` is left out of the checks (named by ``authenticated``, or no input decides it)."""
        return entry.where in self.intrusions or entry.where in self.forged

    def add(self, check: str, message: str, where: Iterable[Entry | str], *, open_: bool = False,
            intrusion: bool = False, resource: str | None = None, at_ms: int | None = None) -> None:
        """Record a finding."""
        positions = tuple(w.where if isinstance(w, Entry) else w for w in where)
        severity = "open" if open_ else "intrusion" if intrusion else "violation"
        self.items.append(Finding(check, severity, message, positions, resource, at_ms))


_Group = tuple[tuple[str, int, int], str, bytes]


def _cause_of(record: Record) -> tuple[str, int, int] | None:
    cause = getattr(record, "cause", None)
    if cause is None:
        return None
    return cause.topic, cause.partition, cause.offset


def check_determinism(log: Log, settings: Settings, decided: list[tuple[Entry, list[Derived]]],
                      findings: Findings, context: Collection[str] = ()) -> dict[str, int]:
    """Compare re-derived decisions with the recorded ones, per input and key. ``context``: positions of
    decisions kept only as context (an audit checkpoint's live state, whose inputs it no longer holds)."""
    recorded, reached = _recorded_decisions(log, settings, findings, context)
    by_position = {(e.topic, e.partition, e.offset): e for e, _ in decided}
    stats = {"inputs": len(decided), "decisions": 0, "redelivered": 0, "dead_lettered": 0}
    derived = _derived_decisions(log, settings, decided, reached, findings, stats)
    for group in sorted(derived.keys() | recorded.keys()):
        want, got = derived.get(group, []), recorded.get(group, [])
        stats["decisions"] += len(want)
        if want and len(got) == len(want) and all(e.record == r for e, r in zip(got, want, strict=True)):
            continue  # the common case: recorded once, as decided
        stats["redelivered"] += _compare(log, group, want, got, by_position.get(group[0]), reached, findings)
    _check_processor_commands(log, settings, decided, reached, findings)
    return stats


def _recorded_decisions(log: Log, settings: Settings, findings: Findings, context: Collection[str]
                        ) -> tuple[dict[_Group, list[Entry]], dict[tuple[str, int], int]]:
    """The recorded decisions, grouped by the input that caused them, its topic and key; and per input
    partition, the last offset any of them names (where the workers got to)."""
    topics = settings.topics
    recorded: dict[_Group, list[Entry]] = defaultdict(list)
    reached: dict[tuple[str, int], int] = {}
    for topic in (topics.resource_events, topics.saga_events, topics.wait_edges):
        for entry in log.of(topic):
            record = entry.record
            if entry.where in findings.intrusions:
                continue  # named by ``authenticated``, and only there
            if context and entry.where in context:
                continue
            if record is None:
                if topic != topics.wait_edges:  # (bad input on the edge topic is the detector's to dead-letter)
                    findings.add("determinism", "a message on a decision topic does not decode: no processor "
                                 "wrote it", [entry])
                continue
            if topic == topics.wait_edges and not isinstance(record, DeadlockDetected):
                continue
            cause = _cause_of(record)
            if cause is None:
                findings.add("determinism", f"a {type(record).__name__} on a decision topic names no cause: no "
                             "processor decided it", [entry])
                findings.forged.add(entry.where)
                continue
            recorded[cause, topic, entry.key or b""].append(entry)
            tp = cause[0], cause[1]
            reached[tp] = max(reached.get(tp, -1), cause[2])
    return recorded, reached


def _derived_decisions(log: Log, settings: Settings, decided: list[tuple[Entry, list[Derived]]],
                       reached: dict[tuple[str, int], int], findings: Findings,
                       stats: dict[str, int]) -> dict[_Group, list[Record]]:
    """The re-derived decisions, grouped as ``_recorded_decisions`` groups the recorded ones; an input the
    replay dead-letters must have its letter in the log once the workers got past it."""
    topics = settings.topics
    decision_topics = {topics.resource_events, topics.saga_events, topics.wait_edges}
    lettered = {(letter.source.topic, letter.source.partition, letter.source.offset)
                for _entry, letter in dead_letters(log, settings)}
    derived: dict[_Group, list[Record]] = defaultdict(list)
    for entry, outputs in decided:
        position = entry.topic, entry.partition, entry.offset
        for topic, key, record in outputs:
            if topic == topics.dead_letter:
                stats["dead_lettered"] += 1
                if position not in lettered and entry.offset <= reached.get((entry.topic, entry.partition), -1):
                    findings.add("determinism", "this input should have been dead-lettered, and the dead-letter "
                                 "topic has no letter for it", [entry])
            elif topic in decision_topics and (topic != topics.wait_edges or isinstance(record, DeadlockDetected)):
                derived[position, topic, key].append(record)
    return derived


def _compare(log: Log, group: _Group, want: list[Record], got: list[Entry], source: Entry | None,
             reached: dict[tuple[str, int], int], findings: Findings) -> int:
    """Report how the decisions recorded for one input and key (``got``) differ from the re-derived ones
    (``want``), if they do; returns how many recorded copies were redeliveries of the same decisions."""
    position, _topic, key = group
    resource = key.decode("utf-8", errors="replace")
    if not got:
        tail = position[2] > reached.get((position[0], position[1]), -1)
        findings.add("determinism", f"the replay decides {len(want)} event(s) here ({_names(want)}) but the log "
                     "recorded none" + (": not yet processed when the log was read" if tail else ""),
                     [source] if source else [], open_=tail, resource=resource)
        return 0
    if not want:
        findings.forged.update(e.where for e in got)
        findings.add("determinism", f"recorded {_names([e.record for e in got])} has no cause in the replay: "
                     f"its input at {position[0]}[{position[1]}]@{position[2]} decides nothing of the kind "
                     "(forged, or decided by different code)", got, resource=resource)
        return 0
    firsts = _first_copies(got)
    records = [e.record for e in firsts]
    if records == want:
        return len(got) - len(firsts)
    last = got[-1]
    if records == want[:len(records)] and last is log.partitions[last.topic, last.partition][-1]:
        findings.add("determinism", f"only {len(records)} of the {len(want)} events decided here were in the "
                     "log when it was read (still being written)", [last], open_=True, resource=resource)
        return 0
    index = next((i for i, (a, b) in enumerate(zip(records, want, strict=False)) if a != b),
                 min(len(records), len(want)))
    bad = firsts[min(index, len(firsts) - 1)]
    findings.add("determinism", f"the log recorded {_names(records)} but the replay decides {_names(want)}; "
                 f"first difference at event {index + 1}", [bad, *([source] if source else [])],
                 resource=resource)
    return 0


def _first_copies(got: list[Entry]) -> list[Entry]:
    """The first copy of each recorded event, in log order.

    Under at-least-once a decision can be written again, whole or in part, and two owners of a
    partition in a rebalance can interleave their identical copies.
    """
    firsts: list[Entry] = []
    seen: set[tuple[str, str]] = set()
    for entry in got:
        ident = identity(entry.record)  # type: ignore[arg-type]  # grouped only if it decodes: never None
        if ident not in seen:
            seen.add(ident)
            firsts.append(entry)
    return firsts


def _check_processor_commands(log: Log, settings: Settings, decided: list[tuple[Entry, list[Derived]]],
                              reached: dict[tuple[str, int], int], findings: Findings) -> None:
    """The commands the processors send each other (revocations, compensations, wait edges,
    answers to a saga) are inputs too: each must be one a replayed decision sends."""
    t = settings.topics
    topics = (t.resource_commands, t.wait_edges, t.saga_commands)
    sent: dict[tuple[str, str], Entry] = {}
    for source, outputs in decided:
        for topic, _key, record in outputs:
            if topic in topics and not isinstance(record, DeadlockDetected):
                sent.setdefault(identity(record), source)
    # What the trust gate refused was never decided, whoever it claims to come from (``authenticated``).
    refused = refused_positions(log, settings)
    logged: dict[tuple[str, str], Entry] = {}
    for topic in topics:
        for entry in log.of(topic):
            message = entry.record
            if refused and (entry.topic, entry.partition, entry.offset) in refused:
                continue
            if message is not None and not isinstance(message, DeadlockDetected) and not from_outside(entry):
                logged.setdefault(identity(message), entry)
    for ident, entry in logged.items():
        if ident not in sent:
            findings.add("determinism", f"{ident[0]} for {getattr(entry.record, 'agent_id', '?')} looks like a "
                         "processor's command, but no replayed decision sends it (forged, or sent by other code)",
                         [entry])
    for ident, source in sent.items():
        if ident not in logged:
            tail = source.offset > reached.get((source.topic, source.partition), -1)
            findings.add("determinism", f"the decision of this input sends a {ident[0]} that is not in the log"
                         + (" (not yet written when the log was read)" if tail else ""), [source], open_=tail)


def _names(records: Iterable[Record | None]) -> str:
    names = [type(r).__name__ for r in records]
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


@dataclass
class _LeaseView:
    agent_id: str
    mode: str
    expires_at_ms: int
    entry: Entry
    ended: bool = False


def check_leases_and_writes(log: Log, settings: Settings, findings: Findings) -> dict[str, int]:
    """Mutual exclusion, monotonic tokens, fenced writes and fresh bases, from recorded events only."""
    stats = {"grants": 0, "writes": 0, "rejected_writes": 0, "expiries": 0, "revocations": 0}
    leases: dict[str, dict[int, _LeaseView]] = defaultdict(dict)
    unended: dict[str, dict[int, _LeaseView]] = defaultdict(dict)
    """The leases not yet released, expired or revoked (``leases`` keeps every lease ever granted)."""
    high: dict[str, tuple[int, Entry]] = {}
    version: dict[str, tuple[int, str]] = {}
    seen_grants: set[tuple[str, str]] = set()
    applied: dict[tuple[str, str], ToolApplied] = {}
    for entry in log.of(settings.topics.resource_events):
        event = entry.record
        if entry.where in findings.intrusions:
            continue  # no worker's decision (``authenticated`` names it): nothing to check it against
        # A decision no input decides (named by the determinism check: a worker's key wrote it) is
        # checked like any decision, but not folded in: the rules it breaks are reported for it, and
        # later real decisions are judged against the real state, not against it.
        forged = bool(findings.forged) and entry.where in findings.forged
        if forged and not isinstance(event, LockGranted | ToolApplied):
            continue
        if isinstance(event, LockGranted):
            ident = identity(event)
            if ident in seen_grants:
                continue  # a redelivered copy of the same decision
            seen_grants.add(ident)
            stats["grants"] += 1
            r, now = event.resource, event.at_ms
            top = high.get(r)
            if top is not None and event.token <= top[0]:
                findings.add("monotonic_tokens", f"token {event.token} granted to {event.agent_id} after token "
                             f"{top[0]} on {r}", [entry, top[1]], resource=r, at_ms=now)
            live = [v for v in unended[r].values() if v.expires_at_ms > now]
            clash = [v for v in live if v.mode == "exclusive" or event.mode == "exclusive"]
            for other in clash:
                findings.add("mutual_exclusion", f"{event.mode} grant to {event.agent_id} (token {event.token}) "
                             f"while {other.agent_id} holds a live {other.mode} lease on {r}",
                             [entry, other.entry], resource=r, at_ms=now)
            if forged:
                continue
            if top is None or event.token > top[0]:
                high[r] = (event.token, entry)
            leases[r][event.token] = unended[r][event.token] = _LeaseView(event.agent_id, event.mode,
                                                                          event.expires_at_ms, entry)
        elif isinstance(event, LockReleased | LockExpired | LockRevoked):
            lease = leases[event.resource].get(event.token)
            if lease is not None and not lease.ended:
                lease.ended = True
                unended[event.resource].pop(event.token, None)
                stats["expiries"] += isinstance(event, LockExpired)
                stats["revocations"] += isinstance(event, LockRevoked)
        elif isinstance(event, LockRenewed):
            lease = leases[event.resource].get(event.token)
            if lease is not None:
                lease.expires_at_ms = event.expires_at_ms
        elif isinstance(event, ToolApplied):
            if applied.get((event.resource, event.intent_id)) == event:
                continue  # redelivered copy
            if forged:
                _check_write(log, entry, event, leases, high, dict(version), dict(applied), findings)
                continue
            _check_write(log, entry, event, leases, high, version, applied, findings)
            stats["writes"] += 1
        elif isinstance(event, ToolRejected):
            stats["rejected_writes"] += 1
    return stats


def _check_write(log: Log, entry: Entry, event: ToolApplied, leases: dict[str, dict[int, _LeaseView]],
                 high: dict[str, tuple[int, Entry]], version: dict[str, tuple[int, str]],
                 applied: dict[tuple[str, str], ToolApplied], findings: Findings) -> None:
    r, now = event.resource, event.at_ms
    if (r, event.intent_id) in applied:
        findings.add("one_outcome", f"intent {event.intent_id} applied twice", [entry], resource=r, at_ms=now)
    applied[r, event.intent_id] = event
    if event.token is not None:
        lease = leases[r].get(event.token)
        top = high.get(r)
        dead = lease is not None and (lease.ended or lease.expires_at_ms <= now)
        if top is not None and event.token < top[0] and (lease is None or dead):
            # (a live lease below the newest may write: a shared holder's, beside newer shared holders)
            findings.add("fenced_writes", f"write by {event.agent_id} accepted with stale token {event.token} "
                         f"(token {top[0]} was already granted)", [entry, top[1]], resource=r, at_ms=now)
        elif lease is None:
            findings.add("fenced_writes", f"write by {event.agent_id} accepted with token {event.token}, which "
                         f"was never granted on {r}", [entry], resource=r, at_ms=now)
        elif dead:
            findings.add("fenced_writes", f"write by {event.agent_id} accepted with token {event.token} after "
                         "that lease " + ("ended" if lease.ended else "expired"), [entry, lease.entry],
                         resource=r, at_ms=now)
        elif lease.agent_id != event.agent_id:
            findings.add("fenced_writes", f"write by {event.agent_id} accepted with {lease.agent_id}'s token "
                         f"{event.token}", [entry, lease.entry], resource=r, at_ms=now)
    previous_version, previous_hash = version.get(r, (0, "0" * 32))
    intent = _intent_of(log, event)
    stale = event.version != previous_version + 1
    if intent is not None:
        stale |= intent.base_version is not None and intent.base_version != previous_version
        stale |= intent.base_hash is not None and intent.base_hash != previous_hash
    if stale:
        base = intent.base_version if intent is not None else None
        findings.add("fresh_bases", f"write by {event.agent_id} accepted as version {event.version} on base "
                     f"{base if base is not None else '?'} while {r} was at version {previous_version}",
                     [entry], resource=r, at_ms=now)
    version[r] = (max(previous_version, event.version), event.content_hash)


def _intent_of(log: Log, event: ToolApplied) -> ToolIntent | None:
    cause = event.cause
    found = log.find(cause.topic, cause.partition, cause.offset)
    record = found.record if found else None
    return record if isinstance(record, ToolIntent) and record.intent_id == event.intent_id else None


_FINAL = (LockGranted, LockDenied, LockCancelled, LockWaitTimedOut)


def count_denials(log: Log, settings: Settings, findings: Findings) -> dict[str, int]:
    """Lease commands the workers refused, by reason (``lease_denials:<reason>``, and ``lease_denials`` in
    all): what a worker's ``arbiter_lease_denials_total`` counts, from the same decisions (each once,
    forged ones left out, reasons as its labels), so the two can be compared."""
    from arbiter.streams.runtime.metrics import code

    stats = {"lease_denials": 0}
    seen: set[tuple[str, str]] = set()
    for entry in log.of(settings.topics.resource_events):
        event = entry.record
        if not isinstance(event, LockDenied) or entry.where in findings.intrusions or entry.where in findings.forged:
            continue
        if (ident := identity(event)) in seen:
            continue  # a redelivered copy of the same decision
        seen.add(ident)
        key = f"lease_denials:{code(event.reason)}"
        stats[key] = stats.get(key, 0) + 1
        stats["lease_denials"] += 1
    return stats


def refused_for_its_send_time(log: Log, event: LockDenied | ToolRejected, clock_skew_ms: int) -> bool:
    """Whether ``event`` refuses one copy of a command for when it was sent, as the log shows: the
    command it names as its cause is that request (same resource, id and sender), sent when the
    refusal says, and that time is at or below the floor the refusal states (``request_expired``:
    the id memory forgot it, or never had it) or beyond the decision's time plus the allowed skew
    (``clock_skew``). Such a refusal decides nothing: it answers that copy (anyone who reads the log
    can send an old signed command again), not the id, which keeps the outcome it had. Whether it
    was the right answer is ``determinism``'s to judge, by re-deriving it."""
    if event.reason not in OUT_OF_WINDOW:
        return False
    cause = event.cause
    found = log.find(cause.topic, cause.partition, cause.offset)
    command = found.record if found is not None else None
    if isinstance(event, LockDenied):
        if not (isinstance(command, LockRequested) and command.request_id == event.request_id):
            return False
    elif not (isinstance(command, ToolIntent) and command.intent_id == event.intent_id):
        return False
    if (command.resource, command.agent_id, command.at_ms) != (event.resource, event.agent_id,
                                                                    event.request_sent_at_ms):
        return False
    sent: int = command.at_ms
    if event.reason == Reason.CLOCK_SKEW:
        return sent > event.at_ms + clock_skew_ms
    detail = event.detail if isinstance(event, LockDenied) else event.diagnostic_json
    try:
        floor = json.loads(detail).get("refused_at_or_before_ms")
    except (ValueError, AttributeError):
        return False
    return isinstance(floor, int) and sent <= floor


def check_outcomes(log: Log, settings: Settings, findings: Findings) -> dict[str, int]:
    """Every acquire and every intent got exactly one final outcome (a refusal of a copy for its send
    time alone, ``refused_for_its_send_time``, answers that copy: it is the outcome only of an id
    that has no other)."""
    answered = _recorded_outcomes(log, settings, findings)
    last_processed = _last_processed(log, settings, findings)
    asked: set[tuple[str, str, str]] = set()
    asked_intents: set[tuple[str, str]] = set()
    stats = {"acquires": 0, "intents": 0}
    # A command the trust gate refused was never decided: its answer (a denial naming the reason)
    # went to the inbox of the agent it claims to be from, and ``authenticated`` accounts for it.
    refused = refused_positions(log, settings)
    for entry in log.of(settings.topics.resource_commands):
        c = entry.record
        if refused and (entry.topic, entry.partition, entry.offset) in refused:
            continue
        if isinstance(c, LockRequested) and entry.key == c.resource.encode():
            ident = c.resource, c.request_id, c.agent_id
            if ident in asked:
                continue
            asked.add(ident)
            stats["acquires"] += 1
            _check_acquire(entry, c, answered, last_processed, findings)
        elif isinstance(c, ToolIntent) and entry.key == c.resource.encode():
            scoped = c.resource, c.intent_id
            if scoped in asked_intents:
                continue
            asked_intents.add(scoped)
            stats["intents"] += 1
            _check_intent(entry, c, answered, last_processed, findings)
    return stats


@dataclass
class _Outcomes:
    """What the recorded decisions answered, per request and per intent (``check_outcomes``)."""

    finals: dict[tuple[str, str, str], set[tuple[str, str]]] = field(default_factory=lambda: defaultdict(set))
    """Per (resource, request id, agent): a request id is its sender's, and another agent's command with
    the same id gets an answer of its own (request_id_taken), which is not this request's outcome."""
    final_at: dict[tuple[str, str, str], Entry] = field(default_factory=dict)
    queued: set[tuple[str, str, str]] = field(default_factory=set)
    trained: set[tuple[str, str]] = field(default_factory=set)
    """Merges that joined their train (an answer comes when they land or leave)."""
    outcomes: dict[tuple[str, str], set[tuple[str, str]]] = field(default_factory=lambda: defaultdict(set))
    """Per (resource, intent id): its scope."""
    outcome_at: dict[tuple[str, str], Entry] = field(default_factory=dict)
    copies_refused: set[tuple[str, ...]] = field(default_factory=set)
    """Ids some copy of which was refused for its send time."""


def _recorded_outcomes(log: Log, settings: Settings, findings: Findings) -> _Outcomes:
    """Every final outcome the log records for a request or an intent, except what ``authenticated`` named."""
    rules = rules_of(log, settings)[0]
    answered = _Outcomes()
    for entry in log.of(settings.topics.resource_events):
        e = entry.record
        if entry.where in findings.intrusions:
            continue
        if isinstance(e, LockDenied) and refused_for_its_send_time(log, e, rules.leases.clock_skew_ms):
            answered.copies_refused.add((e.resource, e.request_id, e.agent_id))
        elif isinstance(e, ToolRejected) and refused_for_its_send_time(log, e, rules.gateway.clock_skew_ms):
            answered.copies_refused.add((e.resource, e.intent_id))
        elif isinstance(e, _FINAL):
            answered.finals[e.resource, e.request_id, e.agent_id].add(identity(e))
            answered.final_at.setdefault((e.resource, e.request_id, e.agent_id), entry)
        elif isinstance(e, LockQueued):
            answered.queued.add((e.resource, e.request_id, e.agent_id))
        elif isinstance(e, MergeQueued):
            answered.trained.add((e.resource, e.intent_id))
        elif isinstance(e, ToolApplied | ToolRejected):
            answered.outcomes[e.resource, e.intent_id].add(identity(e))
            answered.outcome_at.setdefault((e.resource, e.intent_id), entry)
    return answered


def _check_acquire(entry: Entry, c: LockRequested, answered: _Outcomes, last_processed: dict[int, int],
                   findings: Findings) -> None:
    """One acquire (its first copy in the log): exactly one final outcome, or still queued."""
    ident = c.resource, c.request_id, c.agent_id
    got = answered.finals.get(ident, set())
    if len(got) > 1:
        findings.add("one_outcome", f"request {c.request_id} of {c.agent_id} got {len(got)} final outcomes: "
                     f"{', '.join(sorted(name for name, _ in got))}", [entry, answered.final_at[ident]],
                     resource=c.resource)
    elif not got and ident not in answered.copies_refused:
        still = ident in answered.queued
        processed = entry.offset <= last_processed.get(entry.partition, -1)
        findings.add("one_outcome", f"request {c.request_id} of {c.agent_id} "
                     + ("is still queued" if still else "got no answer"), [entry],
                     open_=still or not processed, resource=c.resource)


def _check_intent(entry: Entry, c: ToolIntent, answered: _Outcomes, last_processed: dict[int, int],
                  findings: Findings) -> None:
    """One intent (its first copy in the log): exactly one outcome, or still waiting in its merge train."""
    scoped = c.resource, c.intent_id
    answers = answered.outcomes.get(scoped, set())
    if len(answers) > 1:
        findings.add("one_outcome", f"intent {c.intent_id} got {len(answers)} different outcomes",
                     [entry, answered.outcome_at[scoped]], resource=c.resource)
    elif not answers and scoped not in answered.copies_refused:
        processed = entry.offset <= last_processed.get(entry.partition, -1)
        waits = scoped in answered.trained
        findings.add("one_outcome", f"intent {c.intent_id} of {c.agent_id} "
                     + ("still waits in its merge train" if waits else "got no outcome"), [entry],
                     open_=waits or not processed, resource=c.resource)


def check_merges(log: Log, settings: Settings, findings: Findings) -> dict[str, int]:
    """Every merge that landed on a repository with a check landed on a runner's passing verdict of exactly
    what landed: that merge, its commit and tree, on the head it landed on, under the check it joined with."""
    topics = settings.topics
    refused = refused_positions(log, settings)
    verdicts: dict[str, tuple[Entry, CheckVerdict]] = {}
    for entry in log.of(topics.resource_commands):
        if isinstance(entry.record, CheckVerdict) and (entry.topic, entry.partition, entry.offset) not in refused \
                and entry.where not in findings.intrusions:
            verdicts.setdefault(entry.record.verdict_id, (entry, entry.record))
    joined: dict[tuple[str, str], MergeQueued] = {}
    stats = {"merges_landed": 0, "merges_checked": 0}
    seen: set[tuple[str, str]] = set()
    for entry in log.of(topics.resource_events):
        e = entry.record
        if findings.excluded(entry):
            continue
        if isinstance(e, MergeQueued):
            joined.setdefault((e.resource, e.intent_id), e)
        if not isinstance(e, ToolApplied) or e.tool != "merge" or (e.resource, e.intent_id) not in joined:
            continue
        if (e.resource, e.intent_id) in seen:
            continue  # a redelivered copy
        seen.add((e.resource, e.intent_id))
        stats["merges_landed"] += 1
        queued = joined[e.resource, e.intent_id]
        if queued.check_digest is None:
            continue  # the repository had no check when it joined: it lands unchecked, as configured
        result = json.loads(e.result_json)
        found = verdicts.get(str(result.get("verdict")))
        verdict = found[1] if found is not None else None
        problem = _verdict_problem(verdict, e, queued, result)
        if problem is None:
            stats["merges_checked"] += 1
            continue
        findings.add("checked_merges", f"merge {e.intent_id} of {e.agent_id} landed {problem}",
                     [entry] + ([found[0]] if found is not None else []), resource=e.resource, at_ms=e.at_ms)
    return stats


def _verdict_problem(verdict: CheckVerdict | None, landed: ToolApplied, queued: MergeQueued,
                     result: dict[str, Any]) -> str | None:
    if verdict is None:
        return "with no runner's verdict in the log"
    if verdict.intent_id != landed.intent_id or verdict.resource != landed.resource:
        return f"on a verdict of another merge ({verdict.intent_id})"
    if not verdict.passed:
        return "on a failing verdict"
    if verdict.check_digest != queued.check_digest:
        return f"on a verdict of another check ({verdict.check_digest}, not {queued.check_digest})"
    if (verdict.commit, verdict.tree, verdict.base) != (result.get("head"), result.get("tree"),
                                                      result.get("previous")):
        return (f"as {str(result.get('head'))[:12]} on {str(result.get('previous'))[:12]}, and the verdict checked "
                f"{verdict.commit[:12]} on {verdict.base[:12]}")
    return None


def _last_processed(log: Log, settings: Settings, findings: Findings) -> dict[int, int]:
    """Per command partition, the highest command offset any worker's decision names as its cause (a
    forged one, naming any offset it likes, would turn a request still waiting into one left unanswered)."""
    last: dict[int, int] = {}
    commands = settings.topics.resource_commands
    for entry in log.of(settings.topics.resource_events):
        if entry.where in findings.intrusions:
            continue
        cause = getattr(entry.record, "cause", None)
        if cause is not None and cause.topic == commands:
            last[cause.partition] = max(last.get(cause.partition, -1), cause.offset)
    return last


def check_sagas(log: Log, settings: Settings, findings: Findings) -> dict[str, int]:
    """Every saga finished COMPLETED or COMPENSATED, once."""
    started: dict[str, Entry] = {}
    refused = refused_positions(log, settings)  # a step the trust gate refused started nothing
    for entry in log.of(settings.topics.saga_commands):
        if isinstance(entry.record, SagaStep) and (entry.topic, entry.partition, entry.offset) not in refused:
            started.setdefault(entry.record.saga_id, entry)
    finished: dict[str, set[str]] = defaultdict(set)
    finished_at: dict[str, Entry] = {}
    compensations = 0
    for entry in log.of(settings.topics.saga_events):
        record = entry.record
        if entry.where in findings.intrusions:
            continue
        if isinstance(record, SagaFinished):
            finished[record.saga_id].add(record.outcome)
            finished_at.setdefault(record.saga_id, entry)
        elif type(record).__name__ == "Compensated":
            compensations += 1
    for saga_id, entry in sorted(started.items()):
        outcomes = finished.get(saga_id, set())
        if not outcomes:
            findings.add("sagas_finished", f"saga {saga_id} never finished", [entry], open_=True)
        elif "COMPENSATION_FAILED" in outcomes:
            findings.add("sagas_finished", f"saga {saga_id} could not be compensated (COMPENSATION_FAILED): "
                         "a human must act; see the SagaFinished detail and the operator topic",
                         [finished_at[saga_id]])
        elif len(outcomes) > 1 or not outcomes <= {"COMPLETED", "COMPENSATED"}:
            findings.add("sagas_finished", f"saga {saga_id} finished as {sorted(outcomes)}",
                         [finished_at[saga_id]])
    return {"sagas": len(started), "compensated_steps": compensations,
            "sagas_compensated": sum(1 for o in finished.values() if "COMPENSATED" in o)}


def check_cycles(log: Log, settings: Settings, findings: Findings) -> dict[str, int]:
    """Every cycle the recorded edges closed got a detection that broke it."""
    deadlocks = 0
    for (topic, _partition), entries in sorted(log.partitions.items()):
        if topic != settings.topics.wait_edges:
            continue
        # The detector logs a detection after the edge that closed the cycle, perhaps after
        # other edges (a timeout may even break the cycle first): match them by cause.
        # Refused or forged messages were never decided: they neither add edges nor break cycles.
        entries = [e for e in entries if not findings.excluded(e)]
        # The detector breaks a cycle as it folds the edge that closed it (the victim's waits leave its
        # graph at once); its detection is appended after, maybe after other edges that a graph still
        # holding the victim's waits would take for new cycles. So a detection acts here at its cause.
        detections: dict[str, list[DeadlockDetected]] = defaultdict(list)
        for e in entries:
            if isinstance(r := e.record, DeadlockDetected):
                detections[f"{r.cause.topic}[{r.cause.partition}]@{r.cause.offset}"].append(r)
        detected, applied = set(detections), set()
        graphs: dict[bytes, _Graph] = defaultdict(_Graph)
        for entry in entries:
            record = entry.record
            graph = graphs[entry.key or b""]
            if isinstance(record, WaitEdgeAdded | WaitEdgeRemoved) and graph.copy(record):
                continue  # a lease book's change sent again after a redelivery: folded already
            if isinstance(record, WaitEdgeAdded):
                if graph.add(record) and graph.reaches(record.holder, record.waiter):
                    graph.pending[entry.where] = entry
                for detection in detections.get(entry.where, ()) if entry.where not in applied else ():
                    graph.cancel(detection.victim)
                    graph.pending.pop(entry.where, None)
                applied.add(entry.where)
            elif isinstance(record, WaitEdgeRemoved):
                graph.remove(record.edge_id)
            elif isinstance(record, DeadlockDetected):
                deadlocks += 1
                cause = record.cause
                where = f"{cause.topic}[{cause.partition}]@{cause.offset}"
                if where not in applied:  # (its cause is not in this log: act where it is)
                    graph.cancel(record.victim)
                graph.pending.pop(where, None)
            for where, closing in list(graph.pending.items()):
                if closing is not entry and not graph.has_cycle():
                    if where not in detected:
                        findings.add("cycles_resolved", "a wait-for cycle closed here was broken without a "
                                     "deadlock detection (a timeout or a release cut it)", [closing, entry])
                    del graph.pending[where]
        for graph in graphs.values():
            for where, closing in graph.pending.items():
                if where not in detected:
                    findings.add("cycles_resolved", "a wait-for cycle closed here is still unresolved at the end "
                                 "of the log", [closing], open_=True)
    return {"deadlocks": deadlocks}


@dataclass
class _Graph:
    """A plain wait-for graph, independent of ``arbiter.streams.cores.waitgraph``."""

    edges: dict[str, tuple[str, str]] = field(default_factory=dict)
    cancelled: set[str] = field(default_factory=set)
    pending: dict[str, Entry] = field(default_factory=dict)
    caused: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Per edge a lease book changed, the (partition, offset) of the decision that last changed it."""

    def copy(self, change: WaitEdgeAdded | WaitEdgeRemoved) -> bool:
        """Whether ``change`` is a copy of a change folded already: a worker of the lease books that died
        before committing is redelivered its inputs and sends their edges again, under the same causes. A
        book decides one resource's changes in its partition's order, so a change whose decision is not
        after the last one folded for its edge is a copy; folding it would bring back an edge removed
        since, and close a cycle that no longer exists (the detector's graph skips them the same way)."""
        cause = change.cause
        if cause is None:
            return False  # an agent's own edge (a delegation): one message, never sent again by a worker
        last = self.caused.get(change.edge_id)
        if last is not None and last[0] == cause.partition and cause.offset < last[1]:
            return True  # (one decision may change an edge twice: its own later changes are no copies)
        self.caused[change.edge_id] = (cause.partition, cause.offset)
        return False

    def add(self, edge: WaitEdgeAdded) -> bool:
        if edge.edge_id in self.cancelled or edge.edge_id in self.edges:
            return False
        self.edges[edge.edge_id] = (edge.waiter, edge.holder)
        return True

    def remove(self, edge_id: str) -> None:
        self.edges.pop(edge_id, None)

    def cancel(self, victim: str) -> None:
        for edge_id, (waiter, _holder) in list(self.edges.items()):
            if waiter == victim:
                del self.edges[edge_id]
                self.cancelled.add(edge_id)

    def reaches(self, start: str, goal: str) -> bool:
        out: dict[str, set[str]] = defaultdict(set)
        for waiter, holder in self.edges.values():
            out[waiter].add(holder)
        seen, todo = {start}, [start]
        while todo:
            node = todo.pop()
            if node == goal:
                return True
            for nxt in out[node] - seen:
                seen.add(nxt)
                todo.append(nxt)
        return False

    def has_cycle(self) -> bool:
        return any(self.reaches(holder, waiter) for waiter, holder in self.edges.values())


def summarize(findings: Findings) -> dict[str, dict[str, int]]:
    """Per check: violations and open items."""
    table = {name: {"violations": 0, "intrusions": 0, "open": 0} for name in CHECKS}
    column = {"violation": "violations", "intrusion": "intrusions", "open": "open"}
    for f in findings.items:
        table[f.check][column[f.severity]] += 1
    return table



# -- authenticated ---------------------------------------------------------------------------

_OVERRIDES = (LockRevokeRequested, CompensationRequested)


def check_authenticated(log: Log, settings: Settings, anchors: list[bytes],
                        findings: Findings) -> tuple[dict[str, int], list[dict[str, Any]]]:
    """Every message signed by an identity allowed to write it; and the operators' overrides.

    Only for a log the audit checks signatures of (``replay.verifies``). Signatures are
    checked against the whole registry (a key's end still counts from its ``valid_until_ms``)
    rooted in ``anchors``, the admin public keys this auditor trusts. Decisions (a worker's
    announcement too) must be a worker's; a command that is unsigned, forged or forbidden to its
    signer is fine only if the workers refused it (a dead letter with reason unauthenticated or
    forbidden). A decision that fails is added to ``findings.intrusions``, so no other check folds it
    in. Returns the figures and the human actions: admin-signed overrides, who, what, why, where.
    """
    if not verifies(log, settings):
        return {}, []
    if not anchors:
        findings.add("authenticated", NO_ANCHORS, [])
        return {}, []
    codec = default_codec(settings.max_message_bytes)
    stats = {"signatures_verified": 0, "registry_records": 0, "refused_commands": 0}
    registry = _checked_registry(log, settings, Registry(anchors), codec, findings, stats)
    trail = _checked_decisions(log, settings, registry, codec, findings, stats)
    actions = _checked_commands(log, settings, registry, codec, trail, findings, stats)
    stats["human_actions"] = len(actions)
    return stats, actions


def _checked_registry(log: Log, settings: Settings, registry: Registry, codec: Codec, findings: Findings,
                      stats: dict[str, int]) -> Registry:
    """``registry`` with every registry record an admin signed applied; the others are intrusions."""
    for entry in log.of(settings.topics.registry):
        stats["registry_records"] += 1
        value = entry.value_bytes(codec)
        record = entry.record
        if isinstance(record, IdentityRegistered):
            refusal = registry.apply(entry.topic, entry.key, value, entry.headers, record)
            if refusal is not None:
                findings.add("authenticated", f"registry record of {record.name!r} ({record.role}) was not "
                             f"applied: {refusal.detail}", [entry], intrusion=True, at_ms=entry.timestamp_ms)
                continue
        else:
            signer = registry.verify(entry.topic, entry.key, value, entry.headers, entry.timestamp_ms)
            if isinstance(signer, Refused) or signer.role != ROLE_ADMIN:
                findings.add("authenticated", "a registry message that is not an identity record (a tombstone, or "
                             "bytes that do not decode) is not signed by an admin key", [entry], intrusion=True,
                             at_ms=entry.timestamp_ms)
                continue
        stats["signatures_verified"] += 1
    # Two processes registering one key at once (``Registry.apply``): a repeat, not an intrusion.
    stats["registry_repeats"] = registry.repeats
    return registry


@dataclass
class _Trail:
    """What the workers' own decisions say about the inputs: only decisions a worker signed, so that
    a forged dead letter or decision can neither pass for a refusal nor move where the workers got to."""

    refused: dict[tuple[str, int, int], set[str]] = field(default_factory=lambda: defaultdict(set))
    """Input position -> the reasons of the dead letters the workers wrote for it."""
    reached: dict[tuple[str, int], int] = field(default_factory=dict)
    """Input partition -> the last offset any of the workers' decisions names."""
    caused: dict[tuple[str, int, int], list[str]] = field(default_factory=lambda: defaultdict(list))
    """Input position -> the kinds of the decisions made from it."""

    def letter(self, record: Record | None) -> None:
        """Take in one dead letter a worker signed."""
        if isinstance(record, DeadLetter):
            source = record.source.topic, record.source.partition, record.source.offset
            self.refused[source].add(record.reason)
            self.reached[source[:2]] = max(self.reached.get(source[:2], -1), source[2])

    def follow(self, record: Record | None) -> None:
        """Take in one decision a worker signed (an event, or the detector's or lock processor's command)."""
        if record is not None and (cause := _cause_of(record)) is not None:
            self.reached[cause[:2]] = max(self.reached.get(cause[:2], -1), cause[2])
            self.caused[cause].append(type(record).__name__)


def _not_a_workers(registry: Registry, entry: Entry, value: bytes) -> str | None:
    """Why ``entry`` (its value bytes ``value``) is not a worker's message; None: a worker signed it."""
    signer = registry.verify(entry.topic, entry.key, value, entry.headers, entry.timestamp_ms)
    if isinstance(signer, Refused):
        return signer.detail
    if signer.role != ROLE_WORKER:
        return f"it is signed by {signer.name!r} (role {signer.role}), and only workers write decisions"
    return None


def _checked_decisions(log: Log, settings: Settings, registry: Registry, codec: Codec, findings: Findings,
                       stats: dict[str, int]) -> _Trail:
    """Every decision a worker's (one that is not, an announcement too, is an intrusion, left out of every
    other check), and what the workers' decisions say about the inputs."""
    t = settings.topics
    decisions = {t.resource_events, t.agent_inbox, t.saga_events, t.dead_letter, t.workers, t.operator}
    trail = _Trail()
    for (topic, _partition), entries in sorted(log.partitions.items()):
        if topic not in decisions:
            continue
        for entry in entries:
            kind = type(entry.record).__name__ if entry.record is not None else "a message that does not decode"
            try:
                value = entry.value_bytes(codec)
            except ContractError as exc:
                findings.add("authenticated", f"{kind} cannot be encoded again to check its signature: {exc}",
                             [entry], at_ms=entry.timestamp_ms)
                continue
            problem = _not_a_workers(registry, entry, value)
            if problem is None:
                stats["signatures_verified"] += 1
                if topic == t.dead_letter:
                    trail.letter(entry.record)
                elif topic in (t.resource_events, t.saga_events):
                    trail.follow(entry.record)
                continue
            findings.intrusions.add(entry.where)
            findings.add("authenticated", f"{kind} on {topic} is not a worker's decision: {problem}", [entry],
                         intrusion=True, resource=_resource_of(entry.record), at_ms=entry.timestamp_ms)
    # The detector's detections and the lock processor's wait edges: decisions on a command topic.
    for entry in log.of(t.wait_edges):
        if entry.record is None or _cause_of(entry.record) is None:
            continue
        try:
            value = entry.value_bytes(codec)
        except ContractError:
            continue  # (reported with the commands)
        if _not_a_workers(registry, entry, value) is None:
            trail.follow(entry.record)
    return trail


def _checked_commands(log: Log, settings: Settings, registry: Registry, codec: Codec, trail: _Trail,
                      findings: Findings, stats: dict[str, int]) -> list[dict[str, Any]]:
    """Every command signed by an identity allowed to send it, or refused by the workers; the
    operators' overrides."""
    t = settings.topics
    actions: list[dict[str, Any]] = []
    for (topic, _partition), entries in sorted(log.partitions.items()):
        if topic not in (t.resource_commands, t.saga_commands, t.wait_edges):
            continue
        for entry in entries:
            record = entry.record
            if record is None:
                continue  # the workers dead-letter bytes that do not decode before they look at a signature
            position = entry.topic, entry.partition, entry.offset
            try:
                value = entry.value_bytes(codec)
            except ContractError as exc:
                findings.add("authenticated", f"{type(record).__name__} cannot be encoded again to check its "
                             f"signature: {exc}", [entry], at_ms=entry.timestamp_ms)
                continue
            signer = registry.verify(entry.topic, entry.key, value, entry.headers, entry.timestamp_ms)
            why = None if isinstance(signer, Refused) else authorize(signer.identity, record)
            problem = signer.detail if isinstance(signer, Refused) else why[1] if why is not None else None
            if problem is None:
                stats["signatures_verified"] += 1
                if str(Reason.MISROUTED) in trail.refused.get(position, set()):
                    # Signed by someone allowed to send it, on a partition its key does not hash to: the
                    # workers refused it there (a copy, or a client with another partitioner).
                    stats["misrouted_commands"] = stats.get("misrouted_commands", 0) + 1
                    findings.intrusions.add(entry.where)
                elif isinstance(signer, Verified) and signer.role == ROLE_ADMIN and isinstance(record, _OVERRIDES):
                    actions.append(_human_action(entry, record, signer.name, trail.caused.get(position, [])))
                continue
            if trail.refused.get(position, set()) & REFUSALS:
                stats["refused_commands"] += 1
                # Never decided: a refused look-alike of a decision (a DeadlockDetected on the wait-edge
                # topic, say) is not one for the other checks either.
                findings.intrusions.add(entry.where)
                continue
            pending = entry.offset > trail.reached.get((entry.topic, entry.partition), -1)
            findings.add("authenticated", f"{type(record).__name__} should have been refused ({problem}), and no "
                         "worker refused it (no dead letter with reason unauthenticated or forbidden)"
                         + (": not yet processed when the log was read" if pending else ""), [entry],
                         open_=pending, resource=_resource_of(record), at_ms=entry.timestamp_ms)
    return actions


def refused_inputs(log: Log, settings: Settings) -> list[dict[str, Any]]:
    """Every input the workers refused before deciding it, where and why (oldest first): the traces of
    forged, unauthorized and misrouted commands, which changed nothing. Only the dead letters a worker
    wrote: a forged one is an intrusion, not a refusal."""
    out = []
    for entry, letter in dead_letters(log, settings):
        if letter.reason in REFUSALS:
            source = letter.source
            out.append({"where": f"{source.topic}[{source.partition}]@{source.offset}", "reason": letter.reason,
                        "detail": letter.detail[:300], "at_ms": entry.timestamp_ms})
    return sorted(out, key=lambda r: (r["at_ms"], r["where"]))


def _resource_of(record: Record | None) -> str | None:
    resource = getattr(record, "resource", None)
    return resource if isinstance(resource, str) else None


def _human_action(entry: Entry, record: LockRevokeRequested | CompensationRequested, who: str,
                  outcome: list[str]) -> dict[str, Any]:
    """One operator's override, as the report lists it."""
    if isinstance(record, LockRevokeRequested):
        what = f"force-release {record.agent_id}'s lease on {record.resource}" + (
            f" (token {record.token})" if record.token is not None else "")
        target = {"resource": record.resource, "agent_id": record.agent_id}
    else:
        what = f"abort saga {record.saga_id}"
        target = {"saga_id": record.saga_id}
    return {"who": who, "action": type(record).__name__, "what": what, "reason": record.reason,
            "where": entry.where, "at_ms": entry.timestamp_ms, "outcome": outcome, **target}
