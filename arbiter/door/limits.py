"""The front door's body size limit: 413 before a body is read whole, declared or chunked."""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodyLimit:
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
                    raise TooLarge
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
        except TooLarge:
            if not answered:
                await self._too_large(send)

    async def _too_large(self, send: Send) -> None:
        body = json.dumps({"reason": "too_large", "detail": f"the request body is over {self.limit} bytes",
                           "what_to_do": "Send a smaller body (split the change)."}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


class TooLarge(Exception):
    """The body went over the limit while it was read."""
