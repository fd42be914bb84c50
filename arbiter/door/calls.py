"""What every route shares: the calling agent (checked before its body is read), its state on this
door for the length of one rate-limited call, and a call that ends when its caller hangs up."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from arbiter.schemas.identity import Signer

from .state import AgentState, Door

_bearer = HTTPBearer(auto_error=False, description="A front-door credential (arbiter agents api-key NAME).")


async def _authenticated(request: Request,
                         credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> Signer:
    """The calling agent's credential, checked before its request body is read (a bad key is 401, not 422)."""
    header = None if credentials is None else f"{credentials.scheme} {credentials.credentials}"
    signer, _ = await door_of(request).authenticate(header)
    return signer


Creds = Annotated[Signer, Depends(_authenticated)]
"""A route's authenticated caller."""


def door_of(request: Request) -> Door:
    """The door this application serves."""
    door: Door = request.app.state.door
    return door


@contextlib.asynccontextmanager
async def agent(request: Request, signer: Signer, charge: bool = True) -> AsyncIterator[AgentState]:
    """``async with agent(request, signer) as state``: one rate-limited call of an authenticated agent."""
    async with door_of(request).call(signer, charge) as state:
        yield state


async def _until_gone(request: Request) -> None:
    """Return when the caller hangs up (its body is read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_gone(request: Request, work: Awaitable[Any]) -> Any:
    """Run ``work``; cancel it (the SDK then withdraws a queued request) if the caller hangs up: 499."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_until_gone(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return JSONResponse({"reason": "client_gone"}, status_code=499)
    return task.result()
