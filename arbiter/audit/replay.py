"""Replaying the log through the processors' own code: audit, time travel and what-if.

``Engine`` holds the state the three processors keep in tables (lease books,
contents, wait-for graph rows, sagas) in plain dictionaries, and decides each message
through the very path the workers' runtimes call (``arbiter.streams.shells.pipeline.Pipeline``: decode,
partition, trust gate, shell, quarantine, dead letter), collecting what the worker would
have sent. Tools are not run again: an accepted intent gets the outcome the log
recorded for it.

- ``rederive``: feed every recorded input, partition by partition, and return what
  each input yields, for audit to compare with what the log recorded.
- ``state_at``: the same, up to a moment; the state then.
- ``what_if``: re-run the commands that came from outside (agents) under other rules,
  routing the processors' own commands (revocations, compensations) between them
  in time order, and measure what differs.

A log decided with signature verification on (``verifies``) is replayed through the workers'
own trust gate (``arbiter.streams.shells.trust.Gate``): each input is admitted or refused by the
registry as it stood when the broker appended the input (``ReplayTrust``), against the admin
public keys this auditor trusts, never keys read from the log. Nothing that decides how the log
is judged (whether signatures are checked, the rules, their windows) is taken from a record no
worker signed: the announcements count only when a worker signed them (``announcements``), and
the outcomes, contents and dead letters the replay and the checks read likewise
(``worker_signed``).
"""

from __future__ import annotations

import gc
import heapq
import json
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from arbiter.edge.keys import anchors_for
from arbiter.edge.settings import Settings
from arbiter.schemas import (
    CompensationRequested,
    ContractError,
    DeadLetter,
    DeadlockDetected,
    IdentityRegistered,
    LockRequested,
    LockRevokeRequested,
    LockTick,
    MergeQueued,
    MergeReplanned,
    Record,
    ResourceSnapshot,
    SagaStep,
    SnapshotRequested,
    ToolApplied,
    ToolIntent,
    ToolRejected,
    WaitEdgeAdded,
    WaitEdgeRemoved,
)
from arbiter.schemas.codec import Codec, default_codec
from arbiter.schemas.identity import IdentityError, Refused, Registry, Verified
from arbiter.schemas.partitioning import partition_for
from arbiter.schemas.reasons import Reason
from arbiter.schemas.roles import ROLE_WORKER
from arbiter.streams.cores.gateway import RESERVED_KEYS, ContentState, ToolOutcome
from arbiter.streams.cores.leases import LeaseBook
from arbiter.streams.cores.saga import COMPENSATED, COMPLETED, Saga
from arbiter.streams.cores.train import REPLANNED, Verdict
from arbiter.streams.cores.train import Entry as TrainEntry
from arbiter.streams.cores.waitgraph import VictimPolicy
from arbiter.streams.shells import Routes, Rules
from arbiter.streams.shells.pipeline import Pipeline, RawInput, input_topics
from arbiter.streams.shells.trust import Gate

from .log import Entry, Log

Derived = tuple[str, bytes, Record]
"""(topic, key, record): one output the replay derives, as a worker would have sent it (a dead letter on the
dead-letter topic). The pipeline's ``Output`` with its encoding left out."""


def _recorded_outcome(record: ToolApplied | ToolRejected) -> ToolOutcome | None:
    """What the tool's run gave, as a decision records it (None: the gate refused; no tool ran)."""
    if isinstance(record, ToolApplied):
        return ToolOutcome(True, record.result_json)
    diagnostic = json.loads(record.diagnostic_json)
    if record.reason != "tool_failed" and not diagnostic.get("by_tool"):
        return None  # the gate's own refusal: re-derived, not recorded
    details = tuple(sorted((k, v) for k, v in diagnostic.items() if k not in RESERVED_KEYS))
    return ToolOutcome(False, error=str(diagnostic.get("error", "")), reason=record.reason, details=details)


