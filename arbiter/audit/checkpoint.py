"""Audit checkpoints: resume an audit where the last one ended, so its cost follows the new inputs.

A log kept forever grows forever; an audit that re-reads and re-derives all of it every time costs
more every day while nothing happens. A checkpoint, written at the end of an audit
(``arbiter audit --checkpoint FILE``), holds what the next audit needs to judge only what came after:

- ``through``: per topic partition, the offset after the last message audited, and a digest of that
  message, so the next audit proves it continues the same log (not a reset or a different cluster);
- ``engine``: the processors' re-derived state (the workers' own tables, encoded as their changelogs
  encode them), from which the replay goes on deciding the new inputs;
- ``slice``: the messages of the audited log that can still matter: everything in the last
  ``horizon`` (twice the workers' id window: within it a command can still be decided and a decision
  redelivered), the registry and the workers' announcements, and, however old, what is still live (a
  resource's highest grant and its end, leases not ended and their renewals, its last write, requests
  and intents with no outcome yet and their dead letters, sagas not finished, wait-for edges in place);
- ``decided``: what the replay decided for each input in the slice (so the next audit compares their
  decisions, some of which may come after the checkpoint, without re-deciding them);
- ``findings``: every violation and intrusion found so far (open items are judged again at the end),
  and the figures so far.

The next audit checks the slice followed by the new messages, and once more the slice alone: what the
new messages changed is the difference (a rule broken by a new message; an open item of the old ones
resolved, or now broken). What the slice alone shows was judged already, with its whole context, by
the audit that wrote the checkpoint. So a checkpoint's audit costs its slice plus the new messages, not
the history. The report's ``timeline`` covers the slice and the new messages.

A checkpoint is signed with the admin key (``<home>/keys/admin.key``) and verified against the trust
anchors (the admin public keys), like the registry: a checkpoint is trusted state, and one that does
not verify, or was made for other topics, is refused, never half-used.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from arbiter.edge.settings import Settings
from arbiter.schemas import (
    DeadlockDetected,
    LockCancelled,
    LockDenied,
    LockExpired,
    LockGranted,
    LockQueued,
    LockReleased,
    LockRenewed,
    LockRequested,
    LockRevoked,
    LockWaitTimedOut,
    SagaFinished,
    SagaStep,
    ToolApplied,
    ToolIntent,
    ToolRejected,
    WaitEdgeAdded,
    WaitEdgeRemoved,
    default_codec,
)
from arbiter.schemas.identity import Signer, key_id_of, signed_payload
from arbiter.streams.runtime.common import TABLES

from .log import Entry, Log, from_line, identity, to_line
from .replay import Derived, Engine, dead_letters, from_outside, refused_positions, worker_signed

FORMAT = "arbiter-audit-checkpoint/1"
SIGNED_AS = "arbiter.audit.checkpoint"
"""The ``topic`` a checkpoint's signature is made over (so no message signature can pass for one)."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: unreadable, not signed by a trusted admin key, made for other
    topics, or not continued by this log."""


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text.encode(), validate=True)


def digest(entry: Entry) -> str:
    """A message's fingerprint: its position, time, key, value and headers."""
    return hashlib.sha256(to_line(entry).encode()).hexdigest()


