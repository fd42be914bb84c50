"""What the gateway answers an agent: an outcome (applied or refused) and snapshots."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from arbiter.schemas import ResourceSnapshot, ToolApplied, ToolRejected


@dataclass(frozen=True)
class Outcome:
    """The gateway's answer to one intent.

    ``applied`` is True when the tool ran and its change was recorded. Otherwise
    ``reason`` is a stable code and ``diagnostic`` the structured explanation (your
    token or base, the current high-water mark, version and holder, the changes since
    your base, what to do next); ``diagnostic_json`` is ready for an LLM's context.
    """

    intent_id: str
    resource: str
    tool: str
    applied: bool
    reason: str = "applied"
    version: int | None = None
    content_hash: str | None = None
    result: Any = None
    diagnostic: dict[str, Any] = field(default_factory=dict)

    @property
    def conflict(self) -> bool:
        """True for an optimistic-concurrency conflict: rebase and retry."""
        return self.reason == "version_conflict"

    @property
    def diagnostic_json(self) -> str:
        """The diagnostic as JSON text."""
        return json.dumps(self.diagnostic, sort_keys=True)

    @classmethod
    def from_event(cls, event: ToolApplied | ToolRejected) -> Outcome:
        """The outcome an inbox event describes."""
        if isinstance(event, ToolApplied):
            return cls(event.intent_id, event.resource, event.tool, True, version=event.version,
                       content_hash=event.content_hash, result=json.loads(event.result_json))
        return cls(event.intent_id, event.resource, event.tool, False, reason=event.reason,
                   diagnostic=json.loads(event.diagnostic_json))


@dataclass(frozen=True)
class Snapshot:
    """A resource's version, hash and live holders at one point of its order; with ``content=True``
    also its content as the worker's tools keep it (a document's ``body``, an account's ``balance``),
    None when they keep none."""

    resource: str
    version: int
    content_hash: str
    high_water_token: int
    holders: list[dict[str, Any]]
    content: Any = None

    @classmethod
    def from_event(cls, event: ResourceSnapshot) -> Snapshot:
        """The snapshot an inbox event carries."""
        content = json.loads(event.content_json) if event.content_json is not None else None
        return cls(event.resource, event.version, event.content_hash, event.high_water_token,
                   [h.model_dump() for h in event.holders], content)
