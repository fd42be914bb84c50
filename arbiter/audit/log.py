"""The log as audit sees it: every message of every Arbiter topic, with its position and time.

Two sources give the same ``Log``: the live topics (``read_log``: read-only, no
consumer group, nothing committed) and a portable archive (``load_archive``), one
JSON object per line, decoded, so that a reviewer can read and diff it. Archives are
how golden histories are kept and how tests tamper with a copy of a log.

Each message keeps its headers (the signature: ``arbiter.schemas.identity``), and the audit
checks a signature over the message's exact value bytes. Those are the record encoded
again (``Entry.value_bytes``), which is what the writer sent whenever it used this
Arbiter's schemas; a message whose bytes differ (an older schema wrote it) keeps its
own (``Entry.value``), in memory and in the archive. Archives written before headers
existed read back with none.
"""

from __future__ import annotations

import base64
import json
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import Any

from pydantic_core import PydanticSerializationError

from arbiter.edge.kafkaio import TopicPartition
from arbiter.edge.settings import Settings, Topics
from arbiter.edge.tail import Start, Tail
from arbiter.schemas import MODELS, Cause, ContractError, Record, WorkerStarted, default_codec
from arbiter.schemas.codec import Codec
from arbiter.schemas.jsonwire import current_names

ARCHIVE_FORMAT = "arbiter-log/1"
_BY_NAME: dict[str, type[Record]] = {cls.__name__: cls for cls in MODELS}


@dataclass(frozen=True, slots=True)
class Entry:
    """One message: where it is, when the broker appended it, and what it says."""

    topic: str
    partition: int
    offset: int
    timestamp_ms: int
    key: bytes | None
    record: Record | None
    """None when the bytes do not decode (the processors dead-letter those)."""
    raw: bytes | None = None
    """The original bytes of a message that does not decode."""
    headers: tuple[tuple[str, bytes], ...] = ()
    """The record headers, in order (the signature's ``arbiter-kid``/``-at``/``-sig``)."""
    value: bytes | None = None
    """The exact value bytes of a decoded message, kept only when encoding ``record`` again
    does not give them back (see the module's docstring)."""

    def value_bytes(self, codec: Codec) -> bytes:
        """The message's value bytes as the broker holds them (what a signature covers)."""
        if self.value is not None:
            return self.value
        if self.record is None:
            return self.raw or b""
        return codec.encode(self.record)

    @property
    def cause(self) -> Cause:
        """The ``Cause`` a decision made from this message carries."""
        return Cause(topic=self.topic, partition=self.partition, offset=self.offset)

    @property
    def where(self) -> str:
        """``topic[partition]@offset``: how reports point at a message."""
        return f"{self.topic}[{self.partition}]@{self.offset}"


@dataclass(repr=False)
class Log:
    """Every message, per topic partition in offset order."""

    topics: Topics
    partitions: dict[tuple[str, int], list[Entry]] = field(default_factory=dict)
    source: str = ""
    partition_count: int | None = None
    """Partitions per topic (the processors' partitioner needs it to replay ticks)."""
    archived_rules: list[str] = field(default_factory=list)
    """Rules an archive's header names (``rules_json`` of the workers that wrote the log)."""
    _unordered: set[tuple[str, int]] = field(default_factory=set, repr=False, compare=False)
    """Partitions ``add`` was given out of offset order (until ``sort_partitions``)."""

    def sort_partitions(self) -> None:
        """Put every partition in offset order."""
        for entries in self.partitions.values():
            entries.sort(key=_offset_of)
        self._unordered.clear()

    def announced_rules(self, signed: Callable[[Entry], bool] | None = None) -> list[str]:
        """Every distinct set of rules the workers announced (``WorkerStarted``), first seen first.

        With ``signed`` (whether a worker signed a message: ``replay.announcements``), only the
        announcements it accepts, and not an archive header's (which nobody signs): rules decide how
        every other record is judged, so rules anyone could have written must decide nothing."""
        found = dict.fromkeys(self.archived_rules if signed is None else ())
        for entry in self.of(self.topics.workers):
            if isinstance(entry.record, WorkerStarted) and (signed is None or signed(entry)):
                found.setdefault(entry.record.rules_json)
        return list(found)

    def __repr__(self) -> str:
        # Short on purpose: asyncio.run (3.11) reprs the result of its main task when it
        # restores the SIGINT handler, and the full repr of a large log takes seconds.
        return f"<Log {self.source or '(unnamed)'}: {len(self):,} messages in {len(self.partitions)} partitions>"

    def add(self, entry: Entry) -> None:
        """Append one message to its partition."""
        entries = self.partitions.setdefault((entry.topic, entry.partition), [])
        if entries and entries[-1].offset >= entry.offset:
            self._unordered.add((entry.topic, entry.partition))
        entries.append(entry)

    def of(self, topic: str) -> Iterator[Entry]:
        """Every message of ``topic``, partition by partition, each in offset order."""
        return chain.from_iterable(entries for (name, _partition), entries in sorted(self.partitions.items())
                                   if name == topic)

    def __len__(self) -> int:
        return sum(len(entries) for entries in self.partitions.values())

    def entries(self) -> Iterator[Entry]:
        """Every message, partition by partition."""
        return chain.from_iterable(entries for _tp, entries in sorted(self.partitions.items()))

    def span_ms(self) -> tuple[int, int]:
        """The first and last append time in the log (0, 0 when empty)."""
        times = [e.timestamp_ms for e in self.entries()]
        return (min(times), max(times)) if times else (0, 0)

    def find(self, topic: str, partition: int, offset: int) -> Entry | None:
        """The message at a position, if the log has it.

        Offsets are usually dense (a message's index is its offset less the first
        one's); where they are not (compacted topics, transaction markers, edited
        archives), a binary search on the offset-ordered partition finds it.
        """
        entries = self.partitions.get((topic, partition))
        if not entries:
            return None
        index = offset - entries[0].offset
        if 0 <= index < len(entries) and entries[index].offset == offset:
            return entries[index]
        if (topic, partition) in self._unordered:
            return next((e for e in entries if e.offset == offset), None)  # a partition not in offset order
        index = bisect_left(entries, offset, key=_offset_of)
        if index < len(entries) and entries[index].offset == offset:
            return entries[index]
        return None


