"""The front door under load (``./dev bench door``): N agents through one ``arbiter serve``.

``python -m bench door [--sizes 10,64,100,1000] [--seconds N] [--via ws,rest,sdk] [--sdk-agents 64]``

One worker and one front door (each its own process) on topics of their own. For each N
in ``--sizes``, N agents, each with its own API key, each acquiring and releasing its own
resource (``door:<agent>``: uncontended, the load ``sdk-scale`` puts on the worker) in a
closed loop for ``--seconds``; then the next N. The agents run in a separate load
process (``--load-procs`` of them), on uvloop, speaking to the door as any language would:

- ``ws``: one WebSocket session (``/v1/session``) per agent, frames written by hand
  (``{"op": "send", "id", "key", "record": {"type": "LockRequested", ...}}``); the grant
  and the release come back as ``event`` frames. An acquire is timed from its frame until
  its ``LockGranted`` event; a cycle ends at the ``LockReleased`` event.
- ``rest``: ``POST /v1/leases/acquire`` then ``POST /v1/leases/release`` per cycle (aiohttp,
  one pooled keep-alive connection per agent at most).
- ``sdk``: the Python SDK over the door (``ArbiterClient(url=..., api_key=...)``).

Side by side, in the same run: ``--sdk-agents`` agents on the direct-Kafka SDK in this
process (what ``sdk-scale`` measures; its figure in docs/benchmarks.md is ~500-570 grants/s at 64).

Per row: grants/s; acquire latency p50/p99 (in a closed loop it grows with N: about N
divided by the rate once the machine is saturated); the CPU seconds per grant of the door
process (and the share of it in the kernel), of the worker, of the client side (the load
process(es), or this process for the direct SDK) and of the broker (when it listens on
this machine), each from ``/proc/<pid>/stat`` (utime + stime) around the measured window,
with the share of a core in brackets; how busy the whole machine was (``/proc/stat``:
anyone's processes; at "2.00 of 2" the rate is the machine's, not the door's); and how
long connecting the agents took (setup: not in the figures). CPU per grant is the figure
that carries over to another machine. Keys are issued once for the largest N (one batch
of admin-signed registry records); the run's topics are deleted at the end.
``--profile DIR`` records the door with py-spy during each window (collapsed stacks). On
a saturated machine py-spy counts time a thread waits for a core after waking another
process (socket writes) as that line's: read its shares beside the door's CPU figures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shutil
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaProducer

from arbiter.agents import ArbiterClient
from arbiter.agents.identities import Registrar
from arbiter.edge.clock import now_ms
from arbiter.edge.kafkaauth import kafka_client_options
from arbiter.edge.settings import Settings, load_settings
from arbiter.processes import DoorProcess, WorkerPool, settings_env
from arbiter.schemas.identity import ACTIVE, ROLE_AGENT, Signer
from arbiter.schemas.models import IdentityRegistered
from arbiter.streams.runtime.topics import delete_topics_named

from . import sdk
from .env import bench_workers

SIZES = (10, 64, 100, 1000)
VIAS = ("ws", "rest", "sdk")
_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """The CPU time (user + system, all threads) process ``pid`` has used so far."""
    return sum(cpu_split(pid))


def cpu_split(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds process ``pid`` has used so far (``/proc/<pid>/stat``)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rpartition(")")[2].split()
    except OSError:
        return 0.0, 0.0
    return int(fields[11]) / _TICK, int(fields[12]) / _TICK


def machine_busy() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far, every core (``/proc/stat``)."""
    with open("/proc/stat") as stat:
        ticks = [int(n) for n in stat.readline().split()[1:]]
    total = sum(ticks[:8])  # guest time is counted in user already
    return (total - ticks[3] - ticks[4]) / _TICK, total / _TICK


