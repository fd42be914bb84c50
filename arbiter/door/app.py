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
``limits`` (body size), ``origin`` (which hosts and origins are answered), ``session`` (the
WebSocket session's state machine), ``state`` (who is connected). One-shot calls are plain HTTP
(``/v1/...``, see ``/docs``); an agent that holds leases opens a WebSocket session (``/v1/session``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import fastapi_offline
from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

from arbiter.edge.settings import Settings

from . import errors, mcp
from .limits import BodyLimit
from .metrics import CountCalls, DoorMetrics
from .origin import CheckOrigin
from .routes import ROUTERS
from .state import Door

log = logging.getLogger(__name__)

DOCS_ASSETS = Path(fastapi_offline.__file__).resolve().parent / "static"
"""Swagger UI 5's files (it reads OpenAPI 3.1, which FastAPI writes), as the ``fastapi-offline`` package
ships them: the interactive docs load nothing from a CDN."""

DESCRIPTION = ("Leases, fenced writes, optimistic commits and sagas for AI agents, over HTTP. Authenticate with "
               "'Authorization: Bearer API_KEY' (a front-door credential: arbiter agents api-key NAME). Refusals "
               "are JSON diagnostics with a stable 'reason' and 'what_to_do'. WebSocket sessions: /v1/session "
               "(see docs/front-door.md).")


def create_app(settings: Settings, door: Door | None = None,
               on_ready: Callable[[Door], None] | None = None) -> FastAPI:
    """The front door's ASGI application (``door`` is started and stopped with it; ``on_ready`` is
    told once it has started)."""
    door = door or Door(settings)
    mcp_sessions: list[contextlib.AbstractAsyncContextManager[None]] = []

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await door.start()
        log.info("front door %s ready: %d inbox partitions", door.id, door.partitions)
        try:
            async with mcp_sessions[0]:  # the MCP SDK's session manager, for /mcp
                if on_ready is not None:
                    on_ready(door)
                yield
        finally:
            await door.stop()

    # The interactive docs from Swagger UI's own files, shipped in a package: no CDN, so they work offline.
    app = FastAPI(title="Arbiter front door", version="1", lifespan=lifespan, description=DESCRIPTION,
                  docs_url=None, redoc_url=None)
    app.mount("/docs/assets", StaticFiles(directory=DOCS_ASSETS), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title="Arbiter front door",
                                   swagger_js_url="/docs/assets/swagger-ui-bundle.js",
                                   swagger_css_url="/docs/assets/swagger-ui.css",
                                   swagger_favicon_url="/docs/assets/favicon.png")

    app.state.door = door
    app.state.metrics = DoorMetrics(door)
    app.add_middleware(BodyLimit, limit=settings.door_max_body_bytes)
    app.add_middleware(CountCalls, metrics=app.state.metrics)
    app.add_middleware(CheckOrigin, settings=settings)  # the outermost: a request for another host meets nothing
    errors.install(app)
    for router in ROUTERS:
        app.include_router(router)
    mcp_sessions.append(mcp.mount(app, door, settings))
    return app
