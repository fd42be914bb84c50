"""The Avro contract: schemas, models, single-object encoding and bad input."""

from __future__ import annotations

import contextlib
import json
import shutil
import types
import typing
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from arbiter.schemas import MODELS, Codec, ContractError, LockRequested, Ping, Pong, Record, default_codec
from arbiter.schemas.codec import HEADER_SIZE, SCHEMA_DIR
from tests.avro_strategies import for_record

SCHEMA_FILES = sorted(p for p in SCHEMA_DIR.rglob("*.avsc") if "history" not in p.relative_to(SCHEMA_DIR).parts)
_SCHEMAS_BY_NAME = {raw["namespace"] + "." + raw["name"]: raw
                    for raw in (json.loads(p.read_text()) for p in SCHEMA_FILES)}
RAW = {p: json.loads(p.read_text()) for p in SCHEMA_FILES}
BY_NAME = {f"{raw['namespace']}.{raw['name']}": raw for raw in RAW.values()}
MODEL_BY_NAME = {m.AVRO_NAME: m for m in MODELS}


def crc64_avro(data: bytes) -> int:
    """CRC-64-AVRO, written from the Avro specification (independent of fastavro)."""
    empty = 0xC15D213AA4D7A795
    table = []
    for i in range(256):
        fp = i
        for _ in range(8):
            fp = (fp >> 1) ^ (empty & -(fp & 1))
        table.append(fp & 0xFFFFFFFFFFFFFFFF)
    fp = empty
    for byte in data:
        fp = (fp >> 8) ^ table[(fp ^ byte) & 0xFF]
    return fp


def test_set_of_models_equals_set_of_schema_files() -> None:
    assert set(MODEL_BY_NAME) == set(BY_NAME)
    assert len(SCHEMA_FILES) == len(MODELS) == len(BY_NAME)


def test_every_command_and_event_of_the_design_has_a_schema() -> None:
    required = {
        "LockRequested", "LockGranted", "LockQueued", "LockDenied", "LockRenewed", "LockReleased", "LockExpired",
        "LockRevoked", "LockCancelled", "ToolIntent", "ToolApplied", "ToolRejected", "WaitEdgeAdded",
        "WaitEdgeRemoved", "DeadlockDetected", "SagaStep", "CompensationRequested", "Compensated", "SagaFinished",
    }
    assert required <= {name.rpartition(".")[2] for name in BY_NAME}


@pytest.mark.parametrize("path", SCHEMA_FILES, ids=lambda p: p.stem)
def test_schema_is_namespaced_versioned_and_documented(path: Path) -> None:
    raw = RAW[path]
    assert raw["type"] == "record"
    assert raw["namespace"].startswith("arbiter.")
    assert isinstance(raw["version"], int) and raw["version"] >= 1
    assert raw["doc"].strip()

    def check_fields(record: dict[str, Any]) -> None:
        assert record.get("doc", "").strip(), record["name"]
        for field in record["fields"]:
            assert field.get("doc", "").strip(), f"{record['name']}.{field['name']} has no doc"
            for nested in _records_in(field["type"]):
                check_fields(nested)

    check_fields(raw)


def _records_in(avro: Any) -> list[dict[str, Any]]:
    if isinstance(avro, list):
        return [r for branch in avro for r in _records_in(branch)]
    if isinstance(avro, dict):
        if avro["type"] == "record":
            return [avro]
        if avro["type"] == "array":
            return _records_in(avro["items"])
    return []