def listener_pid(port: int) -> int | None:
    """The process listening on TCP ``port`` (the broker), if this user may see it."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as lines:
            for line in list(lines)[1:]:
                fields = line.split()
                if fields[3] == "0A" and int(fields[1].rpartition(":")[2], 16) == port:
                    inodes.add(f"socket:[{fields[9]}]")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                        return int(pid)
    return None


def _load_average() -> str:
    return f"load {os.getloadavg()[0]:.1f}"


# -- keys -------------------------------------------------------------------------------


async def issue_keys(settings: Settings, names: Sequence[str],
                     credentials: int = 0) -> tuple[list[Signer], list[Signer]]:
    """A new key for each name, and a front-door credential for the first ``credentials`` of them,
    registered in one pipelined batch (``Registrar.publish`` sends and awaits them one at a time:
    seconds for a thousand). Returns (the names' own keys, the credentials' keys)."""
    registrar = Registrar(settings)
    signers = [Signer.generate(name) for name in names]
    issued = [Signer.generate(name) for name in names[:credentials]]
    producer = AIOKafkaProducer(bootstrap_servers=settings.bootstrap, acks="all", linger_ms=5,
                                **kafka_client_options(settings))
    await producer.start()
    try:
        topic, now = settings.topics.registry, now_ms()
        sent = []
        for signer, label in [*((s, "") for s in signers), *((s, "bench") for s in issued)]:
            entry = IdentityRegistered(key_id=signer.key_id, name=signer.name, role=ROLE_AGENT,
                                       public_key=signer.public_raw, status=ACTIVE, valid_from_ms=now, at_ms=now,
                                       credential=label)
            value, key = registrar.codec.encode(entry), signer.key_id.encode()
            headers = registrar.admin.sign(topic, key, value, now)
            sent.append(await producer.send(topic, value, key=key, headers=headers))
        await asyncio.gather(*sent)
    finally:
        await producer.stop()
    return signers, issued


async def delete_topics(settings: Settings) -> int:
    """Delete this run's topics (named after its app id, changelogs included); how many."""
    return await delete_topics_named(settings, (f"{settings.app_id}.", f"{settings.app_id}-"))


# -- results ----------------------------------------------------------------------------


@dataclass
class Row:
    """One measured configuration."""

    path: str
    agents: int
    grants: int = 0
    wall: float = 0.0
    latencies: list[float] = field(default_factory=list)
    door_cpu: float | None = None
    door_sys: float = 0.0
    """The door's CPU in the kernel (system time: socket reads and writes, epoll)."""
    worker_cpu: float = 0.0
    broker_cpu: float | None = None
    busy: float = 0.0
    """The whole machine's busy CPU seconds in the window (every process, anyone's)."""
    client_cpu: float = 0.0
    errors: int = 0
    setup: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.grants / self.wall if self.wall else 0.0

    def quantile(self, q: int) -> float:
        if len(self.latencies) < 2:
            return float("nan")
        return statistics.quantiles(self.latencies, n=100, method="inclusive")[q - 1]

    def per_grant(self, cpu: float | None) -> str:
        return "-" if cpu is None or not self.grants else f"{cpu / self.grants * 1e6:,.0f}"

    def share(self, cpu: float | None) -> str:
        return "-" if cpu is None or not self.wall else f"{cpu / self.wall:.0%}"

    def line(self) -> str:
        return (f"| {self.path} | {self.agents:,} | {self.rate:,.0f} | {self.quantile(50):,.1f} | "
                f"{self.quantile(99):,.1f} | {self.per_grant(self.door_cpu)} ({self.share(self.door_cpu)}) | "
                f"{f'{self.door_sys / self.door_cpu:.0%}' if self.door_cpu else '-'} | "
                f"{self.per_grant(self.worker_cpu)} ({self.share(self.worker_cpu)}) | "
                f"{self.per_grant(self.client_cpu)} ({self.share(self.client_cpu)}) | "
                f"{self.per_grant(self.broker_cpu)} ({self.share(self.broker_cpu)}) | "
                f"{self.busy / self.wall if self.wall else 0:.2f} of {os.cpu_count()} | {self.errors} | "
                f"{self.setup:.1f} |")


