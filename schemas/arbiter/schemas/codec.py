"""Avro single-object encoding of the contract models, with fastavro.

Theory of operation
-------------------
A message on any Arbiter topic is::

    0xC3 0x01 | CRC-64-AVRO fingerprint of the writer schema (8 bytes, little endian)
              | Avro binary body

exactly as the Avro specification's *single-object encoding* defines it. The
fingerprint is taken over the schema's Parsing Canonical Form, so a consumer in any
language can tell which schema wrote a message without a schema registry, and one
topic can carry several message types (the resource-command topic carries lock
commands and tool intents in one order).

Decoding looks the fingerprint up among the current schemas and the superseded ones
in ``schemas/arbiter/schemas/history``; a superseded writer schema is resolved against the current
reader schema, so fields added later with defaults are filled in, and a renamed field is
read under its new name (the current schema lists the old one in the field's ``aliases``).

Every way a message can fail to decode raises one error type, ``ContractError``,
with a stable ``reason`` code. Processors catch exactly that and dead-letter the
message; anything else is a bug and is allowed to surface.
"""

from __future__ import annotations

import functools
import io
import json
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

import fastavro
from fastavro.schema import fingerprint, to_parsing_canonical_form
from pydantic import ValidationError

from arbiter.schemas.models import MODELS, Record

SCHEMA_DIR = Path(__file__).resolve().parent
"""Where the ``.avsc`` files live: beside the models that mirror them."""

MAGIC = b"\xc3\x01"
HEADER_SIZE = len(MAGIC) + 8
DEFAULT_MAX_MESSAGE_BYTES = 2 * 1024 * 1024

R = TypeVar("R", bound=Record)


class ContractError(ValueError):
    """A message does not fit the contract. Not retriable: the bytes will never decode.

    ``reason`` is a stable code: ``too_large``, ``not_single_object`` (no 0xC3 0x01
    marker), ``truncated``, ``unknown_fingerprint``, ``wrong_schema`` (decodes, but
    not as the type the caller expected), ``malformed_body`` (the body does not
    match its schema) or ``invalid_value`` (a model value the schema cannot hold).
    """

    retriable = False

    def __init__(self, reason: str, detail: str) -> None:
        reason = str(reason)  # a ``arbiter.schemas.reasons.Reason`` goes on the wire as its plain value
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class _Writer:
    """A schema that may have written a message, and the model it decodes to."""

    name: str
    parsed: Any
    reader: Any  # the current schema when this is a superseded one, else None
    model: type[Record]


def _load(path: Path) -> tuple[dict[str, Any], Any, bytes]:
    raw = json.loads(path.read_text(encoding="utf-8"))
    # The write hint marks the schema parsed: without it fastavro parses it again on every encode and decode
    # (`python -m bench codec`: 17k -> 37k encodes/s, 18k -> 29k decodes/s).
    parsed = fastavro.parse_schema(raw)
    canonical = to_parsing_canonical_form(raw)
    # fastavro's hex is already the spec's little-endian byte order (the tests check
    # it against an independent CRC-64-AVRO of the canonical form).
    return raw, parsed, bytes.fromhex(fingerprint(canonical, "CRC-64-AVRO"))


def _full_name(raw: dict[str, Any]) -> str:
    ns = raw.get("namespace")
    return f"{ns}.{raw['name']}" if ns else str(raw["name"])