def _train_outcomes(log: Log, signed: Callable[[Entry], bool]
                    ) -> tuple[dict[tuple[str, str], ToolOutcome], dict[tuple[str, str], list[ToolOutcome]]]:
    """Each merge's preflight outcome, and its landing attempts' outcomes in order, as the worker recorded them.

    A merge's first record is its preflight's (``MergeQueued``: it joined; a refusal the tool gave: it did not);
    after it, a landing is a ``MergeReplanned``, the ``ToolApplied``, or a refusal marked ``phase: land``."""
    joins: dict[tuple[str, str], ToolOutcome] = {}
    landings: dict[tuple[str, str], list[ToolOutcome]] = {}
    for entry in log.of(log.topics.resource_events):
        record = entry.record
        if not isinstance(record, MergeQueued | MergeReplanned | ToolApplied | ToolRejected) or not signed(entry):
            continue
        if isinstance(record, ToolApplied | ToolRejected) and record.tool != "merge":
            continue
        key = record.resource, record.intent_id
        if isinstance(record, MergeQueued):
            joins.setdefault(key, ToolOutcome(True, json.dumps({
                "commit": record.commit, "head": record.head, "target": record.target,
                "check_digest": record.check_digest})))
        elif key not in joins:
            if isinstance(record, ToolRejected) and (outcome := _recorded_outcome(record)) is not None:
                joins[key] = outcome
        elif isinstance(record, MergeReplanned):
            landings.setdefault(key, []).append(ToolOutcome(False, error=record.reason, reason=REPLANNED,
                                                            details=(("head", record.head),)))
        elif isinstance(record, ToolApplied) or json.loads(record.diagnostic_json).get("phase") == "land":
            outcome = _recorded_outcome(record)
            if outcome is not None:
                landings.setdefault(key, []).append(outcome)
    return joins, landings


def worker_signed(log: Log, settings: Settings) -> Callable[[Entry], bool]:
    """Whether a recorded decision carries a worker's signature, by the log's whole registry rooted in the
    admin keys this auditor trusts (a log decided without signatures: every decision is taken as it is)."""
    if not verifies(log, settings):
        return lambda _entry: True
    return signed_by_worker(log, settings, trust_anchors(settings))


def signed_by_worker(log: Log, settings: Settings, anchors: list[bytes]) -> Callable[[Entry], bool]:
    """Whether a message carries a worker's signature, by the log's whole registry rooted in ``anchors``."""
    registry = Registry(anchors)
    codec = default_codec(settings.max_message_bytes)
    for entry in log.of(settings.topics.registry):
        if isinstance(entry.record, IdentityRegistered):
            registry.apply(entry.topic, entry.key, entry.value_bytes(codec), entry.headers, entry.record)

    def signed(entry: Entry) -> bool:
        try:
            value = entry.value_bytes(codec)
        except ContractError:
            return False
        signer = registry.verify(entry.topic, entry.key, value, entry.headers, entry.timestamp_ms)
        return isinstance(signer, Verified) and signer.role == ROLE_WORKER

    return signed