HEADER = ("| path | agents | grants/s | acquire p50 ms | acquire p99 ms | door CPU µs/grant (of a core) | door sys | "
          "worker CPU µs/grant | client CPU µs/grant | broker CPU µs/grant | machine busy, cores | errors | "
          "setup s |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def _median_row(rows: list[Row]) -> Row:
    """The row with the median rate (its own latencies and costs, not a mix)."""
    return sorted(rows, key=lambda r: r.rate)[len(rows) // 2]


# -- the direct-Kafka SDK, in this process -----------------------------------------------


async def sdk_direct(settings: Settings, pool: WorkerPool, signers: list[Signer], seconds: float,
                     warmup: float) -> Row:
    """What ``sdk-scale`` measures: one ``ArbiterClient`` per agent in this process, straight to Kafka."""
    row = Row(f"SDK direct to Kafka ({len(signers)} clients, one process)", len(signers))
    started = time.perf_counter()
    async with contextlib.AsyncExitStack() as stack:
        clients = [ArbiterClient(s.name, settings, signer=s) for s in signers]
        await asyncio.gather(*(client.start() for client in clients))
        for client in clients:
            stack.push_async_callback(client.close)
        row.setup = time.perf_counter() - started
        await asyncio.gather(*(sdk._agent(c, time.perf_counter() + warmup, []) for c in clients))
        workers = [w.proc.pid for w in pool.workers]
        broker = listener_pid(int(settings.bootstrap.rpartition(":")[2]))
        cpu, worker_cpu, wall = time.process_time(), sum(map(cpu_seconds, workers)), time.perf_counter()
        broker_cpu, busy = cpu_seconds(broker) if broker else 0.0, machine_busy()[0]
        await asyncio.gather(*(sdk._agent(c, wall + seconds, row.latencies) for c in clients))
        row.wall = time.perf_counter() - wall
        row.client_cpu = time.process_time() - cpu
        row.worker_cpu = sum(map(cpu_seconds, workers)) - worker_cpu
        row.busy = machine_busy()[0] - busy
        row.broker_cpu = cpu_seconds(broker) - broker_cpu if broker else None
    row.grants = len(row.latencies)
    return row


# -- the door: load processes -------------------------------------------------------------


async def door_run(settings: Settings, pool: WorkerPool, door: DoorProcess, keys: Path, via: str, agents: int,
                   seconds: float, warmup: float, procs: int, profile: Path | None,
                   window: tuple[Callable[[], None], Callable[[], None]] | None = None) -> Row:
    """``agents`` agents through the door, from ``procs`` load processes (``window``: called as the
    measured window opens and closes, e.g. to profile the door by signals)."""
    assert door.proc is not None
    label = {"ws": "door, WebSocket sessions", "rest": "door, REST calls", "sdk": "door, Python SDK url="}[via]
    row = Row(label, agents)
    procs = max(1, min(procs, agents))
    shares = [(agents * i // procs, agents * (i + 1) // procs) for i in range(procs)]
    env = settings_env(settings)
    children = []
    try:
        for first, end in shares:
            job = {"url": door.url, "via": via, "keys": str(keys), "first": first, "count": end - first,
                   "seconds": seconds, "warmup": warmup}
            children.append(await asyncio.create_subprocess_exec(
                sys.executable, "-m", "bench.door", "--load", json.dumps(job), env=env,
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, limit=1 << 28))
        ready = [await _line(child, 300) for child in children]
        row.setup = max(r["connect_s"] for r in ready)
        broker = listener_pid(int(settings.bootstrap.rpartition(":")[2]))
        pids = [door.proc.pid, *(w.proc.pid for w in pool.workers), *(c.pid for c in children)]
        if broker is not None:
            pids.append(broker)
        before = {pid: cpu_seconds(pid) for pid in pids}
        busy, door_sys = machine_busy()[0], cpu_split(door.proc.pid)[1]
        spy = None
        if profile is not None:
            spy = await _py_spy(door.proc.pid, seconds, profile / f"door-{via}-{agents}.txt")
        if window is not None:
            window[0]()
        for child in children:
            assert child.stdin is not None
            child.stdin.write(b"go\n")
            await child.stdin.drain()
        results = [await _line(child, seconds + 120) for child in children]
        after = {pid: cpu_seconds(pid) for pid in pids}
        if window is not None:
            window[1]()
        row.busy = machine_busy()[0] - busy
        delta = {pid: after[pid] - before[pid] for pid in pids}
        row.broker_cpu = None if broker is None else delta[broker]
        row.door_cpu = delta[door.proc.pid]
        row.door_sys = cpu_split(door.proc.pid)[1] - door_sys
        row.worker_cpu = sum(delta[w.proc.pid] for w in pool.workers)
        row.client_cpu = sum(delta[c.pid] for c in children)
        for result in results:
            row.grants += result["grants"]
            row.latencies += result["latencies"]
            row.errors += result["errors"]
            row.notes += result["notes"]
        row.wall = max(r["wall"] for r in results)
        for child in children:
            assert child.stdin is not None
            child.stdin.write(b"bye\n")
            await child.stdin.drain()
        await asyncio.gather(*(asyncio.wait_for(child.wait(), 120) for child in children))
        if spy is not None:
            await spy.wait()
    finally:
        for child in children:
            if child.returncode is None:
                child.kill()
                await child.wait()
    return row


async def _line(child: asyncio.subprocess.Process, timeout: float) -> dict[str, Any]:
    assert child.stdout is not None
    line = await asyncio.wait_for(child.stdout.readline(), timeout)
    if not line:
        await child.wait()
        raise RuntimeError(f"a load process exited with {child.returncode} (its error is above)")
    answer: dict[str, Any] = json.loads(line)
    return answer


def _spy_binary() -> str | None:
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    return spy if Path(spy).exists() else None


async def _py_spy(pid: int, seconds: float, out: Path) -> asyncio.subprocess.Process | None:
    spy = _spy_binary()
    if spy is None:
        print("--profile: py-spy is not installed (pip install py-spy)", file=sys.stderr)
        return None
    return await asyncio.create_subprocess_exec(
        spy, "record", "--pid", str(pid), "--duration", str(max(1, round(seconds))), "--rate", "200",
        "--format", "raw", "--nonblocking", "--output", str(out), stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL)


# -- a load process ----------------------------------------------------------------------


class Failed(Exception):
    """The door refused a frame, or a decision was not the one asked for."""


FINAL = frozenset({"LockGranted", "LockDenied", "LockWaitTimedOut", "LockCancelled", "LockReleased"})


class WsAgent:
    """One agent's WebSocket session, speaking the protocol by hand."""

    def __init__(self, name: str, api_key: str) -> None:
        self.name, self.api_key = name, api_key
        self.resource = f"door:{name}"
        self.ids = f"{uuid.uuid4().hex[:12]}-"
        self.count = 0
        self.waiting: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self.sent: dict[int, str] = {}
        self.ws: Any = None
        self.reader: asyncio.Task[None] | None = None

    async def connect(self, http: Any, url: str) -> None:
        for attempt in range(10):
            ws = await http.ws_connect(f"{url}/v1/session", headers={"Authorization": f"Bearer {self.api_key}"},
                                       compress=0, max_msg_size=0, autoping=True)
            hello = json.loads((await ws.receive(timeout=60)).data)
            if hello.get("op") == "hello":
                self.ws = ws
                self.reader = asyncio.create_task(self._read())
                return
            await ws.close()
            if hello.get("status") not in (401, 429, 503) or attempt == 9:
                raise Failed(f"{self.name}: the door refused the session: {hello}")
            await asyncio.sleep(0.5)  # a key registered a moment ago: the door reads the registry again

    async def _read(self) -> None:
        async for message in self.ws:
            frame = json.loads(message.data)
            op = frame.get("op")
            if op == "event":
                record = frame["record"]
                if record.get("type") in FINAL:
                    future = self.waiting.pop(record.get("request_id"), None)
                    if future is not None and not future.done():
                        future.set_result(record)
            elif op == "ack":
                self.sent.pop(frame.get("id"), None)
            elif op == "error":
                future = self.waiting.pop(self.sent.pop(frame.get("id"), ""), None)
                if future is not None and not future.done():
                    future.set_exception(Failed(f"{frame.get('status')} {frame.get('reason')}: {frame.get('detail')}"))
        for future in self.waiting.values():
            if not future.done():
                future.set_exception(Failed(f"the session closed ({self.ws.close_code})"))

    async def call(self, record: dict[str, Any]) -> dict[str, Any]:
        self.count += 1
        request_id = record["request_id"] = f"{self.ids}{self.count}"
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.waiting[request_id] = future
        self.sent[self.count] = request_id
        await self.ws.send_str(json.dumps({"op": "send", "id": self.count, "key": self.resource, "record": record}))
        return await future

    async def cycle(self) -> float:
        """Acquire and release once; the acquire's latency in ms."""
        started = time.perf_counter()
        granted = await self.call({"type": "LockRequested", "agent_id": self.name, "resource": self.resource,
                                   "mode": "exclusive", "ttl_ms": 30_000, "wait_ms": 10_000,
                                   "at_ms": now_ms()})
        latency = (time.perf_counter() - started) * 1000
        if granted["type"] != "LockGranted":
            raise Failed(f"{granted['type']}: {granted.get('reason')}")
        released = await self.call({"type": "LockReleaseRequested", "agent_id": self.name,
                                    "resource": self.resource, "token": granted["token"], "at_ms": now_ms()})
        if released["type"] != "LockReleased":
            raise Failed(f"release: {released['type']}: {released.get('reason')}")
        return latency

    async def close(self) -> None:
        if self.ws is not None:
            await self.ws.close()
        if self.reader is not None:
            self.reader.cancel()
            await asyncio.gather(self.reader, return_exceptions=True)


class RestAgent:
    """One agent's REST calls (keep-alive connections from the shared pool)."""

    def __init__(self, name: str, api_key: str) -> None:
        self.name = name
        self.resource = f"door:{name}"
        self.auth = {"Authorization": f"Bearer {api_key}"}
        self.http: Any = None
        self.url = ""

    async def connect(self, http: Any, url: str) -> None:
        self.http, self.url = http, url
        for attempt in range(10):
            async with http.get(f"{url}/v1/status", headers=self.auth) as answer:
                if answer.status == 200:
                    return
                if answer.status not in (401, 429, 503) or attempt == 9:
                    raise Failed(f"{self.name}: {answer.status} {await answer.text()}")
            await asyncio.sleep(0.5)

    async def cycle(self) -> float:
        started = time.perf_counter()
        async with self.http.post(f"{self.url}/v1/leases/acquire", headers=self.auth,
                                  json={"resource": self.resource, "ttl": 30, "wait": 10}) as answer:
            body = await answer.json()
            if answer.status != 200:
                raise Failed(f"acquire: {answer.status} {body}")
        latency = (time.perf_counter() - started) * 1000
        async with self.http.post(f"{self.url}/v1/leases/release", headers=self.auth,
                                  json={"resource": self.resource, "token": body["token"]}) as answer:
            if answer.status != 200:
                raise Failed(f"release: {answer.status} {await answer.text()}")
        return latency

    async def close(self) -> None:
        pass


class SdkAgent:
    """The Python SDK over the door."""

    def __init__(self, name: str, api_key: str) -> None:
        self.name, self.api_key = name, api_key
        self.client: ArbiterClient | None = None

    async def connect(self, http: Any, url: str) -> None:
        del http
        self.client = ArbiterClient(self.name, load_settings(), url=url, api_key=self.api_key)
        await self.client.start()

    async def cycle(self) -> float:
        assert self.client is not None
        started = time.perf_counter()
        lease = await self.client.acquire(f"door:{self.name}", ttl=30, wait=10)
        latency = (time.perf_counter() - started) * 1000
        await self.client.release(lease)
        return latency

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()


async def _loop(agent: Any, until: float, latencies: list[float], errors: list[str]) -> None:
    while time.perf_counter() < until:
        try:
            async with asyncio.timeout(30):
                latencies.append(await agent.cycle())
        except Exception as exc:  # counted and shown: one agent's failure must not end the run
            errors.append(f"{agent.name}: {exc!r}"[:300])
            await asyncio.sleep(0.1)


async def load(job: dict[str, Any]) -> None:
    """One load process: connect, warm up, say ready; on ``go`` run the loop and print the figures."""
    import aiohttp

    kind: Any = {"ws": WsAgent, "rest": RestAgent, "sdk": SdkAgent}[job["via"]]
    agents: list[Any] = [kind(entry["name"], entry["api_key"]) for entry in job["agents"]]
    stdin = asyncio.StreamReader()
    loop = asyncio.get_running_loop()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)

    def say(answer: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()

    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as http:
        started = time.perf_counter()
        gate = asyncio.Semaphore(64)

        async def connect(agent: Any) -> None:
            async with gate:
                await agent.connect(http, job["url"])

        await asyncio.gather(*(connect(agent) for agent in agents))
        connected = time.perf_counter() - started
        warm: list[str] = []
        until = time.perf_counter() + job["warmup"]
        await asyncio.gather(*(_loop(agent, until, [], warm) for agent in agents))
        say({"connect_s": connected, "warmup_errors": len(warm)})
        if (await stdin.readline()).strip() != b"go":
            return
        latencies: list[float] = []
        errors: list[str] = []
        started = time.perf_counter()
        await asyncio.gather(*(_loop(agent, started + job["seconds"], latencies, errors) for agent in agents))
        wall = time.perf_counter() - started
        say({"grants": len(latencies), "wall": wall, "latencies": [round(x, 3) for x in latencies],
             "errors": len(errors),
             "notes": sorted(set(e.partition(": ")[2] for e in errors))[:5]})
        await stdin.readline()  # "bye": the door's CPU is read; hang up now
        await asyncio.gather(*(agent.close() for agent in agents), return_exceptions=True)


# -- the whole run ----------------------------------------------------------------------------


async def run(sizes: Sequence[int], seconds: float, vias: Sequence[str], sdk_agents: int, warmup: float,
              procs: int, reps: int, profile: Path | None, keep_topics: bool) -> None:
    rows: dict[tuple[str, int], list[Row]] = {}
    ran: list[Settings] = []
    try:
        async with bench_workers(1) as (settings, pool):
            ran.append(settings)
            await _rows(settings, pool, rows, sizes, seconds, vias, sdk_agents, warmup, procs, reps, profile)
    finally:
        if ran and not keep_topics:
            try:
                print(f"deleted this run's {await delete_topics(ran[0])} topics", flush=True)
            except Exception as exc:  # the figures are still worth printing
                print(f"could not delete this run's topics ({ran[0].app_id}.*): {exc!r}", flush=True)
    _table(rows, seconds, vias, sdk_agents, reps, profile)


async def _rows(settings: Settings, pool: WorkerPool, rows: dict[tuple[str, int], list[Row]], sizes: Sequence[int],
                seconds: float, vias: Sequence[str], sdk_agents: int, warmup: float, procs: int, reps: int,
                profile: Path | None) -> None:
    """Issue the keys, start the door, measure every row (``reps`` rounds)."""
    started = time.perf_counter()
    door_names = [f"door-agent-{i}" for i in range(max(sizes, default=0))]
    signers, credentials = await issue_keys(settings, [*door_names, *(f"sdk-agent-{i}" for i in range(sdk_agents))],
                                            credentials=len(door_names))
    keys = settings.home / "door-bench-keys.json"
    keys.touch(mode=0o600)
    keys.write_text(json.dumps([{"name": s.name, "api_key": s.api_key()} for s in credentials]))
    print(f"issued {len(signers):,} keys in {time.perf_counter() - started:.1f} s", flush=True)
    door = DoorProcess(settings)
    await asyncio.to_thread(door.start)
    assert door.proc is not None
    print(f"front door pid {door.proc.pid} at {door.url}; worker pid "
          f"{', '.join(str(w.proc.pid) for w in pool.workers)}", flush=True)
    idle = cpu_seconds(door.proc.pid)
    await asyncio.sleep(3.0)
    print(f"the door idle: {(cpu_seconds(door.proc.pid) - idle) / 3.0:.1%} of a core", flush=True)
    try:
        for rep in range(reps):
            if sdk_agents:
                row = await sdk_direct(settings, pool, signers[len(door_names):], seconds, warmup)
                print(f"[{rep + 1}/{reps}] {row.path}: {row.rate:,.0f} grants/s, worker "
                      f"{row.per_grant(row.worker_cpu)} µs/grant ({_load_average()})", flush=True)
                rows.setdefault(("sdk-direct", sdk_agents), []).append(row)
            for via in vias:
                for n in sizes:
                    row = await door_run(settings, pool, door, keys, via, n, seconds, warmup, procs, profile)
                    print(f"[{rep + 1}/{reps}] {row.path}, {n:,} agents: {row.rate:,.0f} grants/s, door "
                          f"{row.per_grant(row.door_cpu)} µs/grant, worker {row.per_grant(row.worker_cpu)} µs/grant, "
                          f"errors {row.errors} ({_load_average()})", flush=True)
                    rows.setdefault((via, n), []).append(row)
    finally:
        await asyncio.to_thread(door.stop)


def _table(rows: dict[tuple[str, int], list[Row]], seconds: float, vias: Sequence[str], sdk_agents: int, reps: int,
           profile: Path | None) -> None:
    if not rows:
        return
    print(f"\nfront door: one door process, one worker, {seconds:g} s per row"
          f"{f', the median of {reps} rounds' if reps > 1 else ''}; each agent its own resource (uncontended); "
          f"client = the load process(es), or this process for the direct SDK; {_load_average()} at the end")
    print(HEADER)
    for measured in rows.values():
        print(_median_row(measured).line())
    for measured in rows.values():
        for note in _median_row(measured).notes:
            print(f"  {measured[0].path}, {measured[0].agents}: {note}")
    baseline = rows.get(("sdk-direct", sdk_agents))
    for via in vias:
        door_row = rows.get((via, sdk_agents))
        if baseline and door_row:
            ratio = _median_row(door_row).rate / max(1e-9, _median_row(baseline).rate)
            print(f"{_median_row(door_row).path} at {sdk_agents} agents: {ratio:.1f}x the direct SDK's grants/s")
    if profile is not None:
        print(f"py-spy profiles of the door (collapsed stacks): {profile}/door-<via>-<agents>.txt")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench door", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)),
                        help="agents through the door, comma-separated (default %(default)s)")
    parser.add_argument("--seconds", type=float, default=10.0, help="measured time per row (default %(default)s)")
    parser.add_argument("--warmup", type=float, default=2.0, help="unmeasured load before each row")
    parser.add_argument("--via", default="ws", help=f"how the agents reach the door, comma-separated: "
                                                    f"{', '.join(VIAS)} (default %(default)s)")
    parser.add_argument("--sdk-agents", type=int, default=64,
                        help="agents on the direct-Kafka SDK, side by side (0: none; default %(default)s)")
    parser.add_argument("--load-procs", type=int, default=1, help="load processes sharing the agents")
    parser.add_argument("--reps", type=int, default=1, help="rounds (the median row is printed)")
    parser.add_argument("--profile", type=Path, default=None, metavar="DIR",
                        help="record the door with py-spy during each row, into DIR")
    parser.add_argument("--keep-topics", action="store_true", help="keep this run's topics (default: deleted)")
    parser.add_argument("--load", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.load:
        import uvloop

        job = json.loads(args.load)
        job["agents"] = json.loads(Path(job["keys"]).read_text())[job["first"]:job["first"] + job["count"]]
        uvloop.run(load(job))
        return
    sizes = [int(n) for n in args.sizes.split(",") if n.strip()]
    vias = [v.strip() for v in args.via.split(",") if v.strip()]
    if any(v not in VIAS for v in vias):
        parser.error(f"--via: choose from {', '.join(VIAS)}")
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
    print(f"# {platform.node()}: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}")
    asyncio.run(run(sizes, args.seconds, vias, args.sdk_agents, args.warmup, args.load_procs, args.reps,
                    args.profile, args.keep_topics))


if __name__ == "__main__":
    main()
