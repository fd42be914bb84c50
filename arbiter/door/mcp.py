"""``/mcp``: Arbiter's MCP tools over streamable HTTP, in the front door.

Every request is checked before the MCP SDK sees it: its ``Authorization: Bearer`` API key names
the agent (401 otherwise), and while Kafka does not answer it is 503 with ``Retry-After``, like
every other route. Each tool call resolves its agent from the same header again, so one session
cannot act as another agent. An agent's tools (and the leases the server renews while it is
active) live on the door's state for that agent, which the door keeps while they hold anything.
The SDK's session manager runs inside the door's lifespan (``mcp_lifespan``).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from arbiter.edge.settings import Settings

from .errors import Refusal
from .state import Door


class _Guard:
    """The door's checks in front of the SDK's ASGI handler."""

    def __init__(self, door: Door, app: ASGIApp) -> None:
        self.door = door
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        try:
            await self.door.refuse_if_unreachable()
            signer, _ = await self.door.authenticate(headers.get("authorization"))
            if scope.get("method") != "POST":  # the session's event stream, or its end: not a call
                await self.app(scope, receive, send)
                return
            # A message (a tool call) is one call of the agent's: rate-limited and counted like the others.
            call = self.door.call(signer)
            await call.__aenter__()
        except Refusal as refusal:
            await _refuse(send, refusal)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            await call.__aexit__(None, None, None)


async def _refuse(send: Send, refusal: Refusal) -> None:
    body = json.dumps(refusal.body()).encode()
    await send({"type": "http.response.start", "status": refusal.status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        *((k.lower().encode(), v.encode()) for k, v in refusal.headers.items())]})
    await send({"type": "http.response.body", "body": body})


def mount(app: Any, door: Door, settings: Settings) -> contextlib.AbstractAsyncContextManager[None]:
    """Add ``/mcp`` to the door's application; returns the context the door's lifespan runs it in.
    Without the ``mcp`` package (``pip install 'arbiter[mcp]'``) there is no ``/mcp``."""
    try:
        from mcp.server.streamable_http_manager import StreamableHTTPASGIApp

        from arbiter.mcp.server import Notifier, build_server
        from arbiter.mcp.tools import AgentTools
    except ImportError:
        return contextlib.nullcontext()

    notifier = Notifier()

    async def resolve(ctx: Any) -> AgentTools:
        headers = ctx.headers or {}
        signer, _ = await door.authenticate(headers.get("authorization"))
        state = await door.agent(signer)
        if state.mcp is None:
            state.mcp = AgentTools(state.client, on_notice=lambda _: door.spawn(notifier.publish(state.name)),
                                   runs_git=False)
        state.last_used = time.monotonic()
        tools: AgentTools = state.mcp
        return tools

    server = build_server(resolve, notifier)
    server.streamable_http_app(streamable_http_path="/mcp", host=settings.door_host)
    handler = _Guard(door, StreamableHTTPASGIApp(server.session_manager))
    app.router.routes.append(Route("/mcp", endpoint=handler, methods=["GET", "POST", "DELETE"],
                                   include_in_schema=False))

    @contextlib.asynccontextmanager
    async def run() -> AsyncIterator[None]:
        async with server.session_manager.run():
            yield

    return run()
