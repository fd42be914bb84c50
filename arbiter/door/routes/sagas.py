"""``/v1/sagas``: start a saga, run its steps (each with how to undo it), complete or abort it."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path, Request
from fastapi.responses import JSONResponse

from arbiter.agents import Saga, SagaAborted, SagaStepRejected
from arbiter.schemas import SagaFinished
from arbiter.schemas.reasons import what_to_do
from arbiter.streams.cores.trust import owned_saga_prefix

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
    """Its id, ``saga:<agent>/<name>:<id>`` (its steps run on the door that started it)."""
    async with agent(request, credentials) as state:
        limit = request.app.state.door.settings.door_max_open_sagas_per_agent
        if len(state.sagas) >= limit:
            raise Refusal(429, "too_many_sagas", f"{state.name!r} has {len(state.sagas)} sagas open on this door "
                          f"(ARBITER_DOOR_MAX_OPEN_SAGAS_PER_AGENT={limit})",
                          "End one first (POST /v1/sagas/{id}/complete or .../abort), or finish the work of one "
                          "saga before starting the next.", headers={"Retry-After": "1"})
        saga = state.client.open_saga(body.name)
        state.sagas[saga.saga_id] = saga
        return {"saga_id": saga.saga_id}


def _saga_of(state: AgentState, saga_id: str) -> Saga:
    saga = state.sagas.get(saga_id)
    if saga is not None:
        return saga
    finished = state.ended.get(saga_id)
    if finished is not None:
        raise Refusal(409, "saga_ended", f"saga {saga_id!r} has ended: {finished.outcome}",
                      "Start a new saga with POST /v1/sagas for more work.")
    raise Refusal(404, "unknown_saga", f"{state.name!r} has no open saga {saga_id!r} on this door",
                  "Start one with POST /v1/sagas (its steps run on the door that started it); a saga opened "
                  "elsewhere (another door, a process that is gone) can still be aborted here by its id.")


def _answer(finished: SagaFinished) -> dict[str, Any]:
    return {"saga_id": finished.saga_id, "outcome": finished.outcome, "detail": finished.model_dump(mode="json")}


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
    """End a saga open here; answer how a saga that ended already ended; abort one opened elsewhere."""
    if saga_id not in state.sagas and saga_id in state.ended:
        return _answer(state.ended[saga_id])  # ended already (an operator aborted it, say): how it ended
    if saga_id not in state.sagas and abort is not None:
        return await _abort_elsewhere(state, saga_id, abort)
    saga = _saga_of(state, saga_id)
    try:
        finished = await state.client.finish_saga(saga, abort)
    finally:
        state.sagas.pop(saga_id, None)
    return _answer(finished)


async def _abort_elsewhere(state: AgentState, saga_id: str, reason: str) -> JSONResponse:
    """Abort one of the agent's sagas that is not open on this door: 202, its end comes to the inbox."""
    if not saga_id.startswith(owned_saga_prefix(state.name)):
        raise Refusal(403, "forbidden", f"saga {saga_id!r} is not {state.name!r}'s: an agent's saga ids start "
                      f"with {owned_saga_prefix(state.name)!r}", what_to_do("forbidden"))
    await state.client.abort_saga(saga_id, reason)
    return JSONResponse({"saga_id": saga_id, "outcome": None, "requested": True,
                         "detail": "not open on this door: its abort is sent; its completed steps are compensated, "
                                   "and its end (SagaFinished) comes to the agent's inbox. Abort it again here to "
                                   "learn how it ended once it has."}, status_code=202)


@router.post("/{saga_id:path}/complete", summary="End a saga: COMPLETED")
async def saga_complete(saga_id: SagaId, request: Request, credentials: Creds) -> Any:
    """``COMPLETED``, or ``COMPENSATED`` if it was aborted meanwhile."""
    async with agent(request, credentials) as state:
        return await _end(state, saga_id, None)


@router.post("/{saga_id:path}/abort", summary="Abort a saga: its steps are compensated",
             responses={202: {"description": "Not open on this door: the abort is sent; the saga's end comes to "
                                             "the agent's inbox"}})
async def saga_abort(saga_id: SagaId, body: AbortBody, request: Request, credentials: Creds) -> Any:
    """``COMPENSATED`` once every completed step is undone (``COMPENSATION_FAILED``: a human must act). A saga
    of the agent's not open on this door (another door's, a process's that is gone) is aborted by its id:
    202, and its end comes to the agent's inbox."""
    async with agent(request, credentials) as state:
        return await _end(state, saga_id, body.reason)
