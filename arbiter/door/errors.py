"""How the front door refuses: one exception, one table of HTTP statuses, and the handlers that answer.

Every refusal is a JSON diagnostic with a stable ``reason`` and ``what_to_do``, as the SDK's: a
``Refusal`` the door raises itself, a ``LeaseDenied`` or ``Outcome`` from a worker's decision, or a
fault (no decision in time: 504; Kafka unreachable: 503 with ``Retry-After``; bad input: 422).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from arbiter.agents import ArbiterTimeout, ArbiterUnavailable, LeaseDenied
from arbiter.edge.kafkaio import KafkaIOError
from arbiter.schemas import ContractError
from arbiter.schemas.reasons import Reason, what_to_do

log = logging.getLogger(__name__)


class Refusal(Exception):
    """A call the door refuses: an HTTP status, a stable reason code, what happened and what to do."""

    def __init__(self, status: int, reason: str, detail: str, what_to_do: str = "",
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(detail)
        self.status = status
        self.reason = reason
        self.detail = detail
        self.what_to_do = what_to_do
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """The JSON diagnostic."""
        out: dict[str, Any] = {"reason": self.reason, "detail": self.detail}
        if self.what_to_do:
            out["what_to_do"] = self.what_to_do
        return out


def unauthenticated(detail: str) -> Refusal:
    """401, with the header a client needs to know how to authenticate."""
    return Refusal(401, "unauthenticated", detail,
                   "Send 'Authorization: Bearer <API key>' with a front-door credential from "
                   "'arbiter agents api-key NAME'.",
                   headers={"WWW-Authenticate": 'Bearer realm="arbiter"'})


INPUT_REASONS = frozenset({
    Reason.INVALID_RESOURCE, Reason.INVALID_AGENT, Reason.INVALID_MODE, Reason.INVALID_TTL, Reason.INVALID_WAIT,
    Reason.INVALID_INTENT, Reason.INVALID_ARGUMENTS, Reason.ARGUMENTS_TOO_LARGE, Reason.TOKEN_REQUIRED,
    Reason.BASE_VERSION_REQUIRED, Reason.UNKNOWN_TOOL, Reason.NOT_SINGLE_OBJECT, Reason.TRUNCATED,
    Reason.UNKNOWN_FINGERPRINT, Reason.MALFORMED_BODY, Reason.WRONG_SCHEMA, Reason.INVALID_VALUE, Reason.TOO_LARGE,
    Reason.UNSUPPORTED_COMMAND, Reason.KEY_MISMATCH, Reason.MISROUTED,
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




def refused(diagnostic: dict[str, Any], reason: str) -> JSONResponse:
    """A worker's refusal, as an answer."""
    body = {"reason": reason, **diagnostic}
    body.setdefault("what_to_do", what_to_do(reason))  # a worker's denial may carry only a detail
    return JSONResponse(body, status_code=status_of(reason))


async def _refusal(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, Refusal)
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _denied(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, LeaseDenied)
    return refused(exc.diagnostic, exc.reason)


async def _timeout(_: Request, exc: Exception) -> JSONResponse:
    return JSONResponse({"reason": "timeout", "detail": str(exc), "retriable": True,
                         "what_to_do": "No decision arrived in time; it may still be decided. Retry with the "
                                       "same intent id, or read the resource's state first."}, status_code=504)


async def _unavailable(_: Request, exc: Exception) -> JSONResponse:
    return JSONResponse({"reason": "unavailable", "detail": f"Kafka could not be reached: {exc}",
                         "retriable": True, "what_to_do": "Retry shortly."}, status_code=503,
                        headers={"Retry-After": "1"})


async def _contract(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ContractError)
    return JSONResponse({"reason": exc.reason, "detail": str(exc), "what_to_do": what_to_do(exc.reason)},
                        status_code=422)


async def _invalid(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    if request.url.path.startswith("/v1/"):
        # FastAPI parses a JSON body before it runs the key check: a bad key is 401 even then.
        try:
            await request.app.state.door.authenticate(request.headers.get("authorization"))
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


async def _http(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    reason = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    detail = (f"no route {request.method} {request.url.path}" if exc.status_code == 404 else
              f"{request.method} is not allowed on {request.url.path}" if exc.status_code == 405 else
              str(exc.detail))
    return JSONResponse({"reason": reason, "detail": detail, "what_to_do": "See /docs or /openapi.json."},
                        status_code=exc.status_code, headers=getattr(exc, "headers", None))


HANDLERS: dict[type[Exception], Any] = {
    Refusal: _refusal, LeaseDenied: _denied, ArbiterTimeout: _timeout, KafkaIOError: _unavailable,
    ArbiterUnavailable: _unavailable, ContractError: _contract, RequestValidationError: _invalid,
    StarletteHTTPException: _http,
}


def install(app: FastAPI) -> None:
    """Answer every refusal and fault with its JSON diagnostic."""
    for kind, handler in HANDLERS.items():
        app.add_exception_handler(kind, handler)
