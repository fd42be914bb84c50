"""``/v1/sagas``: start a saga, run its steps (each with how to undo it), complete or abort it."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from arbiter.agents import Saga, SagaStepRejected

from ..bodies import AbortBody, SagaBody, StepBody, outcome_answer
from ..calls import Creds, agent
from ..errors import Refusal
from ..state import AgentState

router = APIRouter(prefix="/v1/sagas", tags=["sagas"])


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


@router.post("/{saga_id}/steps", summary="Run one step; name how to undo it")
async def saga_step(saga_id: str, body: StepBody, request: Request, credentials: Creds) -> Any:
    """The step's outcome, as an execute's."""
    async with agent(request, credentials) as state:
        saga = _saga_of(state, saga_id)
        compensate = None if body.compensate is None else (body.compensate.tool, body.compensate.args)
        try:
            outcome = await saga.step(body.resource, body.tool, body.args, compensate=compensate,
                                      base_version=body.base_version, token=body.token)
        except SagaStepRejected as exc:
            outcome = exc.outcome
        return outcome_answer(outcome)


async def _end(state: AgentState, saga_id: str, abort: str | None) -> Any:
    saga = _saga_of(state, saga_id)
    try:
        finished = await state.client.finish_saga(saga, abort)
    finally:
        state.sagas.pop(saga_id, None)
    return {"saga_id": saga_id, "outcome": finished.outcome, "detail": finished.model_dump(mode="json")}


@router.post("/{saga_id}/complete", summary="End a saga: COMPLETED")
async def saga_complete(saga_id: str, request: Request, credentials: Creds) -> Any:
    """``COMPLETED``, or ``COMPENSATED`` if it was aborted meanwhile."""
    async with agent(request, credentials) as state:
        return await _end(state, saga_id, None)


@router.post("/{saga_id}/abort", summary="Abort a saga: its steps are compensated")
async def saga_abort(saga_id: str, body: AbortBody, request: Request, credentials: Creds) -> Any:
    """``COMPENSATED`` once every completed step is undone (``COMPENSATION_FAILED``: a human must act)."""
    async with agent(request, credentials) as state:
        return await _end(state, saga_id, body.reason)
