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
back from ``check`` and is never executed again. An intent sent outside the id window
(``request_expired``, ``clock_skew``) is refused for that first, and its refusal is not
remembered: it ran nothing, a stale re-send is refused alike every time (the floor never
goes down), and remembered, a burst of stale re-sends pushed live outcomes out and raised
the floor.

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

from arbiter.schemas import Cause, ToolApplied, ToolIntent, ToolRejected
from arbiter.schemas.jsonwire import current_names
from arbiter.schemas.reasons import OUT_OF_WINDOW, Reason, what_to_do
from arbiter.streams.cores.fencing import token_problem
from arbiter.streams.cores.leases import LeaseBook
from arbiter.streams.cores.train import Train

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
    id_window_ms: int = 600_000
    """An intent is refused (``request_expired``) once this long has passed since it was sent."""
    clock_skew_ms: int = 60_000
    """How far ahead of the broker a sender's clock may be (``clock_skew`` beyond)."""
    max_remembered_ids: int = 256
    """Per resource. Past it the oldest outcomes are forgotten early, and the window shrinks with them."""
    require_exclusive: bool = True
    """Pessimistic writes need an exclusive lease; a shared lease is for reading."""
    hide_tokens: bool = False
    """A refusal names another agent's lease without its token (with signatures on). Rules
    recorded before this existed mean False."""
    trains: bool = True
    """A merge on a repository joins its train (``arbiter.streams.cores.train``) and lands once checked.
    Rules recorded before trains existed mean False: such a merge ran at once, as its intent was decided."""
    shared_tools: tuple[str, ...] = ("claim", "merge", "sandbox_create", "sandbox_discard")
    """Tools a shared lease may run (an agent in a repository's train holds a shared lease on it while it
    waits, so its other repository tools need no exclusive one). Rules recorded before this existed mean ()."""
    forget_window_refusals: bool = True
    """An intent sent outside the id window is refused for that before any other check, and the
    refusal is not remembered. Rules recorded before this existed mean False (it came after
    ``invalid_intent`` and was remembered like any outcome), so their logs replay as decided."""

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
    parent_hash: str | None = None
    """The content hash of the version before: a base hash of ``version - 1`` is known while this
    change is in the history, exactly as far back as a base version can be rebased."""