class RecordedTools:
    """The worker's tools as replay sees them: real names and argument schemas; the outcome
    of a run is the one the log recorded (tools are side effects, not decisions).

    An outcome is an intent's on its resource: ``(resource, intent id)``, the scope the gateway decides
    ids in, so two agents' intents of the same id on their own resources each get their own. Only
    decisions a worker signed are read (``signed``): a forged outcome, or a forged snapshot's content,
    is an intrusion the ``authenticated`` check reports, never the answer an honest input is replayed
    with."""

    def __init__(self, log: Log, simulated: bool = False,
                 signed: Callable[[Entry], bool] = lambda _entry: True) -> None:
        from arbiter.streams.tools.ledger import ledger_tool_registry

        self.simulated = simulated
        """What-if mode: a run the recording never made succeeds (the tools' answer is unknowable)."""
        self._registry = ledger_tool_registry()
        self._outcomes: dict[tuple[str, str], ToolOutcome] = {}
        for entry in log.of(log.topics.resource_events):
            record = entry.record
            if not isinstance(record, ToolApplied | ToolRejected) or (record.resource, record.intent_id) in \
                    self._outcomes:
                continue
            outcome = _recorded_outcome(record)
            if outcome is not None and signed(entry):
                self._outcomes[record.resource, record.intent_id] = outcome
        self._joins, self._landings = _train_outcomes(log, signed)
        self._contents: dict[tuple[str, str], str | None] = {}
        for entry in log.of(log.topics.agent_inbox):
            record = entry.record
            if isinstance(record, ResourceSnapshot) and (record.agent_id, record.request_id) not in self._contents \
                    and signed(entry):
                self._contents[record.agent_id, record.request_id] = record.content_json

    def names(self) -> frozenset[str]:
        """Registered tool names."""
        return self._registry.names()

    def parse(self, intent: ToolIntent) -> Any:
        """Validated arguments, or why they are invalid (the worker's own schemas)."""
        return self._registry.parse(intent)

    async def run(self, intent: ToolIntent, arguments: Any) -> ToolOutcome:
        """The recorded outcome; when there is none, a failure that says so (or, what-if, a success)."""
        recorded = self._outcomes.get((intent.resource, intent.intent_id))
        if recorded is not None:
            return recorded
        if self.simulated:
            return ToolOutcome(True, json.dumps({"simulated": True}))
        return ToolOutcome(False, error="no outcome recorded in the log")

    async def join(self, intent: ToolIntent, arguments: Any) -> ToolOutcome:
        """A merge's preflight, as the log recorded it (its ``MergeQueued``, or its refusal)."""
        recorded = self._joins.get((intent.resource, intent.intent_id))
        if recorded is not None:
            return recorded
        if self.simulated:
            return ToolOutcome(True, json.dumps({"commit": "0" * 40, "head": "0" * 40, "target": "main",
                                                 "check_digest": None}))
        return ToolOutcome(False, error="no outcome recorded in the log")

    async def land(self, resource: str, entry: TrainEntry, head: str, verdict: Verdict | None) -> ToolOutcome:
        """A landing, as the log recorded it: each attempt's outcome in turn (replanned, landed, refused)."""
        recorded = self._landings.get((resource, entry.intent_id))
        if recorded:
            return recorded.pop(0)
        if self.simulated:
            return ToolOutcome(True, json.dumps({"head": "0" * 40, "simulated": True}))
        return ToolOutcome(False, error="no outcome recorded in the log")

    async def read(self, request: SnapshotRequested) -> str | None:
        """The content the log recorded in the answer to ``request`` (a store's state is not a decision)."""
        return self._contents.get((request.agent_id, request.request_id))


def announcements(log: Log, settings: Settings) -> list[str]:
    """The rules the log's workers announced that this audit may go by, first seen first.

    With trust anchors, only the ``WorkerStarted`` records a worker signed: the rules decide how every
    other record is judged, so an announcement anyone could have written (unsigned, or signed by an
    agent) decides nothing; ``checks.check_authenticated`` reports it as an intrusion. Without anchors no
    signature can be checked: every announcement counts, an archive header's too (and ``verifies`` keeps
    one that says its worker verified from being outvoted)."""
    anchors = trust_anchors(settings)
    if not anchors:
        return log.announced_rules()
    return log.announced_rules(signed=signed_by_worker(log, settings, anchors))


def rules_of(log: Log, settings: Settings) -> tuple[Rules, list[str]]:
    """The rules the log's workers announced (``announcements``; else ``settings``'), and why that may
    not be the whole story.

    The second value lists problems: rules that do not parse, or workers that decided
    by different rules (the first announced are used; the audit reports the rest).
    """
    announced = announcements(log, settings)
    problems: list[str] = []
    parsed: list[Rules] = []
    for text in announced:
        try:
            parsed.append(Rules.from_json(text))
        except ValueError as exc:
            problems.append(f"announced rules that this Arbiter cannot read: {exc}")
    if not parsed:
        if not announced:
            return Rules.from_settings(settings), []
        return Rules.from_settings(settings), problems
    if len({r.to_json() for r in parsed}) > 1:
        problems.append(f"workers announced {len(parsed)} different sets of rules; the replay uses the first")
    return parsed[0], problems


class TrustAnchorsMissing(RuntimeError):
    """A log decided with signature verification, and no admin public key to check it against."""


SET_ANCHORS = ("set ARBITER_ADMIN_PUBLIC_KEYS to the admin public key(s) (base64, the text of the admin's "
               "keys/admin.pub) or point ARBITER_HOME at the admin's home")
NO_ANCHORS = ("this log was decided with signature verification on (its workers' rules say verify_signatures), "
              f"and this audit has no trust anchor to check the signatures against: {SET_ANCHORS}")


