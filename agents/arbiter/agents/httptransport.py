"""The SDK's front-door transport: one agent's commands and inbox over a WebSocket to ``arbiter serve``.

Theory of operation
-------------------
``ArbiterClient(agent, url=..., api_key=...)`` uses this instead of ``KafkaTransport``;
the client above it is the same code, so both paths give the same answers. The agent
holds one WebSocket session (``/v1/session``) with a front door, authenticated by its
API key:

- ``send(topic, key, record)`` sends ``{"op": "send", "id", "key", "record"}`` (the record
  as ``arbiter.schemas.jsonwire`` JSON) and returns when the door answers ``ack``: the door
  checked the command against the agent's identity, signed it with the agent's key and
  the broker has it. A refusal (``error``) raises ``DoorRefused`` with the door's reason.
  The door picks the topic from the record's type, so ``topic`` is not sent.
- Each inbox record for this agent arrives as ``{"op": "event", "offset", "record"}``, in
  inbox order, and goes to ``on_record``.

When the session drops (its door died, or restarts), the transport connects again, to
the next door in ``urls`` in turn, and asks for the inbox from the offset after the last
event it saw (``?resume=``): the log kept what the agent missed, so nothing is lost or
seen twice. A send that was not acknowledged when the session dropped raises
``ArbiterUnavailable`` (retriable: the command may or may not have reached the log).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus, WebSocketException

from arbiter.agents.errors import ArbiterUnavailable, DoorRefused
from arbiter.schemas import ContractError, Record
from arbiter.schemas.jsonwire import from_json, to_json
from arbiter.schemas.models import MODELS

log = logging.getLogger(__name__)

OnRecord = Callable[[Record], None]

SESSION_PATH = "/v1/session"


def session_urls(url: str | Sequence[str]) -> list[str]:
    """The WebSocket session URL of each front door in ``url`` (one URL, a comma-separated list, or a list)."""
    items = [u.strip() for u in (url.split(",") if isinstance(url, str) else url) if u.strip()]
    if not items:
        raise ValueError("url names no front door")
    out = []
    for item in items:
        parts = urlsplit(item)
        scheme = {"http": "ws", "https": "wss", "ws": "ws", "wss": "wss"}.get(parts.scheme)
        if scheme is None or not parts.netloc:
            raise ValueError(f"{item!r} is not an http(s):// or ws(s):// URL")
        out.append(urlunsplit((scheme, parts.netloc, parts.path.rstrip("/") + SESSION_PATH, "", "")))
    return out


class HttpTransport:
    """One agent's session with a front door. ``start`` before, ``close`` after."""

    def __init__(self, agent_id: str, url: str | Sequence[str], api_key: str, on_record: OnRecord,
                 max_message_bytes: int = 4 * 1024 * 1024) -> None:
        self.agent_id = agent_id
        self.urls = session_urls(url)
        self.api_key = api_key
        self._on_record = on_record
        self._max = max_message_bytes
        self._ws: ClientConnection | None = None
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[None]] = {}
        self._next_offset: int | None = None
        """The inbox offset after the last event received: where a new session resumes."""
        self._turn = 0
        self._reader: asyncio.Task[None] | None = None
        self._connected = asyncio.Event()
        self._closing = False
        self.forged = 0
        """Inbox records for this agent that no worker signed: the door verifies, drops them and says so."""
        self.door: str | None = None
        """The id of the front door this session is with."""
        self.reconnects = 0

    async def start(self) -> None:
        """Open the session (trying each door once); raise ``DoorRefused`` or ``ArbiterUnavailable``."""
        if not self.api_key:
            raise ValueError(f"no API key for {self.agent_id!r}: pass api_key= (a front-door credential from "
                             f"'arbiter agents api-key {self.agent_id}') or set ARBITER_API_KEY")
        await self._connect(attempts=len(self.urls))
        self._reader = asyncio.create_task(self._read(), name=f"arbiter-session-{self.agent_id}")

    async def close(self) -> None:
        """End the session."""
        self._closing = True
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        if self._ws is not None:
            with contextlib.suppress(Exception):
                await self._ws.close()
        self._fail_pending("the client was closed")

    async def _connect(self, attempts: int) -> None:
        last: Exception | None = None
        for _ in range(attempts):
            url = self.urls[self._turn % len(self.urls)]
            if self._next_offset is not None:
                url += f"?resume={self._next_offset}"
            try:
                ws = await connect(url, additional_headers={"Authorization": f"Bearer {self.api_key}"},
                                   max_size=self._max, open_timeout=10, compression=None)
                try:
                    hello = json.loads(await asyncio.wait_for(ws.recv(), 10))
                except BaseException:
                    await ws.close()
                    raise
                if not isinstance(hello, dict):
                    raise ValueError(f"the door's first frame is not a JSON object: {hello!r}")
            except InvalidStatus as exc:
                refused = _refusal(exc)
                if refused.status in (401, 403, 422):
                    raise refused from None
                last = refused
            except (OSError, WebSocketException, TimeoutError, ValueError) as exc:
                last = exc
            else:
                if hello.get("op") == "error":  # refused after the upgrade: the door's own diagnostic
                    await ws.close()
                    refused = DoorRefused(int(hello.get("status") or 401), str(hello.get("reason")),
                                          str(hello.get("detail")))
                    if refused.status in (401, 403, 422):
                        raise refused
                    last = refused
                    self._turn += 1
                    continue
                if hello.get("op") != "hello" or hello.get("agent") != self.agent_id:
                    await ws.close()
                    raise DoorRefused(401, "unauthenticated", f"the API key is {hello.get('agent')!r}'s, "
                                                             f"not {self.agent_id!r}'s")
                self._ws = ws
                self.door = hello.get("door")
                if self._next_offset is None:
                    self._next_offset = hello.get("offset")
                self._connected.set()
                return
            self._turn += 1
        raise ArbiterUnavailable(f"no front door answered at {', '.join(self.urls)}: {last}")

    async def _read(self) -> None:
        delay = 0.05
        while not self._closing:
            ws = self._ws
            assert ws is not None
            try:
                async for frame in ws:
                    try:
                        self._handle(json.loads(frame))
                    except Exception:  # one bad frame or listener must not end the session (as in arbiter.agents.hub)
                        log.exception("front-door frame for %s failed", self.agent_id)
                    delay = 0.05
                reason = f"closed ({ws.close_code}: {ws.close_reason})"
            except ConnectionClosed as exc:
                reason = f"lost ({exc})"
            if self._closing:
                return
            self._connected.clear()
            self._fail_pending(f"the session with front door {self.door} was {reason}")
            log.warning("front-door session of %s %s; reconnecting", self.agent_id, reason)
            while not self._closing:
                self._turn += 1
                try:
                    await self._connect(attempts=len(self.urls))
                    self.reconnects += 1
                    break
                except DoorRefused as exc:
                    log.error("front door refused %s's session: %s", self.agent_id, exc)
                    return
                except ArbiterUnavailable:
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 2.0)

    def _handle(self, frame: dict[str, Any]) -> None:
        op = frame.get("op")
        if op == "event":
            try:
                record = from_json(frame.get("record"), MODELS)
            except ContractError as exc:
                log.warning("front door sent a record this client cannot read: %s", exc)
                return
            offset = frame.get("offset")
            if isinstance(offset, int):
                self._next_offset = offset + 1
            self._on_record(record)
        elif op in ("ack", "error"):
            sent = frame.get("id")
            future = self._pending.pop(sent, None) if isinstance(sent, int) else None
            if future is not None and not future.done():
                if op == "ack":
                    future.set_result(None)
                else:
                    future.set_exception(DoorRefused(int(frame.get("status", 400)), str(frame.get("reason")),
                                                     str(frame.get("detail"))))
        elif op == "forged":
            self.forged += 1  # the door dropped an inbox record for this agent that no worker signed
            if isinstance(frame.get("offset"), int):
                self._next_offset = frame["offset"] + 1  # a resumed session starts after it, as after an event
            log.warning("front door %s dropped a forged inbox message for %s: %s", self.door, self.agent_id,
                        frame.get("detail"))
        elif op == "bye":
            log.warning("front door %s ended %s's session: %s", self.door, self.agent_id, frame.get("reason"))

    def _fail_pending(self, why: str) -> None:
        pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(ArbiterUnavailable(f"{why}; the command may or may not have been sent"))

    async def send(self, topic: str, key: str, record: Record) -> None:
        """Send ``record`` under ``key`` through the door; return once the door says the broker has it."""
        del topic  # the door routes by the record's type
        if self._reader is None or self._closing:
            raise RuntimeError("ArbiterClient is not started; use 'async with ArbiterClient(...)'")
        if not self._connected.is_set():
            try:
                await asyncio.wait_for(self._connected.wait(), 10)
            except TimeoutError:
                raise ArbiterUnavailable(f"no front door session for {self.agent_id} (reconnecting)") from None
        ws = self._ws
        assert ws is not None
        frame_id = next(self._ids)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending[frame_id] = future
        try:
            await ws.send(json.dumps({"op": "send", "id": frame_id, "key": key, "record": to_json(record)}))
        except ConnectionClosed as exc:
            self._pending.pop(frame_id, None)
            if future.done():
                future.exception()  # the reader failed it already: retrieved, so asyncio does not warn
            raise ArbiterUnavailable(f"the session with front door {self.door} broke: {exc}") from None
        await future


def _refusal(exc: InvalidStatus) -> DoorRefused:
    response = exc.response
    try:
        body = json.loads(response.body or b"{}")
    except ValueError:
        body = {}
    return DoorRefused(response.status_code, str(body.get("reason", "refused")),
                       str(body.get("detail", (response.body or b"").decode(errors="replace")[:300])))
