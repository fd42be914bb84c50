"""The front door (``arbiter serve``) driven by clients that are not Python: ``curl`` for HTTP,
Node's built-in WebSocket for sessions (``tests/clients/session.mjs``), against a real worker.

One worker and three doors serve the whole module (each test uses resources of its own): the
default door, a tight one (a low rate, a 1 KiB body limit) and a narrow one (4-frame session buffers).
"""

from __future__ import annotations

import asyncio
import json
import queue
import re
import shutil
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from websockets.client import ClientProtocol
from websockets.frames import Opcode
from websockets.http11 import Response
from websockets.sync.client import ClientConnection
from websockets.sync.client import connect as ws_connect
from websockets.uri import parse_uri

from arbiter.agents import ArbiterClient
from arbiter.agents.identities import Operator, Registrar
from arbiter.edge.clock import now_ms
from arbiter.edge.kafkaauth import kafka_client_options
from arbiter.edge.settings import Settings
from arbiter.processes import DoorProcess, WorkerPool, wait_until_served
from arbiter.schemas import default_codec
from arbiter.schemas.identity import Signer
from arbiter.schemas.partitioning import key_for_partition
from arbiter.streams.runtime.topics import ensure_topics
from tests.conftest import REPO, isolated_settings

pytestmark = pytest.mark.kafka

CLIENTS = REPO / "tests" / "clients"
AGENTS = ("alice", "bob", "hasty", "calm", "revokee", "nodey", "forger", "slowpoke", "bystander", "waiter")
TIGHT = {"ARBITER_DOOR_RATE": "0.05", "ARBITER_DOOR_BURST": "3", "ARBITER_DOOR_MAX_BODY_BYTES": "1024"}
"""The tight door: 3 calls at once then one per 20 s per agent, 1 KiB bodies."""
NARROW = {"ARBITER_DOOR_SESSION_BUFFER": "4", "ARBITER_DOOR_MAX_OPEN_SAGAS_PER_AGENT": "2"}
"""The narrow door: a session may leave 4 frames unread, an agent may have 2 sagas open."""


def tool(name: str) -> str:
    """The system's ``name`` (a missing client fails the test, never skips it)."""
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed: these tests drive the front door with it", pytrace=False)
    return path


@dataclass
class Front:
    settings: Settings
    door: DoorProcess
    tight: DoorProcess
    narrow: DoorProcess
    keys: dict[str, str] = field(default_factory=dict)


async def _start(settings: Settings, pool: WorkerPool) -> dict[str, str]:
    await ensure_topics(settings)
    pool.start(1)
    keys = [key_for_partition(p, settings.partitions) for p in range(settings.partitions)]
    async with ArbiterClient("warmup", settings) as client:
        await wait_until_served(client, pool, keys)
    registrar = Registrar(settings)
    issued = {}
    for name, allow in [*((name, []) for name in AGENTS), ("scoped", ["doc:a/"])]:
        await registrar.add(name, allow=allow)
        issued[name] = (await registrar.issue_credential(name, label="http-tests"))[0].api_key()
    return issued


@pytest.fixture(scope="module")
def front(bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Front]:
    settings = isolated_settings(bootstrap, tmp_path_factory.mktemp("door_http"))
    pool = WorkerPool(settings)
    doors = [DoorProcess(settings), DoorProcess(settings, extra_env=TIGHT), DoorProcess(settings, extra_env=NARROW)]
    try:
        keys = asyncio.run(_start(settings, pool))
        with ThreadPoolExecutor(len(doors)) as starting:
            list(starting.map(DoorProcess.start, doors))
        yield Front(settings, *doors, keys=keys)
    finally:
        for door in doors:
            door.stop()
        pool.stop()


# -- curl -------------------------------------------------------------------------------


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    text: str

    @property
    def json(self) -> Any:
        return json.loads(self.text)


def curl(method: str, url: str, *, key: str | None = None, body: Any = None, raw: bytes | None = None,
         headers: tuple[str, ...] = (), timeout: float = 30) -> Answer:
    """One HTTP call with the system's curl: its status, headers (lower-case names) and body."""
    args = [tool("curl"), "-sS", "-D", "-", "-o", "-", "-X", method, "--max-time", str(timeout),
            "-H", "Expect:"]
    if key is not None:
        args += ["-H", f"Authorization: Bearer {key}"]
    for header in headers:
        args += ["-H", header]
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    if data is not None:
        args += ["-H", "Content-Type: application/json", "--data-binary", "@-"]
    args.append(url)
    done = subprocess.run(args, input=data or b"", capture_output=True, timeout=timeout + 10)
    assert done.returncode == 0, f"curl failed ({done.returncode}): {done.stderr.decode()}"
    return parse_http(done.stdout)


