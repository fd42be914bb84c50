"""The execution gateway's gate: fencing and optimistic-concurrency checks for one resource.

Theory of operation
-------------------
Every write an agent wants to make reaches the world only as a ``ToolIntent`` that
this gate accepted. The gate is pure and owns one machine, the resource's
``ContentState`` (version, content hash, a bounded history of applied changes and
the outcomes of recent intents); it reads, but never changes, the resource's
``LeaseBook``. It is decided in the same ordered step as the lease decisions for the
resource, so no change of holder can slip in between a check and its write.

    check(book, content, intent, now_ms, cause, rules) -> Accepted | ToolApplied | ToolRejected
    complete(content, intent, outcome, now_ms, cause)  -> ToolApplied | ToolRejected
    evolve(content, event)                              -> content

``check`` refuses with a stable reason code or accepts; the processor then runs the
tool (its side effect is idempotent by intent id in the store it writes) and
``complete`` records the result. An intent id seen before gets its recorded outcome
back from ``check`` and is never executed again.

The fencing rule (the two seed documents disagree; this is the one that lets a live
holder write twice and still stops every zombie):

- ``stale_fencing_token``: the token is below the resource's high-water mark;
- ``lease_not_live``: the token is the high-water mark (or unknown) but its lease has
  expired, been released or been revoked, even though nobody newer holds it yet;
- a live holder may write any number of times with its token.

Optimistic concurrency: each accepted write raises ``version`` by one and chains the
content hash. A write based on another version is a ``version_conflict`` whose
diagnostic lists every change since that base (from the bounded history), or says the
base is too old to rebase on and the agent must re-read.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Literal

from contract import Cause, ToolApplied, ToolIntent, ToolRejected
from contract.reasons import Reason, what_to_do

from .fencing import token_problem
from .leases import LeaseBook

Policy = Literal["pessimistic", "optimistic", "both"]
GENESIS_HASH = "0" * 32
GatewayEvent = ToolApplied | ToolRejected


@dataclass(frozen=True)
class GatewayRules:
    """Which resources need what, and the gate's limits."""

    policies: tuple[tuple[str, Policy], ...] = ()
    """(name prefix, policy) pairs; the longest matching prefix wins."""
    max_arguments_bytes: int = 1024 * 1024
    history_limit: int = 64
    dedup_window: int = 256
    require_exclusive: bool = True
    """Pessimistic writes need an exclusive lease; a shared lease is for reading."""

    _cache: dict[str, Policy | None] = field(default_factory=dict, compare=False, repr=False)

    def policy_for(self, resource: str) -> Policy | None:
        """The policy of ``resource``, or None when no prefix matches."""
        cache = self._cache
        if resource in cache:
            return cache[resource]
        best: tuple[int, Policy] | None = None
        for prefix, policy in self.policies:
            if resource.startswith(prefix) and (best is None or len(prefix) > best[0]):
                best = (len(prefix), policy)
        if len(cache) >= 65_536:
            cache.clear()
        cache[resource] = best[1] if best else None
        return cache[resource]


@dataclass(frozen=True, slots=True)
class Change:
    """One applied write, kept so that a conflicting agent can rebase on it."""

    version: int
    intent_id: str
    agent_id: str
    tool: str
    arguments_json: str
    content_hash: str


