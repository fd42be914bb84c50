"""The one path every input takes, from the record as it sits in the log to its outcome.

Theory of operation
-------------------
The batched runtime, the faust runtime and the audit's replay each hand every input
record, as Kafka holds it (topic, partition, offset, key, value bytes, headers, append
time), to ``Pipeline.process``, and get back an ``Outcome``: what to send, and whether
the input is dead-lettered and why. Nothing about an input is decided anywhere else, so
"the audit decides exactly as the worker" rests on one function, not on copies.

The stages, all inside one guard:

1. **decode** the value (``arbiter.schemas.codec``); what does not decode is dead-lettered with
   the codec's reason;
2. **trust**: the signature headers are parsed and verified against the registry, and
   the rules of who may send what are applied (``arbiter.streams.shells.trust``); refused:
   ``unauthenticated`` or ``forbidden``;
3. **route**: the record must sit on the partition its key hashes to
   (``arbiter.schemas.partitioning``, Kafka's murmur2; a ``LockTick`` names its own partition).
   A record anywhere else would be decided by another partition's owner, in another
   order, against another copy of the state: a split lock. It is refused ``misrouted``
   (``key_mismatch`` without a key);
4. **decide**: the topic's shell, through an ``InputScope`` (``arbiter.streams.shells.tables``) whose
   table writes wait and whose in-place changes can be undone;
5. **encode** every output (a value the schema cannot hold fails here, not in a batch).

A refused input (2, 3) changes nothing: the agent it names is told, where the record
type has an answer (``refusal_answers``), and it is dead-lettered. An exception in any
stage (a bug, or input no stage foresaw) quarantines the input: its scope is discarded,
its outputs dropped, and it is dead-lettered ``processor_failed`` naming the stage, so
it leaves nothing half-applied and never stops a worker or an audit.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from arbiter.edge.settings import Topics
from arbiter.schemas import Codec, ContractError, DeadLetter, DeadlockDetected, LockTick, Record, ToolIntent
from arbiter.schemas.identity import Refused, Verified
from arbiter.schemas.partitioning import partition_for
from arbiter.schemas.reasons import Reason
from arbiter.streams.shells import build_shells
from arbiter.streams.shells.deadletter import dead_letter
from arbiter.streams.shells.deadlock import RowGraphStore
from arbiter.streams.shells.inputs import RawInput
from arbiter.streams.shells.resource import ToolRunner
from arbiter.streams.shells.routes import Routes
from arbiter.streams.shells.rules import Rules
from arbiter.streams.shells.tables import InputScope
from arbiter.streams.shells.trust import refusal_answers

log = logging.getLogger("arbiter.worker")

__all__ = ["TICK_KEY", "Outcome", "Output", "Pipeline", "RawInput", "Trust", "input_topics", "processor_of",
           "route_problem"]

TICK_KEY = b"__tick__"
"""The key of the workers' clock ticks (each names the partition it is for)."""

Output = tuple[str, bytes, Record, bytes]
"""(topic, key, record, its encoded value): one thing to send."""


@dataclass(slots=True)
class Outcome:
    """What one input leads to."""

    outputs: list[Output]
    """To send, in order (answers and events; a refusal's answer to the agent it names; the dead
    letter, on the dead-letter topic, last)."""
    letter: DeadLetter | None = None
    """Why the input is dead-lettered (None: it was decided)."""
    record: Record | None = None
    """The input, decoded (None: it did not decode)."""
    stage: str = "decided"
    """``decided``, or the stage that refused or failed it: decode, route, trust, decide, encode."""


class Trust(Protocol):
    """The trust gate as one runtime runs it (live registry, or the registry as it stood at the input)."""

    async def admit(self, raw: RawInput, record: Record) -> Verified | Refused | None:
        """The verified sender (None: verification is off), or why the input is refused."""


def route_problem(raw: RawInput, record: Record, partitions: int) -> Refused | None:
    """Why ``record`` may not be decided on the partition it sits on (None: it may)."""
    if isinstance(record, LockTick):
        if raw.key != TICK_KEY or record.partition != raw.partition:
            return Refused(Reason.MISROUTED, f"a clock tick for partition {record.partition} (key {raw.key!r}) sits "
                                             f"on partition {raw.partition}: a tick is keyed {TICK_KEY!r} and written "
                                             "to the partition it names")
        return None
    if raw.key is None:
        return Refused(Reason.KEY_MISMATCH, "a record without a key belongs to no partition: key it by the id it "
                                            "names (the resource, the saga, the wait graph)")
    expected = partition_for(raw.key, partitions)
    if expected != raw.partition:
        return Refused(Reason.MISROUTED, f"key {raw.key[:80]!r} hashes to partition {expected} of {partitions} "
                                         "(Kafka's default murmur2 partitioner), and this record sits on partition "
                                         f"{raw.partition}: it would be decided apart from every other command on "
                                         "its key")
    return None


def processor_of(topics: Topics) -> dict[str, str]:
    """Each input topic's processor name (dead letters name it)."""
    return {topics.resource_commands: "resource", topics.wait_edges: "deadlock", topics.saga_commands: "saga"}


def input_topics(topics: Topics) -> tuple[str, str, str]:
    """The topics the processors read: resource commands, wait edges, saga commands."""
    return topics.resource_commands, topics.wait_edges, topics.saga_commands