def _offset_of(entry: Entry) -> int:
    return entry.offset


def identity(record: Record) -> tuple[str, str]:
    """A hashable identity of a record's whole content (records with lists are unhashable):
    redelivered copies of one decision share it."""
    name = type(record).__name__
    try:
        # ``model_dump_json()`` with its defaults, without its Python-level argument handling.
        return name, record.__pydantic_serializer__.to_json(record).decode()
    except PydanticSerializationError:  # bytes that are not UTF-8 (a dead letter's original message)
        return name, json.dumps(record.model_dump(), sort_keys=True, default=_bytes_out)


Progress = Callable[[int, int], None]
"""progress(messages read so far, messages in total)."""


async def read_log(settings: Settings, progress: Progress | None = None,
                   only: Iterable[tuple[str, int]] | None = None,
                   since: Mapping[tuple[str, int], int] | None = None) -> Log:
    """Every message on Arbiter's topics (or ``only`` those topic partitions), from the beginning
    (or, for a partition ``since`` names, from that offset) to their current end. Read-only: no
    consumer group, nothing committed."""
    codec = default_codec(settings.max_message_bytes)
    log = Log(settings.topics, source=f"kafka://{settings.bootstrap}", partition_count=settings.partitions)
    where = [TopicPartition(topic, partition) for topic, partition in only] if only is not None \
        else settings.topics.all()
    if not where:
        return log
    start: Start = {TopicPartition(*tp): offset for tp, offset in since.items()} if since else "beginning"
    async with Tail(settings, where, start=start, decode=False,
                    max_partition_fetch_bytes=4 * settings.max_message_bytes) as tail:
        if not tail.tps:
            return log
        starts = tail.begun
        ends = await tail.ends()
        total = sum(ends.values()) - sum(min(starts[tp], ends[tp]) for tp in ends)
        for message, _record in await tail.read_to_end(ends, progress=(lambda done: progress(done, total))
                                                       if progress else None):
            log.add(_entry(codec, message.topic, message.partition, message.offset, message.timestamp,
                           message.key, message.value, message.headers))
    return log


def _entry(codec: Codec, topic: str, partition: int, offset: int, timestamp: int, key: bytes | None,
           value: bytes | None, headers: Iterable[tuple[str, bytes | None]] | None = None) -> Entry:
    kept = tuple((str(name), bytes(data or b"")) for name, data in headers or ())
    data = bytes(value or b"")
    try:
        record: Record | None = codec.decode(data)
    except ContractError:
        return Entry(topic, partition, offset, timestamp, key, None, data, kept)
    assert record is not None
    return Entry(topic, partition, offset, timestamp, key, record, None, kept, _exact(codec, record, data))


def _exact(codec: Codec, record: Record, value: bytes) -> bytes | None:
    """``value`` when encoding ``record`` again does not give it back; else None (nothing to keep)."""
    try:
        return None if codec.encode(record) == value else value
    except ContractError:
        return value


# -- archives ------------------------------------------------------------------------


def to_line(entry: Entry) -> str:
    """One archive line (stable key order, so archives diff well)."""
    row: dict[str, Any] = {
        "topic": entry.topic, "partition": entry.partition, "offset": entry.offset, "ts": entry.timestamp_ms,
        "key": _key_out(entry.key),
    }
    if entry.record is None:
        row["raw"] = base64.b64encode(entry.raw or b"").decode()
    else:
        row["type"] = type(entry.record).__name__
        row["record"] = entry.record.model_dump()
        if entry.value is not None:
            row["value"] = entry.value
    if entry.headers:
        row["headers"] = [[name, data] for name, data in entry.headers]
    return json.dumps(row, sort_keys=True, ensure_ascii=False, default=_bytes_out)


