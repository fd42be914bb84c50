"""``WS /v1/session``: moves frames between a WebSocket and the session machine (``arbiter.door.session``).

Three tasks per session: the reader (each frame through ``session.receive``; an agent's command is
checked, signed with its credential and published), the writer (the session's queue to the socket),
and the replay of what the agent missed when it resumes from an inbox offset. The first to end ends
the session, which then says why (``bye``) and closes, without waiting long on a peer that reads
nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

from fastapi import APIRouter, Query, WebSocket, WebSocketDisconnect

from arbiter.agents import ArbiterUnavailable
from arbiter.edge.kafkaio import KafkaIOError
from arbiter.schemas import CompensationRequested, ContractError, Record, SagaStep, WaitEdgeAdded, WaitEdgeRemoved
from arbiter.schemas.identity import Signer
from arbiter.schemas.jsonwire import from_json
from arbiter.schemas.reasons import what_to_do
from arbiter.streams.cores.trust import AGENT_COMMANDS, authorize

from ..errors import Refusal
from ..session import AUTH_SECONDS, Auth, Command, Phase, Reply, Session, error, receive
from ..state import AgentState, Door

log = logging.getLogger(__name__)
router = APIRouter()

PATIENCE_SECONDS = 10.0
"""How long a session waits on a peer that reads nothing: for room to answer one of its frames (then it
is a slow consumer), and for it to take the 'bye' and close frames at the end."""

TOPIC_OF: dict[type[Record], str] = {WaitEdgeAdded: "wait_edges", WaitEdgeRemoved: "wait_edges",
                                     SagaStep: "saga_commands", CompensationRequested: "saga_commands"}
"""The command topic of each agent command (the rest go to resource_commands)."""


@router.websocket("/v1/session")
async def session(ws: WebSocket, resume: int | None = Query(None, ge=0)) -> None:
    """Every inbox record of the agent as it is decided, and its own commands (see docs/front-door.md)."""
    door: Door = ws.app.state.door
    opened = await _open(door, ws)
    if opened is None:
        return
    signer, api_key = opened
    state = await door.agent(signer)
    live = door.open_session(state, 0)
    try:
        until = await door.end_offset(state)
        since = until if resume is None else min(resume, until)  # a resume point past the end is the end
        live.next_offset = since
        await ws.send_text(json.dumps({"op": "hello", "agent": state.name, "door": door.id, "offset": since,
                                       "partition": door.inbox_partition(state.name).partition}))
        await _serve(door, ws, state, live, api_key, since, until)
    finally:
        door.close_session(state, live)


async def _open(door: Door, ws: WebSocket) -> tuple[Signer, str] | None:
    """Accept and authenticate: the credential and its API key, or None (refused and closed, or gone)."""
    header = ws.headers.get("authorization")
    try:
        if header:
            signer, _ = await door.authenticate(header)
            await ws.accept()
            return signer, header.partition(" ")[2].strip()
        await ws.accept()
        try:
            first = receive(Phase.AUTH, await asyncio.wait_for(ws.receive_text(), AUTH_SECONDS))
        except TimeoutError:
            first = Reply(error(None, 401, "unauthenticated", f"no auth frame within {AUTH_SECONDS:g} s"), True)
        if isinstance(first, Reply):
            await ws.send_text(json.dumps(first.frame))
            await ws.close(code=4000 + first.frame["status"], reason=first.frame["reason"])
            return None
        assert isinstance(first, Auth)
        signer, _ = await door.identify(first.api_key)
        return signer, first.api_key
    except Refusal as refusal:
        if ws.client_state.name == "CONNECTING":
            await ws.accept()
        await ws.send_text(json.dumps({"op": "error", "id": None, "status": refusal.status, **refusal.body()}))
        await ws.close(code=4000 + refusal.status, reason=refusal.reason)
        return None
    except WebSocketDisconnect:
        return None


async def _command(door: Door, state: AgentState, session: Session, api_key: str, command: Command) -> None:
    """Check, sign and publish one of the agent's own commands; answer ``ack`` or ``error``."""
    try:
        _, identity = await door.identify(api_key)  # checked on every command: a revoked credential stops here
        await door.refuse_if_unreachable()
        door.admit(state)
        record = from_json(command.record, AGENT_COMMANDS)
        why = authorize(identity, record)
        if why is not None:
            raise Refusal(403, why[0], why[1], what_to_do(why[0]))
        if not isinstance(command.key, str) or not command.key:
            raise Refusal(422, "invalid_request", "'key' must be a non-empty string (the resource, saga id or "
                                                  "graph the record is about)")
        topic = getattr(door.settings.topics, TOPIC_OF.get(type(record), "resource_commands"))
        await state.client.transport.send(topic, command.key, record)
        frame: dict[str, Any] = {"op": "ack", "id": command.id}
    except Refusal as refusal:
        frame = {"op": "error", "id": command.id, "status": refusal.status, **refusal.body()}
    except ContractError as exc:
        frame = error(command.id, 422, exc.reason, str(exc))
    except (KafkaIOError, ArbiterUnavailable) as exc:
        frame = error(command.id, 503, "unavailable", str(exc))
    await session.answer(frame, PATIENCE_SECONDS)


