"""Pydantic models: the Python face of the Avro contract in ``schemas/``.

Each model mirrors exactly one ``.avsc`` file (``AVRO_NAME`` is the schema's full
name). ``tests/schemas/test_contract.py`` proves the mirror: same set of models as schema
files, same field names and types, and a lossless round trip for every model.

Conventions that keep the wire format language-neutral:

- times are integer milliseconds since the Unix epoch (``*_ms``);
- free-form payloads (tool arguments, results, diagnostics) travel as JSON text
  (``*_json``), so that a consumer in any language can read them without our types;
- every event a processor decides carries the ``Cause`` of the command that made it,
  so audit can replay decisions in exactly the recorded order.

Models are frozen: an event, once decided, is a fact.
"""

from __future__ import annotations

from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict


class Record(BaseModel):
    """Base of every contract model."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    AVRO_NAME: ClassVar[str] = ""


# -- nested records -------------------------------------------------------------


class Cause(BaseModel):
    """Where the command that caused a decision sits in the log."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    topic: str
    partition: int
    offset: int


class Holder(BaseModel):
    """One live lease on a resource."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    agent_id: str
    request_id: str
    token: int
    mode: str
    expires_at_ms: int


# -- lock commands (topic: resource commands, key: resource) ---------------------


class LockRequested(Record):
    """An agent asks for a lease on a resource (the Acquire command)."""

    AVRO_NAME: ClassVar[str] = "arbiter.lock.LockRequested"

    request_id: str
    agent_id: str
    resource: str
    mode: str
    ttl_ms: int
    priority: int = 0
    wait_ms: int = 0
    saga_id: str | None = None
    held_resources: list[str] = []
    at_ms: int


class LockRenewRequested(Record):
    """A holder asks to extend its lease."""

    AVRO_NAME: ClassVar[str] = "arbiter.lock.LockRenewRequested"

    request_id: str
    agent_id: str
    resource: str
    token: int
    ttl_ms: int | None = None
    at_ms: int


class LockReleaseRequested(Record):
    """A holder gives its lease back."""

    AVRO_NAME: ClassVar[str] = "arbiter.lock.LockReleaseRequested"

    request_id: str
    agent_id: str
    resource: str
    token: int
    at_ms: int


class LockCancelRequested(Record):
    """A waiter gives up on a queued request."""

    AVRO_NAME: ClassVar[str] = "arbiter.lock.LockCancelRequested"

    request_id: str
    agent_id: str
    resource: str
    target_request_id: str
    at_ms: int


class LockRevokeRequested(Record):
    """The deadlock detector or an operator takes a lease or a wait away."""

    AVRO_NAME: ClassVar[str] = "arbiter.lock.LockRevokeRequested"

    request_id: str
    resource: str
    agent_id: str
    token: int | None = None
    reason: str
    requested_by: str
    at_ms: int


class LockTick(Record):
    """Time passing, as a command: drives expiry and wait time-outs on one partition."""

    AVRO_NAME: ClassVar[str] = "arbiter.lock.LockTick"

    request_id: str
    partition: int
    at_ms: int


# -- lock events (topic: resource events, key: resource; copies to agent inbox) ---


class LockGranted(Record):
    """A lease was granted, with a fresh fencing token."""

    AVRO_NAME: ClassVar[str] = "arbiter.lock.LockGranted"

    request_id: str
    agent_id: str
    resource: str
    token: int
    mode: str
    expires_at_ms: int
    holders: list[Holder]
    resource_version: int
    warnings: list[str] = []
    request_sent_at_ms: int | None = None
    at_ms: int
    cause: Cause


class LockQueued(Record):
    """A request waits behind the current holders."""

    AVRO_NAME: ClassVar[str] = "arbiter.lock.LockQueued"

    request_id: str
    agent_id: str
    resource: str
    mode: str
    ttl_ms: int
    saga_id: str | None = None
    position: int
    priority: int
    wait_deadline_ms: int
    blocking_agents: list[str]
    warnings: list[str] = []
    request_sent_at_ms: int | None = None
    at_ms: int
    cause: Cause


class LockDenied(Record):
    """A lock command was refused; nothing changed."""

    AVRO_NAME: ClassVar[str] = "arbiter.lock.LockDenied"

    request_id: str
    agent_id: str
    resource: str
    reason: str
    detail: str
    request_sent_at_ms: int | None = None
    at_ms: int
    cause: Cause


class LockRenewed(Record):
    """A lease was extended."""

    AVRO_NAME: ClassVar[str] = "arbiter.lock.LockRenewed"

    request_id: str
    agent_id: str
    resource: str
    token: int
    expires_at_ms: int
    request_sent_at_ms: int | None = None
    at_ms: int
    cause: Cause


class LockReleased(Record):
    """A lease was given back by its holder."""

    AVRO_NAME: ClassVar[str] = "arbiter.lock.LockReleased"

    request_id: str
    agent_id: str
    resource: str
    token: int
    request_sent_at_ms: int | None = None
    at_ms: int
    cause: Cause


class LockExpired(Record):
    """A lease ran past its TTL without renewal; its token is dead."""

    AVRO_NAME: ClassVar[str] = "arbiter.lock.LockExpired"

    request_id: str
    agent_id: str
    resource: str
    token: int
    expires_at_ms: int
    at_ms: int
    cause: Cause


class LockRevoked(Record):
    """A lease was taken away (deadlock victim or operator); its token is dead."""

    AVRO_NAME: ClassVar[str] = "arbiter.lock.LockRevoked"

    request_id: str
    agent_id: str
    resource: str
    token: int
    reason: str
    by_request_id: str | None = None
    by_agent_id: str | None = None
    request_sent_at_ms: int | None = None
    at_ms: int
    cause: Cause


class LockCancelled(Record):
    """A queued request left the queue without a grant."""

    AVRO_NAME: ClassVar[str] = "arbiter.lock.LockCancelled"

    request_id: str
    agent_id: str
    resource: str
    reason: str
    by_request_id: str | None = None
    by_agent_id: str | None = None
    request_sent_at_ms: int | None = None
    at_ms: int
    cause: Cause


class LockWaitTimedOut(Record):
    """A queued request's wait time ran out."""

    AVRO_NAME: ClassVar[str] = "arbiter.lock.LockWaitTimedOut"

    request_id: str
    agent_id: str
    resource: str
    waited_ms: int
    at_ms: int
    cause: Cause


