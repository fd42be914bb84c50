"""Who may send what: the trust boundary's rules, pure.

A message reaches these rules only after its signature verified (``arbiter.schemas.identity``),
so the signer's name, role and allowed prefixes are facts. The rules:

- **Workers** may send anything: they are the processors (ticks, wait-for edges,
  revocations by the detector, compensation requests, the commands a saga sends as
  ``saga:<id>``), and they only send what a core decided.
- **Admins** may send the operator's overrides: a revocation (force-release) with a
  reason, a saga abort, and the read-only requests (snapshot, ping). Nothing else: an
  admin who wants to act as an agent registers one.
- **Check runners** may send their verdicts on merges (``CheckVerdict``), naming themselves, on the
  repositories their allowed prefixes cover, and nothing else: a runner's pass is what lands a merge.
- **Agents** may send their own lock commands, intents, saga steps, saga aborts,
  snapshots and pings, and nothing processor-only. Every agent id the message names is
  the signer's; every resource it names lies under the signer's allowed prefixes; no
  request or intent id of theirs lies in a namespace the system derives ids in
  (``saga:``), so no derived id can be pre-claimed.

What a saga processor may do is bounded here too: a saga's owner is in its id
(``saga:<agent>/...``), so a step or an abort is accepted only from the agent that owns
the saga, and a step only on a resource that agent may touch: the saga processor never
acts with more authority than its owner.
"""

from __future__ import annotations

from arbiter.schemas import (
    CheckVerdict,
    CompensationRequested,
    IdentityRegistered,
    LockCancelRequested,
    LockReleaseRequested,
    LockRenewRequested,
    LockRequested,
    LockRevokeRequested,
    Ping,
    Record,
    SagaStep,
    SnapshotRequested,
    ToolIntent,
    WaitEdgeAdded,
    WaitEdgeRemoved,
)
from arbiter.schemas.reasons import Reason
from arbiter.schemas.roles import RESERVED_PREFIXES, ROLE_ADMIN, ROLE_AGENT, ROLE_RUNNER, ROLE_WORKER

AGENT_COMMANDS = (LockRequested, LockRenewRequested, LockReleaseRequested, LockCancelRequested, ToolIntent, SagaStep,
                  CompensationRequested, SnapshotRequested, Ping, WaitEdgeAdded, WaitEdgeRemoved)
"""What an agent may send (wait edges: only its own delegations, never the lease book's).
Everything else on the command topics is a processor's or an admin's."""

ADMIN_COMMANDS = (LockRevokeRequested, CompensationRequested, SnapshotRequested, Ping)
"""What an admin may send: the overrides (with a reason) and reads."""


def owned_saga_prefix(agent_id: str) -> str:
    """Every saga an agent starts has an id starting with this, so its owner is in its id."""
    return f"saga:{agent_id}/"


def saga_owner(saga_id: str) -> str:
    """The agent whose saga ``saga_id`` is ("" when the id names none). Exact, as a name holds no '/'."""
    owner, slash, _ = saga_id.removeprefix("saga:").partition("/")
    return owner if saga_id.startswith("saga:") and slash else ""


def allowed(identity: IdentityRegistered, resource: str) -> bool:
    """Whether ``identity`` may act on ``resource`` (no prefixes: every resource)."""
    return not identity.allow or any(resource.startswith(prefix) for prefix in identity.allow)


def _acting_as(record: Record) -> str | None:
    """The agent a command acts as."""
    if isinstance(record, CompensationRequested):
        return record.requested_by
    if isinstance(record, WaitEdgeAdded | WaitEdgeRemoved):
        return record.waiter
    return record.__dict__.get("agent_id")


def _ids(record: Record) -> list[str]:
    # ``__dict__`` holds a model's fields: a getattr of a field the model lacks costs pydantic an
    # exception each time, and this runs for every command a worker or a front door checks.
    fields = record.__dict__
    return [value for name in ("request_id", "intent_id", "target_request_id")
            if isinstance(value := fields.get(name), str)]


def authorize(identity: IdentityRegistered, record: Record) -> tuple[Reason, str] | None:
    """Why ``identity`` may not send ``record`` (None: it may)."""
    kind = type(record).__name__
    if identity.role == ROLE_WORKER:
        return None
    if identity.role == ROLE_RUNNER:
        if not isinstance(record, CheckVerdict):
            return Reason.FORBIDDEN, f"a check runner sends verdicts, not {kind}"
        if record.runner_id != identity.name:
            return Reason.FORBIDDEN, f"the verdict is signed by {identity.name!r} but names {record.runner_id!r}"
        if not allowed(identity, record.resource):
            return Reason.FORBIDDEN, f"{identity.name!r} may not check {record.resource!r}"
        return None
    if identity.role == ROLE_ADMIN:
        if not isinstance(record, ADMIN_COMMANDS):
            return Reason.FORBIDDEN, f"an admin sends overrides and reads, not {kind}; register an agent to act"
        if isinstance(record, LockRevokeRequested | CompensationRequested) and not record.reason.strip():
            return Reason.FORBIDDEN, "an operator's override must say why (a reason)"
        if isinstance(record, LockRevokeRequested) and record.requested_by != identity.name:
            return Reason.FORBIDDEN, f"the override is signed by {identity.name!r} but names {record.requested_by!r}"
        if isinstance(record, CompensationRequested) and record.requested_by != identity.name:
            return Reason.FORBIDDEN, f"the abort is signed by {identity.name!r} but names {record.requested_by!r}"
        return None
    if identity.role != ROLE_AGENT:
        return Reason.FORBIDDEN, f"unknown role {identity.role!r}"
    if not isinstance(record, AGENT_COMMANDS):
        return Reason.FORBIDDEN, f"{kind} is sent only by workers or an admin, not by agent {identity.name!r}"
    acting = _acting_as(record)
    if acting != identity.name:
        return Reason.FORBIDDEN, f"signed by {identity.name!r} but acts as {acting!r}"
    if isinstance(record, WaitEdgeAdded | WaitEdgeRemoved) and (
            record.source != "delegation" or not record.edge_id.startswith(f"delegation|{identity.name}|")):
        return Reason.FORBIDDEN, "an agent sends only its own delegation edges; the lease book's are the workers'"
    saga_id = record.__dict__.get("saga_id")
    if isinstance(saga_id, str) and not saga_id.startswith(owned_saga_prefix(identity.name)):
        return Reason.FORBIDDEN, (f"saga {saga_id!r} is not {identity.name!r}'s: an agent's saga ids start with "
                                  f"{owned_saga_prefix(identity.name)!r}")
    for value in _ids(record):
        if value.startswith(RESERVED_PREFIXES):
            return Reason.FORBIDDEN, f"id {value!r} is in a namespace only the system derives ids in"
    resource = record.__dict__.get("resource")
    if isinstance(record, SagaStep) and record.status == "saga_completed":
        resource = None  # the saga's end names no resource
    if isinstance(resource, str) and not allowed(identity, resource):
        return Reason.FORBIDDEN, (f"{identity.name!r} may act only on resources starting with "
                                  f"{', '.join(identity.allow)}; not on {resource!r}")
    if isinstance(record, ToolIntent) and record.is_compensation:
        return Reason.FORBIDDEN, "only a saga's processor sends compensations"
    return None