def _key_out(key: bytes | None) -> str | dict[str, str] | None:
    """A key as text when it is UTF-8 (readable, diffable), else as ``{"$bytes": base64}`` (exact)."""
    if key is None:
        return None
    try:
        return key.decode("utf-8")
    except UnicodeDecodeError:
        return {"$bytes": base64.b64encode(key).decode()}


def _bytes_out(value: Any) -> Any:
    if isinstance(value, bytes):
        return {"$bytes": base64.b64encode(value).decode()}
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _bytes_in(obj: dict[str, Any]) -> Any:
    if len(obj) == 1 and "$bytes" in obj:
        return base64.b64decode(obj["$bytes"], validate=True)
    return obj


_DECODER = json.JSONDecoder(object_hook=_bytes_in)
"""One decoder for every line (``json.loads`` with a hook builds a new one per call)."""


def from_line(line: str) -> Entry:
    """Inverse of ``to_line``; a ``ValueError`` says what is wrong with the line."""
    row = _DECODER.decode(line)
    if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object, got {type(row).__name__}")
    raw_key = row.get("key")
    key = raw_key if raw_key is None or isinstance(raw_key, bytes) else str(raw_key).encode()
    where = (str(row["topic"]), int(row["partition"]), int(row["offset"]), int(row["ts"]))
    headers = _headers_in(row.get("headers", []))
    if "raw" in row:
        return Entry(*where, key, None, base64.b64decode(row["raw"], validate=True), headers)
    cls = _BY_NAME.get(row.get("type", ""))
    if cls is None:
        raise ValueError(f"unknown record type {row.get('type')!r}")
    value = row.get("value")
    if value is not None and not isinstance(value, bytes):
        raise ValueError("value: expected {\"$bytes\": base64}")
    record = row["record"]
    if not isinstance(record, dict):
        raise ValueError("record: expected a JSON object")
    # An archive written before a field was renamed reads under the current names.
    return Entry(*where, key, cls.model_validate(current_names(cls, record)), None, headers, value)


def _headers_in(items: Any) -> tuple[tuple[str, bytes], ...]:
    """An archive line's headers: ``[[name, {"$bytes": base64}], ...]``."""
    if not isinstance(items, list):
        raise ValueError("headers: expected a list of [name, {\"$bytes\": base64}] pairs")
    headers = []
    for item in items:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], bytes)):
            raise ValueError(f"headers: expected [name, {{\"$bytes\": base64}}], got {item!r}")
        headers.append((item[0], item[1]))
    return tuple(headers)


def write_archive(path: Path, log: Log) -> int:
    """Write ``log`` as an archive; returns the number of messages written."""
    count = 0
    with path.open("w", encoding="utf-8") as out:
        header = {"format": ARCHIVE_FORMAT, "topics": log.topics.model_dump(), "partitions": log.partition_count,
                  "rules": log.announced_rules()}
        out.write(json.dumps(header, sort_keys=True) + "\n")
        for entry in log.entries():
            out.write(to_line(entry) + "\n")
            count += 1
    return count


def load_archive(path: Path) -> Log:
    """Read an archive written by ``write_archive`` (or edited by hand, or tampered with)."""
    with path.open(encoding="utf-8") as lines:
        return parse_archive(lines, str(path))


def parse_archive(lines: Iterable[str], source: str) -> Log:
    """An archive's messages; a ``ValueError`` names the first bad line."""
    log: Log | None = None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            if log is None:
                log = _header(json.loads(line), source)
                continue
            log.add(from_line(line))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{source}:{number}: {exc}") from exc
    if log is None:
        raise ValueError(f"{source}: empty archive")
    log.sort_partitions()
    return log


def _header(header: Any, source: str) -> Log:
    """The empty log an archive's header line describes."""
    if not isinstance(header, dict):
        raise ValueError(f"expected a JSON object, got {type(header).__name__}")
    if header.get("format") != ARCHIVE_FORMAT:
        raise ValueError(f"not an Arbiter log archive (format {header.get('format')!r})")
    topics = header.get("topics", {})
    unknown = sorted(set(topics) - set(Topics.model_fields)) if isinstance(topics, dict) else []
    if unknown:
        raise ValueError(f"unknown topics {', '.join(map(repr, unknown))} in the header")
    partitions = header.get("partitions")
    if partitions is not None and (type(partitions) is not int or partitions < 1):
        raise ValueError(f"partitions {partitions!r}: expected a positive integer or null")
    rules = header.get("rules", [])
    if not isinstance(rules, list) or not all(isinstance(r, str) for r in rules):
        raise ValueError("rules: expected a list of JSON strings")
    return Log(Topics(**topics), source=source, partition_count=partitions, archived_rules=rules)