class Codec:
    """Encodes models to single-object Avro and decodes them back."""

    def __init__(
        self,
        schema_dir: Path = SCHEMA_DIR,
        models: Iterable[type[Record]] = MODELS,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        self.max_message_bytes = max_message_bytes
        by_name = {m.AVRO_NAME: m for m in models}
        self._current: dict[type[Record], tuple[bytes, Any]] = {}
        self._writers: dict[bytes, _Writer] = {}
        self.schema_files: dict[str, Path] = {}
        self.renamed: dict[type[Record], dict[str, str]] = {}
        """Each model's renamed top-level fields, old name to new (the schemas' ``aliases``)."""
        current_parsed: dict[str, Any] = {}
        for path in sorted(p for p in schema_dir.rglob("*.avsc") if "history" not in p.relative_to(schema_dir).parts):
            raw, parsed, fp = _load(path)
            name = _full_name(raw)
            if name in self.schema_files:
                raise ValueError(f"schema {name} defined twice: {self.schema_files[name]} and {path}")
            self.schema_files[name] = path
            model = by_name.get(name)
            if model is None:
                raise ValueError(f"schema {name} ({path}) has no model in arbiter.schemas.models")
            self._current[model] = (fp, parsed)
            self.renamed[model] = {old: field["name"] for field in raw["fields"] for old in field.get("aliases", ())}
            self._writers[fp] = _Writer(name, parsed, None, model)
            current_parsed[name] = parsed
        missing = sorted(set(by_name) - set(self.schema_files))
        if missing:
            raise ValueError(f"models without a schema file: {', '.join(missing)}")
        history = schema_dir / "history"
        for path in sorted(history.glob("*.avsc")) if history.is_dir() else []:
            raw, parsed, fp = _load(path)
            name = _full_name(raw)
            if name not in current_parsed:
                raise ValueError(f"superseded schema {path} names {name}, which no longer exists")
            if fp not in self._writers:
                self._writers[fp] = _Writer(name, parsed, current_parsed[name], by_name[name])

    def fingerprint_of(self, model: type[Record]) -> bytes:
        """The 8-byte fingerprint that heads every message of ``model``."""
        return self._current[model][0]

    def encode(self, record: Record) -> bytes:
        """Encode one model as an Avro single-object message."""
        try:
            fp, parsed = self._current[type(record)]
        except KeyError:
            raise ContractError("wrong_schema", f"{type(record).__name__} is not a contract model") from None
        buf = io.BytesIO()
        buf.write(MAGIC)
        buf.write(fp)
        try:
            fastavro.schemaless_writer(buf, parsed, record.model_dump())
        except (ValueError, TypeError, OverflowError, struct.error) as exc:
            raise ContractError("invalid_value", f"{type(record).__name__}: {exc}") from exc
        data = buf.getvalue()
        if len(data) > self.max_message_bytes:
            raise ContractError(
                "too_large",
                f"{type(record).__name__} encodes to {len(data)} bytes, over the {self.max_message_bytes} byte limit",
            )
        return data

    def decode(self, data: bytes, expected: type[R] | tuple[type[R], ...] | None = None) -> R:
        """Decode one message; ``expected`` narrows which models are acceptable."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ContractError("not_single_object", f"expected bytes, got {type(data).__name__}")
        size = len(data)
        if size > self.max_message_bytes:
            raise ContractError("too_large", f"{size} bytes, over the {self.max_message_bytes} byte limit")
        if size < len(MAGIC) or bytes(data[:2]) != MAGIC:
            raise ContractError("not_single_object", "missing the Avro single-object marker 0xC3 0x01")
        if size < HEADER_SIZE:
            raise ContractError("truncated", f"{size} bytes is shorter than the {HEADER_SIZE}-byte header")
        fp = bytes(data[2:HEADER_SIZE])
        writer = self._writers.get(fp)
        if writer is None:
            raise ContractError("unknown_fingerprint", f"no known schema has fingerprint {fp.hex()}")
        if expected is not None:
            wanted = expected if isinstance(expected, tuple) else (expected,)
            if writer.model not in wanted:
                names = ", ".join(m.__name__ for m in wanted)
                raise ContractError("wrong_schema", f"message is {writer.model.__name__}, expected {names}")
        body = io.BytesIO(bytes(data[HEADER_SIZE:]))
        try:
            value = fastavro.schemaless_reader(body, writer.parsed, writer.reader)
        except EOFError as exc:
            raise ContractError("truncated", f"{writer.name} body ends early: {exc}") from exc
        except (ValueError, TypeError, IndexError, KeyError, UnicodeDecodeError, OverflowError, MemoryError) as exc:
            raise ContractError("malformed_body", f"{writer.name}: {type(exc).__name__}: {exc}") from exc
        if body.tell() != size - HEADER_SIZE:
            raise ContractError(
                "malformed_body", f"{writer.name}: {size - HEADER_SIZE - body.tell()} bytes left after the record"
            )
        try:
            return cast(R, writer.model.model_validate(value))
        except ValidationError as exc:
            raise ContractError("malformed_body", f"{writer.name}: {exc}") from exc


@functools.cache
def default_codec(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Codec:
    """The process-wide codec over the shipped schemas (loaded once per size limit)."""
    return Codec(max_message_bytes=max_message_bytes)
