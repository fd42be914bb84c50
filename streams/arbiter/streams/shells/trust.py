"""The trust gate every input passes before a processor decides it.

The worker and the audit's replay both run each input through ``Gate.admit`` (in
``arbiter.streams.shells.pipeline``): verify the signature against the registry (``arbiter.schemas.identity``),
then the rules of who may send what (``arbiter.streams.cores.trust``). A refused input changes nothing:
the agent it claims to come from gets a denial with the reason (``unauthenticated``,
``forbidden``, or the pipeline's ``misrouted``) where the input type has an answer (lock
commands, intents, snapshots, pings), and it is dead-lettered.

With verification off (``Settings.verify_signatures``, development only, announced on
every start) every input passes, as before the trust boundary.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from arbiter.schemas import (
    Cause,
    LockCancelRequested,
    LockDenied,
    LockReleaseRequested,
    LockRenewRequested,
    LockRequested,
    Ping,
    Record,
    SnapshotRequested,
    ToolIntent,
    ToolRejected,
)
from arbiter.schemas.identity import RESERVED_PREFIXES, Headers, Refused, Registry, Verified
from arbiter.schemas.reasons import what_to_do
from arbiter.streams.cores.trust import authorize
from arbiter.streams.shells.inputs import RawInput
from arbiter.streams.shells.routes import Routes

Admitted = Verified | None
"""Who sent an admitted input (None: verification is off)."""


@dataclass
class Gate:
    """Decides whether an input may be decided at all, and who sent it."""

    registry: Registry
    enabled: bool = True

    def admit(self, topic: str, key: bytes | None, value: bytes, headers: Headers | None, record: Record,
              appended_at_ms: int) -> Admitted | Refused:
        """The verified sender of ``record``, or why it is refused."""
        if not self.enabled:
            return None
        sender = self.registry.verify(topic, key, value, headers, appended_at_ms)
        if isinstance(sender, Refused):
            return sender
        problem = authorize(sender.identity, record)
        if problem is not None:
            return Refused(*problem)
        return sender


CATCH_UP_SLACK_MS = 5_000
"""How far a broker's append time may run ahead of this worker's clock (see ``LiveTrust``)."""


@dataclass
class LiveTrust:
    """The gate as a worker runs it: over the registry it follows, with one more look at the registry
    for a key it does not know yet (registered a moment ago).

    That look is taken only for an input appended after the last look began (less a slack for the
    broker's clock): a key registered before that look is known already, so a flood of records
    signed by unknown keys costs one look per batch, never one per record."""

    gate: Gate
    catch_up: Callable[[], Awaitable[object]]
    clock: Callable[[], int]
    _looked_at_ms: int = field(default=0, init=False)

    async def admit(self, raw: RawInput, record: Record) -> Verified | Refused | None:
        """The gate's verdict on one input."""
        if not self.gate.enabled:
            return None
        admitted = self.gate.admit(raw.topic, raw.key, raw.value or b"", raw.headers, record, raw.timestamp_ms)
        if isinstance(admitted, Refused) and admitted.unknown_key \
                and raw.timestamp_ms + CATCH_UP_SLACK_MS >= self._looked_at_ms:
            self._looked_at_ms = self.clock()
            await self.catch_up()
            admitted = self.gate.admit(raw.topic, raw.key, raw.value or b"", raw.headers, record, raw.timestamp_ms)
        return admitted


def refusal_answers(record: Record, refused: Refused, routes: Routes, now_ms: int,
                    cause: Cause) -> list[tuple[str, bytes, Record]]:
    """What the agent a refused input names is told (topic, key, record): a denial for the lock
    commands, intents, snapshots and pings that expect an answer, at once (an agent waiting for a
    snapshot outside its prefixes hears ``forbidden``, not silence); nothing for the rest (the dead
    letter has it)."""
    agent = getattr(record, "agent_id", None)
    if not isinstance(agent, str) or not agent or agent.startswith(RESERVED_PREFIXES):
        return []  # a saga's own agent never hears of input it did not send
    diagnostic = json.dumps({"reason": str(refused.reason), "detail": refused.detail[:1000],
                             "what_to_do": what_to_do(refused.reason)}, sort_keys=True)
    answer: Record
    if isinstance(record, LockRequested | LockRenewRequested | LockReleaseRequested | LockCancelRequested
                  | SnapshotRequested):
        answer = LockDenied(request_id=record.request_id, agent_id=agent, resource=record.resource,
                            reason=refused.reason, detail=diagnostic, request_sent_at_ms=record.at_ms,
                            at_ms=now_ms, cause=cause)
    elif isinstance(record, Ping):
        answer = LockDenied(request_id=record.request_id, agent_id=agent, resource="", reason=refused.reason,
                            detail=diagnostic, request_sent_at_ms=record.at_ms, at_ms=now_ms,
                            cause=cause)
    elif isinstance(record, ToolIntent):
        answer = ToolRejected(intent_id=record.intent_id, agent_id=agent, resource=record.resource, tool=record.tool,
                              reason=refused.reason, diagnostic_json=diagnostic,
                              request_sent_at_ms=record.at_ms, at_ms=now_ms, cause=cause)
    else:
        return []
    return [(routes.agent_inbox, agent.encode(), answer)]


__all__ = ["Admitted", "Gate", "LiveTrust", "Refused", "Verified", "refusal_answers"]
