"""A broker outage is quiet, bounded and clear (docs/operations.md, "When Kafka is down").

The broker is stopped for 30 s under a worker, a front door and every CLI verb: the worker logs a
few lines, not one per reconnect; every CLI verb ends with its documented answer (``arbiter lock``: one
JSON object, exit 3; the others: one ``error:`` line, exit 3) and no traceback or resource warning;
every door route answers 503 with ``Retry-After`` at once, ``/healthz`` says not ready and why. The
broker listens on a port in the ephemeral range, where a client that reconnects blindly can connect to
itself and hold the port: after ``up`` everything serves again by itself. Then, with the broker down
again, SIGTERM stops the worker and the door within 15 s, cleanly.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from arbiter.door.app import create_app
from arbiter.edge.kafkaconn import ephemeral_ports, in_ephemeral_range
from arbiter.edge.settings import Settings
from arbiter.kafka import LocalKafka, LocalKafkaError
from arbiter.processes import DoorProcess, WorkerPool, free_port, settings_env
from arbiter.streams.runtime.topics import ensure_topics
from tests.conftest import isolated_settings, share_broker_jars
from tests.streams.tools.test_git_tools import make_repo

pytestmark = [pytest.mark.kafka, pytest.mark.e2e]

OUTAGE_S = 30.0
WORKER_LINES = 300
"""The most lines the worker may log in the whole outage (it logged ~3,000 a second)."""
STOP_S = 15.0
"""docs/operations.md: SIGTERM exits within 15 s, whatever the broker's state."""
ANSWER_S = 5.0
"""How soon the door must answer a call while Kafka is down."""


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _ephemeral_port() -> int:
    """A port in the ephemeral range, free now with the next one (the broker's controller port)."""
    for _ in range(50):
        port = free_port()
        if in_ephemeral_range(port) and in_ephemeral_range(port + 1) and _bindable(port + 1):
            return port
    raise AssertionError(f"no free port in the ephemeral range {ephemeral_ports()}")


def _broker_up(home: Path) -> LocalKafka:
    """A private broker started on ephemeral-range ports. In that range any outgoing connection of this
    machine may take a port between the check and the broker's bind (it did once in CI): then other ports."""
    for attempt in range(3):
        broker = _broker(home / f"try-{attempt}")
        try:
            broker.up()
        except LocalKafkaError as exc:
            if "could not bind" not in str(exc) or attempt == 2:
                raise
            continue
        return broker
    raise AssertionError("unreachable")


def _broker(home: Path) -> LocalKafka:
    port = _ephemeral_port()
    own = Settings(home=home, kafka_port=port, kafka_controller_port=port + 1, bootstrap=f"127.0.0.1:{port}",
                   kafka_heap="384m")
    share_broker_jars(home)
    return LocalKafka(own)


@dataclass
class Ran:
    args: tuple[str, ...]
    code: int
    out: str
    err: str
    seconds: float


class Cli:
    def __init__(self, settings: Settings, folder: Path) -> None:
        self.env = {**os.environ, **settings_env(settings)}
        self.folder = folder

    def __call__(self, *args: str, timeout: float = 90, stdin: str | None = None) -> Ran:
        started = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "arbiter", *args], capture_output=True, text=True,
                              env=self.env, timeout=timeout, check=False, cwd=self.folder,
                              **({"input": stdin} if stdin is not None else {"stdin": subprocess.DEVNULL}))
        return Ran(args, proc.returncode, proc.stdout, proc.stderr, time.monotonic() - started)

    def session(self, *args: str, requests: list[dict[str, Any]], timeout: float = 60) -> Ran:
        """Run a JSON-RPC server over stdio: send ``requests``, keep its input open until every request
        with an id has its answer (or ``timeout``), then close it and wait for the exit."""
        started = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "arbiter", *args], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=self.env,
                                cwd=self.folder)
        assert proc.stdin is not None and proc.stdout is not None
        waiting = {r["id"] for r in requests if "id" in r}
        lines: list[str] = []
        timer = threading.Timer(timeout, proc.kill)
        timer.start()
        try:
            proc.stdin.write("".join(json.dumps(r) + "\n" for r in requests))
            proc.stdin.flush()
            while waiting and (line := proc.stdout.readline()):
                lines.append(line)
                waiting.discard(json.loads(line).get("id"))
            proc.stdin.close()
            out = "".join(lines) + proc.stdout.read()
            err = proc.stderr.read() if proc.stderr else ""
            code = proc.wait()
        finally:
            timer.cancel()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        return Ran(args, code, out, err, time.monotonic() - started)