def verifies(log: Log, settings: Settings) -> bool:
    """Whether the audit checks signatures and replays every input through the workers' trust gate.

    No record can turn that off. An auditor with trust anchors checks every log a worker announced
    itself on, whatever the announcements say: one nobody signed is a forgery like any other (were the
    first one's word taken, a forged ``verify_signatures: false`` written ahead of the workers' own would
    let every forged decision feed the replay). Without anchors, it is on when any announcement, first
    or not, says its worker verified (the audit then asks for the anchors: ``TrustAnchorsMissing``). A
    log no worker announced itself on (made by ``simulate``, or by hand) was decided by no worker that
    verified."""
    announced = log.announced_rules()
    if not announced:
        return False
    return bool(trust_anchors(settings)) or any(_says_it_verified(text) for text in announced)


def _says_it_verified(rules_json: str) -> bool:
    """Whether announced rules say their worker verified signatures (rules that do not parse say
    nothing: ``rules_of`` reports them)."""
    try:
        return Rules.from_json(rules_json).verify_signatures
    except ValueError:
        return False


REFUSALS = frozenset({str(Reason.UNAUTHENTICATED), str(Reason.FORBIDDEN), str(Reason.MISROUTED)})
"""Dead-letter reasons that say: the workers refused this input before deciding anything."""


def dead_letters(log: Log, settings: Settings) -> list[tuple[Entry, DeadLetter]]:
    """The dead letters a worker wrote (``worker_signed``), in log order: a forged one (an intrusion)
    neither refuses nor letters the input it names, so it cannot hide an honest command from the checks."""
    signed = worker_signed(log, settings)
    return [(e, e.record) for e in log.of(settings.topics.dead_letter) if isinstance(e.record, DeadLetter)
            and signed(e)]


def refused_positions(log: Log, settings: Settings) -> set[tuple[str, int, int]]:
    """Inputs the workers refused before deciding (dead-lettered unauthenticated, forbidden or misrouted)."""
    return {(letter.source.topic, letter.source.partition, letter.source.offset)
            for _entry, letter in dead_letters(log, settings) if letter.reason in REFUSALS}


def trust_anchors(settings: Settings) -> list[bytes]:
    """The admin public keys this auditor trusts (``ARBITER_ADMIN_PUBLIC_KEYS``, else
    ``<home>/keys/admin.pub``); ``TrustAnchorsMissing`` when they cannot be read."""
    try:
        return anchors_for(settings.home, settings.admin_public_keys)
    except IdentityError as exc:
        raise TrustAnchorsMissing(f"the admin public keys cannot be read: {exc}") from None


class ReplayTrust:
    """The workers' trust gate over the log's registry topic, as it stood at each input.

    Before an input is decided, every registry record in effect by the input's append time
    is applied (``Registry.apply`` checks the admin's signature); inputs come partition by
    partition, so time runs backwards between partitions, and then the registry is built
    again from the start (its records are few). A record is in effect from its append time,
    or from its ``valid_from_ms`` if that is earlier: compaction may have removed a key's
    first record and kept only a later one (rotated, revoked), which still says from when
    the key was good.
    """

    def __init__(self, log: Log, settings: Settings, anchors: list[bytes], routes: Routes) -> None:
        self.anchors = anchors
        self.routes = routes
        self.codec: Codec = default_codec(settings.max_message_bytes)
        timed = [(min(e.timestamp_ms, e.record.valid_from_ms), e) for e in log.of(settings.topics.registry)
                 if isinstance(e.record, IdentityRegistered)]
        timed.sort(key=lambda pair: pair[0])  # stable: log order among equal times
        self._timed = timed
        self._next = 0
        self.registry = Registry(anchors)
        self.gate = Gate(self.registry)

    @classmethod
    def of(cls, log: Log, settings: Settings, rules: Rules) -> ReplayTrust | None:
        """The gate ``log`` was decided with (None: its workers did not verify signatures)."""
        if not verifies(log, settings):
            return None
        anchors = trust_anchors(settings)
        if not anchors:
            raise TrustAnchorsMissing(NO_ANCHORS)
        return cls(log, settings, anchors, Routes.of(settings.topics, rules.graph_key))

    def _registry_at(self, at_ms: int) -> None:
        if self._next and self._timed[self._next - 1][0] > at_ms:
            self.registry = Registry(self.anchors)  # back in time: build it again
            self.gate = Gate(self.registry)
            self._next = 0
        while self._next < len(self._timed) and self._timed[self._next][0] <= at_ms:
            entry = self._timed[self._next][1]
            assert isinstance(entry.record, IdentityRegistered)
            self.registry.apply(entry.topic, entry.key, entry.value_bytes(self.codec), entry.headers, entry.record)
            self._next += 1

    async def admit(self, raw: RawInput, record: Record) -> Verified | Refused | None:
        """The gate's verdict on one input, as the workers reached it."""
        self._registry_at(raw.timestamp_ms)
        value = raw.value if raw.value is not None else self.codec.encode(record)
        return self.gate.admit(raw.topic, raw.key, value, raw.headers, record, raw.timestamp_ms)