# -- tool intents and outcomes (same topics as locks: one order per resource) ------


class ToolIntent(Record):
    """An agent asks the gateway to run a tool against a resource."""

    AVRO_NAME: ClassVar[str] = "arbiter.tool.ToolIntent"

    intent_id: str
    agent_id: str
    resource: str
    token: int | None = None
    base_version: int | None = None
    base_hash: str | None = None
    tool: str
    arguments_json: str
    saga_id: str | None = None
    step: int | None = None
    is_compensation: bool = False
    at_ms: int


class ToolApplied(Record):
    """The gateway accepted an intent and the tool ran."""

    AVRO_NAME: ClassVar[str] = "arbiter.tool.ToolApplied"

    intent_id: str
    agent_id: str
    resource: str
    tool: str
    token: int | None = None
    arguments_json: str = "{}"
    version: int
    content_hash: str
    result_json: str
    request_sent_at_ms: int | None = None
    at_ms: int
    cause: Cause


class ToolRejected(Record):
    """The gateway refused an intent, or its tool failed; nothing was applied."""

    AVRO_NAME: ClassVar[str] = "arbiter.tool.ToolRejected"

    intent_id: str
    agent_id: str
    resource: str
    tool: str
    reason: str
    diagnostic_json: str
    request_sent_at_ms: int | None = None
    at_ms: int
    cause: Cause


class SnapshotRequested(Record):
    """An agent asks for a resource's current version, hash and holders, and, when it says so, its content."""

    AVRO_NAME: ClassVar[str] = "arbiter.tool.SnapshotRequested"

    request_id: str
    agent_id: str
    resource: str
    at_ms: int
    with_content: bool = False