@dataclass
class Pipeline:
    """The three processors over the given tables, and the path from a raw input to its outcome.

    ``tables`` holds the processors' state by store name (``books``, ``contents``, ``graphs``,
    ``sagas``): changelogged tables in a worker, dicts in an audit. One pipeline decides one
    input at a time (a runtime that decides topics concurrently builds one per topic)."""

    rules: Rules
    topics: Topics
    partitions: int
    tables: Mapping[str, MutableMapping[bytes, Any]]
    tools: ToolRunner
    codec: Codec
    trust: Trust | None = None
    """None: every input passes (verification off, or a log decided without it)."""
    worker_id: str = "replay"
    generation: Callable[[], int | None] = lambda: 0
    after_tool: Callable[[ToolIntent], None] = lambda _intent: None
    on_detection: Callable[[DeadlockDetected], None] = lambda _detection: None
    clock: Callable[[], int] = lambda: 0
    """Wall time for dead letters (``at_ms``); decisions use the input's append time."""
    quiet: bool = False
    """Do not log quarantined inputs (an audit reports them itself)."""
    _held: list[tuple[str, bytes, Record]] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        self.scope = InputScope(self.tables)
        views = self.scope.views
        self.graph_store = RowGraphStore(views["graphs"], self.generation)
        self.routes = Routes.of(self.topics, self.rules.graph_key)
        self.processors = processor_of(self.topics)
        self.shells = build_shells(
            self.rules, self.topics, self.partitions, books=views["books"], contents=views["contents"],
            graphs=self.graph_store, sagas=views["sagas"], tools=self.tools, send=self._hold, scope=self.scope,
            worker_id=self.worker_id, generation=self.generation, after_tool=self.after_tool,
            on_detection=self.on_detection)

    async def _hold(self, topic: str, key: bytes, record: Record) -> None:
        self._held.append((topic, key, record))

    async def process(self, raw: RawInput, *, trusted: bool = False) -> Outcome:
        """Decode, admit, route, decide and encode one input. ``trusted``: skip the trust gate (a
        what-if replay routes the processors' own commands to each other unsigned)."""
        stage = "decode"
        record = raw.record
        try:
            if record is None:
                try:
                    record = self.codec.decode(raw.value or b"")
                except ContractError as error:
                    return self._rejected(raw, [], error, None, stage)
            shell = self.shells.for_topic(raw.topic)
            if shell is None:
                return self._rejected(raw, [], ContractError(Reason.UNSUPPORTED_COMMAND,
                                                             f"no processor reads {raw.topic}"), record, stage)
            stage = "trust"
            sender: Verified | None = None
            if self.trust is not None and not trusted:
                admitted = await self.trust.admit(raw, record)
                if isinstance(admitted, Refused):
                    return self._refused(raw, record, admitted, stage)
                sender = admitted
            stage = "route"
            misrouted = route_problem(raw, record, self.partitions)
            if misrouted is not None:
                return self._refused(raw, record, misrouted, stage)
            stage = "decide"
            self._held.clear()
            problem = await shell.handle(raw.key, record, raw.timestamp_ms, raw.cause, sender=sender)
            stage = "encode"
            outputs = self._encoded(self._held)
            self._held.clear()
            self.scope.commit()
        except Exception:
            # A bug, or input no stage foresaw: quarantine it. Nothing it caused is kept (outputs are
            # held here, table writes wait in the scope's views, in-place changes are undone), and the
            # offset moves on, so it is never retried into a crash loop.
            self._held.clear()
            self.scope.discard()
            if not self.quiet:
                log.exception("%s failed on %s; quarantined", stage, raw.where)
            detail = f"{stage} failed: " + traceback.format_exc(limit=8)[-1800:]
            return self._rejected(raw, [], ContractError(Reason.PROCESSOR_FAILED, detail), record, stage)
        if problem is not None:
            return self._rejected(raw, outputs, problem, record, "decide")
        return Outcome(outputs, None, record)

    def _refused(self, raw: RawInput, record: Record, refused: Refused, stage: str) -> Outcome:
        answers = self._encoded(refusal_answers(record, refused, self.routes, raw.timestamp_ms, raw.cause))
        return self._rejected(raw, answers, ContractError(refused.reason, refused.detail), record, stage)

    def _encoded(self, outputs: list[tuple[str, bytes, Record]]) -> list[Output]:
        encoded: dict[int, bytes] = {}  # a decision goes to several topics: encode it once
        out: list[Output] = []
        for topic, key, record in outputs:
            value = encoded.get(id(record))
            if value is None:
                value = encoded[id(record)] = self.codec.encode(record)
            out.append((topic, key, record, value))
        return out

    def _rejected(self, raw: RawInput, outputs: list[Output], error: ContractError, record: Record | None,
                  stage: str) -> Outcome:
        """``outputs`` and the dead letter of ``raw`` (a letter too large to encode keeps no copy of the input)."""
        if not self.quiet:
            log.warning("dead-lettered %s: %s", raw.where, error)
        processor = self.processors.get(raw.topic, "none")
        letter = dead_letter(error, processor=processor, source=raw.cause, key=raw.key, value=raw.value or b"",
                             now_ms=self.clock(), max_message_bytes=self.codec.max_message_bytes)
        try:
            value = self.codec.encode(letter)
        except ContractError:
            letter = dead_letter(ContractError(error.reason, error.detail[:200]), processor=processor,
                                 source=raw.cause, key=None, value=b"", now_ms=self.clock(),
                                 max_message_bytes=self.codec.max_message_bytes)
            value = self.codec.encode(letter)
        outputs.append((self.topics.dead_letter, raw.key or b"", letter, value))
        return Outcome(outputs, letter, record, stage)
