"""A web page cannot read a door or its console: requests for another ``Host`` (DNS rebinding) and
from another ``Origin`` get nothing, over HTTP, on the WebSocket handshake and at ``/mcp``.

Real doors, real requests (curl, raw sockets for the handshake, the ``websockets`` client): a door on
loopback (the default, no key needed for its console), ``arbiter console`` on loopback, and a door
listening on every address (``--host 0.0.0.0``) that names the host it is reached by in
``ARBITER_DOOR_ALLOWED_HOSTS``.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect as ws_connect
from websockets.typing import Origin

from arbiter.agents import ArbiterClient
from arbiter.agents.identities import Registrar
from arbiter.edge.settings import Settings
from arbiter.processes import DoorProcess, WorkerPool, wait_until_served
from arbiter.schemas.partitioning import key_for_partition
from arbiter.streams.runtime.topics import ensure_topics
from tests.conftest import isolated_settings
from tests.door.test_door_http import Answer, curl

pytestmark = pytest.mark.kafka

NAMED = "arbiter.example.com"
"""The name the door that listens beyond loopback is configured to answer."""
HOSTILE_HOSTS = ("attacker.example", "attacker.example:{port}", f"{NAMED}.attacker.example", "localhost.evil",
                 "127.0.0.1.nip.io:{port}", "", "[::1", "a b")
FOREIGN_ORIGINS = ("http://attacker.example", "http://attacker.example:{port}", "null", "http://localhost:1",
                   "https://127.0.0.1.nip.io:{port}", "file://", "http://127.0.0.1:{port}/path")


@dataclass
class Doors:
    settings: Settings
    loopback: DoorProcess
    console: DoorProcess
    wide: DoorProcess
    key: str
    operator: str


async def _start(settings: Settings, pool: WorkerPool) -> tuple[str, str]:
    await ensure_topics(settings)
    pool.start(1)
    keys = [key_for_partition(p, settings.partitions) for p in range(settings.partitions)]
    async with ArbiterClient("warmup", settings) as client:
        await wait_until_served(client, pool, keys)
    registrar = Registrar(settings)
    issued = []
    for name in ("webby", "ops"):
        await registrar.add(name)
        issued.append((await registrar.issue_credential(name, label="origin"))[0].api_key())
    return issued[0], issued[1]


@pytest.fixture(scope="module")
def doors(bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Doors]:
    settings = isolated_settings(bootstrap, tmp_path_factory.mktemp("door_origin"), console_operators="ops")
    pool = WorkerPool(settings)
    started = [DoorProcess(settings), DoorProcess(settings, command=("console",)),
               DoorProcess(settings, extra_env={"ARBITER_DOOR_ALLOWED_HOSTS": f"{NAMED}, other.example"},
                           command=("serve", "--host", "0.0.0.0", "--loglevel", "info"))]
    try:
        key, operator = asyncio.run(_start(settings, pool))
        with ThreadPoolExecutor(len(started)) as starting:
            list(starting.map(DoorProcess.start, started))
        yield Doors(settings, *started, key=key, operator=operator)
    finally:
        for door in started:
            door.stop()
        pool.stop()


def get(door: DoorProcess, path: str, *headers: str, key: str | None = None, method: str = "GET",
        body: object = None) -> Answer:
    sent = tuple("Host;" if h == "Host: " else h for h in headers)  # (curl's way to send an empty header)
    return curl(method, door.url + path, key=key, body=body, headers=sent, timeout=15)


def routes(doors: Doors) -> list[tuple[str, str, object]]:
    """(method, path, body) of a call of each kind a page might want to read: the console, the API, /mcp."""
    initialize = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "test", "version": "1"}}}
    return [("GET", "/", None), ("GET", "/console/console.js", None), ("GET", "/console/history?name=doc:x", None),
            ("GET", "/console/stream", None), ("GET", "/v1/status", None), ("GET", "/healthz", None),
            ("GET", "/metrics", None), ("GET", "/openapi.json", None), ("GET", "/docs", None),
            ("POST", "/v1/leases/acquire", {"resource": "doc:origin", "ttl": 5}), ("POST", "/mcp", initialize)]


MCP_ACCEPT = "Accept: application/json, text/event-stream"


def _refused(answer: Answer, status: int, reason: str, what: object) -> None:
    assert answer.status == status, (what, answer.status, answer.text[:300])
    assert answer.json["reason"] == reason, (what, answer.text)
    assert "holders" not in answer.text and "snapshot" not in answer.text and "<html" not in answer.text, what


@pytest.mark.parametrize("which", ["loopback", "console", "wide"])
def test_a_request_for_another_host_gets_nothing(doors: Doors, which: str) -> None:
    door: DoorProcess = getattr(doors, which)
    for host in HOSTILE_HOSTS:
        host = host.format(port=door.port)
        for method, path, body in routes(doors):
            answer = get(door, path, f"Host: {host}", MCP_ACCEPT, key=doors.key, method=method, body=body)
            _refused(answer, 421, "host_not_allowed", (host, path))
    # A name the door is not configured for, on a loopback door; an address, on a loopback door.
    for host in ((NAMED, "10.0.0.7:{port}") if which != "wide" else ()):
        answer = get(door, "/", f"Host: {host.format(port=door.port)}")
        _refused(answer, 421, "host_not_allowed", host)


@pytest.mark.parametrize("which", ["loopback", "console", "wide"])
def test_the_names_a_door_is_reached_by_are_answered(doors: Doors, which: str) -> None:
    door: DoorProcess = getattr(doors, which)
    names = ["localhost", "127.0.0.1", "[::1]", "LocalHost.", "127.0.0.2"]
    if which == "wide":
        names += [NAMED, NAMED.upper(), "other.example", "10.0.0.7", "[fd00::7]"]
    for name in names:
        for host in (name, f"{name}:{door.port}"):
            page = get(door, "/", f"Host: {host}")
            assert page.status == 200 and "<html" in page.text, (host, page.status, page.text[:200])
            origin = f"http://{host}"
            live = get(door, "/livez", f"Host: {host}", f"Origin: {origin}")
            assert live.status == 200 and live.json["live"] is True, (host, origin, live.text)
    mcp = get(door, "/mcp", MCP_ACCEPT, key=doors.key, method="POST", body=routes(doors)[-1][2])
    assert mcp.status == 200 and "serverInfo" in mcp.text, mcp.text[:300]


@pytest.mark.parametrize("which", ["loopback", "console", "wide"])
def test_a_request_from_another_origin_gets_nothing(doors: Doors, which: str) -> None:
    door: DoorProcess = getattr(doors, which)
    host = f"127.0.0.1:{door.port}"
    for origin in FOREIGN_ORIGINS:
        origin = origin.format(port=door.port)
        for method, path, body in routes(doors):
            answer = get(door, path, f"Host: {host}", f"Origin: {origin}", MCP_ACCEPT, key=doors.key,
                         method=method, body=body)
            _refused(answer, 403, "cross_origin", (origin, path))
    # A browser's own word that a script or an image of another site asks; a link to the console still opens it.
    for site in ("cross-site", "same-site"):
        for mode in ("cors", "no-cors"):
            answer = get(door, "/console/history?name=doc:x", f"Sec-Fetch-Site: {site}", f"Sec-Fetch-Mode: {mode}")
            _refused(answer, 403, "cross_origin", (site, mode))
        page = get(door, "/", f"Sec-Fetch-Site: {site}", "Sec-Fetch-Mode: navigate")
        assert page.status == 200 and "<html" in page.text, page.text[:200]
    # The door's own page calling it: answered.
    own = get(door, "/console/history?name=doc:x", f"Origin: http://{host}", "Sec-Fetch-Site: same-origin",
              "Sec-Fetch-Mode: cors", *((f"Authorization: Bearer {doors.operator}",) if which == "wide" else ()))
    assert own.status == 200 and own.json["name"] == "doc:x", own.text


def handshake(door: DoorProcess, *headers: str) -> tuple[int, str]:
    """A WebSocket opening handshake on a raw socket: the status and the body of the door's answer."""
    lines = ["GET /v1/session HTTP/1.1", "Upgrade: websocket", "Connection: Upgrade",
             "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==", "Sec-WebSocket-Version: 13", *headers]
    with socket.create_connection(("127.0.0.1", door.port), timeout=15) as sock:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(4096)
            if not chunk:
                break
            data += chunk
        head, _, rest = data.partition(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        if status != 101:
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            while len(rest) < length and (chunk := sock.recv(4096)):
                rest += chunk
        return status, rest.decode(errors="replace")


@pytest.mark.parametrize("which", ["loopback", "wide"])
def test_a_websocket_from_another_host_or_origin_is_never_opened(doors: Doors, which: str) -> None:
    door: DoorProcess = getattr(doors, which)
    auth = f"Authorization: Bearer {doors.key}"
    host = f"Host: 127.0.0.1:{door.port}"
    for hostile in HOSTILE_HOSTS[:5]:
        status, body = handshake(door, f"Host: {hostile.format(port=door.port)}", auth)
        assert status == 421 and json.loads(body)["reason"] == "host_not_allowed", (hostile, status, body)
    for origin in FOREIGN_ORIGINS:
        status, body = handshake(door, host, f"Origin: {origin.format(port=door.port)}", auth)
        assert status == 403 and json.loads(body)["reason"] == "cross_origin", (origin, status, body)
    assert handshake(door, host, f"Origin: http://127.0.0.1:{door.port}", auth)[0] == 101
    assert handshake(door, host, auth)[0] == 101  # not a browser: no Origin at all

    # A real client: a page's Origin is refused before anything is said; the door's own is a session.
    url, bearer = door.url.replace("http", "ws") + "/v1/session", {"Authorization": f"Bearer {doors.key}"}
    with pytest.raises(InvalidStatus) as refused:
        ws_connect(url, origin=Origin("http://attacker.example"), additional_headers=bearer, open_timeout=10)
    assert refused.value.response.status_code == 403
    with ws_connect(url, origin=Origin(f"http://127.0.0.1:{door.port}"), additional_headers=bearer,
                    open_timeout=10) as session:
        assert json.loads(session.recv(timeout=10))["op"] == "hello"


def test_a_door_beyond_loopback_opens_its_console_to_operators_only(doors: Doors) -> None:
    """``arbiter serve --host 0.0.0.0``: the address on the command line is where it listens, so its console
    asks for an operator's key even when ``ARBITER_DOOR_HOST`` says loopback."""
    door = doors.wide
    assert get(door, "/console/history?name=doc:x", f"Host: {NAMED}").status == 401
    assert get(door, "/console/history?name=doc:x", f"Host: {NAMED}", key=doors.key).status == 403
    assert get(door, "/console/history?name=doc:x", f"Host: {NAMED}", key=doors.operator).status == 200
    assert get(doors.loopback, "/console/history?name=doc:x").status == 200
