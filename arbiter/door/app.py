"""``arbiter serve``: the HTTP and WebSocket front door (FastAPI), in front of Arbiter's topics.

Theory of operation
-------------------
Nothing is decided here. Every call is one or more commands the door signs with the calling
agent's credential and publishes to the command topics, exactly as the SDK does (the log
stays the source of truth), and one decision it awaits in the agent's inbox
(``arbiter.door.state``). The answers are the SDK's: the same JSON diagnostics, with an HTTP
status that fits (``arbiter.door.errors``).

The rooms: ``routes`` (one router per area), ``bodies`` (what a request may hold), ``calls``
(the authenticated caller and its rate-limited call), ``errors`` (refusals and faults),
``limits`` (body size), ``session`` (the WebSocket session's state machine), ``state`` (who is
connected). One-shot calls are plain HTTP (``/v1/...``, see ``/docs``); an agent that holds
leases opens a WebSocket session (``/v1/session``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI

from arbiter.edge.settings import Settings

from . import errors
from .limits import BodyLimit
from .routes import ROUTERS
from .state import Door

log = logging.getLogger(__name__)

DESCRIPTION = ("Leases, fenced writes, optimistic commits and sagas for AI agents, over HTTP. Authenticate with "
               "'Authorization: Bearer <API key>' (a front-door credential: arbiter agents api-key NAME). Refusals "
               "are JSON diagnostics with a stable 'reason' and 'what_to_do'. WebSocket sessions: /v1/session "
               "(see the README).")


def create_app(settings: Settings, door: Door | None = None) -> FastAPI:
    """The front door's ASGI application (``door`` is started and stopped with it)."""
    door = door or Door(settings)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await door.start()
        log.info("front door %s ready: %d inbox partitions", door.id, door.partitions)
        try:
            yield
        finally:
            await door.stop()

    app = FastAPI(title="Arbiter front door", version="1", lifespan=lifespan, description=DESCRIPTION)
    app.state.door = door
    app.add_middleware(BodyLimit, limit=settings.door_max_body_bytes)
    errors.install(app)
    for router in ROUTERS:
        app.include_router(router)
    return app
