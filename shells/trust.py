"""The trust gate every input passes before a processor decides it.

The worker and the audit's replay both run each input through ``Gate.admit``: verify the
signature against the registry (``contract.identity``), then the rules of who may send
what (``cores.trust``). A refused input changes nothing: the agent it claims to come from
gets a denial with the reason (``unauthenticated`` or ``forbidden``) where the input
type has one, and the worker dead-letters a copy.

With verification off (``Settings.verify_signatures``, development only, announced on
every start) every input passes, as before the trust boundary.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from contract import (
    Cause,
    LockCancelRequested,
    LockDenied,
    LockReleaseRequested,
    LockRenewRequested,
    LockRequested,
    Record,
    ToolIntent,
    ToolRejected,
)
from contract.identity import RESERVED_PREFIXES, Headers, Refused, Registry, Verified
from contract.reasons import what_to_do
from cores.trust import authorize

from .routes import Routes

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


def refusal_answers(record: Record, refused: Refused, routes: Routes, now_ms: int,
                    cause: Cause) -> list[tuple[str, bytes, Record]]:
    """What the agent a refused input names is told (topic, key, record): a denial for the lock
    commands and intents that expect an answer; nothing for the rest (the dead letter has it)."""
    agent = getattr(record, "agent_id", None)
    if not isinstance(agent, str) or not agent or agent.startswith(RESERVED_PREFIXES):
        return []  # a saga's own agent never hears of input it did not send
    detail = refused.detail[:1000]
    answer: Record
    if isinstance(record, LockRequested | LockRenewRequested | LockReleaseRequested | LockCancelRequested):
        answer = LockDenied(request_id=record.request_id, agent_id=agent, resource=record.resource,
                            reason=refused.reason, detail=detail, request_sent_at_ms=record.sent_at_ms,
                            decided_at_ms=now_ms, cause=cause)
    elif isinstance(record, ToolIntent):
        diagnostic = {"reason": str(refused.reason), "detail": detail, "what_to_do": what_to_do(refused.reason)}
        answer = ToolRejected(intent_id=record.intent_id, agent_id=agent, resource=record.resource, tool=record.tool,
                              reason=refused.reason, diagnostic_json=json.dumps(diagnostic, sort_keys=True),
                              request_sent_at_ms=record.sent_at_ms, decided_at_ms=now_ms, cause=cause)
    else:
        return []
    return [(routes.agent_inbox, agent.encode(), answer)]


__all__ = ["Admitted", "Gate", "Refused", "Verified", "refusal_answers"]