@dataclass(repr=False)
class Engine:
    """The processors' state and decisions, without Kafka: the workers' pipeline over dicts."""

    settings: Settings
    tools: Any
    rules: Rules | None = None
    """The rules to decide by (default: ``settings``')."""
    victim_policy: VictimPolicy | None = None
    """Overrides the rules' victim policy (what-if)."""
    trust: ReplayTrust | None = None
    """The trust gate every input passes first (None: the log's workers did not verify)."""
    books: dict[bytes, LeaseBook] = field(default_factory=dict)
    contents: dict[bytes, ContentState] = field(default_factory=dict)
    graph_rows: dict[bytes, bytes] = field(default_factory=dict)
    """The wait-for graphs as the worker keeps them: one row per edge (``shells.deadlock.RowGraphStore``)."""
    sagas: dict[bytes, Saga] = field(default_factory=dict)
    pipeline: Pipeline = field(init=False)

    def __post_init__(self) -> None:
        rules = self.rules or Rules.from_settings(self.settings)
        if self.victim_policy is not None:
            rules = replace(rules, victim_policy=self.victim_policy)
        self.rules = rules
        tables: dict[str, Any] = {"books": self.books, "contents": self.contents, "graphs": self.graph_rows,
                                  "sagas": self.sagas}
        self.pipeline = Pipeline(rules, self.settings.topics, self.settings.partitions, tables, self.tools,
                                 default_codec(self.settings.max_message_bytes), trust=self.trust, quiet=True)
        self._inputs = frozenset(input_topics(self.settings.topics))

    def __repr__(self) -> str:  # short: see ``Log.__repr__``
        return (f"<Engine: {len(self.books)} lease books, {len(self.contents)} contents, "
                f"{len(self.graph_rows)} wait-for rows, {len(self.sagas)} sagas>")

    async def decide(self, entry: Entry, trusted: bool = False) -> list[Derived]:
        """What the worker sends for one input message (an input topic's message). ``trusted``:
        skip the trust gate (a what-if routes the processors' own commands unsigned)."""
        if entry.topic not in self._inputs:
            return []
        raw = RawInput(entry.topic, entry.partition, entry.offset, entry.key,
                       entry.raw if entry.record is None else entry.value, entry.headers, entry.timestamp_ms,
                       entry.record)
        outcome = await self.pipeline.process(raw, trusted=trusted)
        return [(topic, key, record) for topic, key, record, _value in outcome.outputs]

    def wait_edges(self) -> list[Any]:
        """Every wait-for edge in every graph."""
        store = self.pipeline.graph_store
        keys = sorted({row.split(b"\x00", 1)[0] for row in self.graph_rows})
        return [edge for key in keys for edge in store.get(key).edges.values()]

    def open_sagas(self) -> list[Saga]:
        """Sagas that have not finished."""
        return [s for s in self.sagas.values() if s.status not in (COMPLETED, COMPENSATED)]


@contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic garbage collection inside (nested uses are free).

    A replay allocates hundreds of thousands of objects that live until it ends, and
    every full collection they trigger walks the whole log again: up to half of a large
    replay's time. Reference counting still frees everything that is not in a cycle;
    cycles wait until the block ends.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def new_engine(log: Log, settings: Settings, *, simulated: bool = False,
               victim_policy: VictimPolicy | None = None) -> Engine:
    """An engine that decides as the log's workers did: their rules, their trust gate."""
    rules = rules_of(log, settings)[0]
    trust = ReplayTrust.of(log, settings, rules)
    tools = RecordedTools(log, simulated=simulated, signed=worker_signed(log, settings))
    return Engine(settings, tools, rules, victim_policy=victim_policy, trust=trust)


def inputs(log: Log, settings: Settings) -> Iterator[Entry]:
    """Every input message, partition by partition, in offset order."""
    for topic in input_topics(settings.topics):
        yield from log.of(topic)


