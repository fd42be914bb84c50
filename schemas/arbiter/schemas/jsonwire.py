"""Records as JSON: how the front door and its clients, in any language, speak the contract.

A record travels as one JSON object: the model's fields, plus ``"type"``, the model's
name (``"LockRequested"``, ``"LockGranted"``...). Field names, types and meanings are
those of the Avro schemas (``schemas/*/*.avsc``); times are integer milliseconds and
free-form payloads are JSON text (``*_json``), so nothing here is Python-specific.

A field renamed in the contract is still taken under its old name (the schema's ``aliases``),
so a client written against an older contract keeps working; answers use the current names.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from arbiter.schemas.codec import ContractError, default_codec
from arbiter.schemas.models import MODELS, Record

BY_NAME: dict[str, type[Record]] = {m.__name__: m for m in MODELS}
"""Every contract model by its JSON ``type``."""


def to_json(record: Record) -> dict[str, Any]:
    """``record`` as a JSON object with its ``type``."""
    return {"type": type(record).__name__, **record.model_dump(mode="json")}


def current_names(model: type[Record], fields: dict[str, Any]) -> dict[str, Any]:
    """``fields`` (a copy, if anything changes) with each field the contract renamed under its current name."""
    renamed = default_codec().renamed[model]
    if not renamed.keys() & fields.keys():
        return fields
    current: dict[str, Any] = {}
    for name, value in fields.items():
        new = renamed.get(name)
        current[new if new is not None and new not in fields else name] = value  # (both given: refused as extra)
    return current


def from_json(value: Any, allowed: tuple[type[Record], ...]) -> Record:
    """The record a JSON object describes, if its ``type`` is one of ``allowed``.

    Raises ``ContractError`` (``wrong_schema`` or ``malformed_body``, with the field) otherwise.
    """
    if not isinstance(value, dict):
        raise ContractError("malformed_body", "a record is a JSON object with a 'type'")
    fields = dict(value)
    kind = fields.pop("type", None)
    model = BY_NAME.get(kind) if isinstance(kind, str) else None
    if model is None or model not in allowed:
        names = ", ".join(m.__name__ for m in allowed)
        raise ContractError("wrong_schema", f"'type' is {kind!r}; expected one of: {names}")
    try:
        return model.model_validate(current_names(model, fields))
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(record)"
        raise ContractError("malformed_body", f"{kind}.{where}: {first['msg']}") from None
