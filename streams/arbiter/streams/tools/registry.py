"""Tools registered by name in a worker, each with an argument schema and a compensation."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import BaseModel, ValidationError

from arbiter.schemas import SnapshotRequested, ToolIntent
from arbiter.schemas.reasons import Reason
from arbiter.streams.cores.gateway import ToolOutcome
from arbiter.streams.cores.train import REPLANNED, Entry, Verdict


class ToolError(Exception):
    """A tool's expected failure (insufficient balance, say): nothing was applied.

    ``reason``: the refusal's code when the cause has one of its own (``target_dirty``, say), else
    ``tool_failed``; ``conflict=True`` is ``version_conflict``: the resource moved under the intent (a
    merge that conflicts with what landed since its base). ``details`` go into the refusal's diagnostic."""

    def __init__(self, message: str, *, conflict: bool = False, reason: Reason | None = None,
                 **details: Any) -> None:
        super().__init__(message)
        self.conflict = conflict
        self.reason = Reason.VERSION_CONFLICT if conflict else reason or Reason.TOOL_FAILED
        self.details = details


class Replan(ToolError):
    """A landing found the target elsewhere than its train had it (moved outside Arbiter): nothing landed."""

    def __init__(self, message: str, head: str) -> None:
        super().__init__(message, head=head)
        self.head = head


class TrainTools(Protocol):
    """What the repository host does for a train (``arbiter.streams.tools.merges``): blocking calls."""

    def join(self, call: ToolCall) -> dict[str, Any]:
        """A merge's preflight: ``commit``, ``head``, ``target``, ``check_digest``; ``ToolError`` refuses it."""

    def land(self, resource: str, entry: Entry, head: str, verdict: Verdict | None) -> dict[str, Any]:
        """Land the front entry on ``head``; ``Replan`` when the target is elsewhere, ``ToolError`` refuses it."""


@dataclass(frozen=True)
class ToolCall:
    """One accepted intent, as a tool sees it."""

    intent_id: str
    agent_id: str
    resource: str
    token: int | None
    arguments: BaseModel
    saga_id: str | None = None
    is_compensation: bool = False
    """True only for a saga's compensation (the trust gate lets only a worker's saga processor send one)."""


ToolFn = Callable[[ToolCall], Awaitable[Any]]


@dataclass(frozen=True)
class Tool:
    """A named side effect: what it takes, what runs it, and what undoes it."""

    name: str
    arguments: type[BaseModel]
    run: ToolFn
    compensation: str | None = None
    doc: str = ""


MAX_CONTENT_BYTES = 512 * 1024
"""The largest content a snapshot carries (its inbox message stays under Kafka's default 1 MB)."""

Reader = Callable[[str], Awaitable[Any]]
"""A resource's content as its tools keep it (JSON-able), or None when they keep none."""


class ToolRegistry:
    """The tools a worker can run, and how to read what they keep."""

    def __init__(self) -> None:
        self._tools: dict[str, Tool] = {}
        self._readers: list[Reader] = []
        self.trains: TrainTools | None = None
        """The repository host's train work (None: this registry serves no repository)."""

    def reader(self, fn: Reader) -> Reader:
        """Decorator: ``fn(resource)`` reads a resource's content for snapshots that ask for it (None: not
        one of its resources; the next reader is asked)."""
        self._readers.append(fn)
        return fn

    async def read(self, request: SnapshotRequested) -> str | None:
        """The resource's content as JSON; None when no reader keeps it, or it is over ``MAX_CONTENT_BYTES``."""
        content = None
        for reader in self._readers:
            try:
                content = await reader(request.resource)
            except Exception:  # a store's fault must not take the partition down: the answer says nothing
                return None
            if content is not None:
                break
        if content is None:
            return None
        text = json.dumps(content, sort_keys=True, default=str)
        return text if len(text.encode()) <= MAX_CONTENT_BYTES else None

    def register(self, name: str, arguments: type[BaseModel], *, compensation: str | None = None
                 ) -> Callable[[ToolFn], ToolFn]:
        """Decorator: register ``fn`` as tool ``name``."""
        if name in self._tools:
            raise ValueError(f"tool {name!r} is registered twice")

        def decorate(fn: ToolFn) -> ToolFn:
            self._tools[name] = Tool(name, arguments, fn, compensation, (fn.__doc__ or "").strip())
            return fn

        return decorate

    def names(self) -> frozenset[str]:
        """Every registered tool name."""
        return frozenset(self._tools)

    def get(self, name: str) -> Tool | None:
        """The tool called ``name``."""
        return self._tools.get(name)

    def parse(self, intent: ToolIntent) -> BaseModel | str:
        """The intent's arguments validated against its tool's schema, or why they are not."""
        tool = self._tools.get(intent.tool)
        if tool is None:
            return f"unknown tool {intent.tool!r}"
        try:
            return tool.arguments.model_validate_json(intent.arguments_json)
        except ValidationError as exc:
            return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'arguments'}: {e['msg']}" for e in exc.errors())

    async def run(self, intent: ToolIntent, arguments: BaseModel) -> ToolOutcome:
        """Run an accepted intent's tool. Failures are outcomes, not exceptions."""
        tool = self._tools[intent.tool]
        call = ToolCall(intent.intent_id, intent.agent_id, intent.resource, intent.token, arguments,
                        intent.saga_id, intent.is_compensation)
        try:
            result = await tool.run(call)
        except ToolError as exc:
            return ToolOutcome(False, error=str(exc), reason=exc.reason.value,
                               details=tuple(sorted(exc.details.items())))
        except Exception as exc:  # a tool's bug must not take the partition down; record it
            return ToolOutcome(False, error=f"{type(exc).__name__}: {exc}")
        return ToolOutcome(True, json.dumps(result, sort_keys=True, default=str))

    async def join(self, intent: ToolIntent, arguments: BaseModel) -> ToolOutcome:
        """A merge's preflight on the repository host (``TrainTools.join``), as an outcome."""
        call = ToolCall(intent.intent_id, intent.agent_id, intent.resource, intent.token, arguments,
                        intent.saga_id, intent.is_compensation)
        return await _outcome(lambda trains: trains.join(call), self.trains)

    async def land(self, resource: str, entry: Entry, head: str, verdict: Verdict | None) -> ToolOutcome:
        """Land a train's front entry (``TrainTools.land``), as an outcome (``REPLANNED``: the target moved)."""
        return await _outcome(lambda trains: trains.land(resource, entry, head, verdict), self.trains, landing=True)


async def _outcome(work: Callable[[TrainTools], dict[str, Any]], trains: TrainTools | None,
                   landing: bool = False) -> ToolOutcome:
    if trains is None:
        return ToolOutcome(False, error="this worker serves no repository", reason=Reason.UNKNOWN_REPOSITORY.value)
    phase = (("phase", "land"),) if landing else ()
    try:
        result = await asyncio.to_thread(work, trains)
    except Replan as exc:
        return ToolOutcome(False, error=str(exc), reason=REPLANNED, details=(("head", exc.head), *phase))
    except ToolError as exc:
        return ToolOutcome(False, error=str(exc), reason=exc.reason.value,
                           details=tuple(sorted((*exc.details.items(), *phase))))
    except Exception as exc:  # a bug must not take the partition down; record it
        return ToolOutcome(False, error=f"{type(exc).__name__}: {exc}", details=phase)
    return ToolOutcome(True, json.dumps(result, sort_keys=True, default=str))