async def _read(door: Door, ws: WebSocket, state: AgentState, session: Session, api_key: str,
                tasks: set[asyncio.Task[None]]) -> None:
    """The agent's frames, one at a time; its commands run side by side, at most the per-agent limit."""
    sends = asyncio.Semaphore(door.settings.door_max_inflight_per_agent)
    while True:
        message = await ws.receive()
        if message["type"] == "websocket.disconnect":
            session.close("the agent disconnected")
            return
        inbound = receive(Phase.OPEN, message.get("text"))
        if isinstance(inbound, Command):
            await sends.acquire()
            task = asyncio.create_task(_command(door, state, session, api_key, inbound))
            task.add_done_callback(lambda _t: sends.release())
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        elif isinstance(inbound, Reply):
            await session.answer(inbound.frame, PATIENCE_SECONDS)


async def _write(ws: WebSocket, session: Session) -> None:
    while (frame := await session.next_frame()) is not None:
        await ws.send_text(frame)


async def _serve(door: Door, ws: WebSocket, state: AgentState, session: Session, api_key: str, since: int,
                 until: int) -> None:
    closed = asyncio.Event()
    session.on_close = lambda reason: closed.set()
    tasks: set[asyncio.Task[None]] = set()

    def failed(task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None and not isinstance(
                task.exception(), WebSocketDisconnect):
            log.warning("session of %s failed: %r", state.name, task.exception())
            session.close(f"the door failed: {task.exception()!r}"[:120])

    workers = [asyncio.create_task(_read(door, ws, state, session, api_key, tasks)),
               asyncio.create_task(_write(ws, session)),
               asyncio.create_task(door.replay(state, session, since, until))]
    for task in workers:
        task.add_done_callback(failed)
    closer = asyncio.create_task(closed.wait())
    try:
        await asyncio.wait([workers[0], workers[1], closer], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in [*workers, *tasks]:
            task.cancel()
        closer.cancel()
        await asyncio.gather(*workers, *tasks, closer, return_exceptions=True)
        await _goodbye(ws, state, session)


async def _goodbye(ws: WebSocket, state: AgentState, session: Session) -> None:
    reason = session.closed_because or "closed"
    log.info("session %s of %s ended: %s", session.id, state.name, reason)
    if reason != "the agent disconnected":
        # Bounded: a peer that reads nothing (a slow consumer) would hold the session here forever.
        with contextlib.suppress(Exception):
            async with asyncio.timeout(PATIENCE_SECONDS):
                await ws.send_text(json.dumps({"op": "bye", "reason": reason}))
                await ws.close(code=1008 if reason.startswith("slow consumer") else 1001,
                               reason=reason.encode()[:120].decode(errors="ignore"))
