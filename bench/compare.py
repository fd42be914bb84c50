"""``python -m bench compare [--reps N] [--quick]``: Arbiter side by side with etcd, ZooKeeper and Redis.

``./dev bench compare`` installs what it needs first (Debian's etcd-server, zookeeperd and
redis-server when a binary is missing; the Python clients, the ``compare`` extra, into
.venv). This module starts each server itself on loopback, on ports of its own, with its
data in a temporary directory (``bench.compare_servers``), and stops them at the end,
also after an error or Ctrl-C. Arbiter runs one worker of its own (``bench_arbiter``)
against the local broker that ``./dev`` reuses or starts. Which client drives each
system, and why, is in ``bench.compare_sides``.

The same client process and the same workloads for all four:

1. uncontended: one client acquires and releases a new name, sequentially; acquire latency.
2. hand-off: 9 clients on one name, so 8 wait while one holds; the holder keeps it 10 ms and
   releases; the latency from that release going out until the next holder's acquire returns.
   The client that released queues again only once the next one holds, so there is always a
   hand-off to another client (Redis' ``Lock`` would otherwise let the releaser take it back).
3. 64 clients, each its own connection, each acquiring and releasing its own name in a loop;
   grants per second and acquire p50.
4. burst: one client acquires distinct names, as many at once as its library allows:
   Arbiter all of them (one producer pipelines them), etcd and Redis over 256 connections,
   kazoo on 64 threads sharing one session; grants per second until the last is granted.

Each workload runs for each system in turn, repeated ``--reps`` times (interleaved, so a
noisy minute hurts every system alike); the table shows the median of the repetitions.
CPU seconds are those the server processes used during the workload (``/proc/<pid>/stat``:
for Arbiter, the Kafka broker and the worker; for the others, their server) and the
client process's own.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import logging
import os
import resource
import signal
import statistics
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from .compare_servers import Server, broker_pid, cpu_seconds, start_etcd, start_redis, start_zookeeper, worker_pids
from .compare_sides import ArbiterSide, EtcdSide, Held, Locker, RedisSide, Side, ZooKeeperSide
from .env import bench_arbiter
from .floor import one_produce, two_hops

HOLD_S = 0.010  # how long a hand-off holder keeps the lock
WAITERS = 8


@dataclass
class Sizes:
    uncontended: int
    handoffs: int
    clients: int
    loop_seconds: float
    burst: int

    @classmethod
    def full(cls) -> Sizes:
        return cls(uncontended=400, handoffs=200, clients=64, loop_seconds=10.0, burst=3000)

    @classmethod
    def quick(cls) -> Sizes:
        return cls(uncontended=100, handoffs=40, clients=64, loop_seconds=3.0, burst=500)


@dataclass
class Result:
    """One workload run on one system."""

    p50_ms: float | None = None
    p99_ms: float | None = None
    rate: float | None = None  # grants per second
    server_cpu: float = 0.0
    client_cpu: float = 0.0
    n: int = 0
    seconds: float = 0.0  # wall time of the timed part
    broker_cpu: float = 0.0  # the shared broker's CPU meanwhile, whoever ran
    server_cpu_raw: float | None = None  # Arbiter's, before the broker's background was subtracted
    worker_cpu: float | None = None  # Arbiter's worker alone (its servers' CPU less the broker's)


def _client_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this process
    return usage.ru_utime + usage.ru_stime


def _quantile(samples: list[float], q: int) -> float:
    if len(samples) == 1:
        return samples[0]
    return statistics.quantiles(samples, n=100, method="inclusive")[q - 1]


BROKER: list[int] = []  # the local broker's pid, when it is ours to read


@dataclass
class Meter:
    """CPU seconds of the side's servers, of this process and of the broker over a workload's timed part."""

    side: Side
    server: float = 0.0
    client: float = 0.0
    broker: float = 0.0
    seconds: float = 0.0
    _at0: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)

    def _now(self) -> tuple[float, float, float, float]:
        return cpu_seconds(self.side.server_pids()), _client_cpu(), cpu_seconds(BROKER), time.perf_counter()

    def __enter__(self) -> Meter:
        self._at0 = self._now()
        return self

    def __exit__(self, *_exc: object) -> None:
        now = self._now()
        self.server, self.client, self.broker, self.seconds = (b - a for a, b in zip(self._at0, now, strict=True))

    def result(self, p50: float | None, p99: float | None, rate: float | None, n: int) -> Result:
        return Result(p50, p99, rate, self.server, self.client, n, self.seconds, self.broker)


async def _with_lockers(side: Side, count: int, concurrency: int,
                        body: Callable[[list[Locker]], Awaitable[Result]]) -> Result:
    lockers = await side.lockers(count, concurrency)
    try:
        return await body(lockers)
    finally:
        await side.close_lockers(lockers)


async def uncontended(side: Side, sizes: Sizes, tag: str) -> Result:
    async def body(lockers: list[Locker]) -> Result:
        (locker,) = lockers
        samples = []
        with Meter(side) as meter:
            for i in range(sizes.uncontended):
                held = await locker.acquire(f"u-{tag}-{i}")
                samples.append((held.granted - held.started) * 1000)
                await locker.release(held)
        return meter.result(_quantile(samples, 50), _quantile(samples, 99), None, len(samples))

    return await _with_lockers(side, 1, 1, body)


async def handoff(side: Side, sizes: Sizes, tag: str) -> Result:
    name = f"h-{tag}"
    grants: list[float] = []
    releases: list[float] = []
    granted = asyncio.Condition()
    target = sizes.handoffs + 2  # the first grant has no release before it; one more for the queue to form

    async def member(locker: Locker) -> None:
        while len(grants) < target:
            held = await locker.acquire(name)
            async with granted:
                grants.append(held.granted)
                mine = len(grants)
                granted.notify_all()
            await asyncio.sleep(HOLD_S)
            releases.append(await locker.release(held))
            async with granted:  # queue again once another client holds it
                await granted.wait_for(lambda mine=mine: len(grants) > mine or len(grants) >= target)  # type: ignore[misc]

    async def body(lockers: list[Locker]) -> Result:
        with Meter(side) as meter:
            await asyncio.gather(*(member(locker) for locker in lockers))
        releases.sort()
        samples = []
        for at in sorted(grants)[2:]:
            before = bisect.bisect_left(releases, at)
            if before:
                samples.append((at - releases[before - 1]) * 1000)
        return meter.result(_quantile(samples, 50), _quantile(samples, 99), None, len(samples))

    return await _with_lockers(side, WAITERS + 1, 1, body)


async def many_clients(side: Side, sizes: Sizes, tag: str) -> Result:
    async def body(lockers: list[Locker]) -> Result:
        samples: list[float] = []
        deadline = time.perf_counter() + sizes.loop_seconds

        async def member(i: int, locker: Locker) -> None:
            name = f"m-{tag}-{i}"
            while time.perf_counter() < deadline:
                held = await locker.acquire(name)
                samples.append((held.granted - held.started) * 1000)
                await locker.release(held)

        with Meter(side) as meter:
            started = time.perf_counter()
            await asyncio.gather(*(member(i, locker) for i, locker in enumerate(lockers)))
            elapsed = time.perf_counter() - started
        return meter.result(_quantile(samples, 50), _quantile(samples, 99), len(samples) / elapsed, len(samples))

    return await _with_lockers(side, sizes.clients, 1, body)


BURST_CONCURRENCY = 256  # connections for etcd and Redis; kazoo's calls are bounded by its thread pool


async def burst(side: Side, sizes: Sizes, tag: str) -> Result:
    async def body(lockers: list[Locker]) -> Result:
        (locker,) = lockers
        await locker.warm(BURST_CONCURRENCY)
        names = [f"b-{tag}-{i}" for i in range(sizes.burst)]
        with Meter(side) as meter:
            started = time.perf_counter()
            held: list[Held] = await asyncio.gather(*(locker.acquire(name) for name in names))
            elapsed = time.perf_counter() - started
        await asyncio.gather(*(locker.release(h) for h in held))  # not timed
        return meter.result(None, None, len(names) / elapsed, len(names))

    return await _with_lockers(side, 1, BURST_CONCURRENCY, body)


Workload = Callable[[Side, Sizes, str], Awaitable[Result]]
WORKLOADS: list[tuple[str, Workload]] = [
    ("uncontended", uncontended),
    ("handoff", handoff),
    ("clients", many_clients),
    ("burst", burst),
]


@dataclass
class Runs:
    results: dict[tuple[str, str], list[Result]] = field(default_factory=dict)
    background: list[float] = field(default_factory=list)  # the broker's, per repetition (CPU s/s)

    def add(self, workload: str, side: str, result: Result) -> None:
        self.results.setdefault((workload, side), []).append(result)

    def median(self, workload: str, side: str, attribute: str) -> float | None:
        values = [getattr(r, attribute) for r in self.results.get((workload, side), [])]
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None


def subtract_background(arbiter: str, results: list[tuple[str, Result]]) -> float | None:
    """Take the shared broker's background off Arbiter's server CPU: its CPU per second while the
    other systems ran (other users of the broker, and the idle worker's ticks), times the Arbiter
    run's length, at most what the broker used in that run. Returns the background (CPU s/s)."""
    others = [r for title, r in results if title != arbiter]
    seconds = sum(r.seconds for r in others)
    if not BROKER or not seconds:
        return None
    rate = sum(r.broker_cpu for r in others) / seconds
    for title, r in results:
        if title == arbiter:
            r.server_cpu_raw = r.server_cpu
            r.worker_cpu = r.server_cpu - r.broker_cpu
            r.server_cpu -= min(r.broker_cpu, rate * r.seconds)
    return rate


FloorRun = Callable[[int], Awaitable[dict[str, list[float]]]]


async def measure(sides: list[Side], sizes: Sizes, reps: int, say: Callable[[str], None],
                  floor: FloorRun | None = None) -> Runs:
    """Every workload on every side, ``reps`` times interleaved; with ``floor`` (ms per sample by kind, as
    many samples as the uncontended workload takes), the floor rows too, in each repetition."""
    runs = Runs()
    # Warm up each side (JIT, connections, caches, the worker's first books) before anything counts.
    for side in sides:
        await uncontended(side, Sizes(20, 0, 0, 0, 0), f"warm-{uuid.uuid4().hex[:6]}")
    for rep in range(1, reps + 1):
        this_rep: list[tuple[str, Result]] = []
        if floor is not None:
            for kind, samples in (await floor(sizes.uncontended)).items():
                runs.add(kind, sides[0].title, Result(_quantile(samples, 50), _quantile(samples, 99), n=len(samples)))
                say(f"rep {rep}/{reps} {kind:11s} p50 {_quantile(samples, 50):.2f} ms p99 "
                    f"{_quantile(samples, 99):.2f} ms (n={len(samples)})")
        for workload, run in WORKLOADS:
            for side in sides:
                tag = f"{rep}-{uuid.uuid4().hex[:6]}"
                result = await run(side, sizes, tag)
                runs.add(workload, side.title, result)
                this_rep.append((side.title, result))
                figure = (f"p50 {result.p50_ms:.2f} ms p99 {result.p99_ms:.2f} ms" if result.rate is None
                          else f"{result.rate:,.0f} grants/s" + (f", p50 {result.p50_ms:.2f} ms"
                                                                  if result.p50_ms is not None else ""))
                say(f"rep {rep}/{reps} {workload:11s} {side.title:9s} {figure} (n={result.n}); "
                    f"CPU s server {result.server_cpu:.2f} client {result.client_cpu:.2f} "
                    f"(broker {result.broker_cpu:.2f}) in {result.seconds:.1f} s")
        background = subtract_background(sides[0].title, this_rep)
        if background is not None:
            runs.background.append(background)
            say(f"rep {rep}/{reps}: the broker's background while the others ran: {background:.2f} CPU s/s")
    return runs


# -- the table --------------------------------------------------------------------------

def _ratio(value: float | None, base: float | None) -> str:
    if value is None or base is None or base == 0:
        return ""
    return f" ({value / base:.2g}x)"


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f} ms" if value < 10 else f"{value:.1f} ms"