@dataclass
class Checkpoint:
    """What an audit leaves for the next one (see the module's docstring)."""

    topics: dict[str, str]
    partitions: int | None
    through: dict[str, int]
    """``topic[partition]`` -> the offset after the last message audited."""
    last: dict[str, str]
    """``topic[partition]`` -> the digest of that last message."""
    engine: dict[str, dict[str, str]]
    slice_lines: list[str]
    decided: dict[str, list[list[str]]]
    """Input position -> its outputs, each ``[topic, key (base64), record (base64, the codec's bytes)]``."""
    redecide: list[str]
    """The inputs of ``decided`` after the settled ones: not in ``engine``'s state, so decided again (what
    the audit that wrote the checkpoint decided for them is kept to tell the new messages' effect)."""
    findings: list[dict[str, Any]]
    stats: dict[str, int]
    messages: int
    first_ms: int
    horizon_ms: int
    refused_inputs: list[dict[str, Any]] = field(default_factory=list)
    human_actions: list[dict[str, Any]] = field(default_factory=list)
    created_at_ms: int = 0
    signer: str = ""
    signature: str = ""
    _slice: frozenset[str] = field(default=frozenset(), repr=False, compare=False)

    def body(self) -> dict[str, Any]:
        return {"format": FORMAT, "topics": self.topics, "partitions": self.partitions, "through": self.through,
                "last": self.last, "engine": self.engine, "slice": self.slice_lines, "decided": self.decided,
                "redecide": self.redecide,
                "findings": self.findings, "stats": self.stats, "messages": self.messages,
                "first_ms": self.first_ms, "horizon_ms": self.horizon_ms, "refused_inputs": self.refused_inputs,
                "human_actions": self.human_actions, "created_at_ms": self.created_at_ms}

    def _payload(self) -> bytes:
        canonical = json.dumps(self.body(), sort_keys=True, separators=(",", ":")).encode()
        return signed_payload(SIGNED_AS, None, hashlib.sha256(canonical).digest(), "admin", self.created_at_ms)

    def sign(self, admin: Signer) -> None:
        self.signer = admin.key_id
        self.signature = _b64(admin.private_key.sign(self._payload()))

    def verify(self, anchors: Iterable[bytes]) -> None:
        """Raise ``CheckpointError`` unless one of the trusted admin keys signed exactly this."""
        by_id = {key_id_of(raw): raw for raw in anchors}
        raw = by_id.get(self.signer)
        if raw is None:
            raise CheckpointError(f"the checkpoint is signed by key {self.signer[:16] or '(none)'}, which is not one "
                                  "of the admin public keys this auditor trusts")
        try:
            Ed25519PublicKey.from_public_bytes(raw).verify(_unb64(self.signature), self._payload())
        except (InvalidSignature, ValueError) as exc:
            raise CheckpointError("the checkpoint's signature does not verify: it was changed after it was "
                                  "written") from exc

    @property
    def positions(self) -> frozenset[str]:
        """The inputs the checkpoint's engine decided already (the slice's settled ones)."""
        return frozenset(self.decided) - frozenset(self.redecide)

    def slice_positions(self) -> frozenset[str]:
        """Every position in the slice (known once ``continue_with`` has read it)."""
        return self._slice

    # -- files ----------------------------------------------------------------------------

    def write(self, path: Path) -> None:
        """Write it whole or not at all (a crash mid-write leaves the old one)."""
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**self.body(), "signer": self.signer, "signature": self.signature},
                                  sort_keys=True) + "\n", encoding="utf-8")
        os.replace(tmp, path)

    @classmethod
    def read(cls, path: Path) -> Checkpoint:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"cannot read the checkpoint {path}: {exc}") from exc
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise CheckpointError(f"{path} is not an audit checkpoint (format {FORMAT!r})")
        try:
            return cls(topics=data["topics"], partitions=data["partitions"], through=data["through"],
                       last=data["last"], engine=data["engine"], slice_lines=data["slice"], decided=data["decided"],
                       redecide=data["redecide"],
                       findings=data["findings"], stats=data["stats"], messages=data["messages"],
                       first_ms=data["first_ms"], horizon_ms=data["horizon_ms"],
                       refused_inputs=data.get("refused_inputs", []), human_actions=data.get("human_actions", []),
                       created_at_ms=data["created_at_ms"], signer=data.get("signer", ""),
                       signature=data.get("signature", ""))
        except (KeyError, TypeError) as exc:
            raise CheckpointError(f"{path}: an incomplete checkpoint ({exc})") from exc

    # -- using it -------------------------------------------------------------------------

    def check_settings(self, settings: Settings) -> None:
        if self.topics != settings.topics.model_dump():
            raise CheckpointError("the checkpoint was made for other topics (ARBITER_TOPICS__*) than these")
        if self.partitions is not None and self.partitions != settings.partitions:
            raise CheckpointError(f"the checkpoint was made for {self.partitions} partitions per topic, not "
                                  f"{settings.partitions} (ARBITER_PARTITIONS)")

    def since(self, registry: str) -> dict[tuple[str, int], int]:
        """Where to read each partition from: its last audited message (to prove continuity), or the start.
        The ``registry`` topic is read whole (the slice leaves it out: it is compacted, and every
        identity in it decides how an input verifies)."""
        out = {}
        for where, offset in self.through.items():
            topic, partition = _split(where)
            if topic != registry:
                out[topic, partition] = max(0, offset - 1)
        return out

    def slice_entries(self) -> list[Entry]:
        """The slice's messages, parsed once."""
        cached: list[Entry] | None = self.__dict__.get("_entries")
        if cached is None:
            cached = self.__dict__["_entries"] = [from_line(line) for line in self.slice_lines]
        return cached

    def continue_with(self, fresh: Log, settings: Settings) -> tuple[Log, frozenset[str]]:
        """The log to audit: the slice, then ``fresh``'s messages after ``through`` (``fresh`` read from
        ``since()``, or a whole archive); and the slice's positions. ``CheckpointError`` when ``fresh``
        does not continue the audited log."""
        registry = settings.topics.registry
        log = Log(fresh.topics, source=fresh.source, partition_count=fresh.partition_count,
                  archived_rules=fresh.archived_rules)
        kept: set[str] = set()
        for entry in self.slice_entries():
            if entry.topic == registry:
                continue  # the registry is read again whole (compacted: its old records may be gone)
            log.add(entry)
            kept.add(entry.where)
        for (topic, partition), entries in fresh.partitions.items():
            where = f"{topic}[{partition}]"
            through = self.through.get(where, 0)
            if topic != registry and through > 0:
                previous = next((e for e in entries if e.offset == through - 1), None)
                if previous is None:
                    raise CheckpointError(f"the log does not hold {where}@{through - 1}, the checkpoint's last "
                                          "message there (deleted, or another log)")
                if digest(previous) != self.last.get(where):
                    raise CheckpointError(f"{where}@{through - 1} is not the message the checkpoint audited: this "
                                          "is not the log it was made from (reset, or another cluster)")
            for entry in entries:
                if (topic == registry or entry.offset >= through) and entry.where not in kept:
                    log.add(entry)
        for where, through in self.through.items():
            topic, partition = _split(where)
            if topic != registry and through > 0 and (topic, partition) not in fresh.partitions:
                raise CheckpointError(f"the log has no messages in {where}, where the checkpoint audited {through}")
        log.sort_partitions()
        self._slice = frozenset(kept)
        return log, self._slice

    def slice_log(self, like: Log) -> Log:
        """The slice alone (with the log's registry): what the audit that wrote the checkpoint judged already."""
        registry = like.topics.registry
        log = Log(like.topics, source=like.source, partition_count=like.partition_count,
                  archived_rules=like.archived_rules)
        for entry in self.slice_entries():
            if entry.topic != registry:
                log.add(entry)
        for (topic, _partition), entries in like.partitions.items():
            if topic == registry:
                for entry in entries:
                    log.add(entry)
        log.sort_partitions()
        return log

    def restore(self, engine: Engine) -> Engine:
        """``engine`` with the re-derived state of the checkpoint."""
        stores: dict[str, dict[bytes, Any]] = {"books": engine.books, "contents": engine.contents,
                                                "graphs": engine.graph_rows, "sagas": engine.sagas}
        for name, rows in self.engine.items():
            spec, store = TABLES[name], stores[name]
            for key, value in rows.items():
                store[_unb64(key)] = spec.loads(_unb64(value))
        return engine

    def decided_entries(self, log: Log, settings: Settings, settled_only: bool = False
                        ) -> list[tuple[Entry, list[Derived]]]:
        """The slice's inputs with what the replay decided for each, in the log's order (``settled_only``:
        without the ones to decide again)."""
        codec = default_codec(settings.max_message_bytes)
        out: list[tuple[Entry, list[Derived]]] = []
        again = frozenset(self.redecide)
        decoded = self.__dict__.setdefault("_decoded", {})  # each decision decoded once, however often asked
        for _tp, entries in sorted(log.partitions.items()):
            for entry in entries:
                outputs = self.decided.get(entry.where)
                if outputs is not None and not (settled_only and entry.where in again):
                    if entry.where not in decoded:
                        decoded[entry.where] = [(t, _unb64(k), codec.decode(_unb64(v))) for t, k, v in outputs]
                    out.append((entry, decoded[entry.where]))
        return out