class ResourceSnapshot(Record):
    """A resource's state at one point of its decision order."""

    AVRO_NAME: ClassVar[str] = "arbiter.tool.ResourceSnapshot"

    request_id: str
    agent_id: str
    resource: str
    version: int
    content_hash: str
    high_water_token: int
    holders: list[Holder]
    at_ms: int
    cause: Cause
    content_json: str | None = None


# -- wait-for graph ----------------------------------------------------------------


class WaitEdgeAdded(Record):
    """An agent now waits on another (queued behind a lease, or delegated to it)."""

    AVRO_NAME: ClassVar[str] = "arbiter.wait.WaitEdgeAdded"

    edge_id: str
    waiter: str
    holder: str
    source: str
    resource: str | None = None
    waiter_priority: int = 0
    waiter_registered_at_ms: int
    saga_id: str | None = None
    at_ms: int
    cause: Cause | None = None


class WaitEdgeRemoved(Record):
    """A wait ended: the edge leaves the graph."""

    AVRO_NAME: ClassVar[str] = "arbiter.wait.WaitEdgeRemoved"

    edge_id: str
    waiter: str
    holder: str
    source: str
    resource: str | None = None
    at_ms: int
    cause: Cause | None = None


class DeadlockDetected(Record):
    """A wait-for cycle was found and one victim chosen to break it."""

    AVRO_NAME: ClassVar[str] = "arbiter.wait.DeadlockDetected"

    detection_id: str
    victim: str
    cycle: list[str]
    cycle_json: str
    message: str
    saga_id: str | None = None
    at_ms: int
    cause: Cause


# -- sagas -----------------------------------------------------------------------


class SagaStep(Record):
    """A step of a saga changed state (started, completed or failed)."""

    AVRO_NAME: ClassVar[str] = "arbiter.saga.SagaStep"

    saga_id: str
    step: int
    agent_id: str
    status: str
    intent_id: str
    resource: str
    tool: str
    arguments_json: str
    compensate_tool: str | None = None
    compensate_arguments_json: str | None = None
    at_ms: int


class CompensationRequested(Record):
    """A saga is aborting: its completed steps must be undone in reverse order."""

    AVRO_NAME: ClassVar[str] = "arbiter.saga.CompensationRequested"

    saga_id: str
    reason: str
    requested_by: str
    at_ms: int
    cause: Cause | None = None


class Compensated(Record):
    """One completed step's compensation ran (at most once per step)."""

    AVRO_NAME: ClassVar[str] = "arbiter.saga.Compensated"

    saga_id: str
    step: int
    compensation_intent_id: str
    tool: str
    at_ms: int
    cause: Cause


class SagaFinished(Record):
    """A saga ended: COMPLETED, COMPENSATED, or COMPENSATION_FAILED (a human must act)."""

    AVRO_NAME: ClassVar[str] = "arbiter.saga.SagaFinished"

    saga_id: str
    outcome: str
    detail: str | None = None
    at_ms: int
    cause: Cause


# -- merge trains (topic: resource commands / events, key: repo:<name>) ------------------


class CheckVerdict(Record):
    """A check runner's signed verdict on one merge of a repository's train."""

    AVRO_NAME: ClassVar[str] = "arbiter.train.CheckVerdict"

    verdict_id: str
    runner_id: str
    resource: str
    intent_id: str
    base: str
    commit: str
    tree: str
    check_digest: str
    command: str = ""
    passed: bool
    conflicts: list[str] = []
    exit_code: int | None = None
    stopped: str
    output_digest: str
    output_bytes: int
    output_tail: str
    seconds_ms: int
    at_ms: int


class MergeQueued(Record):
    """A merge joined its repository's train."""

    AVRO_NAME: ClassVar[str] = "arbiter.train.MergeQueued"

    intent_id: str
    agent_id: str
    resource: str
    target: str
    token: int
    commit: str
    head: str
    check_digest: str | None = None
    arguments_json: str
    position: int
    request_sent_at_ms: int | None = None
    at_ms: int
    cause: Cause