def _rate(value: float | None) -> str:
    return "n/a" if value is None else f"{value:,.0f}/s"


def table(runs: Runs, titles: list[str], sizes: Sizes, reps: int) -> str:
    base = titles[0]
    rows: list[tuple[str, str, str, Callable[[float | None], str]]] = [
        (f"0. floor, {base}'s client and broker: one acknowledged produce (acks=all), p50", ONE_PRODUCE, "p50_ms",
         _ms),
        ("   floor: two hops through a relay process, p50", TWO_HOPS, "p50_ms", _ms),
        (f"1. uncontended acquire p50 (n={sizes.uncontended})", "uncontended", "p50_ms", _ms),
        ("   uncontended acquire p99", "uncontended", "p99_ms", _ms),
        ("   CPU s: servers / client", "uncontended", "cpu", _ms),
        ("   CPU µs a grant (and its release): worker / broker / SDK, or server / client", "uncontended", "pergrant",
         _ms),
        (f"2. hand-off, {WAITERS} waiting: release to next grant, p50 (n={sizes.handoffs})", "handoff", "p50_ms",
         _ms),
        ("   hand-off p99", "handoff", "p99_ms", _ms),
        ("   CPU s: servers / client", "handoff", "cpu", _ms),
        (f"3. {sizes.clients} clients, own names, {sizes.loop_seconds:.0f} s: grants/s", "clients", "rate", _rate),
        ("   acquire p50", "clients", "p50_ms", _ms),
        ("   CPU s: servers / client", "clients", "cpu", _ms),
        ("   CPU µs a grant (and its release)", "clients", "pergrant", _ms),
        (f"4. burst of {sizes.burst:,} distinct names: grants/s", "burst", "rate", _rate),
        ("   CPU s: servers / client", "burst", "cpu", _ms),
        ("   CPU µs a grant", "burst", "pergrant", _ms),
    ]
    lines = [f"| Workload (median of {reps}) | " + " | ".join(titles) + " |",
             "|---|" + "---|" * len(titles)]
    for label, workload, attribute, fmt in rows:
        cells = []
        for title in titles:
            if attribute == "pergrant":
                cell = _per_grant(runs, workload, title)
            elif attribute == "cpu":
                server, client = runs.median(workload, title, "server_cpu"), runs.median(workload, title, "client_cpu")
                cell = "n/a" if server is None or client is None else f"{server:.2f} / {client:.2f}"
                raw = runs.median(workload, title, "server_cpu_raw")
                if raw is not None:
                    cell += f" (raw {raw:.2f})"
                if title != base:
                    cell += _ratio(server, runs.median(workload, base, "server_cpu")).replace(")", " servers)")
            elif workload in (ONE_PRODUCE, TWO_HOPS):
                cell = fmt(runs.median(workload, title, attribute)) if title == base else ""
            else:
                value = runs.median(workload, title, attribute)
                cell = fmt(value) + ("" if title == base else _ratio(value, runs.median(workload, base, attribute)))
            cells.append(cell)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