def _split(where: str) -> tuple[str, int]:
    topic, _, rest = where.rpartition("[")
    return topic, int(rest.rstrip("]"))


# -- making one -----------------------------------------------------------------------------------


def horizon_of(rules_id_window_ms: int) -> int:
    """How far back the slice keeps everything: twice the workers' id window."""
    return 2 * rules_id_window_ms


def snapshot(engine: Engine) -> dict[str, dict[str, str]]:
    """The engine's state, as the workers' changelogs encode it."""
    tables: dict[str, dict[bytes, Any]] = {"books": engine.books, "contents": engine.contents,
                                           "graphs": engine.graph_rows, "sagas": engine.sagas}
    return {name: {_b64(key): _b64(TABLES[name].dumps(value)) for key, value in store.items()}
            for name, store in tables.items()}


def make(log: Log, settings: Settings, state: dict[str, dict[str, str]], settled: dict[tuple[str, int], int],
         decided: list[tuple[Entry, list[Derived]]], findings: list[dict[str, Any]], stats: dict[str, int],
         messages: int, first_ms: int, horizon_ms: int, refused_inputs: list[dict[str, Any]],
         human_actions: list[dict[str, Any]], admin: Signer, previous: Checkpoint | None = None) -> Checkpoint:
    """A signed checkpoint of an audit of ``log``: ``state`` is the engine's after the ``settled`` inputs,
    whose decisions ``decided`` holds; the inputs after them are kept in the slice to be decided again.
    ``previous``: the checkpoint the audit resumed from (where ``log`` holds nothing of a partition, it
    audited that partition as far as ``previous`` says)."""
    codec = default_codec(settings.max_message_bytes)
    keep = live_slice(log, settings, horizon_ms)
    unsettled = {e.where for (topic, partition), entries in log.partitions.items() if (topic, partition) in settled
                 for e in entries if e.offset > settled[topic, partition]}
    keep |= unsettled | pending_inputs(log, settings, decided)
    while more := consequences(log, settings, decided, keep) - keep:  # (what they sent is an input too)
        keep |= more
    through = dict(previous.through) if previous is not None else {}
    last = dict(previous.last) if previous is not None else {}
    for (topic, partition), entries in log.partitions.items():
        if entries:
            tail = max(entries, key=lambda e: e.offset)
            if tail.offset + 1 >= through.get(f"{topic}[{partition}]", 0):
                through[f"{topic}[{partition}]"] = tail.offset + 1
                last[f"{topic}[{partition}]"] = digest(tail)
    carried = {entry.where: [[topic, _b64(key), _b64(codec.encode(record))] for topic, key, record in outputs]
               for entry, outputs in decided if entry.where in keep}
    checkpoint = Checkpoint(
        topics=settings.topics.model_dump(), partitions=log.partition_count, through=through, last=last,
        engine=state, slice_lines=[to_line(e) for e in log.entries() if e.where in keep], decided=carried,
        redecide=sorted(unsettled & carried.keys()),
        findings=[f for f in findings if f["severity"] != "open"], stats=stats, messages=messages,
        first_ms=first_ms, horizon_ms=horizon_ms, refused_inputs=refused_inputs, human_actions=human_actions,
        created_at_ms=int(time.time() * 1000))
    checkpoint.sign(admin)
    return checkpoint


