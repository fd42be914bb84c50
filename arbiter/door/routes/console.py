"""The live console: ``/`` (the page, from the package: no build step, no CDN), ``/console/stream``
(the log's changes as server-sent events, after a snapshot) and ``/console/history`` (one resource's
or agent's recent timeline).

An operator's view: when the door listens on loopback only, anyone on this machine may watch;
otherwise the stream and history need the API key of an operator (an identity named in
``ARBITER_CONSOLE_OPERATORS``; ``Authorization: Bearer``, which the page asks for). Nothing it sends
carries a fencing token.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse

from arbiter.edge.hosts import is_loopback

from ..calls import door_of
from ..errors import Refusal

router = APIRouter(tags=["console"])

STATIC = Path(__file__).resolve().parent.parent / "static"
QUEUE = 20_000
"""Changes a slow page may leave unread; past them its stream ends (it reconnects for a new snapshot)."""


async def _operator(request: Request) -> None:
    door = door_of(request)
    if is_loopback(door.settings.door_host):
        return
    signer, _entry = await door.authenticate(request.headers.get("authorization"))
    if signer.name not in door.settings.operator_names():
        raise Refusal(403, "forbidden", f"{signer.name!r} is not an operator; the console is an operator's view",
                      "Use the API key of an identity named in ARBITER_CONSOLE_OPERATORS.")


@router.get("/", include_in_schema=False)
async def page() -> FileResponse:
    return FileResponse(STATIC / "console.html", media_type="text/html")


@router.get("/console/{name}.js", include_in_schema=False)
async def script(name: str) -> Any:
    path = STATIC / f"{name}.js"
    if name not in ("console",) or not path.exists():
        return JSONResponse({"reason": "not_found"}, status_code=404)
    return FileResponse(path, media_type="text/javascript")


@router.get("/console/stream", summary="The live console's stream (server-sent events)")
async def stream(request: Request) -> StreamingResponse:
    """A snapshot of leases held and queued, the wait-for graph, deadlocks, sagas, refusals and lag,
    then every change as it is decided, one ``data:`` line each."""
    await door_of(request).refuse_if_unreachable()
    await _operator(request)
    feed = await door_of(request).live()
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(QUEUE)
    overflowed = asyncio.Event()

    def push(change: dict[str, Any]) -> None:
        try:
            queue.put_nowait(change)
        except asyncio.QueueFull:
            overflowed.set()

    stop = feed.subscribe(push)
    first = feed.state.snapshot()

    async def events() -> AsyncIterator[bytes]:
        try:
            yield f"data: {json.dumps(first)}\n\n".encode()
            while True:
                try:
                    change = await asyncio.wait_for(queue.get(), 15)
                except TimeoutError:
                    yield b": keep-alive\n\n"
                    continue
                if overflowed.is_set():
                    yield b'data: {"kind": "overflow"}\n\n'
                    return
                yield f"data: {json.dumps(change)}\n\n".encode()
        finally:
            stop()

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})


@router.get("/console/history", summary="One resource's or agent's recent timeline")
async def history(request: Request, name: str = Query("", max_length=512)) -> Any:
    await door_of(request).refuse_if_unreachable()
    await _operator(request)
    feed = await door_of(request).live()
    return {"name": name, "events": list(feed.state.history.get(name, ()))}