def _avro_of(annotation: Any) -> Any:
    """The Avro type a model annotation must mirror."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        (inner,) = [a for a in typing.get_args(annotation) if a is not type(None)]
        return ["null", _avro_of(inner)]
    if origin is list:
        return {"type": "array", "items": _avro_of(typing.get_args(annotation)[0])}
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return {"record": annotation.__name__, "fields": _fields_of(annotation)}
    return {str: "string", int: "long", bool: "boolean", bytes: "bytes"}[annotation]


def _fields_of(model: type[BaseModel]) -> list[tuple[str, Any, Any]]:
    return [
        (name, _avro_of(f.annotation), "required" if f.is_required() else f.default)
        for name, f in model.model_fields.items()
    ]


def _schema_shape(avro: Any) -> Any:
    if isinstance(avro, list):
        return [_schema_shape(b) for b in avro]
    if isinstance(avro, dict):
        if avro["type"] == "record":
            return {"record": avro["name"], "fields": _schema_fields(avro)}
        if avro["type"] == "array":
            return {"type": "array", "items": _schema_shape(avro["items"])}
    return avro


def _schema_fields(record: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    return [(f["name"], _schema_shape(f["type"]), f.get("default", "required")) for f in record["fields"]]


@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_model_mirrors_its_schema(name: str) -> None:
    model = MODEL_BY_NAME[name]
    assert model.__name__ == BY_NAME[name]["name"]
    assert _fields_of(model) == _schema_fields(BY_NAME[name])


@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_every_model_round_trips_through_its_schema(name: str) -> None:
    codec = default_codec()
    model = MODEL_BY_NAME[name]

    @settings(max_examples=40, deadline=None)
    @given(for_record(BY_NAME[name]))
    def round_trip(values: dict[str, Any]) -> None:
        record = model.model_validate(values)
        data = codec.encode(record)
        assert data[:2] == b"\xc3\x01"
        assert data[2:HEADER_SIZE] == codec.fingerprint_of(model)
        back = codec.decode(data, model)
        assert back == record
        assert back.model_dump() == values

    round_trip()


def test_fingerprint_is_the_specs_little_endian_crc64_of_the_canonical_form() -> None:
    from fastavro.schema import to_parsing_canonical_form

    codec = default_codec()
    assert crc64_avro(b'"int"') == 0x7275D51A3F395C8F  # the specification's own test vector
    for name, raw in BY_NAME.items():
        canonical = to_parsing_canonical_form(raw).encode()
        assert codec.fingerprint_of(MODEL_BY_NAME[name]) == crc64_avro(canonical).to_bytes(8, "little")


def _ping_bytes() -> bytes:
    return default_codec().encode(Ping(request_id="p1", agent_id="alpha", at_ms=1))


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"", "not_single_object"),
        (b"{\"json\": true}", "not_single_object"),
        (b"\xc3\x01\x00\x01", "truncated"),
        (b"\xc3\x01" + b"\xff" * 8 + b"body", "unknown_fingerprint"),
        (_ping_bytes()[:-3], "truncated"),
        (_ping_bytes() + b"\x00", "malformed_body"),
    ],
    ids=["empty", "json", "short-header", "unknown-fingerprint", "truncated-body", "trailing-bytes"],
)
def test_bad_messages_raise_one_typed_error(data: bytes, reason: str) -> None:
    with pytest.raises(ContractError) as info:
        default_codec().decode(data)
    assert info.value.reason == reason
    assert info.value.retriable is False


def test_wrong_schema_is_refused_when_a_type_is_expected() -> None:
    with pytest.raises(ContractError) as info:
        default_codec().decode(_ping_bytes(), LockRequested)
    assert info.value.reason == "wrong_schema"
    assert default_codec().decode(_ping_bytes(), (LockRequested, Ping)).request_id == "p1"


def test_size_limit_applies_to_encode_and_decode() -> None:
    small = Codec(max_message_bytes=1024)
    big = Ping(request_id="x" * 2000, agent_id="a", at_ms=0)
    with pytest.raises(ContractError) as info:
        small.encode(big)
    assert info.value.reason == "too_large"
    with pytest.raises(ContractError) as info:
        small.decode(default_codec().encode(big))
    assert info.value.reason == "too_large"


def test_value_the_schema_cannot_hold_is_refused_at_encode() -> None:
    with pytest.raises(ContractError) as info:
        default_codec().encode(Ping(request_id="p", agent_id="a", at_ms=2**70))
    assert info.value.reason == "invalid_value"


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200), st.sampled_from([None, *SCHEMA_FILES]))
def test_arbitrary_bytes_never_raise_anything_but_contract_error(body: bytes, path: Path | None) -> None:
    codec = default_codec()
    data = body if path is None else b"\xc3\x01" + codec.fingerprint_of(MODEL_BY_NAME[
        f"{RAW[path]['namespace']}.{RAW[path]['name']}"]) + body
    with contextlib.suppress(ContractError):  # any other exception fails the test
        codec.decode(data)


def test_old_messages_still_decode_after_a_field_is_added(tmp_path: Path) -> None:
    """Schema evolution: a superseded schema in history/ resolves to the current one."""
    shutil.copytree(SCHEMA_DIR, tmp_path / "schemas")
    current = tmp_path / "schemas" / "system" / "pong.avsc"
    old = json.loads(current.read_text())
    old_fields = [f for f in old["fields"] if f["name"] != "worker_id"]
    older = {**old, "fields": old_fields}
    (tmp_path / "schemas" / "history" / "Pong.v0.avsc").write_text(json.dumps(older))

    import io

    import fastavro
    buf = io.BytesIO()
    from fastavro.schema import fingerprint, to_parsing_canonical_form
    fastavro.schemaless_writer(buf, fastavro.parse_schema(older), {
        "request_id": "p", "agent_id": "a", "at_ms": 5, "cause": {"topic": "t", "partition": 0, "offset": 9},
    })
    old_message = b"\xc3\x01" + bytes.fromhex(fingerprint(to_parsing_canonical_form(older), "CRC-64-AVRO")) \
        + buf.getvalue()

    # In the real evolution the current schema gains the field *with a default*.
    for field in old["fields"]:
        if field["name"] == "worker_id":
            field["default"] = "unknown"
    current.write_text(json.dumps(old))

    from pydantic import create_model

    from arbiter.schemas import models

    evolved = create_model("Pong", __base__=Pong, worker_id=(str, "unknown"))
    evolved.AVRO_NAME = Pong.AVRO_NAME
    codec = Codec(tmp_path / "schemas", models=[evolved if m is Pong else m for m in models.MODELS])
    decoded = codec.decode(old_message)
    assert decoded.model_dump() == {
        "request_id": "p", "agent_id": "a", "worker_id": "unknown", "at_ms": 5,
        "cause": {"topic": "t", "partition": 0, "offset": 9},
    }


def test_codec_refuses_a_schema_without_a_model(tmp_path: Path) -> None:
    shutil.copytree(SCHEMA_DIR, tmp_path / "schemas")
    (tmp_path / "schemas" / "system" / "stray.avsc").write_text(json.dumps(
        {"type": "record", "name": "Stray", "namespace": "arbiter.system", "fields": []}))
    with pytest.raises(ValueError, match="no model"):
        Codec(tmp_path / "schemas")


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.AVRO_NAME)
@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_a_trusted_record_equals_the_validated_one(model: type[Record], data: st.DataObject) -> None:
    """``trusted`` (the cores' unvalidated constructor) builds exactly what validation builds."""
    from arbiter.schemas.models import trusted

    validated = model.model_validate(data.draw(for_record(_SCHEMAS_BY_NAME[model.AVRO_NAME])))
    fields = {name: getattr(validated, name) for name in model.model_fields}
    built = trusted(model, **dict(reversed(fields.items())))  # in any order
    assert built == validated and validated == built
    assert list(built.__dict__) == list(validated.__dict__), "the fields' order (serializers follow it)"
    assert built.model_dump() == validated.model_dump()
    assert default_codec().encode(built) == default_codec().encode(validated)


HISTORY_FILES = sorted((SCHEMA_DIR / "history").glob("*.avsc"))
RENAMED_AWAY = {"sent_at_ms", "decided_at_ms", "started_at_ms", "added_at_ms", "removed_at_ms", "expired_at_ms",
                "ended_at_ms", "ping_id", "tick_id"}


def test_one_name_for_a_records_own_time_and_for_a_commands_id() -> None:
    """Every record says when it was made as ``at_ms``, whoever made it (an agent's command, a worker's decision, a
    wait edge either may write); the other times it carries are something else's: a lease's end, the command a
    decision answers, when a waiter queued. A command's correlation id is ``request_id`` (a tool intent's is its
    ``intent_id``, the idempotency key the agent chooses)."""
    others = {"expires_at_ms", "request_sent_at_ms", "waiter_registered_at_ms"}
    for model in MODELS:
        fields = set(model.model_fields)
        assert "at_ms" in fields, model.__name__
        assert not fields & RENAMED_AWAY, (model.__name__, fields & RENAMED_AWAY)
        assert {f for f in fields if f.endswith("_at_ms")} <= others, model.__name__


@pytest.mark.parametrize("path", HISTORY_FILES, ids=lambda p: p.stem)
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_a_message_written_by_a_superseded_schema_reads_under_the_current_names(path: Path, data: Any) -> None:
    """Old logs stay readable across a rename: the bytes decode (the current schema's ``aliases``), and the same
    record as JSON, in an old archive or from an old client, reads under the current names too."""
    import io

    import fastavro
    from fastavro.schema import fingerprint, to_parsing_canonical_form

    from arbiter.audit.log import from_line
    from arbiter.schemas.jsonwire import current_names

    raw = json.loads(path.read_text())
    old = data.draw(for_record(raw))
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, fastavro.parse_schema(raw), old)
    message = b"\xc3\x01" + bytes.fromhex(fingerprint(to_parsing_canonical_form(raw), "CRC-64-AVRO")) + buf.getvalue()
    model = MODEL_BY_NAME[f"{raw['namespace']}.{raw['name']}"]
    try:
        record = default_codec().decode(message)
    except ContractError as exc:  # a value the model refuses (the generator knows only the Avro types)
        assert exc.reason == "malformed_body", exc
        return
    assert type(record) is model
    renamed = default_codec().renamed[model]
    assert set(renamed) <= RENAMED_AWAY
    dumped = record.model_dump()
    for name, value in old.items():
        assert dumped[renamed.get(name, name)] == value, name
    as_json = json.loads(json.dumps(old, default=lambda b: b.decode("latin-1")))
    assert set(current_names(model, as_json)) <= set(model.model_fields)
    if not any(isinstance(v, bytes) for v in old.values()):
        line = json.dumps({"topic": "t", "partition": 0, "offset": 0, "ts": 0, "key": None, "type": model.__name__,
                           "record": old})
        assert from_line(line).record == record


def test_a_client_may_still_send_a_renamed_field_by_its_old_name_but_not_both() -> None:
    from arbiter.schemas.jsonwire import from_json

    old = {"type": "Ping", "ping_id": "p1", "agent_id": "a", "sent_at_ms": 5}
    assert from_json(old, (Ping,)) == Ping(request_id="p1", agent_id="a", at_ms=5)
    with pytest.raises(ContractError, match="malformed_body"):
        from_json({**old, "request_id": "p2"}, (Ping,))