@dataclass(slots=True)
class ContentState:
    """What the gate knows about one resource's content."""

    resource: str
    version: int = 0
    content_hash: str = GENESIS_HASH
    history: list[Change] = field(default_factory=list)
    outcomes: dict[str, GatewayEvent] = field(default_factory=dict)
    """The outcome of every intent id decided within the id window, in decision order."""
    clock_ms: int = 0
    """The latest decision time folded in."""
    forgotten_sent_ms: int | None = None
    """The latest send time of an intent forgotten early (over ``max_remembered_ids``): no intent
    sent at or before it is decided any more."""
    train: Train | None = None
    """A repository's merge trains (``arbiter.streams.cores.train``); None for every other resource."""

    def copy(self) -> ContentState:
        """An independent copy (changes and outcomes are immutable and shared)."""
        return ContentState(self.resource, self.version, self.content_hash, list(self.history), dict(self.outcomes),
                            self.clock_ms, self.forgotten_sent_ms, None if self.train is None else self.train.copy())

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly snapshot (the table's changelog format)."""
        return {
            "resource": self.resource,
            "version": self.version,
            "content_hash": self.content_hash,
            "history": [[c.version, c.intent_id, c.agent_id, c.tool, c.arguments_json, c.content_hash,
                         c.parent_hash] for c in self.history],
            "outcomes": [[type(e).__name__, e.model_dump(mode="json")] for e in self.outcomes.values()],
            "clock_ms": self.clock_ms,
            "forgotten_sent_ms": self.forgotten_sent_ms,
            **({} if self.train is None else {"train": self.train.to_dict()}),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ContentState:
        """Inverse of ``to_dict``."""
        kinds: dict[str, type[GatewayEvent]] = {"ToolApplied": ToolApplied, "ToolRejected": ToolRejected}
        outcomes: dict[str, GatewayEvent] = {}
        for kind, payload in data["outcomes"]:
            event = kinds[kind].model_validate(current_names(kinds[kind], payload))  # (written before a rename)
            outcomes[event.intent_id] = event
        return cls(
            resource=data["resource"],
            version=data["version"],
            content_hash=data["content_hash"],
            history=[Change(*row) for row in data["history"]],  # 6-item rows: written before parent_hash
            outcomes=outcomes,
            clock_ms=data.get("clock_ms", 0),
            forgotten_sent_ms=data.get("forgotten_sent_ms"),
            train=Train.from_dict(data["train"]) if "train" in data else None,
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
    reason: str = "tool_failed"
    """Why it failed: ``tool_failed``, or a code of its own cause (``version_conflict`` when the tool found
    the resource moved under the intent: a merge that conflicts with what landed since its base)."""
    details: tuple[tuple[str, Any], ...] = ()
    """What the tool adds to the refusal's diagnostic (the conflicting paths, say)."""




def reject(content: ContentState, book: LeaseBook, intent: ToolIntent, reason: Reason, now_ms: int, cause: Cause,
           *, hide_tokens: bool = False, **extra: Any) -> ToolRejected:
    """A refusal of ``intent`` with ``reason`` and a diagnostic an LLM can act on (with
    ``hide_tokens``, another agent's lease is named without its token)."""
    holder = next(iter(book.holders.values()), None)
    diagnostic = {
        "reason": reason,
        "resource": intent.resource,
        "you_sent": {"intent_id": intent.intent_id, "agent_id": intent.agent_id, "tool": intent.tool,
                     "token": intent.token, "base_version": intent.base_version, "base_hash": intent.base_hash},
        "current": {
            "high_water_token": book.last_token,
            "holder": None if holder is None else {
                "agent_id": holder.agent_id, "mode": holder.mode, "expires_at_ms": holder.expires_at_ms,
                **({} if hide_tokens and holder.agent_id != intent.agent_id else {"token": holder.token})},
            "version": content.version,
            "content_hash": content.content_hash,
        },
        **extra,
        "what_to_do": what_to_do(reason),
    }
    return ToolRejected(intent_id=intent.intent_id, agent_id=intent.agent_id, resource=intent.resource,
                        tool=intent.tool, reason=reason.value, diagnostic_json=json.dumps(diagnostic, sort_keys=True),
                        request_sent_at_ms=intent.at_ms, at_ms=now_ms, cause=cause)


def changes_since(content: ContentState, base_version: int) -> tuple[list[dict[str, Any]], bool]:
    """The changes after ``base_version`` and whether the history still reaches back that far."""
    newer = [c for c in content.history if c.version > base_version]
    oldest_known = content.history[0].version if content.history else content.version + 1
    too_old = base_version < oldest_known - 1 and content.version > base_version
    return [{"version": c.version, "intent_id": c.intent_id, "agent_id": c.agent_id, "tool": c.tool,
             "arguments": json.loads(c.arguments_json), "content_hash": c.content_hash} for c in newer], too_old


def _version_of_hash(content: ContentState, content_hash: str) -> int | None:
    """The version whose content hash is ``content_hash``, as far back as the history can rebase."""
    if content_hash == content.content_hash:
        return content.version
    for change in content.history:
        if change.content_hash == content_hash:
            return change.version
    if content.history:
        first = content.history[0]
        parent = first.parent_hash if first.parent_hash is not None else (GENESIS_HASH if first.version == 1
                                                                          else None)
        if content_hash == parent:
            return first.version - 1
    return None


def _id_problem(content: ContentState, intent: ToolIntent, now_ms: int, rules: GatewayRules
                ) -> tuple[Reason, dict[str, Any]] | None:
    """Why an intent id not seen before may not be decided now: sent too long ago, or in the future."""
    floor = now_ms - rules.id_window_ms
    if content.forgotten_sent_ms is not None:
        floor = max(floor, content.forgotten_sent_ms)
    if intent.at_ms <= floor:
        return Reason.REQUEST_EXPIRED, {"refused_at_or_before_ms": floor, "id_window_ms": rules.id_window_ms,
                                        "at_ms": intent.at_ms}
    if intent.at_ms > now_ms + rules.clock_skew_ms:
        return Reason.CLOCK_SKEW, {"broker_time_ms": now_ms, "clock_skew_ms": rules.clock_skew_ms,
                                   "at_ms": intent.at_ms}
    return None


def check(
    book: LeaseBook, content: ContentState, intent: ToolIntent, now_ms: int, cause: Cause,
    rules: GatewayRules, known_tools: frozenset[str] | None = None,
) -> Accepted | GatewayEvent:
    """Accept ``intent`` or refuse it with a reason. Changes nothing."""
    hide = rules.hide_tokens
    recorded = content.outcomes.get(intent.intent_id)
    if recorded is not None:
        return recorded
    expired = _id_problem(content, intent, max(now_ms, content.clock_ms), rules)
    if expired is not None and rules.forget_window_refusals:
        return reject(content, book, intent, expired[0], now_ms, cause, hide_tokens=hide, **expired[1])
    if not (intent.resource and intent.agent_id and intent.intent_id and intent.tool):
        return reject(content, book, intent, Reason.INVALID_INTENT, now_ms, cause, hide_tokens=hide)
    if expired is not None:
        return reject(content, book, intent, expired[0], now_ms, cause, hide_tokens=hide, **expired[1])
    text = intent.arguments_json
    # A character is at most 4 UTF-8 bytes: encode only when the length alone cannot tell.
    if len(text) * 4 > rules.max_arguments_bytes and len(text.encode()) > rules.max_arguments_bytes:
        return reject(content, book, intent, Reason.ARGUMENTS_TOO_LARGE, now_ms, cause, hide_tokens=hide,
                       limit_bytes=rules.max_arguments_bytes)
    # Only the shape here: the tool's schema parses the arguments fully before it runs.
    if not (text[:1] == "{" and text[-1:] == "}") and not (text.strip()[:1] == "{" and text.strip()[-1:] == "}"):
        return reject(content, book, intent, Reason.INVALID_ARGUMENTS, now_ms, cause, hide_tokens=hide)
    if known_tools is not None and intent.tool not in known_tools:
        return reject(content, book, intent, Reason.UNKNOWN_TOOL, now_ms, cause, hide_tokens=hide,
                      known_tools=sorted(known_tools))
    policy = rules.policy_for(intent.resource)
    if policy is None:
        return reject(content, book, intent, Reason.NO_POLICY, now_ms, cause, hide_tokens=hide)
    fenced = policy in ("pessimistic", "both")
    optimistic = policy in ("optimistic", "both")
    if fenced and intent.token is None:
        return reject(content, book, intent, Reason.TOKEN_REQUIRED, now_ms, cause, hide_tokens=hide)
    if optimistic and intent.base_version is None and intent.base_hash is None:
        return reject(content, book, intent, Reason.BASE_VERSION_REQUIRED, now_ms, cause, hide_tokens=hide)
    if intent.token is not None:
        problem = _fencing_problem(book, intent, now_ms, rules)
        if problem:
            return reject(content, book, intent, problem, now_ms, cause, hide_tokens=hide)
    base = intent.base_version
    if intent.base_hash is not None:
        hashed = _version_of_hash(content, intent.base_hash)
        if base is not None and hashed != base and (hashed is not None or not changes_since(content, base)[1]):
            # Both sent and they name different versions: the agent's view is confused, not stale.
            return reject(content, book, intent, Reason.INVALID_INTENT, now_ms, cause, hide_tokens=hide,
                          problem=f"base_hash is {'unknown' if hashed is None else f'version {hashed}'}, "
                                  f"base_version is {base}: send one, or both of the same version")
        if base is None and hashed is None:
            return reject(content, book, intent, Reason.VERSION_CONFLICT, now_ms, cause, hide_tokens=hide,
                          changes_since_base=[], base_too_old=True)
        base = hashed if base is None else base
    if base is not None and base != content.version:
        changes, too_old = changes_since(content, base)
        return reject(content, book, intent, Reason.VERSION_CONFLICT, now_ms, cause, hide_tokens=hide,
                      changes_since_base=changes, base_too_old=too_old or base > content.version)
    return Accepted(intent)


def _fencing_problem(book: LeaseBook, intent: ToolIntent, now_ms: int, rules: GatewayRules) -> Reason | None:
    token = intent.token
    assert token is not None
    problem = token_problem(book.holders, book.last_token, intent.agent_id, token, now_ms)
    if (problem is None and rules.require_exclusive and book.holders[token].mode != "exclusive"
            and intent.tool not in rules.shared_tools):
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
    book: LeaseBook, content: ContentState, intent: ToolIntent, outcome: ToolOutcome, now_ms: int, cause: Cause,
    hide_tokens: bool = False,
) -> GatewayEvent:
    """The event that records an accepted intent's tool run."""
    if outcome.ok:
        return ToolApplied(intent_id=intent.intent_id, agent_id=intent.agent_id, resource=intent.resource,
                           tool=intent.tool, token=intent.token, arguments_json=intent.arguments_json,
                           version=content.version + 1,
                           content_hash=next_hash(content.content_hash, intent), result_json=outcome.result_json,
                           request_sent_at_ms=intent.at_ms, at_ms=now_ms, cause=cause)
    details = {key: value for key, value in outcome.details if key not in RESERVED_KEYS}
    reason = Reason(outcome.reason) if outcome.reason in _CODES else Reason.TOOL_FAILED
    if reason != Reason.TOOL_FAILED:
        # A cause the tool named (the resource moved under the intent, say); ``by_tool`` tells a replay it
        # was the tool's answer, not the gate's.
        return reject(content, book, intent, reason, now_ms, cause, hide_tokens=hide_tokens, **details,
                      error=outcome.error[:2000], by_tool=True)
    return reject(content, book, intent, Reason.TOOL_FAILED, now_ms, cause, hide_tokens=hide_tokens, **details,
                  error=outcome.error[:2000])


_CODES = frozenset(Reason)

RESERVED_KEYS = frozenset({"reason", "resource", "you_sent", "current", "what_to_do", "error", "by_tool"})
"""Diagnostic keys a tool's details never replace."""


def evolve(content: ContentState, event: GatewayEvent, rules: GatewayRules | None = None) -> ContentState:
    """Fold ``event`` into ``content`` (in place) and return it."""
    limits = rules or GatewayRules()
    if isinstance(event, ToolApplied) and event.version == content.version + 1:
        content.history.append(Change(event.version, event.intent_id, event.agent_id, event.tool,
                                      event.arguments_json, event.content_hash, content.content_hash))
        del content.history[:-limits.history_limit]
        content.version = event.version
        content.content_hash = event.content_hash
    content.clock_ms = max(content.clock_ms, event.at_ms)
    outcomes = content.outcomes
    if event.intent_id in outcomes:
        return content
    if limits.forget_window_refusals and isinstance(event, ToolRejected) and event.reason in OUT_OF_WINDOW:
        return content  # refused for its send time alone, running nothing (see the theory of operation)
    outcomes[event.intent_id] = event
    # Forget outcomes sent before the window (refused as expired from now on), then, over the
    # limit, the oldest, raising the floor below which nothing is decided any more.
    horizon = content.clock_ms - limits.id_window_ms
    while outcomes:
        first = next(iter(outcomes.values()))
        if _sent_at(first) >= horizon:
            break
        del outcomes[first.intent_id]
    while len(outcomes) > limits.max_remembered_ids:
        sent = _sent_at(outcomes.pop(next(iter(outcomes))))
        content.forgotten_sent_ms = max(content.forgotten_sent_ms or sent, sent)
    return content


def _sent_at(event: GatewayEvent) -> int:
    """When the intent an outcome answers was sent (version-1 events: when it was decided)."""
    return event.request_sent_at_ms if event.request_sent_at_ms is not None else event.at_ms