@dataclass(slots=True)
class ContentState:
    """What the gate knows about one resource's content."""

    resource: str
    version: int = 0
    content_hash: str = GENESIS_HASH
    history: list[Change] = field(default_factory=list)
    outcomes: dict[str, GatewayEvent] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly snapshot (the table's changelog format)."""
        return {
            "resource": self.resource,
            "version": self.version,
            "content_hash": self.content_hash,
            "history": [[c.version, c.intent_id, c.agent_id, c.tool, c.arguments_json, c.content_hash]
                        for c in self.history],
            "outcomes": [[type(e).__name__, e.model_dump(mode="json")] for e in self.outcomes.values()],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ContentState:
        """Inverse of ``to_dict``."""
        kinds: dict[str, type[GatewayEvent]] = {"ToolApplied": ToolApplied, "ToolRejected": ToolRejected}
        outcomes: dict[str, GatewayEvent] = {}
        for kind, payload in data["outcomes"]:
            event = kinds[kind].model_validate(payload)
            outcomes[event.intent_id] = event
        return cls(
            resource=data["resource"],
            version=data["version"],
            content_hash=data["content_hash"],
            history=[Change(*row) for row in data["history"]],
            outcomes=outcomes,
        )


@dataclass(frozen=True, slots=True)
class Accepted:
    """The intent passed every check; run the tool, then call ``complete``."""

    intent: ToolIntent


@dataclass(frozen=True, slots=True)
class ToolOutcome:
    """What running the tool gave: a JSON result, or an error message."""

    ok: bool
    result_json: str = "null"
    error: str = ""




def reject(content: ContentState, book: LeaseBook, intent: ToolIntent, reason: Reason, now_ms: int, cause: Cause,
           **extra: Any) -> ToolRejected:
    """A refusal of ``intent`` with ``reason`` and a diagnostic an LLM can act on."""
    holder = next(iter(book.holders.values()), None)
    diagnostic = {
        "reason": reason,
        "resource": intent.resource,
        "you_sent": {"intent_id": intent.intent_id, "agent_id": intent.agent_id, "tool": intent.tool,
                     "token": intent.token, "base_version": intent.base_version, "base_hash": intent.base_hash},
        "current": {
            "high_water_token": book.last_token,
            "holder": None if holder is None else {"agent_id": holder.agent_id, "token": holder.token,
                                                   "mode": holder.mode, "expires_at_ms": holder.expires_at_ms},
            "version": content.version,
            "content_hash": content.content_hash,
        },
        **extra,
        "what_to_do": what_to_do(reason),
    }
    return ToolRejected(intent_id=intent.intent_id, agent_id=intent.agent_id, resource=intent.resource,
                        tool=intent.tool, reason=reason.value, diagnostic_json=json.dumps(diagnostic, sort_keys=True),
                        decided_at_ms=now_ms, cause=cause)


def changes_since(content: ContentState, base_version: int) -> tuple[list[dict[str, Any]], bool]:
    """The changes after ``base_version`` and whether the history still reaches back that far."""
    newer = [c for c in content.history if c.version > base_version]
    oldest_known = content.history[0].version if content.history else content.version + 1
    too_old = base_version < oldest_known - 1 and content.version > base_version
    return [{"version": c.version, "intent_id": c.intent_id, "agent_id": c.agent_id, "tool": c.tool,
             "arguments": json.loads(c.arguments_json), "content_hash": c.content_hash} for c in newer], too_old


def _version_of_hash(content: ContentState, content_hash: str) -> int | None:
    if content_hash == content.content_hash:
        return content.version
    if content_hash == GENESIS_HASH and (not content.history or content.history[0].version == 1):
        return 0
    return next((c.version for c in content.history if c.content_hash == content_hash), None)


def check(
    book: LeaseBook, content: ContentState, intent: ToolIntent, now_ms: int, cause: Cause,
    rules: GatewayRules, known_tools: frozenset[str] | None = None,
) -> Accepted | GatewayEvent:
    """Accept ``intent`` or refuse it with a reason. Changes nothing."""
    recorded = content.outcomes.get(intent.intent_id)
    if recorded is not None:
        return recorded
    if not (intent.resource and intent.agent_id and intent.intent_id and intent.tool):
        return reject(content, book, intent, Reason.INVALID_INTENT, now_ms, cause)
    text = intent.arguments_json
    # A character is at most 4 UTF-8 bytes: encode only when the length alone cannot tell.
    if len(text) * 4 > rules.max_arguments_bytes and len(text.encode()) > rules.max_arguments_bytes:
        return reject(content, book, intent, Reason.ARGUMENTS_TOO_LARGE, now_ms, cause,
                       limit_bytes=rules.max_arguments_bytes)
    # Only the shape here: the tool's schema parses the arguments fully before it runs.
    if not (text[:1] == "{" and text[-1:] == "}") and not (text.strip()[:1] == "{" and text.strip()[-1:] == "}"):
        return reject(content, book, intent, Reason.INVALID_ARGUMENTS, now_ms, cause)
    if known_tools is not None and intent.tool not in known_tools:
        return reject(content, book, intent, Reason.UNKNOWN_TOOL, now_ms, cause, known_tools=sorted(known_tools))
    policy = rules.policy_for(intent.resource)
    if policy is None:
        return reject(content, book, intent, Reason.NO_POLICY, now_ms, cause)
    fenced = policy in ("pessimistic", "both")
    optimistic = policy in ("optimistic", "both")
    if fenced and intent.token is None:
        return reject(content, book, intent, Reason.TOKEN_REQUIRED, now_ms, cause)
    if optimistic and intent.base_version is None and intent.base_hash is None:
        return reject(content, book, intent, Reason.BASE_VERSION_REQUIRED, now_ms, cause)
    if intent.token is not None:
        problem = _fencing_problem(book, intent, now_ms, rules)
        if problem:
            return reject(content, book, intent, problem, now_ms, cause)
    base = intent.base_version
    if base is None and intent.base_hash is not None:
        base = _version_of_hash(content, intent.base_hash)
        if base is None:
            return reject(content, book, intent, Reason.VERSION_CONFLICT, now_ms, cause, changes_since_base=[],
                           base_too_old=True)
    if base is not None and base != content.version:
        changes, too_old = changes_since(content, base)
        return reject(content, book, intent, Reason.VERSION_CONFLICT, now_ms, cause, changes_since_base=changes,
                       base_too_old=too_old or base > content.version)
    return Accepted(intent)


def _fencing_problem(book: LeaseBook, intent: ToolIntent, now_ms: int, rules: GatewayRules) -> Reason | None:
    token = intent.token
    assert token is not None
    problem = token_problem(book.holders, book.last_token, intent.agent_id, token, now_ms)
    if problem is None and rules.require_exclusive and book.holders[token].mode != "exclusive":
        return Reason.LEASE_NOT_EXCLUSIVE
    return problem


def next_hash(previous: str, intent: ToolIntent) -> str:
    """The content hash after applying ``intent``: a chain over every applied write."""
    digest = hashlib.sha256()
    for part in (previous, intent.intent_id, intent.tool, intent.arguments_json):
        digest.update(part.encode())
        digest.update(b"\x00")
    return digest.hexdigest()[:32]


def complete(
    book: LeaseBook, content: ContentState, intent: ToolIntent, outcome: ToolOutcome, now_ms: int, cause: Cause
) -> GatewayEvent:
    """The event that records an accepted intent's tool run."""
    if outcome.ok:
        return ToolApplied(intent_id=intent.intent_id, agent_id=intent.agent_id, resource=intent.resource,
                           tool=intent.tool, token=intent.token, arguments_json=intent.arguments_json,
                           version=content.version + 1,
                           content_hash=next_hash(content.content_hash, intent), result_json=outcome.result_json,
                           decided_at_ms=now_ms, cause=cause)
    return reject(content, book, intent, Reason.TOOL_FAILED, now_ms, cause, error=outcome.error[:2000])


def evolve(content: ContentState, event: GatewayEvent, rules: GatewayRules | None = None) -> ContentState:
    """Fold ``event`` into ``content`` (in place) and return it."""
    limits = rules or GatewayRules()
    if isinstance(event, ToolApplied) and event.version == content.version + 1:
        content.version = event.version
        content.content_hash = event.content_hash
        content.history.append(Change(event.version, event.intent_id, event.agent_id, event.tool,
                                      event.arguments_json, event.content_hash))
        del content.history[:-limits.history_limit]
    outcomes = content.outcomes
    outcomes[event.intent_id] = event
    while len(outcomes) > limits.dedup_window:
        del outcomes[next(iter(outcomes))]
    return content