async def rederive(log: Log, settings: Settings, engine: Engine | None = None,
                   progress: Callable[[int], None] | None = None, skip: Collection[str] = (),
                   settled: Mapping[tuple[str, int], int] | None = None,
                   at_settled: Callable[[Engine], None] | None = None
                   ) -> tuple[Engine, list[tuple[Entry, list[Derived]]]]:
    """Every input and what the processors decide for it, replayed from the log (but the positions in
    ``skip``: inputs an audit checkpoint's ``engine`` decided already).

    With ``settled`` (per input partition, the last offset whose decisions the log records), the inputs
    up to it are decided first, then ``at_settled(engine)`` is told, then the rest: the state an audit
    checkpoint keeps is the one of settled inputs only (a tool's outcome is known once its decision is
    in the log). A partition's state is its own, so the order across partitions does not matter."""
    engine = engine or new_engine(log, settings)
    decided: list[tuple[Entry, list[Derived]]] = []
    todo = [e for e in inputs(log, settings) if not skip or e.where not in skip]
    if settled is not None:
        first = [e for e in todo if e.offset <= settled.get((e.topic, e.partition), -1)]
        chosen = {id(e) for e in first}
        phases = [first, [e for e in todo if id(e) not in chosen]]
    else:
        phases = [todo]
    count = 0
    with gc_paused():
        for number, phase in enumerate(phases):
            if number == 1 and at_settled is not None:
                at_settled(engine)
            for entry in phase:
                decided.append((entry, list(await engine.decide(entry))))
                count += 1
                if progress and count % 5000 == 0:
                    progress(count)
        if len(phases) == 1 and at_settled is not None:
            at_settled(engine)
    return engine, decided


def settled_offsets(log: Log, settings: Settings) -> dict[tuple[str, int], int]:
    """Per input partition, the last input offset before the first tool intent whose outcome the log does
    not record yet (a tool's outcome is a side effect, known once its decision is written): every input up
    to it decides the same whatever comes later. Partitions without such an intent are settled to the end."""
    t = settings.topics
    signed = worker_signed(log, settings)  # a forged outcome settles nothing
    answered = {(e.record.resource, e.record.intent_id) for e in log.of(t.resource_events)
                if isinstance(e.record, ToolApplied | ToolRejected) and signed(e)}
    lettered = {(letter.source.topic, letter.source.partition, letter.source.offset)
                for _entry, letter in dead_letters(log, settings)}
    settled: dict[tuple[str, int], int] = {}
    for (topic, partition), entries in log.partitions.items():
        if topic not in input_topics(t) or not entries:
            continue
        limit = entries[-1].offset
        if topic == t.resource_commands:
            for entry in entries:
                r = entry.record
                if (isinstance(r, ToolIntent) and (r.resource, r.intent_id) not in answered
                        and (topic, partition, entry.offset) not in lettered):
                    limit = entry.offset - 1
                    break
        settled[topic, partition] = limit
    return settled


# -- time travel -------------------------------------------------------------------------


@dataclass(frozen=True)
class Moment:
    """A point in the log: a broker time, or a message position (inclusive)."""

    at_ms: int | None = None
    topic: str | None = None
    partition: int | None = None
    offset: int | None = None

    def includes(self, entry: Entry, position_ms: int | None) -> bool:
        """Whether ``entry`` happened at or before this moment."""
        if self.topic is not None:
            if entry.topic == self.topic and entry.partition == self.partition:
                return entry.offset <= (self.offset or 0)
            return position_ms is not None and entry.timestamp_ms <= position_ms
        return self.at_ms is not None and entry.timestamp_ms <= self.at_ms


def parse_moment(text: str, log: Log) -> Moment:
    """``--at``: ISO time, epoch ms, ``+12.5s`` after the log's start, or ``topic[partition]@offset``."""
    from datetime import UTC, datetime

    text = text.strip()
    if "@" in text:
        where, _, offset = text.rpartition("@")
        topic, _, partition = where.rstrip("]").partition("[")
        if not topic or not partition.isdigit() or not offset.isdigit():
            raise ValueError(f"position {text!r}: expected topic[partition]@offset")
        if log.find(topic, int(partition), int(offset)) is None:
            raise ValueError(f"position {text!r} is not in the log")
        return Moment(topic=topic, partition=int(partition), offset=int(offset))
    if text.startswith("+") and text.endswith("s"):
        seconds = text[1:-1]
        if not seconds.replace(".", "", 1).isdigit():  # no signs, exponents, inf or nan
            raise ValueError(f"moment {text!r}: expected +<seconds>s after the log's start, e.g. +12.5s")
        start, _end = log.span_ms()
        return Moment(at_ms=start + round(float(seconds) * 1000))
    if text.isdigit():
        return Moment(at_ms=int(text))
    try:
        when = datetime.fromisoformat(text.replace("Z", "+00:00"))
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)  # the log's times are UTC; a bare time means UTC too
        return Moment(at_ms=round(when.timestamp() * 1000))
    except ValueError:
        raise ValueError(f"moment {text!r}: expected an ISO time, epoch milliseconds, +<seconds>s after "
                         "the log's start, or topic[partition]@offset") from None


