"""One WebSocket session, as a state machine with no socket in it: frames in, frames out.

Theory of operation
-------------------
A session starts ``AUTH`` (its agent named by an ``Authorization`` header, or by a first frame
``{"op": "auth", "api_key": ...}`` from clients that cannot set headers: browsers, Node) and is
``OPEN`` once the door accepts the credential. ``receive`` turns each frame the agent sends into
what the door must do: authenticate it (``Auth``), send one of its commands (``Command``), or
answer at once (``Reply``: a pong, or an error naming what is wrong with the frame).

The other way, ``Session`` holds the frames still to write, at most ``limit``: the agent's
inbox records, the live ones and, when it resumes from an offset, the ones read back from the
log, each offset once and in order; the answers to its own frames. A session whose peer falls
``limit`` frames behind is closed with a reason (``slow consumer``), never waited for. The
WebSocket route (``arbiter.door.routes.session``) only moves frames between a socket and this.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

AUTH_SECONDS = 10.0
"""How long a session without an Authorization header waits for its ``auth`` frame."""


class Phase(Enum):
    """Where a session is."""

    AUTH = "auth"
    OPEN = "open"


@dataclass(frozen=True)
class Auth:
    """The first frame named this credential: authenticate it."""

    api_key: str


@dataclass(frozen=True)
class Command:
    """The agent sends one of its own commands (to be checked, signed and published), answered ``ack``."""

    id: Any
    key: Any
    record: Any


@dataclass(frozen=True)
class Reply:
    """Answer at once with ``frame`` (``refuse``: the session ends after it, with close code 4000+status)."""

    frame: dict[str, Any]
    refuse: bool = False


Inbound = Auth | Command | Reply


def error(frame_id: Any, status: int, reason: str, detail: str) -> dict[str, Any]:
    """An ``error`` frame."""
    return {"op": "error", "id": frame_id, "status": status, "reason": reason, "detail": detail}


def receive(phase: Phase, text: str | None) -> Inbound:
    """What one frame from the agent asks the door to do, in ``phase``."""
    try:
        frame = json.loads(text) if text is not None else None
    except ValueError:
        frame = None
    if phase is Phase.AUTH:
        if isinstance(frame, dict) and frame.get("op") == "auth" and isinstance(frame.get("api_key"), str):
            return Auth(frame["api_key"])
        if text is None:
            wrong = "no Authorization header and the first frame is not text"
        elif not isinstance(frame, dict):
            wrong = "no Authorization header and the first frame is not a JSON object"
        elif frame.get("op") != "auth":
            wrong = f"no Authorization header and the first frame's op is {frame.get('op')!r}, not 'auth'"
        else:
            wrong = "the auth frame has no api_key string"
        return Reply(error(None, 401, "unauthenticated", f"{wrong}: a session starts with an Authorization header, "
                           'or with a first frame {"op": "auth", "api_key": "<API key>"} (a JSON object, sent as '
                           "text)"), refuse=True)
    if not isinstance(frame, dict):
        return Reply(error(None, 422, "malformed_json", "a frame is one JSON object, sent as text"))
    op = frame.get("op")
    if op == "send":
        return Command(frame.get("id"), frame.get("key"), frame.get("record"))
    if op == "ping":
        return Reply({"op": "pong", "id": frame.get("id")})
    return Reply(error(frame.get("id"), 422, "unknown_op", f"op {op!r}: a session sends 'send' or 'ping'"))


class Session:
    """One WebSocket session: the events still to write, at most ``limit`` of them."""

    def __init__(self, agent: str, limit: int, since: int) -> None:
        self.agent = agent
        self.id = uuid.uuid4().hex[:12]
        self.queue: asyncio.Queue[str | None] = asyncio.Queue(maxsize=limit)
        self.limit = limit
        self.next_offset = since
        """The inbox offset of the next event to forward: every earlier one was forwarded (or predates it)."""
        self.replaying = True
        self._held: list[tuple[int, str]] = []
        self.closed_because: str | None = None
        self.on_close: Callable[[str], None] = lambda reason: None
        self._room = asyncio.Event()
        """Set each time the writer takes a frame (``answer`` waits on it)."""

    def push(self, offset: int, frame: str) -> None:
        """Queue one live event (never blocks: a full queue closes the session)."""
        if self.closed_because is not None:
            return
        if self.replaying:
            self._held.append((offset, frame))
            if len(self._held) > self.limit:
                self.close(f"slow consumer: over {self.limit} events unread while resuming")
            return
        self._forward(offset, frame)

    def _forward(self, offset: int, frame: str) -> None:
        if offset < self.next_offset:
            return  # forwarded already (resumed from the log), or from before this session
        try:
            self.queue.put_nowait(frame)
        except asyncio.QueueFull:
            self.close(f"slow consumer: {self.limit} events unread; resume from offset {self.next_offset}")
            return
        self.next_offset = offset + 1

    async def replayed(self, offset: int, frame: str) -> None:
        """Queue one event read back from the log (waiting for room is fine: it is this session's task)."""
        if offset >= self.next_offset and self.closed_because is None:
            await self.queue.put(frame)
            self.next_offset = offset + 1

    def live(self) -> None:
        """The log is read up to the live events: forward those held meanwhile, in order."""
        held, self._held = self._held, []
        self.replaying = False
        for offset, frame in sorted(held):
            self._forward(offset, frame)

    def close(self, reason: str) -> None:
        """End the session with ``reason`` (the writer sends it and closes)."""
        if self.closed_because is None:
            self.closed_because = reason
            self.on_close(reason)

    async def answer(self, frame: dict[str, Any], patience: float) -> None:
        """Queue the answer to one of the agent's own frames. While half the buffer is taken it waits (up to
        ``patience`` seconds), so an agent that sends a burst is slowed to its own reading pace instead of
        being cut off, and the other half stays free for the events the door pushes (those never wait)."""
        try:
            async with asyncio.timeout(patience):
                while self.queue.qsize() >= max(1, self.limit // 2):
                    self._room.clear()
                    await self._room.wait()
            self.queue.put_nowait(json.dumps(frame))
        except (TimeoutError, asyncio.QueueFull):
            self.close(f"slow consumer: {self.limit} frames unread")

    async def next_frame(self) -> str | None:
        """The next frame to write (None: the session is over)."""
        frame = await self.queue.get()
        self._room.set()
        return frame