def pending_inputs(log: Log, settings: Settings, decided: list[tuple[Entry, list[Derived]]]) -> set[str]:
    """Inputs some of whose decisions (or the commands they send) are not in the log yet: a later audit
    compares those with what the replay decided for them. Only what a worker signed counts as written:
    a forged decision naming an input (or a forged copy of a command it sends) would leave it out of the
    slice, and its real decisions, once written, would have no input to be compared with."""
    t = settings.topics
    signed = worker_signed(log, settings)
    caused: dict[str, int] = {}
    for topic in (t.resource_events, t.saga_events, t.wait_edges, t.dead_letter):
        for entry in log.of(topic):
            if not signed(entry):
                continue
            r = entry.record
            cause = getattr(r, "source", None) if topic == t.dead_letter else getattr(r, "cause", None)
            if cause is not None and hasattr(cause, "offset"):
                where = f"{cause.topic}[{cause.partition}]@{cause.offset}"
                caused[where] = caused.get(where, 0) + 1
    commands = (t.resource_commands, t.saga_commands, t.wait_edges)
    logged = {identity(e.record) for topic in commands for e in log.of(topic)
              if e.record is not None and not isinstance(e.record, DeadlockDetected) and not from_outside(e)
              and signed(e)}
    decisions = (t.resource_events, t.saga_events, t.dead_letter)
    pending = set()
    for entry, outputs in decided:
        wanted = sum(1 for topic, _key, record in outputs
                     if topic in decisions or isinstance(record, DeadlockDetected))
        sends = [record for topic, _key, record in outputs
                 if topic in commands and not isinstance(record, DeadlockDetected)]
        if caused.get(entry.where, 0) < wanted or any(identity(r) not in logged for r in sends):
            pending.add(entry.where)
    return pending