ONE_PRODUCE, TWO_HOPS = "floor-one", "floor-two"
"""The floor rows' workloads: one acknowledged acks=all produce, and two hops through a relay, on Arbiter's
broker with Arbiter's client (``bench.floor``), no Arbiter."""


def _per_grant(runs: Runs, workload: str, title: str) -> str:
    """Each process's CPU a grant: Arbiter's worker, broker (less its background) and SDK; another system's
    server and client."""
    results = runs.results.get((workload, title), [])
    if not results or not all(r.n for r in results):
        return "n/a"

    def micros(values: list[float]) -> str:
        return f"{statistics.median(values) * 1e6:,.0f}"

    client = micros([r.client_cpu / r.n for r in results])
    if all(r.worker_cpu is not None for r in results):
        worker = micros([(r.worker_cpu or 0.0) / r.n for r in results])
        broker = micros([(r.server_cpu - (r.worker_cpu or 0.0)) / r.n for r in results])
        return f"{worker} / {broker} / {client}"
    return f"{micros([r.server_cpu / r.n for r in results])} / {client}"


FOOTNOTES = """\
(Nx) is the system's figure divided by Arbiter's: for latency and CPU below 1 is better, for grants/s above 1.
CPU s: CPU seconds (user + system) over the timed part of the workload; servers = Arbiter's Kafka
broker + its worker, or the one etcd / ZooKeeper / Redis process; client = this benchmark's process.
The broker is shared (other topics, other users): its CPU per second while the other three systems
ran (BACKGROUND CPU s/s, median of the repetitions) is taken off Arbiter's, times the run's length;
"raw" is before that. Arbiter runs one worker (all partitions); each system one server process.
A client CPU close to the workload's length (the "in N s" of the lines above the table) means the
client process, not the server, set the pace: kazoo's two threads per session do that in 3 and 4 here.
The floor (row 0) is what Kafka itself costs here with the client Arbiter's SDK uses, no Arbiter
(bench.floor): one record produced with acks=all until acknowledged (the least one durable write
costs), and one record produced, read by a relay process that produces it to a second topic, and read
back (a grant on the topics is those two hops, plus signing, deciding and the changelog).
CPU µs a grant: each process's CPU over the workload divided by the grants (for 1 and 3, each with its
release): for Arbiter its worker, its broker (less the background above) and the SDK (this process);
for the others their server and this process.
Clients: Arbiter's SDK (each command and inbox message signed and verified); etcd's own lock
service (v3lock, as `etcdctl lock`) over native gRPC (grpcio), one channel and session lease per client;
kazoo's Lock recipe (kazoo blocks, so its calls run on threads); redis-py's asyncio Lock with its
defaults (a blocked acquire polls every 0.1 s, so a hand-off waits for a poll). Burst concurrency:
Arbiter all at once over one producer, etcd and Redis 256 connections, kazoo 64 threads on one session.
Durability: Kafka acknowledges a command once the broker has it (acks=all on one broker, no fsync per
write, Kafka's default); etcd and ZooKeeper fsync each write before answering; Redis here persists
nothing (--save '' --appendonly no): a restart forgets every lock.
Fencing: Arbiter grants a token per lease (the resource's counter, +1 per grant); etcd's lock key has
a create revision usable as one; ZooKeeper's lock node a sequence number (per name); redis-py's Lock
has none (its random token only guards its own release).
Expiry: Arbiter and Redis leases have a TTL per lock (30 s here); etcd's and ZooKeeper's end with the
client's session."""


