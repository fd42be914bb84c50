"""``/v1/execute``, ``/v1/commit``, ``/v1/resources``: writes through the gateway, and reads."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path, Request

from ..bodies import CommitBody, ExecuteBody, outcome_answer
from ..calls import Creds, agent

router = APIRouter(tags=["gateway"])


@router.post("/v1/execute", summary="Run a tool on a resource through the gateway")
async def execute(body: ExecuteBody, request: Request, credentials: Creds) -> Any:
    """Applied (200, the new version and the tool's result), or refused with the gateway's diagnostic."""
    async with agent(request, credentials) as state:
        return outcome_answer(await state.client.execute(
            body.resource, body.tool, body.args, token=body.token, base_version=body.base_version,
            base_hash=body.base_hash, intent_id=body.intent_id))


@router.post("/v1/commit", summary="Optimistic write: a JSON merge patch at a base version")
async def commit(body: CommitBody, request: Request, credentials: Creds) -> Any:
    """Applied, or 409 ``version_conflict`` with ``changes_since_base`` to rebase on."""
    async with agent(request, credentials) as state:
        return outcome_answer(await state.client.execute(
            body.resource, "commit", {"patch": body.patch}, token=body.token, base_version=body.base_version,
            intent_id=body.intent_id))


@router.get("/v1/resources/{resource:path}", summary="A resource's version, hash, holders and content")
async def snapshot(resource: Annotated[str, Path(description="The resource's name, e.g. doc:a/b: as it is "
                                                             "('/' and ':' included) or percent-encoded.")],
                   request: Request, credentials: Creds, content: bool = False) -> Any:
    """The resource as its decision order stands; ``?content=true`` adds its content (a document's
    revision and body, an account's balance; null when the tools keep none). 403 outside the agent's
    prefixes."""
    async with agent(request, credentials) as state:
        snap = await state.client.snapshot(resource, content=content)
        answer = {"resource": snap.resource, "version": snap.version, "content_hash": snap.content_hash,
                  "high_water_token": snap.high_water_token, "holders": snap.holders}
        return {**answer, "content": snap.content} if content else answer