def consequences(log: Log, settings: Settings, decided: list[tuple[Entry, list[Derived]]], kept: set[str]) -> set[str]:
    """What the kept inputs caused that the log records: their decisions, dead letters and the commands they
    sent (a later audit compares them with what the replay decided for the inputs)."""
    t = settings.topics
    out = set()
    for topic in (t.resource_events, t.saga_events, t.wait_edges, t.dead_letter):
        for entry in log.of(topic):
            r = entry.record
            cause = getattr(r, "source", None) if topic == t.dead_letter else getattr(r, "cause", None)
            if cause is not None and hasattr(cause, "offset") and \
                    f"{cause.topic}[{cause.partition}]@{cause.offset}" in kept:
                out.add(entry.where)
    commands = (t.resource_commands, t.saga_commands, t.wait_edges)
    sent = {identity(record) for entry, outputs in decided if entry.where in kept
            for topic, _key, record in outputs if topic in commands and not isinstance(record, DeadlockDetected)}
    if sent:
        for topic in commands:
            out.update(e.where for e in log.of(topic) if e.record is not None and identity(e.record) in sent)
    return out


_FINAL = (LockGranted, LockDenied, LockCancelled, LockWaitTimedOut)


def live_slice(log: Log, settings: Settings, horizon_ms: int) -> set[str]:
    """The positions of ``log`` a later audit may still need (see the module's docstring).

    What ends or supersedes something (a release, an outcome, a higher grant, a renewal, a saga's end,
    an edge's removal) counts only when a worker wrote it or the workers took it in: a forged one
    would leave out of the slice what the next audit judges honest records by (a resource's last
    write, say, without which the next honest write would look as if made on a stale base)."""
    t = settings.topics
    end = log.span_ms()[1]
    cut = end - horizon_ms
    keep: set[str] = set()
    for (topic, _partition), entries in log.partitions.items():
        if topic in (t.registry, t.workers):
            keep.update(e.where for e in entries)
        else:
            keep.update(e.where for e in entries if e.timestamp_ms >= cut)
    signed = worker_signed(log, settings)
    refused = refused_positions(log, settings)
    keep |= _live_resources(log, settings, signed)
    # Sagas not finished: their first step.
    finished = {e.record.saga_id for e in log.of(t.saga_events) if isinstance(e.record, SagaFinished) and signed(e)}
    first_step: dict[str, Entry] = {}
    for entry in log.of(t.saga_commands):
        if isinstance(entry.record, SagaStep) and entry.record.saga_id not in finished:
            first_step.setdefault(entry.record.saga_id, entry)
    keep.update(e.where for e in first_step.values())
    keep |= _live_edges(log, settings, lambda e: signed(e) if isinstance(e.record, DeadlockDetected)
                        else (e.topic, e.partition, e.offset) not in refused)
    # Dead letters of what is kept.
    for entry, letter in dead_letters(log, settings):
        source = f"{letter.source.topic}[{letter.source.partition}]@{letter.source.offset}"
        if source in keep:
            keep.add(entry.where)
    return keep


