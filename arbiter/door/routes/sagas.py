"""``/v1/sagas``: start a saga, run its steps (each with how to undo it), complete or abort it."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path, Request

from arbiter.agents import Saga, SagaAborted, SagaStepRejected

from ..bodies import AbortBody, SagaBody, StepBody, outcome_answer
from ..calls import Creds, agent
from ..errors import Refusal
from ..state import AgentState

router = APIRouter(prefix="/v1/sagas", tags=["sagas"])

SagaId = Annotated[str, Path(description="The id POST /v1/sagas answered, e.g. saga:AGENT/NAME:ID: as it is "
                                         "(its '/' and ':' included) or percent-encoded.")]
"""A saga's id holds '/' (``saga:<agent>/<name>:<id>``): the routes take it as a path, up to their last segment."""


@router.post("", summary="Start a saga")
async def saga_start(body: SagaBody, request: Request, credentials: Creds) -> Any:
    """Its id (sagas live on the door that started them)."""
    async with agent(request, credentials) as state:
        saga = state.client.open_saga(body.name)
        state.sagas[saga.saga_id] = saga
        return {"saga_id": saga.saga_id}


def _saga_of(state: AgentState, saga_id: str) -> Saga:
    saga = state.sagas.get(saga_id)
    if saga is None:
        raise Refusal(404, "unknown_saga", f"{state.name!r} has no open saga {saga_id!r} on this door",
                      "Start one with POST /v1/sagas (sagas live on the door that started them).")
    return saga


@router.post("/{saga_id:path}/steps", summary="Run one step; name how to undo it")
async def saga_step(saga_id: SagaId, body: StepBody, request: Request, credentials: Creds) -> Any:
    """The step's outcome, as an execute's."""
    async with agent(request, credentials) as state:
        saga = _saga_of(state, saga_id)
        compensate = None if body.compensate is None else (body.compensate.tool, body.compensate.args)
        try:
            outcome = await saga.step(body.resource, body.tool, body.args, compensate=compensate,
                                      base_version=body.base_version, token=body.token)
        except SagaStepRejected as exc:
            outcome = exc.outcome
        except SagaAborted as exc:
            raise Refusal(409, "saga_aborted", str(exc), "Its steps are being compensated: end it with POST "
                          ".../abort (or .../complete) to learn how it ended.") from None
        return outcome_answer(outcome)


async def _end(state: AgentState, saga_id: str, abort: str | None) -> Any:
    saga = _saga_of(state, saga_id)
    try:
        finished = await state.client.finish_saga(saga, abort)
    finally:
        state.sagas.pop(saga_id, None)
    return {"saga_id": saga_id, "outcome": finished.outcome, "detail": finished.model_dump(mode="json")}


@router.post("/{saga_id:path}/complete", summary="End a saga: COMPLETED")
async def saga_complete(saga_id: SagaId, request: Request, credentials: Creds) -> Any:
    """``COMPLETED``, or ``COMPENSATED`` if it was aborted meanwhile."""
    async with agent(request, credentials) as state:
        return await _end(state, saga_id, None)


@router.post("/{saga_id:path}/abort", summary="Abort a saga: its steps are compensated")
async def saga_abort(saga_id: SagaId, body: AbortBody, request: Request, credentials: Creds) -> Any:
    """``COMPENSATED`` once every completed step is undone (``COMPENSATION_FAILED``: a human must act)."""
    async with agent(request, credentials) as state:
        return await _end(state, saga_id, body.reason)
