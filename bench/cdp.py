"""A small driver for Debian's headless Chromium over the DevTools protocol (the ``websockets`` package
Arbiter already depends on): open a page, evaluate JavaScript in it, collect its console errors and
uncaught exceptions, and take a screenshot. Chromium is started by its PID and stopped by it. The
console's browser test and ``python -m bench console`` drive the page with it."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

from websockets.asyncio.client import ClientConnection, connect


class Browser:
    """``async with Browser(profile) as page``: one headless Chromium tab."""

    def __init__(self, chromium: str, profile: Path, width: int = 1400, height: int = 900) -> None:
        self.chromium = chromium
        self.profile = profile
        self.size = (width, height)
        self.proc: subprocess.Popen[str] | None = None
        self.ws: ClientConnection | None = None
        self.errors: list[str] = []
        self._next = 0
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._events: dict[str, asyncio.Event] = {}
        self._reader: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Browser:
        self.proc = await asyncio.to_thread(
            subprocess.Popen, [self.chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--no-first-run", "--remote-debugging-port=0", "--remote-allow-origins=*",
             f"--user-data-dir={self.profile}", f"--window-size={self.size[0]},{self.size[1]}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        url = await asyncio.to_thread(self._devtools_url)
        port = re.search(r":(\d+)/", url)
        assert port, url
        targets = await asyncio.to_thread(self._json, f"http://127.0.0.1:{port.group(1)}/json/list")
        page = next(t for t in targets if t["type"] == "page")
        self.ws = await connect(page["webSocketDebuggerUrl"], max_size=64 * 1024 * 1024)
        self._reader = asyncio.create_task(self._read())
        for domain in ("Page", "Runtime", "Log"):
            await self.send(f"{domain}.enable")
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._reader is not None:
            self._reader.cancel()
        if self.ws is not None:
            await self.ws.close()
        if self.proc is not None:
            self.proc.terminate()
            try:
                await asyncio.to_thread(self.proc.wait, 10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                await asyncio.to_thread(self.proc.wait)

    def _devtools_url(self) -> str:
        assert self.proc is not None and self.proc.stderr is not None
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            found = re.search(r"DevTools listening on (ws://\S+)", line)
            if found:
                return found.group(1)
            if not line and self.proc.poll() is not None:
                break
        raise AssertionError("chromium did not open its DevTools port")

    @staticmethod
    def _json(url: str) -> Any:
        with urllib.request.urlopen(url, timeout=10) as answer:
            return json.loads(answer.read())

    async def _read(self) -> None:
        assert self.ws is not None
        async for raw in self.ws:
            message = json.loads(raw)
            if "id" in message:
                waiting = self._waiting.pop(message["id"], None)
                if waiting is not None and not waiting.done():
                    waiting.set_result(message)
                continue
            method, params = message.get("method", ""), message.get("params", {})
            if method == "Runtime.exceptionThrown":
                self.errors.append(json.dumps(params.get("exceptionDetails", {}))[:500])
            elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                self.errors.append(json.dumps(params.get("args", []))[:500])
            elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
                self.errors.append(params["entry"].get("text", "")[:500])
            event = self._events.get(method)
            if event is not None:
                event.set()

    async def send(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        assert self.ws is not None
        self._next += 1
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[self._next] = future
        await self.ws.send(json.dumps({"id": self._next, "method": method, "params": params or {}}))
        answer = await asyncio.wait_for(future, 30)
        assert "error" not in answer, answer
        return dict(answer.get("result", {}))

    async def open(self, url: str) -> None:
        loaded = self._events["Page.loadEventFired"] = asyncio.Event()
        await self.send("Page.navigate", {"url": url})
        await asyncio.wait_for(loaded.wait(), 30)

    async def eval(self, expression: str) -> Any:
        result = await self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                                      "awaitPromise": True})
        assert "exceptionDetails" not in result, result
        return result["result"].get("value")

    async def until(self, expression: str, timeout: float = 10.0) -> Any:
        """Evaluate ``expression`` until it is truthy (the page's own state, not a sleep)."""
        deadline = time.monotonic() + timeout
        while True:
            value = await self.eval(expression)
            if value:
                return value
            assert time.monotonic() < deadline, f"never true: {expression}"
            await asyncio.sleep(0.02)

    async def screenshot(self, path: Path) -> Path:
        shot = await self.send("Page.captureScreenshot", {"format": "png"})
        await asyncio.to_thread(path.write_bytes, base64.b64decode(shot["data"]))
        return path