async def state_at(log: Log, settings: Settings, moment: Moment) -> dict[str, Any]:
    """Holders, queues, tokens, versions, the wait-for graph and open sagas at ``moment``."""
    position_ms = None
    if moment.topic is not None:
        found = log.find(moment.topic, moment.partition or 0, moment.offset or 0)
        position_ms = found.timestamp_ms if found else None
    engine = new_engine(log, settings)
    last = 0
    with gc_paused():
        for entry in inputs(log, settings):
            if moment.includes(entry, position_ms):
                await engine.decide(entry)
                last = max(last, entry.timestamp_ms)
    return {
        "at_ms": moment.at_ms if moment.at_ms is not None else position_ms,
        "last_input_ms": last,
        "resources": [_resource_state(key, book, engine.contents.get(key))
                      for key, book in sorted(engine.books.items())],
        "wait_for": sorted(
            ({"waiter": e.waiter, "holder": e.holder, "resource": e.resource, "source": e.source}
             for e in engine.wait_edges()),
            key=lambda e: (e["waiter"], e["holder"], e["resource"] or "")),
        "open_sagas": [{"saga_id": s.saga_id, "agent_id": s.agent_id, "status": s.status, "steps": sorted(s.steps),
                        "compensated": list(s.compensated)} for s in engine.open_sagas()],
    }


def _resource_state(key: bytes, book: LeaseBook, content: ContentState | None) -> dict[str, Any]:
    return {
        "resource": key.decode("utf-8", errors="replace"),
        "high_water_token": book.last_token,
        "version": content.version if content else 0,
        "holders": [{"agent_id": h.agent_id, "token": h.token, "mode": h.mode, "expires_at_ms": h.expires_at_ms}
                    for h in book.holders.values()],
        "queue": [{"agent_id": w.agent_id, "mode": w.mode, "priority": w.priority, "queued_at_ms": w.queued_at_ms}
                  for w in book.queue],
    }


# -- what-if -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Policy:
    """The rules a what-if replay changes."""

    ttl_ms: int | None = None
    """Every agent's lease TTL (acquire and renew)."""
    victim: VictimPolicy = "priority"

    @classmethod
    def parse(cls, text: str) -> Policy:
        """``ttl=30s,victim=youngest``: a clear ``ValueError`` for anything else."""
        from arbiter.streams.cores.waitgraph import VICTIM_POLICIES

        values: dict[str, Any] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, sep, value = part.partition("=")
            if not sep:
                raise ValueError(f"policy {part!r}: expected name=value")
            if name == "ttl":
                values["ttl_ms"] = _duration_ms(value)
            elif name == "victim":
                if value not in VICTIM_POLICIES:
                    raise ValueError(f"victim {value!r}: expected one of {', '.join(VICTIM_POLICIES)}")
                values["victim"] = value
            else:
                raise ValueError(f"unknown policy {name!r}: expected ttl or victim")
        return cls(**values)


def _duration_ms(text: str) -> int:
    units = {"ms": 1, "s": 1000, "m": 60_000}
    for unit in ("ms", "s", "m"):
        if text.endswith(unit) and text[:-len(unit)].replace(".", "", 1).isdigit():
            value = round(float(text[:-len(unit)]) * units[unit])
            if value > 0:
                return value
    raise ValueError(f"duration {text!r}: expected e.g. 500ms, 30s or 2m, above zero")


