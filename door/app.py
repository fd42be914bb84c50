"""``arbiter serve``: the HTTP and WebSocket front door (FastAPI), in front of Arbiter's topics.

Theory of operation
-------------------
Nothing is decided here. Every call is one or more commands the door signs with the
calling agent's key and publishes to the command topics, exactly as the SDK does (the
log stays the source of truth), and one decision it awaits in the agent's inbox
(``door.state``). The answers are the SDK's: the same JSON diagnostics, with an HTTP
status that fits (``status_of``): 409 for a conflict with the current state, 403 for a
command the agent may not send, 401 for a missing or bad key, 422 for input that will
never be accepted, 429 over a limit, 503 when Kafka is unreachable, 504 when no
decision came in time (retriable: it may still have been decided).

One-shot calls are plain HTTP (``/v1/...``, see ``/docs``). An agent that holds leases
opens a WebSocket session (``/v1/session``) and gets every inbox record for it the
moment it is decided (lease lost, revoked, deadlock notices, grants of queued requests),
and can send its own commands over it (the Python SDK's ``url=`` transport does).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from aiokafka.errors import KafkaError
from fastapi import Depends, FastAPI, Query, Request, WebSocket, WebSocketDisconnect
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from agents import ArbiterTimeout, LeaseDenied, Outcome, SagaStepRejected
from agents.leases import ArbiterUnavailable
from contract import (
    CompensationRequested,
    ContractError,
    LockDenied,
    LockRenewed,
    Record,
    SagaStep,
    WaitEdgeAdded,
    WaitEdgeRemoved,
)
from contract.identity import Signer
from contract.jsonwire import from_json
from contract.reasons import Reason, what_to_do
from contract.settings import Settings
from cores.trust import AGENT_COMMANDS, authorize

from .state import AgentState, Door, Refusal, Session

log = logging.getLogger(__name__)

INPUT_REASONS = frozenset({
    Reason.INVALID_RESOURCE, Reason.INVALID_AGENT, Reason.INVALID_MODE, Reason.INVALID_TTL, Reason.INVALID_WAIT,
    Reason.INVALID_INTENT, Reason.INVALID_ARGUMENTS, Reason.ARGUMENTS_TOO_LARGE, Reason.TOKEN_REQUIRED,
    Reason.BASE_VERSION_REQUIRED, Reason.UNKNOWN_TOOL, Reason.NOT_SINGLE_OBJECT, Reason.TRUNCATED,
    Reason.UNKNOWN_FINGERPRINT, Reason.MALFORMED_BODY, Reason.WRONG_SCHEMA, Reason.INVALID_VALUE, Reason.TOO_LARGE,
    Reason.UNSUPPORTED_COMMAND, Reason.KEY_MISMATCH,
})
"""Refusals of input that will never be accepted as sent (422)."""


def status_of(reason: str) -> int:
    """The HTTP status of a refusal with ``reason``."""
    if reason == Reason.UNAUTHENTICATED:
        return 401
    if reason == Reason.FORBIDDEN:
        return 403
    if reason in INPUT_REASONS:
        return 422
    if reason == Reason.TOOL_FAILED:
        return 502
    return 409


def _refused(diagnostic: dict[str, Any], reason: str) -> JSONResponse:
    body = {"reason": reason, **diagnostic}
    body.setdefault("what_to_do", what_to_do(reason))  # a worker's denial may carry only a detail
    return JSONResponse(body, status_code=status_of(reason))


# -- request bodies -------------------------------------------------------------------


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


Resource = Annotated[str, Field(min_length=1, max_length=1024, description="The resource's name.")]


class AcquireBody(_Body):
    resource: Resource
    ttl: float = Field(30.0, gt=0, le=86_400, description="Seconds the lease lives unless renewed.")
    mode: Literal["exclusive", "shared"] = "exclusive"
    priority: int = Field(0, ge=-(2**31), lt=2**31, description="Higher wins a deadlock.")
    wait: float = Field(0.0, ge=0, le=3_600, description="Seconds to wait in the queue (0: try once). The "
                                                          "request is held open until granted, refused or timed out.")
    saga_id: str | None = Field(None, max_length=1024)


class TokenBody(_Body):
    resource: Resource
    token: int = Field(ge=0, lt=2**63, description="The lease's fencing token.")


class RenewBody(TokenBody):
    ttl: float | None = Field(None, gt=0, le=86_400, description="New TTL in seconds (default: the lease's).")


class ExecuteBody(_Body):
    resource: Resource
    tool: str = Field(min_length=1, max_length=200)
    args: dict[str, Any] = Field(default_factory=dict, description="The tool's arguments (one JSON object).")
    token: int | None = Field(None, ge=0, lt=2**63, description="The lease's fencing token (fenced writes).")
    base_version: int | None = Field(None, ge=0, lt=2**63, description="The version you read (optimistic writes).")
    base_hash: str | None = Field(None, max_length=200)
    intent_id: str | None = Field(None, min_length=1, max_length=200,
                                  description="Reusing one returns the first outcome: the tool never runs twice.")


class CommitBody(_Body):
    resource: Resource
    base_version: int = Field(ge=0, lt=2**63)
    patch: dict[str, Any] = Field(description="A JSON merge patch.")
    token: int | None = Field(None, ge=0, lt=2**63)
    intent_id: str | None = Field(None, min_length=1, max_length=200)


class SagaBody(_Body):
    name: str = Field(min_length=1, max_length=200, pattern=r"^[^/\s]+$")


class Compensation(_Body):
    tool: str = Field(min_length=1, max_length=200)
    args: dict[str, Any] = Field(default_factory=dict)


class StepBody(ExecuteBody):
    compensate: Compensation | None = None


class AbortBody(_Body):
    reason: str = Field("aborted_by_agent", min_length=1, max_length=200)


# -- responses ------------------------------------------------------------------------


def _outcome(outcome: Outcome) -> JSONResponse:
    body = {"applied": outcome.applied, "intent_id": outcome.intent_id, "resource": outcome.resource,
            "tool": outcome.tool, "reason": outcome.reason}
    if outcome.applied:
        body.update(version=outcome.version, content_hash=outcome.content_hash, result=outcome.result)
        return JSONResponse(body)
    return JSONResponse({**body, **outcome.diagnostic, "reason": outcome.reason},
                        status_code=status_of(outcome.reason))


class _BodyLimit:
    """Refuse request bodies over ``limit`` bytes with 413, before reading them whole."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            await self._too_large(send)
            return
        seen = 0
        too_large = False
        answered = False

        async def limited() -> Message:
            nonlocal seen, too_large
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    too_large = True
                    raise _TooLarge
            return message

        async def answer(message: Message) -> None:
            nonlocal answered
            if too_large:  # FastAPI answers a body it could not read with its own 400: it is a 413
                if not answered:
                    answered = True
                    await self._too_large(send)
                return
            answered = answered or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited, answer)
        except _TooLarge:
            if not answered:
                await self._too_large(send)

    async def _too_large(self, send: Send) -> None:
        body = json.dumps({"reason": "too_large", "detail": f"the request body is over {self.limit} bytes",
                           "what_to_do": "Send a smaller body (split the change)."}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


class _TooLarge(Exception):
    pass


# -- the application ------------------------------------------------------------------

_bearer = HTTPBearer(auto_error=False, description="The agent's API key (arbiter agents add NAME --print-api-key).")


async def _authenticated(request: Request,
                         credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> Signer:
    """The calling agent, checked before its request body is read (so a bad key is 401, not 422)."""
    header = None if credentials is None else f"{credentials.scheme} {credentials.credentials}"
    door: Door = request.app.state.door
    signer, _ = await door.authenticate(header)
    return signer


Creds = Annotated[Signer, Depends(_authenticated)]


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

    app = FastAPI(title="Arbiter front door", version="1", lifespan=lifespan,
                  description="Leases, fenced writes, optimistic commits and sagas for AI agents, over HTTP. "
                              "Authenticate with 'Authorization: Bearer <API key>' (arbiter agents add NAME "
                              "--print-api-key). Refusals are JSON diagnostics with a stable 'reason' and "
                              "'what_to_do'. WebSocket sessions: /v1/session (see the README).")
    app.state.door = door
    app.add_middleware(_BodyLimit, limit=settings.door_max_body_bytes)

    @app.exception_handler(Refusal)
    async def _refusal(_: Request, exc: Refusal) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(LeaseDenied)
    async def _denied(_: Request, exc: LeaseDenied) -> JSONResponse:
        return _refused(exc.diagnostic, exc.reason)

    @app.exception_handler(ArbiterTimeout)
    async def _timeout(_: Request, exc: ArbiterTimeout) -> JSONResponse:
        return JSONResponse({"reason": "timeout", "detail": str(exc), "retriable": True,
                             "what_to_do": "No decision arrived in time; it may still be decided. Retry with the "
                                           "same intent id, or read the resource's state first."}, status_code=504)

    @app.exception_handler(KafkaError)
    @app.exception_handler(ArbiterUnavailable)
    async def _unavailable(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse({"reason": "unavailable", "detail": f"Kafka could not be reached: {exc}",
                             "retriable": True, "what_to_do": "Retry shortly."}, status_code=503,
                            headers={"Retry-After": "1"})

    @app.exception_handler(ContractError)
    async def _contract(_: Request, exc: ContractError) -> JSONResponse:
        return JSONResponse({"reason": exc.reason, "detail": str(exc), "what_to_do": what_to_do(exc.reason)},
                            status_code=422)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        if request.url.path.startswith("/v1/"):
            # FastAPI parses a JSON body before it runs the key check: a bad key is 401 even then.
            try:
                await door.authenticate(request.headers.get("authorization"))
            except Refusal as refusal:
                return await _refusal(request, refusal)
        errors = [{"field": "body", "message": f"malformed JSON at character {e['loc'][-1]}: "
                                                f"{e.get('ctx', {}).get('error', e['msg'])}"}
                  if e.get("type") == "json_invalid" else
                  {"field": ".".join(str(p) for p in e["loc"]), "message": e["msg"]} for e in exc.errors()]
        first = errors[0] if errors else {"field": "body", "message": "invalid"}
        return JSONResponse({"reason": "invalid_request", "detail": f"{first['field']}: {first['message']}",
                             "errors": errors, "what_to_do": "Fix the named field; see /openapi.json."},
                            status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        reason = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        detail = (f"no route {request.method} {request.url.path}" if exc.status_code == 404 else
                  f"{request.method} is not allowed on {request.url.path}" if exc.status_code == 405 else
                  str(exc.detail))
        return JSONResponse({"reason": reason, "detail": detail, "what_to_do": "See /docs or /openapi.json."},
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @contextlib.asynccontextmanager
    async def agent(signer: Signer, charge: bool = True) -> AsyncIterator[AgentState]:
        async with door.call(signer, charge) as state:
            yield state

    async def until_gone(request: Request) -> None:
        """Return when the caller hangs up (its body is read already)."""
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    async def unless_gone(request: Request, work: Any) -> Any:
        """Run ``work``; cancel it (the SDK then withdraws a queued request) if the caller hangs up."""
        task = asyncio.ensure_future(work)
        gone = asyncio.ensure_future(until_gone(request))
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return JSONResponse({"reason": "client_gone"}, status_code=499)
        return task.result()

    # -- leases -----------------------------------------------------------------------

    @app.post("/v1/leases/acquire", tags=["leases"], summary="Acquire a lease (optionally waiting for it)")
    async def acquire(body: AcquireBody, request: Request, credentials: Creds) -> Any:
        async with agent(credentials) as state:
            lease = await unless_gone(request, state.client.acquire(
                body.resource, ttl=body.ttl, mode=body.mode, priority=body.priority, wait=body.wait,
                saga_id=body.saga_id))
            if isinstance(lease, JSONResponse):
                return lease
            state.leases[(lease.resource, lease.token)] = lease
            return {"granted": True, "resource": lease.resource, "token": lease.token, "mode": lease.mode,
                    "ttl_ms": lease.ttl_ms, "expires_at_ms": lease.expires_at_ms,
                    "resource_version": lease.resource_version, "request_id": lease.request_id,
                    "warnings": lease.warnings}

    @app.post("/v1/leases/renew", tags=["leases"], summary="Extend a lease")
    async def renew(body: RenewBody, credentials: Creds) -> Any:
        async with agent(credentials) as state:
            outcome = await state.client.renew_token(body.resource, body.token, body.ttl)
            if isinstance(outcome, LockRenewed):
                return {"renewed": True, "resource": body.resource, "token": body.token,
                        "expires_at_ms": outcome.expires_at_ms}
            raise LeaseDenied.from_event(outcome)

    @app.post("/v1/leases/release", tags=["leases"], summary="Give a lease back")
    async def release(body: TokenBody, credentials: Creds) -> Any:
        async with agent(credentials) as state:
            outcome = await state.client.release_token(body.resource, body.token)
            lease = state.leases.pop((body.resource, body.token), None)
            if lease is not None:
                state.client.forget(lease)
            if isinstance(outcome, LockDenied):
                if outcome.reason in (Reason.LEASE_NOT_LIVE, Reason.STALE_FENCING_TOKEN):
                    return {"released": False, "resource": body.resource, "token": body.token,
                            "reason": outcome.reason, "detail": "the lease was already gone (not an error)"}
                raise LeaseDenied.from_event(outcome)
            return {"released": True, "resource": body.resource, "token": body.token}

    # -- the gateway --------------------------------------------------------------------

    @app.post("/v1/execute", tags=["gateway"], summary="Run a tool on a resource through the gateway")
    async def execute(body: ExecuteBody, credentials: Creds) -> Any:
        async with agent(credentials) as state:
            return _outcome(await state.client.execute(
                body.resource, body.tool, body.args, token=body.token, base_version=body.base_version,
                base_hash=body.base_hash, intent_id=body.intent_id))

    @app.post("/v1/commit", tags=["gateway"], summary="Optimistic write: a JSON merge patch at a base version")
    async def commit(body: CommitBody, credentials: Creds) -> Any:
        async with agent(credentials) as state:
            return _outcome(await state.client.execute(
                body.resource, "commit", {"patch": body.patch}, token=body.token, base_version=body.base_version,
                intent_id=body.intent_id))

    @app.get("/v1/resources/{resource:path}", tags=["gateway"], summary="A resource's version, hash and holders")
    async def snapshot(resource: str, credentials: Creds) -> Any:
        async with agent(credentials) as state:
            snap = await state.client.snapshot(resource)
            return {"resource": snap.resource, "version": snap.version, "content_hash": snap.content_hash,
                    "high_water_token": snap.high_water_token, "holders": snap.holders}

    # -- sagas --------------------------------------------------------------------------

    @app.post("/v1/sagas", tags=["sagas"], summary="Start a saga")
    async def saga_start(body: SagaBody, credentials: Creds) -> Any:
        async with agent(credentials) as state:
            saga = state.client.open_saga(body.name)
            state.sagas[saga.saga_id] = saga
            return {"saga_id": saga.saga_id}

    def saga_of(state: AgentState, saga_id: str) -> Any:
        saga = state.sagas.get(saga_id)
        if saga is None:
            raise Refusal(404, "unknown_saga", f"{state.name!r} has no open saga {saga_id!r} on this door",
                          "Start one with POST /v1/sagas (sagas live on the door that started them).")
        return saga

    @app.post("/v1/sagas/{saga_id}/steps", tags=["sagas"], summary="Run one step; name how to undo it")
    async def saga_step(saga_id: str, body: StepBody, credentials: Creds) -> Any:
        async with agent(credentials) as state:
            saga = saga_of(state, saga_id)
            compensate = None if body.compensate is None else (body.compensate.tool, body.compensate.args)
            try:
                outcome = await saga.step(body.resource, body.tool, body.args, compensate=compensate,
                                          base_version=body.base_version, token=body.token)
            except SagaStepRejected as exc:
                outcome = exc.outcome
            return _outcome(outcome)

    async def saga_end(state: AgentState, saga_id: str, abort: str | None) -> Any:
        saga = saga_of(state, saga_id)
        try:
            finished = await state.client.finish_saga(saga, abort)
        finally:
            state.sagas.pop(saga_id, None)
        return {"saga_id": saga_id, "outcome": finished.outcome, "detail": finished.model_dump(mode="json")}

    @app.post("/v1/sagas/{saga_id}/complete", tags=["sagas"], summary="End a saga: COMPLETED")
    async def saga_complete(saga_id: str, credentials: Creds) -> Any:
        async with agent(credentials) as state:
            return await saga_end(state, saga_id, None)

    @app.post("/v1/sagas/{saga_id}/abort", tags=["sagas"], summary="Abort a saga: its steps are compensated")
    async def saga_abort(saga_id: str, body: AbortBody, credentials: Creds) -> Any:
        async with agent(credentials) as state:
            return await saga_end(state, saga_id, body.reason)

    # -- status ---------------------------------------------------------------------------

    @app.get("/v1/status", tags=["status"], summary="This agent on this door; ping a worker")
    async def status(credentials: Creds, ping: bool = Query(False, description="Round-trip through a worker.")
                     ) -> Any:
        async with agent(credentials, charge=ping) as state:
            body: dict[str, Any] = {
                "agent": state.name, "door": door.id, "sessions": len(state.sessions),
                "leases": [{"resource": lease.resource, "token": lease.token, "expires_at_ms": lease.expires_at_ms}
                           for lease in state.leases.values() if not lease.lost],
                "sagas": sorted(state.sagas)}
            if ping:
                result = await state.client.ping()
                body["worker"] = {"worker_id": result.worker_id, "rtt_ms": round(result.rtt_ms, 2),
                                  "partition": result.partition}
            return body

    @app.get("/healthz", tags=["status"], summary="Liveness, for a load balancer (no key needed)")
    async def healthz() -> Any:
        return {"door": door.id, "agents": len({s.name for s in door.agents.values()}),
                "sessions": sum(len(s.sessions) for s in door.agents.values())}

    # -- sessions -------------------------------------------------------------------------

    @app.websocket("/v1/session")
    async def session(ws: WebSocket, resume: int | None = Query(None, ge=0)) -> None:
        await run_session(door, ws, resume)

    return app


# -- WebSocket sessions -----------------------------------------------------------------

PATIENCE_SECONDS = 10.0
"""How long a session waits on a peer that reads nothing: for room to answer one of its frames (then it
is a slow consumer), and for it to take the 'bye' and close frames at the end."""

TOPIC_OF: dict[type[Record], str] = {WaitEdgeAdded: "wait_edges", WaitEdgeRemoved: "wait_edges",
                                     SagaStep: "saga_commands", CompensationRequested: "saga_commands"}
"""The command topic of each agent command (the rest go to resource_commands)."""


async def run_session(door: Door, ws: WebSocket, resume: int | None) -> None:
    """Serve one agent's WebSocket session until it or the door ends it."""
    header = ws.headers.get("authorization")
    api_key: str | None = None
    try:
        if header:
            signer, _ = await door.authenticate(header)
            api_key = header.partition(" ")[2].strip()
            await ws.accept()
        else:
            await ws.accept()
            try:
                first = json.loads(await asyncio.wait_for(ws.receive_text(), 10))
                api_key = str(first.get("api_key", "")) if first.get("op") == "auth" else ""
            except (TimeoutError, ValueError, AttributeError, KeyError):
                api_key = ""
            signer, _ = await door.identify(api_key) if api_key else await door.authenticate(None)
        state = await door.agent(signer)
        live = door.open_session(state, 0)
    except Refusal as refusal:
        if ws.client_state.name == "CONNECTING":
            await ws.accept()
        await ws.send_text(json.dumps({"op": "error", "id": None, "status": refusal.status, **refusal.body()}))
        await ws.close(code=4000 + refusal.status, reason=refusal.reason)
        return
    except WebSocketDisconnect:
        return
    assert api_key is not None
    try:
        until = await door.end_offset(state)
        since = until if resume is None else min(resume, until)  # a resume point past the end is the end
        live.next_offset = since
        hello = {"op": "hello", "agent": state.name, "door": door.id, "offset": since,
                 "partition": door.inbox_partition(state.name).partition}
        await ws.send_text(json.dumps(hello))
        await _serve(door, ws, state, live, api_key, since, until)
    finally:
        door.close_session(state, live)


async def _serve(door: Door, ws: WebSocket, state: AgentState, session: Session, api_key: str, since: int,
                 until: int) -> None:
    closed = asyncio.Event()
    session.on_close = lambda reason: closed.set()
    sends = asyncio.Semaphore(door.settings.door_max_inflight_per_agent)
    tasks: set[asyncio.Task[None]] = set()

    room = asyncio.Event()  # set each time the writer takes a frame

    async def reply(frame: dict[str, Any]) -> None:
        """Queue the answer to one of the agent's own frames. While half the buffer is taken it waits (up to
        PATIENCE_SECONDS), so an agent that sends a burst is slowed to its own reading pace instead of being
        cut off, and the other half stays free for the events the door pushes (those never wait)."""
        try:
            async with asyncio.timeout(PATIENCE_SECONDS):
                while session.queue.qsize() >= max(1, session.limit // 2):
                    room.clear()
                    await room.wait()
            session.queue.put_nowait(json.dumps(frame))
        except (TimeoutError, asyncio.QueueFull):
            session.close(f"slow consumer: {session.limit} frames unread")

    async def handle(frame: dict[str, Any]) -> None:
        frame_id = frame.get("id")
        try:
            _, identity = await door.identify(api_key)  # checked on every command: a revoked key stops here
            door.admit(state)
            record = from_json(frame.get("record"), AGENT_COMMANDS)
            why = authorize(identity, record)
            if why is not None:
                raise Refusal(403, why[0], why[1], what_to_do(why[0]))
            key = frame.get("key")
            if not isinstance(key, str) or not key:
                raise Refusal(422, "invalid_request", "'key' must be a non-empty string (the resource, saga id or "
                                                      "graph the record is about)")
            topic = getattr(door.settings.topics, TOPIC_OF.get(type(record), "resource_commands"))
            await state.client.transport.send(topic, key, record)
            await reply({"op": "ack", "id": frame_id})
        except Refusal as refusal:
            await reply({"op": "error", "id": frame_id, "status": refusal.status, **refusal.body()})
        except ContractError as exc:
            await reply({"op": "error", "id": frame_id, "status": 422, "reason": exc.reason, "detail": str(exc)})
        except (KafkaError, ArbiterUnavailable) as exc:
            await reply({"op": "error", "id": frame_id, "status": 503, "reason": "unavailable", "detail": str(exc)})
        finally:
            sends.release()

    async def read() -> None:
        while True:
            message = await ws.receive()
            if message["type"] == "websocket.disconnect":
                session.close("the agent disconnected")
                return
            text = message.get("text")
            try:
                frame = json.loads(text) if text is not None else None
            except ValueError:
                frame = None
            if not isinstance(frame, dict):
                await reply({"op": "error", "id": None, "status": 422, "reason": "malformed_json",
                             "detail": "a frame is one JSON object, sent as text"})
                continue
            op = frame.get("op")
            if op == "send":
                await sends.acquire()
                task = asyncio.create_task(handle(frame))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            elif op == "ping":
                await reply({"op": "pong", "id": frame.get("id")})
            else:
                await reply({"op": "error", "id": frame.get("id"), "status": 422, "reason": "unknown_op",
                             "detail": f"op {op!r}: a session sends 'send' or 'ping'"})

    async def write() -> None:
        while True:
            frame = await session.queue.get()
            room.set()
            if frame is None:
                return
            await ws.send_text(frame)

    def failed(task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None and not isinstance(
                task.exception(), WebSocketDisconnect):
            log.warning("session of %s failed: %r", state.name, task.exception())
            session.close(f"the door failed: {task.exception()!r}"[:120])

    workers = [asyncio.create_task(read()), asyncio.create_task(write()),
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
        reason = session.closed_because or "closed"
        log.info("session %s of %s ended: %s", session.id, state.name, reason)
        if reason != "the agent disconnected":
            # Bounded: a peer that reads nothing (a slow consumer) would hold the session here forever.
            with contextlib.suppress(Exception):
                async with asyncio.timeout(PATIENCE_SECONDS):
                    await ws.send_text(json.dumps({"op": "bye", "reason": reason}))
                    await ws.close(code=1008 if reason.startswith("slow consumer") else 1001,
                                   reason=reason.encode()[:120].decode(errors="ignore"))
