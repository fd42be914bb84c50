"""The front door's request bodies (validated before anything is sent) and how an outcome is answered."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from arbiter.agents import Outcome

from .errors import status_of


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


Resource = Annotated[str, Field(min_length=1, max_length=1024, description="The resource's name.")]


class AcquireBody(_Body):
    resource: Resource
    ttl: float = Field(30.0, gt=0, le=86_400, description="Seconds the lease lives unless renewed.")
    mode: Literal["exclusive", "shared"] = "exclusive"
    priority: int = Field(0, ge=-(2**31), lt=2**31, description="Higher wins a deadlock.")
    wait: float = Field(0.0, ge=0, le=3_600, description="Seconds to wait in the queue (0: try once). The "
                                                          "request is held open until granted, refused or timed out.")
    saga_id: str | None = Field(None, max_length=1024)


class TokenBody(_Body):
    resource: Resource
    token: int = Field(ge=0, lt=2**63, description="The lease's fencing token.")


class RenewBody(TokenBody):
    ttl: float | None = Field(None, gt=0, le=86_400, description="New TTL in seconds (default: the lease's).")


class ExecuteBody(_Body):
    resource: Resource
    tool: str = Field(min_length=1, max_length=200)
    args: dict[str, Any] = Field(default_factory=dict, description="The tool's arguments (one JSON object).")
    token: int | None = Field(None, ge=0, lt=2**63, description="The lease's fencing token (fenced writes).")
    base_version: int | None = Field(None, ge=0, lt=2**63, description="The version you read (optimistic writes).")
    base_hash: str | None = Field(None, max_length=200)
    intent_id: str | None = Field(None, min_length=1, max_length=200,
                                  description="Reusing one returns the first outcome: the tool never runs twice.")


class CommitBody(_Body):
    resource: Resource
    base_version: int = Field(ge=0, lt=2**63)
    patch: dict[str, Any] = Field(description="A JSON merge patch.")
    token: int | None = Field(None, ge=0, lt=2**63)
    intent_id: str | None = Field(None, min_length=1, max_length=200)


class SagaBody(_Body):
    name: str = Field(min_length=1, max_length=200, pattern=r"^[^/\s]+$")


class Compensation(_Body):
    tool: str = Field(min_length=1, max_length=200)
    args: dict[str, Any] = Field(default_factory=dict)


class StepBody(ExecuteBody):
    compensate: Compensation | None = None


class AbortBody(_Body):
    reason: str = Field("aborted_by_agent", min_length=1, max_length=200)


def outcome_answer(outcome: Outcome) -> JSONResponse:
    """An applied write (200), or the gateway's refusal with the status that fits."""
    body = {"applied": outcome.applied, "intent_id": outcome.intent_id, "resource": outcome.resource,
            "tool": outcome.tool, "reason": outcome.reason}
    if outcome.applied:
        body.update(version=outcome.version, content_hash=outcome.content_hash, result=outcome.result)
        return JSONResponse(body)
    return JSONResponse({**body, **outcome.diagnostic, "reason": outcome.reason},
                        status_code=status_of(outcome.reason))