def from_outside(entry: Entry) -> bool:
    """Whether an input came from an agent (not from a processor deciding something else)."""
    record = entry.record
    if isinstance(record, LockRevokeRequested):
        return record.requested_by != "deadlock-detector"
    if isinstance(record, CompensationRequested):
        return record.cause is None  # the detector's carry the edge that closed the cycle
    if isinstance(record, WaitEdgeAdded | WaitEdgeRemoved):
        return record.source != "lock"
    if isinstance(record, DeadlockDetected):
        return False
    agent = getattr(record, "agent_id", "")
    if isinstance(agent, str) and agent.startswith("saga:"):
        return isinstance(record, SagaStep)
    return record is not None


def _adjust(record: Record, policy: Policy) -> Record:
    if policy.ttl_ms is not None and isinstance(record, LockRequested) and not record.agent_id.startswith("saga:"):
        return record.model_copy(update={"ttl_ms": policy.ttl_ms})
    if policy.ttl_ms is not None and type(record).__name__ == "LockRenewRequested":
        return record.model_copy(update={"ttl_ms": policy.ttl_ms})
    return record


def _adjusted(entry: Entry, policy: Policy, codec: Codec) -> Entry:
    """``entry`` under ``policy``; a changed record keeps the bytes its sender signed, so the trust
    gate still knows the sender (a what-if changes the rules, not who sent what)."""
    if entry.record is None:
        return entry
    record = _adjust(entry.record, policy)
    if record is entry.record:
        return entry
    return replace(entry, record=record, value=entry.value_bytes(codec) if entry.headers else None)


def outside_inputs(log: Log, settings: Settings, policy: Policy | None = None) -> list[Entry]:
    """The inputs that came from agents and clocks (not from a processor), in time order."""
    policy = policy or Policy()
    codec = default_codec(settings.max_message_bytes)
    found = [_adjusted(entry, policy, codec) for entry in inputs(log, settings) if from_outside(entry)]
    found.sort(key=lambda e: e.timestamp_ms)
    return found


async def simulate(log: Log, settings: Settings, policy: Policy | None = None,
                   outside: list[Entry] | None = None) -> Log:
    """The log the agents' recorded commands would have produced under ``policy``.

    The processors' own commands (revocations, compensations) are routed between them
    at once, in time order. Every message is appended to its topic partition when it
    is processed (inputs) or sent (outputs), so the result is a log like a real one,
    which audit can replay. Open loop: agents send what they sent in the recording, at
    the times they sent it, whatever the answers (a limit of any replay that cannot
    re-run the agents).
    """
    policy = policy or Policy()
    engine = new_engine(log, settings, simulated=True, victim_policy=policy.victim)
    inbound = set(input_topics(settings.topics))
    # (time, sequence, input, routed): routed inputs are the processors' own commands, passed on unsigned.
    queue = [(entry.timestamp_ms, seq, entry, False)
             for seq, entry in enumerate(outside if outside is not None else outside_inputs(log, settings, policy))]
    seq = len(queue)
    heapq.heapify(queue)
    produced = Log(settings.topics, source=f"what-if of {log.source}", partition_count=settings.partitions)

    def append(topic: str, key: bytes | None, now: int, record: Record | None, raw: bytes | None = None,
               headers: tuple[tuple[str, bytes], ...] = (), value: bytes | None = None,
               recorded: int = -1) -> Entry:
        # A recorded input stays on its partition (one on the wrong partition is refused there again).
        partition = recorded if recorded >= 0 else record.partition if isinstance(record, LockTick) \
            else partition_for(key or b"", settings.partitions)
        entries = produced.partitions.setdefault((topic, partition), [])
        entry = Entry(topic, partition, len(entries), now, key, record, raw, headers, value)
        entries.append(entry)
        return entry

    budget = 100 * len(queue) + 100_000
    with gc_paused():
        while queue:
            budget -= 1
            if budget < 0:
                raise RuntimeError("the simulation did not settle: the processors kept sending each other commands "
                                   f"(last: {type(queue[0][2].record).__name__} at {queue[0][0]})")
            now, _, pending, routed = heapq.heappop(queue)
            entry = append(pending.topic, pending.key, now, pending.record, pending.raw, pending.headers,
                           pending.value, pending.partition)
            for topic, key, record in await engine.decide(entry, trusted=routed):
                if topic == settings.topics.dead_letter:
                    continue
                if topic in inbound:
                    seq += 1
                    heapq.heappush(queue, (now, seq, Entry(topic, -1, -1, now, key, record), True))
                else:
                    append(topic, key, now, record)
    return produced
