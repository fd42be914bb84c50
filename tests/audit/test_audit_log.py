"""Audit's pure parts: archive lines round-trip every record, bad input is a ValueError that says where.

No Kafka: records come from the Avro schemas (as in ``tests/schemas/test_contract.py``),
archives are written to and read from temporary files.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic_core import PydanticSerializationError

from arbiter.audit.log import (
    ARCHIVE_FORMAT,
    Entry,
    Log,
    from_line,
    identity,
    load_archive,
    parse_archive,
    to_line,
    write_archive,
)
from arbiter.audit.replay import Moment, Policy, parse_moment
from arbiter.edge.settings import Topics
from arbiter.schemas import MODELS, Cause, DeadLetter, LockGranted, LockRequested
from arbiter.schemas.codec import SCHEMA_DIR
from tests.avro_strategies import for_record

SCHEMAS = {raw["name"]: raw for raw in (json.loads(p.read_text()) for p in SCHEMA_DIR.rglob("*.avsc")
                                        if "history" not in p.parts)}
MODEL_NAMES = sorted(m.__name__ for m in MODELS)
BY_NAME = {m.__name__: m for m in MODELS}
TOPICS = Topics()
T0 = 1_700_000_000_000

positions = st.tuples(st.sampled_from(sorted(TOPICS.all())), st.integers(0, 1023), st.integers(0, 2**62),
                      st.integers(0, 2**62))
keys = st.none() | st.binary(max_size=16) | st.text(max_size=16).map(str.encode)


def _header(**changes: Any) -> str:
    return json.dumps({"format": ARCHIVE_FORMAT, "topics": TOPICS.model_dump(), "partitions": 2, **changes})


def test_the_schemas_and_the_models_are_the_same_set() -> None:
    assert set(SCHEMAS) == set(MODEL_NAMES)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_every_record_round_trips_through_an_archive_line(name: str) -> None:
    model = BY_NAME[name]

    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(for_record(SCHEMAS[name]), positions, keys)
    def round_trip(values: dict[str, Any], where: tuple[str, int, int, int], key: bytes | None) -> None:
        entry = Entry(*where, key, model.model_validate(values))
        line = to_line(entry)
        assert "\n" not in line and "\r" not in line
        back = from_line(line)
        assert back == entry
        assert back.record is not None and back.record.model_dump() == values
        assert to_line(back) == line, "a line is canonical: reading and writing it again changes nothing"

    round_trip()


@given(positions, keys, st.binary(max_size=64))
def test_undecodable_messages_round_trip_with_their_raw_bytes(where: tuple[str, int, int, int], key: bytes | None,
                                                               raw: bytes) -> None:
    entry = Entry(*where, key, None, raw)
    assert from_line(to_line(entry)) == entry


def test_dead_letters_keep_bytes_that_are_not_utf8() -> None:
    garbage = b"\xc3\x01\xff\xfe\x00not avro\x80"
    letter = DeadLetter(reason="undecodable", detail="bad magic", processor="resource",
                        source=Cause(topic=TOPICS.resource_commands, partition=1, offset=7),
                        key=b"\xff\xfeaccount:a", value=garbage, at_ms=T0)
    entry = Entry(TOPICS.dead_letter, 0, 3, T0, b"\xff\xfeaccount:a", letter)
    line = to_line(entry)
    json.loads(line)  # valid JSON, whatever the bytes
    back = from_line(line)
    assert back == entry
    assert isinstance(back.record, DeadLetter) and back.record.value == garbage
    raw = Entry(TOPICS.resource_commands, 1, 7, T0, b"\xff\xfeaccount:a", None, garbage)
    assert from_line(to_line(raw)) == raw


header_lists = st.lists(st.tuples(st.text(max_size=12), st.binary(max_size=70)), max_size=4).map(tuple)


@given(positions, keys, header_lists, st.none() | st.binary(max_size=40))
def test_headers_and_exact_value_bytes_round_trip(where: tuple[str, int, int, int], key: bytes | None,
                                                   headers: tuple[tuple[str, bytes], ...],
                                                   value: bytes | None) -> None:
    request = LockRequested(request_id="r1", agent_id="alpha", resource="account:a", mode="exclusive",
                            ttl_ms=30_000, at_ms=T0)
    for entry in (Entry(*where, key, request, None, headers, value), Entry(*where, key, None, b"\x00raw", headers)):
        line = to_line(entry)
        back = from_line(line)
        assert back == entry and back.headers == headers
        assert to_line(back) == line


def test_an_archive_line_without_headers_reads_as_before() -> None:
    """Archives written before messages were signed (the golden histories) have no headers."""
    request = LockRequested(request_id="r1", agent_id="alpha", resource="account:a", mode="exclusive",
                            ttl_ms=30_000, at_ms=T0)
    old = json.dumps({"topic": TOPICS.resource_commands, "partition": 0, "offset": 0, "ts": T0,
                      "key": "account:a", "type": "LockRequested", "record": request.model_dump()})
    entry = from_line(old)
    assert entry.headers == () and entry.value is None and entry.record == request
    assert "headers" not in to_line(entry) and "value" not in to_line(entry), "unsigned lines stay as they were"


def test_value_bytes_are_the_encoded_record_unless_kept() -> None:
    from arbiter.schemas import default_codec

    codec = default_codec()
    request = LockRequested(request_id="r1", agent_id="alpha", resource="account:a", mode="exclusive",
                            ttl_ms=30_000, at_ms=T0)
    assert Entry(TOPICS.resource_commands, 0, 0, T0, b"k", request).value_bytes(codec) == codec.encode(request)
    assert Entry(TOPICS.resource_commands, 0, 0, T0, b"k", request, None, (), b"kept").value_bytes(codec) == b"kept"
    assert Entry(TOPICS.resource_commands, 0, 0, T0, b"k", None, b"raw").value_bytes(codec) == b"raw"


@pytest.mark.parametrize("headers", ['{"a": 1}', '[["a"]]', '[[1, {"$bytes": ""}]]', '[["a", "text"]]'])
def test_bad_headers_name_their_line(headers: str) -> None:
    line = ('{"topic": "t", "partition": 0, "offset": 0, "ts": 0, "key": null, "raw": "", "headers": '
            + headers + "}")
    with pytest.raises(ValueError, match=r"^bad.jsonl:2: .*headers"):
        parse_archive([_header(), line], "bad.jsonl")


def test_a_key_that_looks_like_an_escape_stays_itself() -> None:
    for key in (b"\\xff", "account:\u00e9".encode(), b"\xff", b"", b'{"$bytes": "AA=="}'):
        entry = Entry(TOPICS.resource_commands, 0, 0, T0, key, None, b"x")
        assert from_line(to_line(entry)).key == key


def _sample_log() -> Log:
    log = Log(TOPICS, partition_count=2)
    cause = Cause(topic=TOPICS.resource_commands, partition=0, offset=0)
    request = LockRequested(request_id="r1", agent_id="alpha", resource="account:a", mode="exclusive", ttl_ms=30_000,
                            at_ms=T0)
    grant = LockGranted(request_id="r1", agent_id="alpha", resource="account:a", token=1, mode="exclusive",
                        expires_at_ms=T0 + 30_000, holders=[], resource_version=0, at_ms=T0 + 1, cause=cause)
    log.add(Entry(TOPICS.resource_commands, 0, 0, T0, b"account:a", request))
    log.add(Entry(TOPICS.resource_commands, 0, 1, T0 + 5, b"\xff", None, b"\xff\x00"))
    log.add(Entry(TOPICS.resource_events, 1, 0, T0 + 1, b"account:a", grant))
    return log


def test_an_archive_file_round_trips_a_log(tmp_path: Path) -> None:
    log = _sample_log()
    path = tmp_path / "log.jsonl"
    assert write_archive(path, log) == 3
    back = load_archive(path)
    assert back.topics == log.topics and back.partition_count == 2 and back.source == str(path)
    assert back.partitions == log.partitions
    assert back.span_ms() == (T0, T0 + 5)
    assert back.find(TOPICS.resource_events, 1, 0) == log.find(TOPICS.resource_events, 1, 0)
    assert back.find(TOPICS.resource_events, 1, 1) is None


def test_an_archive_is_read_in_offset_order_and_blank_lines_are_skipped() -> None:
    lines = [to_line(e) for e in _sample_log().entries()]
    back = parse_archive([_header(), "", lines[1], "   ", lines[0], lines[2]], "mem")
    assert [e.offset for e in back.of(TOPICS.resource_commands)] == [0, 1]


@pytest.mark.parametrize(("lines", "number", "says"), [
    ([], None, "empty archive"),
    (["", "  "], None, "empty archive"),
    (["{not json"], 1, ""),
    (['{"format": "something-else/9"}'], 1, "not an Arbiter log archive"),
    (['{"topics": {}}'], 1, "not an Arbiter log archive"),
    (["[1, 2, 3]"], 1, "JSON object"),
    (["null"], 1, "JSON object"),
    ([_header(topics={"nonsense": "x"})], 1, "nonsense"),
    ([_header(partitions="two")], 1, "partitions"),
    ([_header(partitions=0)], 1, "partitions"),
    ([_header(), "", "{oops"], 3, ""),
    ([_header(), '{"topic": "t", "partition": 0, "offset": 0, "ts": 0, "key": null, "type": "LockStolen", '
                 '"record": {}}'], 2, "unknown record type 'LockStolen'"),
    ([_header(), '{"topic": "t", "partition": 0, "offset": 0, "ts": 0, "key": null, "record": {}}'], 2,
     "unknown record type None"),
    ([_header(), '{"topic": "t", "partition": 0, "offset": 0, "key": null, "raw": ""}'], 2, "ts"),
    ([_header(), '{"topic": "t", "partition": "zero", "offset": 0, "ts": 0, "key": null, "raw": ""}'], 2, "zero"),
    ([_header(), '{"topic": "t", "partition": 0, "offset": 0, "ts": 0, "key": null, "raw": "***"}'], 2, ""),
    ([_header(), '{"topic": "t", "partition": 0, "offset": 0, "ts": 0, "key": null, "type": "Ping", '
                 '"record": {"request_id": 1}}'], 2, "Ping"),
    ([_header(), '["topic", "t"]'], 2, "JSON object"),
    ([_header(), '"just a string"'], 2, "JSON object"),
])
def test_a_bad_archive_names_its_bad_line(lines: list[str], number: int | None, says: str) -> None:
    with pytest.raises(ValueError) as caught:
        parse_archive(lines, "bad.jsonl")
    message = str(caught.value)
    assert message.startswith(f"bad.jsonl:{number}: " if number else "bad.jsonl: "), message
    assert says in message


def test_a_bad_archive_file_names_its_path_and_line(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    write_archive(path, _sample_log())
    lines = path.read_text(encoding="utf-8").splitlines()
    lines[2] = lines[2].replace('"partition": 0', '"partition": []')
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=rf"^{path}:3: "):
        load_archive(path)


# -- what-if policies ------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "ttl_ms", "victim"), [
    ("", None, "priority"),
    ("ttl=30s", 30_000, "priority"),
    ("ttl=500ms", 500, "priority"),
    ("ttl=2m", 120_000, "priority"),
    ("ttl=1.5s", 1_500, "priority"),
    ("ttl=0.25s", 250, "priority"),
    ("victim=youngest", None, "youngest"),
    ("victim=oldest", None, "oldest"),
    ("victim=priority", None, "priority"),
    ("ttl=100ms,victim=youngest", 100, "youngest"),
    (" ttl=100ms , victim=oldest ", 100, "oldest"),
    ("ttl=1s,", 1_000, "priority"),
])
def test_policies_in_every_documented_form(text: str, ttl_ms: int | None, victim: str) -> None:
    assert Policy.parse(text) == Policy(ttl_ms=ttl_ms, victim=victim)  # type: ignore[arg-type]


@pytest.mark.parametrize(("text", "says"), [
    ("ttl=abc", "duration 'abc'"),
    ("ttl=30", "duration '30'"),
    ("ttl=", "duration ''"),
    ("ttl=0s", "above zero"),
    ("ttl=0.0001s", "above zero"),
    ("ttl=-5s", "duration '-5s'"),
    ("ttl=1e3ms", "duration '1e3ms'"),
    ("ttl=5h", "duration '5h'"),
    ("ttl=nans", "duration 'nans'"),
    ("ttl=infs", "duration 'infs'"),
    ("victim=random", "expected one of priority, youngest, oldest"),
    ("speed=2", "unknown policy 'speed'"),
    ("ttl", "expected name=value"),
    ("ttl=30s;victim=oldest", "duration"),
])
def test_bad_policies_say_what_is_wrong(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=None) as caught:
        Policy.parse(text)
    assert says in str(caught.value)


# -- moments ---------------------------------------------------------------------------------


def test_moments_in_every_documented_form() -> None:
    log = _sample_log()
    assert parse_moment(str(T0 + 3), log) == Moment(at_ms=T0 + 3)
    assert parse_moment("+0.004s", log) == Moment(at_ms=T0 + 4)
    assert parse_moment("+2s", log) == Moment(at_ms=T0 + 2_000)
    iso = datetime.fromtimestamp(T0 / 1000, UTC)
    assert parse_moment(iso.isoformat(), log) == Moment(at_ms=T0)
    assert parse_moment(iso.strftime("%Y-%m-%dT%H:%M:%S.%fZ"), log) == Moment(at_ms=T0)
    assert parse_moment(iso.strftime("%Y-%m-%dT%H:%M:%S.%f"), log) == Moment(at_ms=T0), "a bare time is UTC"
    assert parse_moment(f"  {TOPICS.resource_events}[1]@0 ", log) == Moment(topic=TOPICS.resource_events,
                                                                            partition=1, offset=0)
    assert parse_moment(f"{TOPICS.resource_commands}[0]@1", log).offset == 1


@pytest.mark.parametrize("text", [
    "nonsense", "", "yesterday", "-5", "12:00", "+s", "+abcs", "+infs", "+nans", "+1e999s", "+-2s",
    "resource_events@0", "x[a]@0", "x[0]@b", "x[0]@", "[0]@0",
])
def test_bad_moments_say_what_is_expected(text: str) -> None:
    with pytest.raises(ValueError) as caught:
        parse_moment(text, _sample_log())
    message = str(caught.value)
    assert ("expected" in message or "not in the log" in message) and repr(text.strip()) in message, message


def test_a_position_outside_the_log_is_refused() -> None:
    with pytest.raises(ValueError, match="is not in the log"):
        parse_moment(f"{TOPICS.resource_events}[1]@5", _sample_log())
    with pytest.raises(ValueError, match="is not in the log"):
        parse_moment("elsewhere[0]@0", _sample_log())


# -- the log as an index ---------------------------------------------------------------------


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_identity_is_the_whole_content(name: str) -> None:
    model = BY_NAME[name]

    @settings(max_examples=10, deadline=None)
    @given(for_record(SCHEMAS[name]))
    def same(values: dict[str, Any]) -> None:
        record = model.model_validate(values)
        try:
            assert identity(record) == (name, record.model_dump_json())
        except PydanticSerializationError:  # bytes that are not UTF-8: identity still has an answer
            assert name in ("DeadLetter", "IdentityRegistered")  # the models with a bytes field
        assert identity(model.model_validate(values)) == identity(record)

    same()


def test_find_with_dense_sparse_and_unordered_offsets() -> None:
    log = Log(TOPICS)
    for offset in (3, 4, 5, 9, 12, 40):  # compaction and transaction markers leave gaps
        log.add(Entry(TOPICS.resource_events, 0, offset, T0 + offset, b"k", None, b""))
    for offset in range(50):
        found = log.find(TOPICS.resource_events, 0, offset)
        assert (found.offset if found else None) == (offset if offset in (3, 4, 5, 9, 12, 40) else None)
    assert log.find(TOPICS.resource_events, 1, 3) is None and log.find("other", 0, 3) is None
    shuffled = Log(TOPICS)
    for offset in (7, 2, 5):  # added out of order, not yet sorted
        shuffled.add(Entry(TOPICS.resource_events, 0, offset, T0, b"k", None, b""))
    assert [shuffled.find(TOPICS.resource_events, 0, o).offset for o in (2, 5, 7)] == [2, 5, 7]  # type: ignore[union-attr]


def test_a_large_log_has_a_short_repr() -> None:
    """asyncio.run reprs the result of its main task: a log's repr must not be the whole log."""
    log = Log(TOPICS, source="big.jsonl")
    for offset in range(10_000):
        log.add(Entry(TOPICS.resource_commands, 0, offset, T0, b"k", None, b"x" * 100))
    assert repr(log) == "<Log big.jsonl: 10,000 messages in 1 partitions>"


def test_a_dead_letter_where_events_belong_does_not_crash_the_audit() -> None:
    """Identity must hold for every record: a misplaced (or forged) dead letter has bytes that are not UTF-8."""
    import asyncio

    from arbiter.audit import audit
    from arbiter.edge.settings import Settings

    letter = DeadLetter(reason="undecodable", detail="", processor="resource", value=b"\xff\xfe", at_ms=T0,
                        source=Cause(topic=TOPICS.resource_commands, partition=0, offset=0))
    other = letter.model_copy(update={"value": b"\xff\xfd"})
    assert identity(letter) != identity(other) and identity(letter) == identity(letter.model_copy())
    log = Log(TOPICS, partition_count=2)
    log.add(Entry(TOPICS.resource_events, 1, 0, T0, b"account:a", letter))
    report = asyncio.run(audit(log, Settings(topics=TOPICS, partitions=2)))
    assert report["messages"] == 1 and report["timeline"]["resources"] == []