class MergeChecked(Record):
    """A runner's verdict on a merge of the train, recorded in the repository's order."""

    AVRO_NAME: ClassVar[str] = "arbiter.train.MergeChecked"

    intent_id: str
    agent_id: str
    resource: str
    verdict_id: str
    runner_id: str
    base: str
    commit: str
    tree: str
    check_digest: str
    command: str = ""
    passed: bool
    conflicts: list[str] = []
    exit_code: int | None = None
    stopped: str
    output_digest: str
    output_bytes: int
    output_tail: str
    seconds_ms: int
    at_ms: int
    cause: Cause


class MergeReplanned(Record):
    """A merge at the front could not land as checked (the target moved): it waits for a new check."""

    AVRO_NAME: ClassVar[str] = "arbiter.train.MergeReplanned"

    intent_id: str
    agent_id: str
    resource: str
    target: str
    head: str
    reason: str
    at_ms: int
    cause: Cause


# -- system ------------------------------------------------------------------------


class Ping(Record):
    """A health probe that travels the resource-command path to a worker and back."""

    AVRO_NAME: ClassVar[str] = "arbiter.system.Ping"

    request_id: str
    agent_id: str
    at_ms: int


class Pong(Record):
    """A worker's answer to a Ping, sent to the agent's inbox."""

    AVRO_NAME: ClassVar[str] = "arbiter.system.Pong"

    request_id: str
    agent_id: str
    worker_id: str
    at_ms: int
    cause: Cause


class WorkerStarted(Record):
    """A worker's announcement when it starts: the rules it decides by, for audit and replay."""

    AVRO_NAME: ClassVar[str] = "arbiter.system.WorkerStarted"

    worker_id: str
    rules_json: str
    processing_guarantee: str
    partitions: int
    at_ms: int


class IdentityRegistered(Record):
    """One key of one identity, as the admin registered it (``arbiter.schemas.identity``)."""

    AVRO_NAME: ClassVar[str] = "arbiter.system.IdentityRegistered"

    key_id: str
    name: str
    role: str
    public_key: bytes
    tenant: str = ""
    allow: list[str] = []
    status: str
    valid_from_ms: int
    valid_until_ms: int | None = None
    reason: str = ""
    credential: str = ""
    at_ms: int


class DeadLetter(Record):
    """A message a processor could not use, kept with the reason and its original bytes."""

    AVRO_NAME: ClassVar[str] = "arbiter.system.DeadLetter"

    reason: str
    detail: str
    processor: str
    source: Cause
    key: bytes | None = None
    value: bytes
    at_ms: int


MODELS: tuple[type[Record], ...] = tuple(
    cls for cls in list(globals().values())
    if isinstance(cls, type) and issubclass(cls, Record) and cls is not Record
)
"""Every top-level message model, in definition order."""


_new = object.__new__
_set_dict = object.__setattr__
_SLOTS = BaseModel.__dict__
_set_fields_set = _SLOTS["__pydantic_fields_set__"].__set__
_set_extra = _SLOTS["__pydantic_extra__"].__set__
_set_private = _SLOTS["__pydantic_private__"].__set__
_DEFAULTS: dict[type[BaseModel], dict[str, Any]] = {}

R = TypeVar("R", bound=BaseModel)


def trusted(cls: type[R], **values: Any) -> R:
    """A record built from values its caller guarantees fit the schema, without validation.

    For the pure cores' hot path only: they build decisions from records that were validated
    when decoded, and validation cost ~3 us of each decision's ~10. The result equals the
    validated record (``tests/schemas/test_contract.py`` checks every model); anything built from
    outside input must use the model's constructor.
    """
    template = _DEFAULTS.get(cls)
    if template is None:
        # Every field in the schema's order (serializers follow the dict's order), required ones unset.
        template = _DEFAULTS[cls] = {name: None if field.is_required() else field.default
                                     for name, field in cls.model_fields.items()}
    fields = template.copy()
    fields.update(values)
    record = _new(cls)
    _set_dict(record, "__dict__", fields)
    _set_fields_set(record, set(values))
    _set_extra(record, None)
    _set_private(record, None)
    return record