# -- running it -------------------------------------------------------------------------

@contextlib.contextmanager
def _sigterm_stops() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C does, so every server is stopped on the way out."""
    def handler(_sig: int, _frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _say(message: str) -> None:
    print(f"# {message}", flush=True)


async def _run(servers: dict[str, Server], sizes: Sizes, reps: int) -> tuple[Runs, list[str]]:
    run = uuid.uuid4().hex[:8]
    broker = broker_pid()
    if broker is None:
        _say("the broker is not the local one: its CPU is not counted (Arbiter's servers = the worker only)")
    else:
        BROKER[:] = [broker]
    # The bench's own home issues each client's key on first use; that is said once per agent, not news here.
    for name in ("transport", "hub", "identities", "client"):
        name = f"arbiter.agents.{name}"
        logging.getLogger(name).addFilter(lambda record: not record.getMessage().startswith("auto_enroll"))
    async with bench_arbiter() as settings:
        workers = worker_pids(settings.app_id)
        if not workers:
            raise RuntimeError(f"found no worker process of app {settings.app_id}")
        zookeeper = ZooKeeperSide(servers["zookeeper"].port, servers["zookeeper"].pid, run)
        sides: list[Side] = [
            ArbiterSide(settings, [p for p in [broker, *workers] if p is not None]),
            EtcdSide(servers["etcd"].port, servers["etcd"].pid),
            zookeeper,
            RedisSide(servers["redis"].port, servers["redis"].pid),
        ]
        _say(f"Arbiter: broker pid {broker}, worker pid(s) {workers}; " + ", ".join(
            f"{s.name} pid {s.pid} port {s.port}" for s in servers.values()))
        try:
            async def floor(count: int) -> dict[str, list[float]]:
                return {ONE_PRODUCE: await one_produce(settings, count), TWO_HOPS: await two_hops(settings, count)}

            runs = await measure(sides, sizes, reps, _say, floor)
        finally:
            zookeeper.shutdown()
        for server in servers.values():
            server.alive()
        return runs, [side.title for side in sides]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench compare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3, help="repetitions of each workload per system (default 3)")
    parser.add_argument("--quick", action="store_true", help="a short run (smoke test): fewer samples, 3 s loops")
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    sizes = Sizes.quick() if args.quick else Sizes.full()
    started, load = time.monotonic(), os.getloadavg()
    with _sigterm_stops(), tempfile.TemporaryDirectory(prefix="arbiter-compare-") as tmp, \
            contextlib.ExitStack() as stack:
        root = Path(tmp)
        servers: dict[str, Server] = {}
        for name, start in (("etcd", start_etcd), ("zookeeper", start_zookeeper), ("redis", start_redis)):
            server = start(root)
            stack.callback(server.stop)
            servers[name] = server
        try:
            runs, titles = asyncio.run(_run(servers, sizes, args.reps))
        except BaseException:
            for server in servers.values():
                if server.proc.poll() is not None:
                    print(f"# {server.name} had exited ({server.proc.returncode}); its log:\n{server.tail()}")
            raise
    print(f"\nArbiter vs etcd 3.4 / ZooKeeper 3.8 / Redis 7.0 (Debian's), one client process, "
          f"{'quick' if args.quick else 'full'} run, {time.monotonic() - started:.0f} s, "
          f"{os.cpu_count()} cores, load average {load[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end\n")
    print(table(runs, titles, sizes, args.reps))
    print()
    background = statistics.median(runs.background) if runs.background else None
    print(FOOTNOTES.replace("BACKGROUND", "n/a" if background is None else f"{background:.2f}"))