def _http(url: str, method: str = "GET", body: Any = None, key: str | None = None,
          timeout: float = 30) -> tuple[int, dict[str, Any], dict[str, str], float]:
    headers = {"content-type": "application/json"}
    if key:
        headers["authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None)
    request = urllib.request.Request(url, data=data, headers=headers, method=method)
    started = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            status, raw, got = answer.status, answer.read(), {k.lower(): v for k, v in answer.headers.items()}
    except urllib.error.HTTPError as exc:
        status, raw, got = exc.code, exc.read(), {k.lower(): v for k, v in exc.headers.items()}
    text = raw.decode(errors="replace")
    try:
        parsed = json.loads(text) if text.strip().startswith(("{", "[")) else {"text": text[:200]}
    except json.JSONDecodeError:
        parsed = {"text": text[:200]}
    return status, parsed, got, time.monotonic() - started


SAGA = "saga-outage-1"
ROUTES: dict[tuple[str, str], Any] = {
    ("POST", "/v1/leases/acquire"): {"resource": "out:1", "ttl": 5},
    ("POST", "/v1/leases/renew"): {"resource": "out:1", "token": 1},
    ("POST", "/v1/leases/release"): {"resource": "out:1", "token": 1},
    ("POST", "/v1/execute"): {"resource": "account:out-1", "tool": "ledger.read", "token": 1},
    ("POST", "/v1/commit"): {"resource": "doc:out-1", "base_version": 0, "patch": {"text": "x"}},
    ("GET", "/v1/resources/{resource}"): None,
    ("POST", "/v1/sagas"): {"name": "outage"},
    ("POST", "/v1/sagas/{saga_id}/steps"): {"resource": "account:out-1", "tool": "ledger.read"},
    ("POST", "/v1/sagas/{saga_id}/complete"): None,
    ("POST", "/v1/sagas/{saga_id}/abort"): {"reason": "outage"},
    ("GET", "/v1/status"): None,
    ("GET", "/console/stream"): None,
    ("GET", "/console/history"): None,
    ("POST", "/mcp"): {"jsonrpc": "2.0", "id": 1, "method": "tools/list"},
    ("GET", "/mcp"): None,
    ("DELETE", "/mcp"): None,
}
"""Every route that needs Kafka, with a body that passes validation (``/healthz``, ``/livez``, the docs:
checked on their own)."""


def _every_route() -> set[tuple[str, str]]:
    from starlette.routing import Route

    app = create_app(Settings())
    spec = app.openapi()
    hidden = {(method, route.path) for route in app.routes if isinstance(route, Route)
              and not route.include_in_schema and not route.path.startswith(("/docs", "/openapi", "/redoc"))
              for method in route.methods or () if method != "HEAD"}
    return {(method.upper(), path) for path, ops in spec["paths"].items() for method in ops} | hidden


def test_the_route_table_names_every_route() -> None:
    """A new door route must be added to ``ROUTES`` (and so to the outage test)."""
    assert _every_route() == set(ROUTES) | {("GET", "/healthz"), ("GET", "/livez"), ("GET", "/metrics")}


LOCK_VERBS: list[tuple[str, ...]] = [
    ("lock", "acquire", "out:2", "--agent", "alice", "--ttl", "5"),
    ("lock", "renew", "out:2", "--agent", "alice", "--token", "1"),
    ("lock", "release", "out:2", "--agent", "alice", "--token", "1"),
    ("lock", "revoke", "out:2", "--agent", "alice", "--reason", "outage"),
    ("lock", "status", "out:2"),
    ("sandbox", "create", "--repo", "app", "--agent", "alice"),
    ("sandbox", "merge", "--repo", "app", "--agent", "alice", "-m", "outage"),
    ("sandbox", "discard", "--repo", "app", "--agent", "alice"),
]
OTHER_VERBS: list[tuple[str, ...]] = [
    ("agents", "add", "carol"), ("agents", "api-key", "alice"), ("agents", "list"), ("agents", "revoke", "carol"),
    ("agents", "rotate", "alice"), ("audit",), ("replay", "--at", "0"), ("log", "export", "log.jsonl"),
    ("ping", "--count", "1"), ("saga", "abort", SAGA, "--reason", "outage"), ("topics", "create"),
    ("topics", "list"), ("topics", "delete", "tzz-none."), ("worker",), ("serve", "--port", "0"),
    ("demo", "--workers", "1"), ("chaos", "calm", "--duration", "5"), ("sandbox", "gc", "--repo", "app"),
    ("sandbox", "hook", "--agent", "alice", "--repo", "app"), ("hook", "serve", "--agent", "alice"),
    ("top", "--once"), ("console", "--port", "0"), ("runner", "--name", "alice"),
]
"""Every other verb that needs Kafka. Not here: ``kafka up``/``down``/``reset`` (they act on the local
broker itself; ``tests/kafka/test_localkafka.py``), ``kafka status`` (below)."""
NO_KAFKA_VERBS: list[tuple[str, ...]] = [
    ("ledger", "open", "out-2", "--balance", "5"), ("ledger", "show"), ("ledger", "tools"),
    ("sandbox", "list", "--repo", "app"), ("sandbox", "claims", "--repo", "app"),
    ("sandbox", "rebase", "--repo", "app", "--agent", "alice"),
]
"""Verbs that never talk to Kafka (the ledger's database, the repository): they work through an outage."""
HOOK_VERBS: list[tuple[str, ...]] = [("hook", "pre-tool-use", "--agent", "alice", "--timeout", "5")]
"""Coding agents' hooks: Kafka unreachable, they block the call (exit 2, the reason on stderr), since the
agents read any other failure as "go ahead"."""
MCP_VERBS: list[tuple[str, ...]] = [("mcp", "--agent", "alice")]
"""The MCP server answers the protocol at once (an agent's launch does not wait on Kafka), and a tool call
in an outage with a tool error that says so; the session then ends with its input."""
MCP_REQUESTS: list[dict[str, Any]] = [
    {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "outage", "version": "1"}}},
    {"jsonrpc": "2.0", "method": "notifications/initialized"},
    {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": "acquire_lease",
                                                                   "arguments": {"resource": "out:2"}}}]


