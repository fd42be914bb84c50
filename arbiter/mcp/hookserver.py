"""The PreToolUse hook's server: one agent's long-lived process answering its hook over a Unix socket.

``arbiter mcp`` serves it beside its MCP tools (the hook's calls are then the agent's activity, which keeps
its leases renewed); ``arbiter hook serve`` serves it alone. The socket (``hookclient.socket_path``) is in a
folder of mode 0700, so only the agent's own user can ask. Each connection carries one request, a JSON
(the agent's name on a line, then the PreToolUse payload as the agent sent it) and gets one answer:
``allow``, ``deny`` with the JSON the agent reads, or ``block`` with the reason when it cannot decide in
time (Arbiter unreachable) or cannot read the input (``hookclient``'s protocol). The decision is
``arbiter.mcp.hook.decide`` with this process's client, already connected; a repository's sandboxes are
listed once and again only when its folder of sandboxes changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import stat
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from arbiter.edge.settings import Settings
from arbiter.mcp.hook import HookInputError, Sandboxes, decide, deny_json, parse, sandboxes_of, written_paths
from arbiter.mcp.hookclient import socket_path

log = logging.getLogger("arbiter.hook")

DECIDE_SECONDS = 0.35
"""How long a decision may take before the answer is "block" (the client waits 0.45 s in all)."""
MAX_REQUEST = 1 << 20


class CachedSandboxes:
    """Each repository's sandboxes, listed again only when its folder of sandboxes changes."""

    def __init__(self, sandbox_root: str) -> None:
        self.sandbox_root = sandbox_root
        self._list = sandboxes_of(sandbox_root)
        self._seen: dict[Path, tuple[int, list[dict[str, Any]]]] = {}

    def __call__(self, name: str, root: Path) -> list[dict[str, Any]]:
        stamp = _sandboxes_stamp(root, self.sandbox_root)
        cached = self._seen.get(root)
        if cached is not None and stamp is not None and cached[0] == stamp:
            return cached[1]
        boxes = self._list(name, root)
        if stamp is not None:
            self._seen[root] = (stamp, boxes)
        return boxes


def _sandboxes_stamp(root: Path, sandbox_root: str) -> int | None:
    """When the repository's folder of sandboxes last had one added or removed (None: it cannot be told;
    list them)."""
    if sandbox_root:
        folder = Path(sandbox_root).expanduser() / root.name
    else:
        git = root / ".git"
        folder = (git if git.is_dir() else root) / "arbiter" / "sandboxes"
    with contextlib.suppress(OSError):
        return folder.stat().st_mtime_ns
    return None


class HookServer:
    """Answers ``agent``'s hook with ``client`` (an ``ArbiterClient``, started by the caller)."""

    def __init__(self, client: Any, settings: Settings, *, on_activity: Callable[[], None] | None = None,
                 heartbeat: Path | None = None, ready: Callable[[], Awaitable[None]] | None = None) -> None:
        self.client = client
        self.ready = ready
        """What to wait for before a decision (the client's connection), within the decision's time."""
        self.agent: str = client.agent_id
        self.settings = settings
        self.on_activity = on_activity
        self.heartbeat = heartbeat
        self.path = Path(socket_path(settings.home, self.agent))
        self.sandboxes: Sandboxes = CachedSandboxes(settings.sandbox_root)
        self.answered = 0
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> bool:
        """Listen; False when another live process already answers this agent's hook (it keeps doing so)."""
        folder = self.path.parent
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        if folder.stat().st_uid != os.getuid():
            raise PermissionError(f"{folder} is not this user's: the hook's socket cannot go there")
        if stat.S_IMODE(folder.stat().st_mode) & 0o077:
            os.chmod(folder, 0o700)  # only this user may reach the socket
        if self.path.exists():
            if await _answers(self.path):
                log.warning("another process already answers %s's hook at %s", self.agent, self.path)
                return False
            self.path.unlink()  # left by a process that is gone
        self._server = await asyncio.start_unix_server(self._serve, path=str(self.path), limit=MAX_REQUEST)
        os.chmod(self.path, 0o600)
        return True

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            with contextlib.suppress(OSError):
                if self.path.is_socket():
                    self.path.unlink()
            self._server = None

    async def __aenter__(self) -> HookServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(5):
                agent = (await reader.readline()).decode(errors="replace").rstrip("\n")
                payload = await reader.read(MAX_REQUEST)
            decision, text = await self.answer(agent, payload.decode(errors="replace"))
            writer.write(f"{decision}\n{text}".encode())
            await writer.drain()
        except (OSError, TimeoutError, ValueError) as error:
            log.debug("hook connection dropped: %s", error)
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def answer(self, agent: str, text: str) -> tuple[str, str]:
        """The decision on one PreToolUse payload, and what the client prints (``hookclient``'s protocol)."""
        self.answered += 1
        if agent != self.agent:
            return "block", f"this process answers {self.agent}'s hook, not {agent!r}'s."
        try:
            payload = parse(text)
        except HookInputError as error:
            return "block", f"cannot read the PreToolUse input: {error}."
        self._active()
        if not written_paths(payload):
            return "allow", ""  # a read, or nothing to check: the agent's own permissions decide
        try:
            repos = {name: repo.path for name, repo in self.settings.repositories().items()}
            async with asyncio.timeout(DECIDE_SECONDS):
                if self.ready is not None:
                    await self.ready()
                reason = await decide(payload, self.client, repos, self.sandboxes)
        except TimeoutError:
            return "block", (f"Arbiter at {self.settings.bootstrap} did not answer within {DECIDE_SECONDS:g} s, "
                             "so it cannot tell whether another agent holds these paths.")
        except Exception as error:  # a broken setting, or Arbiter unreachable: block, say why
            return "block", f"cannot decide ({type(error).__name__}: {error})."
        return ("allow", "") if reason is None else ("deny", deny_json(reason))

    def _active(self) -> None:
        if self.on_activity is not None:
            self.on_activity()
        if self.heartbeat is not None:
            with contextlib.suppress(OSError):
                self.heartbeat.parent.mkdir(parents=True, exist_ok=True)
                self.heartbeat.touch()


async def _answers(path: Path) -> bool:
    """Whether a process listens on the socket at ``path``."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_unix_connection(str(path)), 1)
    except (OSError, TimeoutError):
        return False
    writer.close()
    return True