def _live_resources(log: Log, settings: Settings, signed: Callable[[Entry], bool]) -> set[str]:
    """Resource events: each resource's highest grant (and its end), its unended leases (and their last
    renewal), its last write, the requests still waiting; and the commands with no outcome yet. Only
    the events a worker ``signed``."""
    t = settings.topics
    high: dict[str, tuple[int, Entry]] = {}
    unended: dict[tuple[str, int], list[Entry]] = {}
    ended_high: dict[tuple[str, int], Entry] = {}
    last_write: dict[str, Entry] = {}
    finals: set[tuple[str, str, str]] = set()
    queued: dict[tuple[str, str, str], Entry] = {}
    outcomes: set[tuple[str, str]] = set()
    for entry in log.of(t.resource_events):
        e = entry.record
        if not signed(entry):
            continue
        if isinstance(e, LockGranted):
            top = high.get(e.resource)
            if top is None or e.token >= top[0]:
                high[e.resource] = (e.token, entry)
            unended.setdefault((e.resource, e.token), []).insert(0, entry)
        if isinstance(e, _FINAL):
            finals.add((e.resource, e.request_id, e.agent_id))
        if isinstance(e, LockQueued):
            queued[e.resource, e.request_id, e.agent_id] = entry
        elif isinstance(e, LockRenewed):
            leases = unended.get((e.resource, e.token))
            if leases is not None:
                del leases[1:]
                leases.append(entry)
        elif isinstance(e, LockReleased | LockExpired | LockRevoked):
            if (e.resource, e.token) in unended:
                unended.pop((e.resource, e.token))
                ended_high[e.resource, e.token] = entry
        elif isinstance(e, ToolApplied):
            last_write[e.resource] = entry
            outcomes.add((e.resource, e.intent_id))
        elif isinstance(e, ToolRejected):
            outcomes.add((e.resource, e.intent_id))
    keep: set[str] = set()
    for resource, (token, grant) in high.items():
        keep.add(grant.where)
        end_of = ended_high.get((resource, token))
        if end_of is not None:
            keep.add(end_of.where)
    for leases in unended.values():
        keep.update(e.where for e in leases)
    keep.update(e.where for e in last_write.values())
    keep.update(e.where for ident, e in queued.items() if ident not in finals)
    for entry in log.of(t.resource_commands):
        c = entry.record
        if (isinstance(c, LockRequested) and (c.resource, c.request_id, c.agent_id) not in finals) or (
                isinstance(c, ToolIntent) and (c.resource, c.intent_id) not in outcomes):
            keep.add(entry.where)
    return keep


def _live_edges(log: Log, settings: Settings, taken: Callable[[Entry], bool]) -> set[str]:
    """Wait-for edges still in place, by the edges and detections the workers took in (``taken``)."""
    live: dict[str, Entry] = {}
    for entry in log.of(settings.topics.wait_edges):
        r = entry.record
        if not taken(entry):
            continue
        if isinstance(r, WaitEdgeAdded):
            live.setdefault(r.edge_id, entry)
        elif isinstance(r, WaitEdgeRemoved):
            live.pop(r.edge_id, None)
        elif isinstance(r, DeadlockDetected):
            for edge_id, added in list(live.items()):
                if isinstance(added.record, WaitEdgeAdded) and added.record.waiter == r.victim:
                    del live[edge_id]
    return {e.where for e in live.values()}