def _every_verb() -> set[tuple[str, ...]]:
    import click

    from arbiter.cli import main

    found: set[tuple[str, ...]] = set()

    def walk(command: click.Command, path: tuple[str, ...], ctx: click.Context) -> None:
        if isinstance(command, click.Group):
            for name in command.list_commands(ctx):  # (the CLI imports a command's module when asked for it)
                sub = command.get_command(ctx, name)
                assert sub is not None, name
                walk(sub, (*path, name), click.Context(sub, parent=ctx, info_name=name))
        else:
            found.add(path)
    walk(main, (), click.Context(main, info_name="arbiter"))
    return found


def test_the_verb_lists_name_every_cli_verb() -> None:
    """A new CLI verb must be added to the outage test's lists."""
    groups = ("lock", "agents", "topics", "log", "saga", "sandbox", "ledger", "hook")
    verbs = LOCK_VERBS + OTHER_VERBS + NO_KAFKA_VERBS + HOOK_VERBS + MCP_VERBS
    named = {v[:2] if v[0] in groups else v[:1] for v in verbs}
    assert _every_verb() == named | {("kafka", "up"), ("kafka", "down"), ("kafka", "reset"), ("kafka", "status")}


def _clean(ran: Ran) -> None:
    text = ran.out + ran.err
    assert "Traceback" not in text, f"{' '.join(ran.args)}: a traceback\n{text[-3000:]}"
    assert "Unclosed" not in text, f"{' '.join(ran.args)}: a resource warning\n{text[-3000:]}"
    assert ran.seconds < 45, f"{' '.join(ran.args)} took {ran.seconds:.0f} s"