def parse_http(output: bytes) -> Answer:
    head, _, body = output.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {name.strip().lower(): value.strip()
               for name, _, value in (line.partition(":") for line in lines[1:])}
    return Answer(status, headers, body.decode())


def curl_in_background(method: str, url: str, *, key: str, body: Any, timeout: float = 30
                       ) -> subprocess.Popen[bytes]:
    """A curl call left running (read it with ``finish``)."""
    proc = subprocess.Popen(
        [tool("curl"), "-sS", "-D", "-", "-o", "-", "-X", method, "--max-time", str(timeout), "-H", "Expect:",
         "-H", f"Authorization: Bearer {key}", "-H", "Content-Type: application/json",
         "--data-binary", json.dumps(body), url],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    return proc


def finish(proc: subprocess.Popen[bytes], timeout: float) -> Answer:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"curl failed ({proc.returncode}): {err.decode()}"
    return parse_http(out)


def until(what: str, check: Callable[[], Any], timeout: float = 15.0) -> Any:
    """Call ``check`` until it returns something true; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout:g} s (last: {value!r})")
        time.sleep(0.05)


# -- the HTTP API, with curl --------------------------------------------------------------


def test_curl_acquire_busy_renew_snapshot_release(front: Front) -> None:
    url, keys, resource = front.door.url, front.keys, "ticket:curl-1"
    granted = curl("POST", f"{url}/v1/leases/acquire", key=keys["alice"], body={"resource": resource, "ttl": 20})
    assert granted.status == 200, granted.text
    lease = granted.json
    assert lease["granted"] is True and lease["resource"] == resource and isinstance(lease["token"], int)
    assert granted.headers["content-type"] == "application/json"

    busy = curl("POST", f"{url}/v1/leases/acquire", key=keys["bob"], body={"resource": resource})
    assert busy.status == 409, busy.text
    assert busy.headers["content-type"] == "application/json"
    diagnostic = busy.json
    assert diagnostic["reason"] == "busy" and diagnostic["resource"] == resource and diagnostic["what_to_do"]
    assert [h["agent_id"] for h in diagnostic["current"]["holders"]] == ["alice"], diagnostic

    renewed = curl("POST", f"{url}/v1/leases/renew", key=keys["alice"],
                   body={"resource": resource, "token": lease["token"], "ttl": 60})
    assert renewed.status == 200, renewed.text
    assert renewed.json["renewed"] is True and renewed.json["expires_at_ms"] > lease["expires_at_ms"]

    snapshot = curl("GET", f"{url}/v1/resources/{resource}", key=keys["alice"])
    assert snapshot.status == 200, snapshot.text
    assert snapshot.json["resource"] == resource and snapshot.json["high_water_token"] == lease["token"]
    assert [(h["agent_id"], h["token"]) for h in snapshot.json["holders"]] == [("alice", lease["token"])]
    # Another agent sees who holds it, not the holder's token.
    assert [(h["agent_id"], h["token"]) for h in curl("GET", f"{url}/v1/resources/{resource}",
                                                      key=keys["bob"]).json["holders"]] == [("alice", 0)]

    # Only the holder renews or releases its lease.
    stolen = curl("POST", f"{url}/v1/leases/release", key=keys["bob"],
                  body={"resource": resource, "token": lease["token"]})
    assert stolen.status == 409 and stolen.json["reason"] == "not_holder", stolen.text

    released = curl("POST", f"{url}/v1/leases/release", key=keys["alice"],
                    body={"resource": resource, "token": lease["token"]})
    assert released.status == 200 and released.json["released"] is True, released.text
    again = curl("POST", f"{url}/v1/leases/release", key=keys["alice"],
                 body={"resource": resource, "token": lease["token"]})
    assert again.status == 200 and again.json["released"] is False, again.text

    taken = curl("POST", f"{url}/v1/leases/acquire", key=keys["bob"], body={"resource": resource})
    assert taken.status == 200 and taken.json["token"] == lease["token"] + 1, taken.text
    assert curl("GET", f"{url}/v1/resources/{resource}", key=keys["alice"]).json["holders"][0]["agent_id"] == "bob"
    curl("POST", f"{url}/v1/leases/release", key=keys["bob"], body={"resource": resource, "token": taken.json["token"]})


def test_curl_commit_and_execute_with_a_version_conflict(front: Front) -> None:
    url, keys, doc = front.door.url, front.keys, "doc:curl-occ"
    base = curl("GET", f"{url}/v1/resources/{doc}", key=keys["alice"]).json["version"]
    first = curl("POST", f"{url}/v1/commit", key=keys["alice"],
                 body={"resource": doc, "base_version": base, "patch": {"title": "Arbiter"}})
    assert first.status == 200, first.text
    assert first.json["applied"] is True and first.json["version"] == base + 1

    stale = curl("POST", f"{url}/v1/commit", key=keys["bob"],
                 body={"resource": doc, "base_version": base, "patch": {"title": "Mine"}})
    assert stale.status == 409, stale.text
    conflict = stale.json
    assert conflict["reason"] == "version_conflict" and conflict["applied"] is False
    assert [c["arguments"] for c in conflict["changes_since_base"]] == [{"patch": {"title": "Arbiter"}}]
    assert conflict["what_to_do"]

    executed = curl("POST", f"{url}/v1/execute", key=keys["bob"],
                    body={"resource": doc, "tool": "commit", "args": {"patch": {"intro": "x"}}, "base_version": base})
    assert executed.status == 409 and executed.json["reason"] == "version_conflict", executed.text
    assert executed.json["changes_since_base"]
    rebased = curl("POST", f"{url}/v1/execute", key=keys["bob"],
                   body={"resource": doc, "tool": "commit", "args": {"patch": {"intro": "x"}},
                         "base_version": base + 1})
    assert rebased.status == 200 and rebased.json["version"] == base + 2, rebased.text
    snapshot = curl("GET", f"{url}/v1/resources/{doc}", key=keys["alice"]).json
    assert snapshot["version"] == base + 2 and snapshot["content_hash"] == rebased.json["content_hash"]


def next_event(session: ClientConnection, kind: str, timeout: float = 15.0) -> dict[str, Any]:
    """The next event frame of a session whose record is a ``kind``."""
    deadline = time.monotonic() + timeout
    while True:
        frame = json.loads(session.recv(timeout=max(0.0, deadline - time.monotonic())))
        if frame["op"] == "event" and frame["record"]["type"] == kind:
            return dict(frame)


def test_curl_acquire_with_wait_is_held_open_until_the_holder_releases(front: Front) -> None:
    url, keys, resource = front.door.url, front.keys, "ticket:curl-wait"
    held = curl("POST", f"{url}/v1/leases/acquire", key=keys["alice"], body={"resource": resource, "ttl": 30})
    assert held.status == 200, held.text
    # The waiter's own session shows when its request is queued (a fact, not a guess at timing).
    with ws_connect(url.replace("http", "ws") + "/v1/session",
                    additional_headers={"Authorization": f"Bearer {keys['waiter']}"}, open_timeout=10) as session:
        hello = json.loads(session.recv(timeout=10))
        assert hello["op"] == "hello" and hello["agent"] == "waiter"
        waiting = curl_in_background("POST", f"{url}/v1/leases/acquire", key=keys["waiter"],
                                     body={"resource": resource, "ttl": 10, "wait": 20})
        try:
            assert next_event(session, "LockQueued")["record"]["resource"] == resource
            assert waiting.poll() is None, "the waiting acquire answered before the holder released"
            released = curl("POST", f"{url}/v1/leases/release", key=keys["alice"],
                            body={"resource": resource, "token": held.json["token"]})
            assert released.status == 200, released.text
            granted = finish(waiting, timeout=20)
        finally:
            if waiting.poll() is None:
                waiting.kill()
                waiting.wait()
        assert granted.status == 200, granted.text
        assert granted.json["granted"] is True and granted.json["token"] == held.json["token"] + 1
        grant = next_event(session, "LockGranted")
        assert grant["record"]["token"] == granted.json["token"]


def test_curl_unauthenticated_comes_before_the_body(front: Front) -> None:
    url = front.door.url
    acquire = f"{url}/v1/leases/acquire"
    ghost = Signer.generate("ghost").api_key()  # well formed, never registered
    for key, headers in [(None, ()), (None, ("Authorization: Basic YWxpY2U6eA==",)), ("not-a-key", ()),
                         (ghost, ())]:
        for raw in [b'{"resource": "ticket:auth"}', b'{"resource": "", "ttl": -1}', b"{not json", b""]:
            answer = curl("POST", acquire, key=key, raw=raw, headers=headers)
            assert answer.status == 401, (key, headers, raw, answer.text)
            assert answer.json["reason"] == "unauthenticated" and answer.json["what_to_do"]
            assert answer.headers["www-authenticate"].startswith("Bearer")
    assert curl("GET", f"{url}/v1/resources/ticket:auth").status == 401
    assert curl("GET", f"{url}/v1/status", key=ghost).status == 401


def test_curl_invalid_input_is_422_naming_the_field(front: Front) -> None:
    url, key = front.door.url, front.keys["alice"]
    malformed = curl("POST", f"{url}/v1/leases/acquire", key=key, raw=b'{"resource": "ticket:x", ')
    assert malformed.status == 422, malformed.text
    assert malformed.json["reason"] == "invalid_request" and malformed.json["detail"].startswith("body")

    for body, where in [({"resource": "ticket:x", "ttl": -1}, "body.ttl"), ({"resource": ""}, "body.resource"),
                        ({"resource": "ticket:x", "mode": "sideways"}, "body.mode"),
                        ({"resource": "ticket:x", "colour": "red"}, "body.colour"),
                        ({"ttl": 5}, "body.resource")]:
        answer = curl("POST", f"{url}/v1/leases/acquire", key=key, body=body)
        assert answer.status == 422, (body, answer.text)
        assert answer.json["reason"] == "invalid_request"
        assert answer.json["detail"].startswith(f"{where}:"), (body, answer.json)
        assert [e["field"] for e in answer.json["errors"]] == [where]
    token = curl("POST", f"{url}/v1/leases/renew", key=key, body={"resource": "ticket:x", "token": "seven"})
    assert token.status == 422 and token.json["errors"][0]["field"] == "body.token", token.text


def test_curl_unknown_route_too_large_body_and_openapi(front: Front) -> None:
    url, key = front.door.url, front.keys["alice"]
    missing = curl("GET", f"{url}/v1/nothing-here", key=key)
    assert missing.status == 404 and missing.headers["content-type"] == "application/json"
    assert missing.json["reason"] == "not_found" and "/v1/nothing-here" in missing.json["detail"]
    wrong = curl("GET", f"{url}/v1/leases/acquire", key=key)
    assert wrong.status == 405 and wrong.json["reason"] == "method_not_allowed", wrong.text

    tight = front.tight.url
    big = json.dumps({"resource": "ticket:big", "saga_id": "x" * 2000}).encode()
    declared = curl("POST", f"{tight}/v1/leases/acquire", key=front.keys["alice"], raw=big)
    assert declared.status == 413 and declared.json["reason"] == "too_large", declared.text
    chunked = curl("POST", f"{tight}/v1/leases/acquire", key=front.keys["alice"], raw=big,
                   headers=("Transfer-Encoding: chunked",))
    assert chunked.status == 413 and chunked.json["reason"] == "too_large", chunked.text

    spec = curl("GET", f"{url}/openapi.json")
    assert spec.status == 200, spec.text
    paths = spec.json["paths"]
    for path in ["/v1/leases/acquire", "/v1/leases/renew", "/v1/leases/release", "/v1/execute", "/v1/commit",
                 "/v1/resources/{resource}", "/v1/sagas", "/v1/sagas/{saga_id}/steps",
                 "/v1/sagas/{saga_id}/complete", "/v1/sagas/{saga_id}/abort", "/v1/status", "/healthz"]:
        assert path in paths, (path, sorted(paths))
    assert "post" in paths["/v1/leases/acquire"]
    assert "bearer" in json.dumps(spec.json["components"]["securitySchemes"]).lower()


def test_curl_rate_limit_of_one_agent_leaves_others_alone(front: Front) -> None:
    url, keys = front.tight.url, front.keys
    for i in range(3):  # the burst
        answer = curl("GET", f"{url}/v1/resources/rate:{i}", key=keys["hasty"])
        assert answer.status == 200, answer.text
    with ThreadPoolExecutor(4) as pool:
        over = [pool.submit(curl, "GET", f"{url}/v1/resources/rate:over", key=keys["hasty"]) for _ in range(2)]
        others = [pool.submit(curl, "GET", f"{url}/v1/resources/rate:calm", key=keys["calm"]) for _ in range(2)]
        for limited in (f.result() for f in over):
            assert limited.status == 429, limited.text
            assert limited.json["reason"] == "rate_limited" and limited.json["what_to_do"]
            assert int(limited.headers["retry-after"]) >= 1
        for fine in (f.result() for f in others):
            assert fine.status == 200 and fine.json["resource"] == "rate:calm", fine.text
    # Calls that send no command are not charged: the limited agent can still ask how it stands.
    status = curl("GET", f"{url}/v1/status", key=keys["hasty"])
    assert status.status == 200 and status.json["agent"] == "hasty", status.text


def test_curl_revoked_agent_key_is_401(front: Front) -> None:
    url, key = front.door.url, front.keys["revokee"]
    assert curl("GET", f"{url}/v1/resources/ticket:revokee", key=key).status == 200
    asyncio.run(Registrar(front.settings).revoke("revokee", "test: key leaked"))
    refused = until("the door refuses the revoked key",
                    lambda: (a := curl("GET", f"{url}/v1/status", key=key)).status == 401 and a)
    assert refused.json["reason"] == "unauthenticated" and "revoked" in refused.json["detail"]
    answer = curl("POST", f"{url}/v1/leases/acquire", key=key, body={"resource": "ticket:revokee"})
    assert answer.status == 401, answer.text


def test_curl_agent_restricted_to_a_prefix_is_403_elsewhere(front: Front) -> None:
    url, key = front.door.url, front.keys["scoped"]
    inside = curl("POST", f"{url}/v1/leases/acquire", key=key, body={"resource": "doc:a/intro", "ttl": 5})
    assert inside.status == 200, inside.text
    outside = curl("POST", f"{url}/v1/leases/acquire", key=key, body={"resource": "doc:b/intro", "ttl": 5})
    assert outside.status == 403, outside.text
    assert outside.json["reason"] == "forbidden" and outside.json["what_to_do"]
    write = curl("POST", f"{url}/v1/commit", key=key, body={"resource": "doc:b/intro", "base_version": 0,
                                                            "patch": {"x": 1}})
    assert write.status == 403 and write.json["reason"] == "forbidden", write.text
    curl("POST", f"{url}/v1/leases/release", key=key, body={"resource": "doc:a/intro", "token": inside.json["token"]})


# -- sessions: Node's WebSocket ---------------------------------------------------------------


def node_command() -> list[str]:
    """``node`` with its WebSocket client on (a flag from Node 20.10, on by default from 22)."""
    node = tool("node")
    version = subprocess.run([node, "--version"], capture_output=True, text=True, check=True).stdout.strip()
    major, minor = (int(part) for part in version.lstrip("v").split(".")[:2])
    if (major, minor) < (20, 10):
        pytest.fail(f"node {version} has no built-in WebSocket client: these tests need Node 20.10 or later",
                    pytrace=False)
    return [node, "--experimental-websocket"] if major < 22 else [node]


class NodeSession:
    """``tests/clients/session.mjs``: a session in JavaScript; every frame it gets, one JSON line each."""

    def __init__(self, url: str, api_key: str, *options: str) -> None:
        self.proc = subprocess.Popen([*node_command(), str(CLIENTS / "session.mjs"), url, api_key, *options],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        self.lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.seen: list[dict[str, Any]] = []
        self.unclaimed: list[dict[str, Any]] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(json.loads(line))
        self.lines.put(None)

    def send(self, frame: dict[str, Any] | str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((frame if isinstance(frame, str) else json.dumps(frame)) + "\n")
        self.proc.stdin.flush()

    def expect(self, what: str, matches: Callable[[dict[str, Any]], bool], timeout: float = 15.0) -> dict[str, Any]:
        """The first line not yet claimed that ``matches``: the session's events and the HTTP answers
        race each other, so a line printed before the one awaited waits in ``unclaimed``."""
        for i, line in enumerate(self.unclaimed):
            if matches(line):
                return self.unclaimed.pop(i)
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"the Node client printed no {what} within {timeout:g} s; it printed {self.seen}")
            if line is None:
                self.proc.wait(5)
                stderr = self.proc.stderr.read() if self.proc.stderr else ""
                pytest.fail(f"the Node client exited ({self.proc.returncode}) before {what}; it printed "
                            f"{self.seen}\n{stderr}")
            self.seen.append(line)
            if matches(line):
                return line
            self.unclaimed.append(line)

    def reply(self, frame_id: int, timeout: float = 15.0) -> dict[str, Any]:
        return self.expect(f"answer to frame {frame_id}",
                           lambda f: f.get("op") in ("ack", "error", "pong") and f.get("id") == frame_id, timeout)

    def __enter__(self) -> NodeSession:
        return self

    def __exit__(self, *_: object) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(5)
        for pipe in (self.proc.stdin, self.proc.stderr):
            if pipe is not None:
                pipe.close()


def lock_request(agent: str, resource: str, request_id: str) -> dict[str, Any]:
    """A LockRequested record as JSON (``arbiter.schemas.jsonwire``)."""
    return {"type": "LockRequested", "request_id": request_id, "agent_id": agent, "resource": resource,
            "mode": "exclusive", "ttl_ms": 30_000, "at_ms": now_ms()}


async def request_ids_in(settings: Settings, topic: str) -> set[str]:
    """The request id of every record on ``topic`` now (read from the beginning to the end)."""
    codec = default_codec(settings.max_message_bytes)
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.bootstrap, group_id=None, enable_auto_commit=False,
                                **kafka_client_options(settings))
    await consumer.start()
    try:
        partitions = [TopicPartition(topic, p) for p in range(settings.partitions)]  # every topic has as many
        consumer.assign(partitions)
        await consumer.seek_to_beginning(*partitions)
        ends = await consumer.end_offsets(partitions)
        ids: set[str] = set()
        while [tp for tp in partitions if await consumer.position(tp) < ends[tp]]:
            for messages in (await consumer.getmany(timeout_ms=1000)).values():
                for message in messages:
                    request_id = getattr(codec.decode(message.value), "request_id", None)
                    if request_id is not None:
                        ids.add(request_id)
        return ids
    finally:
        await consumer.stop()


def test_node_session_sees_its_lease_revoked_by_an_operator(front: Front) -> None:
    url, key, resource = front.door.url, front.keys["nodey"], "ticket:node-revoked"
    with NodeSession(url, key, "--acquire", resource, "--until", "LockRevoked", "--timeout", "40") as node:
        hello = node.expect("hello", lambda f: f.get("op") == "hello")
        assert hello["agent"] == "nodey" and isinstance(hello["offset"], int)
        acquired = node.expect("acquired", lambda f: f.get("op") == "acquired")
        assert acquired["status"] == 200 and acquired["body"]["granted"] is True, acquired
        token = acquired["body"]["token"]
        # The lease the agent took over HTTP is its session's too: the grant arrives on it.
        node.expect("the grant", lambda f: f.get("op") == "event" and f["record"]["type"] == "LockGranted"
                    and f["record"]["token"] == token)

        asyncio.run(Operator(front.settings).revoke(resource, "nodey", "test: an operator takes it back"))
        revoked_at = time.monotonic()
        frame = node.expect("the revocation", lambda f: f.get("op") == "event"
                            and f["record"]["type"] == "LockRevoked", timeout=15)
        took = time.monotonic() - revoked_at
        assert node.proc.wait(10) == 0, node.seen
    record = frame["record"]
    assert (record["agent_id"], record["resource"], record["token"]) == ("nodey", resource, token)
    assert record["reason"] and isinstance(frame["offset"], int) and frame["offset"] >= hello["offset"]
    assert took < 10, f"the revocation took {took:.1f} s to reach the session"
    # The door forgot the lease, and its token is dead.
    status = curl("GET", f"{url}/v1/status", key=key).json
    assert status["leases"] == [], status
    renew = curl("POST", f"{url}/v1/leases/renew", key=key, body={"resource": resource, "token": token})
    assert renew.status == 409, renew.text


def test_node_session_refuses_malformed_and_forged_frames_and_stays_open(front: Front) -> None:
    url, resource = front.door.url, "ticket:node-forge"
    forged_id, honest_id = f"forged-{uuid.uuid4().hex}", f"honest-{uuid.uuid4().hex}"
    with NodeSession(url, front.keys["forger"], "--timeout", "40") as node:
        node.expect("hello", lambda f: f.get("op") == "hello")
        for text in ["this is not JSON", "[1, 2, 3]", '"a string"']:
            node.send(text)
            error = node.expect("an error", lambda f: f.get("op") in ("error", "closed"))
            assert (error["op"], error["status"], error["reason"]) == ("error", 422, "malformed_json"), error
        node.send({"op": "dance", "id": 1})
        assert node.reply(1)["status"] == 422 and node.seen[-1]["reason"] == "unknown_op"
        node.send({"op": "send", "id": 2, "key": resource, "record": {"type": "LockRequested", "agent_id": "forger"}})
        error = node.reply(2)
        assert (error["op"], error["status"], error["reason"]) == ("error", 422, "malformed_body"), error
        node.send({"op": "send", "id": 3, "key": resource, "record": {"type": "LockGranted"}})
        error = node.reply(3)
        assert (error["op"], error["status"], error["reason"]) == ("error", 422, "wrong_schema"), error
        node.send({"op": "send", "id": 4, "key": "", "record": lock_request("forger", resource, "x")})
        assert node.reply(4)["status"] == 422
        node.send({"op": "ping", "id": 5})
        assert node.reply(5)["op"] == "pong"  # still open

        # A command acting as another agent: refused at the door, never published.
        node.send({"op": "send", "id": 6, "key": resource, "record": lock_request("alice", resource, forged_id)})
        error = node.reply(6)
        assert (error["op"], error["status"], error["reason"]) == ("error", 403, "forbidden"), error
        assert "alice" in error["detail"]
        # The agent's own command, on the same key after it, goes through and is decided.
        node.send({"op": "send", "id": 7, "key": resource, "record": lock_request("forger", resource, honest_id)})
        assert node.reply(7)["op"] == "ack", node.seen[-1]
        grant = node.expect("the grant", lambda f: f.get("op") == "event" and f["record"]["type"] == "LockGranted")
        assert grant["record"]["request_id"] == honest_id and grant["record"]["agent_id"] == "forger"
    published = asyncio.run(request_ids_in(front.settings, front.settings.topics.resource_commands))
    assert honest_id in published and forged_id not in published


# -- sessions: a slow consumer ----------------------------------------------------------------


def test_slow_consumer_session_is_closed_1008_and_others_carry_on(front: Front) -> None:
    """A session that does not read the events the door pushes: the narrow door (4 unread frames) closes it,
    while other agents are served. The client is a raw socket with a small receive buffer that reads nothing
    until the door has said (in its log) that it ended the session; then it reads what it was sent."""
    door, address = front.narrow, front.narrow.url.removeprefix("http://")
    host, port = address.rsplit(":", 1)
    assert door.log is not None
    # Each stale commit on this document is refused with every change since its base: a large event.
    doc, blob = "doc:slow-consumer", "x" * 100_000
    big = curl("POST", f"{front.door.url}/v1/commit", key=front.keys["alice"],
               body={"resource": doc, "base_version": 0, "patch": {"blob": blob}})
    assert big.status == 200, big.text

    protocol = ClientProtocol(parse_uri(f"ws://{address}/v1/session"))
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(10)
    sock.connect((host, int(port)))
    try:
        request = protocol.connect()
        request.headers["Authorization"] = f"Bearer {front.keys['slowpoke']}"
        protocol.send_request(request)
        sock.sendall(b"".join(protocol.data_to_send()))
        events: list[Any] = []
        while not any(getattr(e, "opcode", None) is Opcode.TEXT for e in events):  # up to the hello
            protocol.receive_data(sock.recv(4096))
            events += protocol.events_received()
        assert isinstance(events[0], Response) and events[0].status_code == 101, events[0]

        # The agent's own calls over HTTP push their outcomes to its session, which reads none of them.
        ended = re.compile(r"session \w+ of slowpoke ended: slow consumer")
        calls, deadline = 0, time.monotonic() + 30
        while not ended.search(door.log.read_text(errors="replace")):
            assert time.monotonic() < deadline, f"the door did not end the session after {calls} unread events"
            stale = curl("POST", f"{door.url}/v1/commit", key=front.keys["slowpoke"],
                         body={"resource": doc, "base_version": 0, "patch": {"mine": calls}})
            assert stale.status == 409 and stale.json["reason"] == "version_conflict", stale.text[:300]
            calls += 1

        # Meanwhile another agent on the same door is served as usual.
        other = curl("GET", f"{door.url}/v1/resources/{doc}", key=front.keys["bystander"])
        assert other.status == 200 and other.json["version"] == 1, other.text

        # Now read: the events it had room for, then why it ended, then the close (1008).
        while protocol.close_rcvd is None:
            data = sock.recv(65536)
            if not data:
                break
            protocol.receive_data(data)
            events += protocol.events_received()
    finally:
        sock.close()
    texts = [json.loads(e.data) for e in events if getattr(e, "opcode", None) is Opcode.TEXT]
    assert texts[0]["op"] == "hello" and texts[0]["agent"] == "slowpoke", texts[0]
    pushed = texts[1:-1]
    assert pushed and {(t["op"], t["record"]["type"]) for t in pushed} == {("event", "ToolRejected")}
    assert len(pushed) < calls, "every event was delivered: the session was not behind"
    assert texts[-1]["op"] == "bye" and texts[-1]["reason"].startswith("slow consumer"), texts[-1]
    assert protocol.close_rcvd is not None, "the door closed the connection without a close frame"
    assert protocol.close_rcvd.code == 1008 and protocol.close_rcvd.reason.startswith("slow consumer")

    # The agent is not shut out: a new session of its own works.
    with NodeSession(door.url, front.keys["slowpoke"], "--timeout", "20") as node:
        node.expect("hello", lambda f: f.get("op") == "hello")
        node.send({"op": "ping", "id": 1})
        assert node.reply(1)["op"] == "pong"


def test_a_session_that_reads_keeps_up_with_bursts_beyond_its_buffer(front: Front) -> None:
    """On the narrow door (4 unread frames), a Node client that reads as it goes sends 40 pings at once and
    gets 40 pongs, and the events of 6 calls made one after another: being ahead of the door's writer for a
    moment is not being a slow consumer."""
    url, key, doc = front.narrow.url, front.keys["bystander"], "doc:narrow-burst"
    with NodeSession(url, key, "--timeout", "30") as node:
        node.expect("hello", lambda f: f.get("op") == "hello")
        node.send("\n".join(json.dumps({"op": "ping", "id": i}) for i in range(40)))
        for i in range(40):
            assert node.reply(i)["op"] == "pong"
        for i in range(6):
            answer = curl("POST", f"{url}/v1/commit", key=key, body={"resource": doc, "base_version": i,
                                                                     "patch": {"n": i}})
            assert answer.status == 200, answer.text
            node.expect(f"the event of commit {i}", lambda f: f.get("op") == "event"
                        and f["record"]["type"] == "ToolApplied")
        node.send({"op": "ping", "id": 99})
        assert node.reply(99)["op"] == "pong"
        assert not [f for f in node.seen if f.get("op") in ("bye", "closed")], node.seen


def test_an_agent_may_have_only_so_many_sagas_open_on_a_door(front: Front) -> None:
    """Each open saga is kept by the door until it ends: on the narrow door (2 at most) a third start is 429
    ``too_many_sagas`` and opens nothing; ending one makes room again."""
    url, key = front.narrow.url, front.keys["calm"]
    opened = [curl("POST", f"{url}/v1/sagas", key=key, body={"name": f"cap-{i}"}) for i in range(2)]
    assert [a.status for a in opened] == [200, 200], opened
    third = curl("POST", f"{url}/v1/sagas", key=key, body={"name": "cap-2"})
    assert third.status == 429 and third.json["reason"] == "too_many_sagas", third
    assert third.headers["retry-after"] == "1" and "complete" in third.json["what_to_do"]
    first = opened[0].json["saga_id"]
    ended = curl("POST", f"{url}/v1/sagas/{first}/complete", key=key)
    assert ended.status == 200 and ended.json["outcome"] == "COMPLETED", ended
    again = curl("POST", f"{url}/v1/sagas", key=key, body={"name": "cap-2"})
    assert again.status == 200, again
    for saga in (opened[1].json["saga_id"], again.json["saga_id"]):
        aborted = curl("POST", f"{url}/v1/sagas/{saga}/abort", key=key, body={"reason": "test_over"})
        assert aborted.status == 200, aborted