def _lines(path: Path) -> int:
    return len(path.read_text(errors="replace").splitlines())


async def test_a_thirty_second_outage_is_quiet_bounded_and_clear(tmp_path: Path) -> None:
    broker = await asyncio.to_thread(_broker_up, tmp_path / "broker")
    assert in_ephemeral_range(broker.settings.kafka_port)
    repo = make_repo(tmp_path)
    settings = isolated_settings(broker.bootstrap, tmp_path / "arbiter", repos=f"app={repo}")
    pool = WorkerPool(settings)
    door = DoorProcess(settings)
    cli = Cli(settings, tmp_path)
    try:
        await ensure_topics(settings)
        pool.start(1)  # (its start makes this home's admin key, which the door trusts)
        added = cli("agents", "add", "alice")
        assert added.code == 0, added.err
        issued = cli("agents", "api-key", "alice")
        assert issued.code == 0, issued.err
        key = issued.out.strip().splitlines()[-1]
        first = await _until(lambda: cli("lock", "acquire", "out:0", "--agent", "alice", "--ttl", "5"),
                             lambda r: r.code == 0, 90, "a first grant")
        assert json.loads(first.out)["token"] == 1
        made = cli("sandbox", "create", "--repo", "app", "--agent", "alice")  # so that merge reaches Kafka
        assert made.code == 0 and await asyncio.to_thread(Path(json.loads(made.out)["path"]).is_dir), made.err
        sandbox = Path(json.loads(made.out)["path"])
        await asyncio.to_thread(door.start)
        await _until(lambda: _http(f"{door.url}/healthz"), lambda r: r[0] == 200, 30, "the door ready")
        worker_log, door_log = pool.workers[0].log, door.log
        assert door_log is not None
        before = (_lines(worker_log), _lines(door_log))

        down_at = time.monotonic()
        await asyncio.to_thread(broker.down)

        # The door: not ready (its check is at most a second old), and every route answered 503 at once.
        status, body, headers, _ = await _until(lambda: _http(f"{door.url}/healthz"), lambda r: r[0] == 503,
                                                ANSWER_S, "/healthz not ready")
        assert status == 503 and body["ready"] is False and body["kafka"] == "unreachable", body
        assert "does not answer" in body["why"] and headers.get("retry-after"), (body, headers)
        assert (await asyncio.to_thread(_http, f"{door.url}/livez"))[0] == 200
        for (method, path), route_body in ROUTES.items():
            url = door.url + path.replace("{resource}", "account:out-1").replace("{saga_id}", SAGA)
            status, body, headers, took = await asyncio.to_thread(_http, url, method, route_body, key)
            assert status == 503 and body.get("reason") == "unavailable", (method, path, status, body)
            assert headers.get("retry-after") and took < ANSWER_S, (method, path, headers, took)

        # Every CLI verb: its documented answer, no traceback, no resource warning.
        for args in LOCK_VERBS:
            ran = await asyncio.to_thread(cli, *args)
            _clean(ran)
            assert ran.code == 3, (args, ran.code, ran.out, ran.err)
            objects = [json.loads(line) for line in ran.out.splitlines() if line.strip()]
            assert len(objects) == 1 and objects[0]["reason"] == "unavailable", (args, ran.out)
        for args in OTHER_VERBS:
            ran = await asyncio.to_thread(cli, *args)
            _clean(ran)
            assert ran.code == 3 and "error:" in ran.err, (args, ran.code, ran.out, ran.err[-2000:])
        for args in NO_KAFKA_VERBS:
            ran = await asyncio.to_thread(cli, *args)
            _clean(ran)
            assert ran.code == 0 and json.loads(ran.out), (args, ran.code, ran.out, ran.err[-2000:])
        edit = json.dumps({"tool_name": "Edit", "tool_input": {"file_path": str(sandbox / "auth.py")},
                           "cwd": str(sandbox), "session_id": "s1", "hook_event_name": "PreToolUse"})
        for args in HOOK_VERBS:
            ran = await asyncio.to_thread(lambda a=args: cli(*a, stdin=edit))
            _clean(ran)
            assert ran.code == 2 and "cannot reach Arbiter" in ran.err and not ran.out, (args, ran.code, ran.err)
        for args in MCP_VERBS:
            ran = await asyncio.to_thread(lambda a=args: cli.session(*a, requests=MCP_REQUESTS))
            _clean(ran)
            answers = {m["id"]: m for m in map(json.loads, ran.out.splitlines())}
            assert ran.code == 0 and "capabilities" in answers[1]["result"], (args, ran.code, ran.out, ran.err[-2000:])
            told = answers[2].get("result", answers[2])
            assert told.get("isError") and "unavailable" in told["content"][0]["text"], (args, told)

        await asyncio.sleep(max(0.0, OUTAGE_S - (time.monotonic() - down_at)))  # the outage lasts 30 s
        worker_lines = _lines(worker_log) - before[0]
        door_lines = _lines(door_log) - before[1]
        print(f"\n{time.monotonic() - down_at:.0f} s without a broker: the worker logged {worker_lines} lines, "
              f"the door {door_lines}")
        assert worker_lines <= WORKER_LINES, worker_log.read_text()[-5000:]
        assert door_lines <= WORKER_LINES, door_log.read_text()[-5000:]
        pool.check_alive()

        # Back: on the same ephemeral port (no client of ours holds it), and everything serves by itself.
        await asyncio.to_thread(broker.up)
        await _until(lambda: _http(f"{door.url}/healthz"), lambda r: r[0] == 200, 60, "the door ready again")
        again = await _until(lambda: cli("lock", "acquire", "out:3", "--agent", "alice", "--ttl", "5"),
                             lambda r: r.code == 0, 60, "a grant from the CLI")
        assert json.loads(again.out)["token"] == 1
        status, body, _, _ = await asyncio.to_thread(_http, f"{door.url}/v1/leases/acquire", "POST",
                                                     {"resource": "out:4", "ttl": 5}, key)
        assert status == 200 and body["granted"], body
        pool.check_alive()  # the same worker process throughout
        text = worker_log.read_text(errors="replace")
        assert "reachable again" in text and "Correlation" not in text, text[-3000:]

        # SIGTERM with the broker down: within 15 s, cleanly.
        await asyncio.to_thread(broker.down)
        await _until(lambda: _http(f"{door.url}/healthz"), lambda r: r[0] == 503, 30, "the door to see it")
        worker = pool.workers[0]
        for name, proc in (("worker", worker.proc), ("door", door.proc)):
            assert proc is not None
            started = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            code = await asyncio.to_thread(proc.wait, STOP_S + 15)
            took = time.monotonic() - started
            print(f"{name} stopped {took:.1f} s after SIGTERM, broker down, exit {code}")
            assert took < STOP_S, f"the {name} took {took:.1f} s to stop"
            assert code in (0, -signal.SIGTERM), f"the {name} exited {code}"
        for logged in (worker_log, door_log):
            tail = logged.read_text(errors="replace")
            for bad in ("Traceback", "Unclosed", "shutdown failed", "Task was destroyed"):
                assert bad not in tail, f"{bad!r} in {logged.name}:\n{tail[-4000:]}"
        assert "stopped after" in worker_log.read_text()
    finally:
        pool.stop()
        door.stop()
        await asyncio.to_thread(broker.down)


async def _until(probe: Any, good: Any, timeout: float, what: str) -> Any:
    """Run the blocking ``probe`` until ``good(result)``; each try is a real request, none is a sleep."""
    deadline = time.monotonic() + timeout
    while True:
        result = await asyncio.to_thread(probe)
        if good(result):
            return result
        assert time.monotonic() < deadline, f"no {what} within {timeout:.0f} s: {result}"
        await asyncio.sleep(0.5)
