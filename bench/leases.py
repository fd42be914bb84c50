"""Lease benchmarks: the pure core in-process, and grants through Kafka and a worker."""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from collections.abc import Callable
from typing import Any

from aiokafka import AIOKafkaProducer

from arbiter.agents import ArbiterClient
from arbiter.edge.clock import now_ms
from arbiter.schemas import Cause, LockGranted, LockReleaseRequested, LockRequested, default_codec
from arbiter.streams.cores.leases import LockCommand, decide, evolve, new_book, step

from .compare_servers import cpu_seconds
from .env import bench_arbiter, bench_workers, burst


async def faust_ceiling(total: int) -> None:
    """How fast one faust worker consumes when it does nothing: the bound on every processor."""
    import subprocess
    import sys
    import tempfile

    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    from arbiter.edge.settings import load_settings

    settings = load_settings()
    topic = f"ceiling-{uuid.uuid4().hex[:8]}"
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, settings.partitions, 1)])
    finally:
        await admin.close()
    producer = AIOKafkaProducer(bootstrap_servers=settings.bootstrap, linger_ms=5)
    await producer.start()
    try:
        for i in range(total):
            await producer.send(topic, key=str(i).encode(), value=b"x" * 100)
        await producer.flush()
    finally:
        await producer.stop()
    with tempfile.NamedTemporaryFile(mode="r", suffix=".rate") as out:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bench.faust_ceiling", topic, str(total), out.name,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        await asyncio.wait_for(proc.wait(), 300)
        rate = out.read().strip()
    print(f"faust ceiling, one worker consuming and doing nothing: {int(rate):>8,} msgs/s")


def percentiles(samples: list[float]) -> str:
    q = statistics.quantiles(samples, n=100, method="inclusive")
    return f"p50 {q[49]:.2f} ms  p99 {q[98]:.2f} ms  max {max(samples):.2f} ms  (n={len(samples)})"


def core(seconds: float) -> None:
    """Decisions per second of ``step`` (decide + evolve) on prepared commands."""
    cause = Cause(topic="bench", partition=0, offset=0)
    n = 20_000
    names = [f"res:{i % 1000}" for i in range(n)]
    # Commands are built before the clock starts: the figure is the core's, not pydantic's.
    # Each resource sees acquire, release, acquire, ...: its k-th grant has token k. A command
    # is sent at the moment it is decided (the id window refuses ones sent long before).
    acquires = [LockRequested(request_id=f"a{i}", agent_id=f"agent{i % 50}", resource=names[i], mode="exclusive",
                              ttl_ms=30_000, wait_ms=5_000, at_ms=i) for i in range(n)]
    releases = [LockReleaseRequested(request_id=f"r{i}", agent_id=acquires[i].agent_id, resource=names[i],
                                     token=i // 1000 + 1, at_ms=i) for i in range(n)]

    def run_uncontended() -> int:
        books = {name: new_book(name) for name in set(names)}
        done = 0
        for i, cmd in enumerate(acquires):
            book = books[cmd.resource]
            step(book, cmd, i, cause)
            step(book, releases[i], i, cause)
            done += 2
        assert all(book.last_token == n // 1000 and book.is_idle() for book in books.values())
        return done

    cases: list[tuple[str, Callable[[], int]]] = [("uncontended acquire+release", run_uncontended)]
    for label, fn in cases:
        count, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < seconds:
            count += fn()
        print(f"pure core, {label}: {count / elapsed:>10,.0f} decisions/s")
    queue_cost(seconds)
    history_cost()


QUEUES = (1, 20, 100, 1000)
"""Queue lengths the queue-cost benchmark measures."""


def _handoffs(waiters: int, rounds: int) -> tuple[list[LockRequested], list[tuple[Any, Any]]]:
    """A queue of ``waiters`` on one resource, then ``rounds`` of: the holder releases (a hand-off to
    the head) and a new agent queues at the tail, so the queue keeps its length."""
    def acquire(i: int, at: int) -> LockRequested:
        return LockRequested(request_id=f"q{i}", agent_id=f"w{i}", resource="hot", mode="exclusive",
                             ttl_ms=600_000, wait_ms=600_000, at_ms=at)

    # Each command sent (and decided) 1 ms after the one before: over ``max_remembered_ids`` the id
    # memory forgets the oldest, and refuses anything sent at or before the last one forgotten.
    setup = [acquire(i, i) for i in range(waiters + 1)]
    base = waiters + 1
    work = [(LockReleaseRequested(request_id=f"x{r}", agent_id=f"w{r}", resource="hot", token=r + 1,
                                  at_ms=base + 2 * r), acquire(waiters + 1 + r, base + 2 * r + 1))
            for r in range(rounds)]
    return setup, work


def through_step(waiters: int, rounds: int = 2_000) -> Callable[[], float]:
    """Decisions/s of ``cores.leases.step`` alone, with ``waiters`` queued (the queue is built untimed)."""
    cause = Cause(topic="bench", partition=0, offset=0)
    setup, work = _handoffs(waiters, rounds)

    def run() -> float:
        book = new_book("hot")
        for cmd in setup:
            step(book, cmd, cmd.at_ms, cause)
        started = time.perf_counter()
        for release, queue_up in work:
            step(book, release, release.at_ms, cause)
            step(book, queue_up, queue_up.at_ms, cause)
        elapsed = time.perf_counter() - started
        assert book.last_token == rounds + 1 and len(book.queue) == waiters
        return 2 * rounds / elapsed
    return run


def through_pipeline(waiters: int, rounds: int = 1_000) -> Callable[[], float]:
    """Decisions through the whole per-input path a worker takes (``arbiter.streams.shells.pipeline``: the route
    check, the resource shell over a table view, the undo record, the encoding of every output),
    over dict tables, with ``waiters`` queued. No broker, no signatures: the cost that grows, if any,
    with the queue."""
    from arbiter.edge.settings import Settings
    from arbiter.schemas.partitioning import partition_for
    from arbiter.streams.shells import Rules
    from arbiter.streams.shells.pipeline import Pipeline, RawInput

    settings = Settings(partitions=4)
    codec = default_codec()
    topic = settings.topics.resource_commands
    partition = partition_for(b"hot", settings.partitions)
    setup, work = _handoffs(waiters, rounds)
    offsets = iter(range(10**9))

    def raw(command: Any) -> RawInput:
        return RawInput(topic, partition, next(offsets), b"hot", None, (), command.at_ms, command)

    inputs = [raw(c) for c in setup], [(raw(a), raw(b)) for a, b in work]

    class _NoTools:
        def names(self) -> frozenset[str]:
            return frozenset()

        def parse(self, intent: Any) -> Any:
            return "none"

        async def run(self, intent: Any, arguments: Any) -> Any:
            raise AssertionError("no tools here")

        async def read(self, request: Any) -> Any:
            return None

        async def join(self, intent: Any, arguments: Any) -> Any:
            raise AssertionError("no repositories here")

        async def land(self, resource: str, entry: Any, head: str, verdict: Any) -> Any:
            raise AssertionError("no repositories here")

    async def run_async() -> float:
        tables: dict[str, dict[bytes, Any]] = {"books": {}, "contents": {}, "graphs": {}, "sagas": {}}
        pipeline = Pipeline(Rules(), settings.topics, settings.partitions, tables, _NoTools(), codec, quiet=True)
        for item in inputs[0]:
            await pipeline.process(item)
        started = time.perf_counter()
        for release, queue_up in inputs[1]:
            await pipeline.process(release)
            await pipeline.process(queue_up)
        elapsed = time.perf_counter() - started
        book = tables["books"][b"hot"]
        assert book.last_token == rounds + 1 and len(book.queue) == waiters, (book.last_token, len(book.queue))
        return 2 * rounds / elapsed

    return lambda: asyncio.run(run_async())


def queue_cost(seconds: float) -> dict[str, dict[int, float]]:
    """Hand-off decisions/s with 1, 20, 100 and 1,000 waiters, through ``step`` and through the pipeline;
    the figure of each queue length is the best of interleaved rounds (so both see the same machine)."""
    results: dict[str, dict[int, float]] = {}
    for label, make in (("pure core (step)", through_step), ("through the shell (pipeline)", through_pipeline)):
        runs = {w: make(w) for w in QUEUES}
        best = dict.fromkeys(QUEUES, 0.0)
        end = time.perf_counter() + seconds * len(QUEUES)
        while time.perf_counter() < end:
            for w, fn in runs.items():
                best[w] = max(best[w], fn())
        results[label] = best
        row = ", ".join(f"{w} waiter{'s' if w > 1 else ''} {rate:,.0f}" for w, rate in best.items())
        print(f"queue cost, hand-off (release + queue), {label}: {row} decisions/s; "
              f"100 waiters at {best[100] / best[1]:.2f}x and 1,000 at {best[1000] / best[1]:.2f}x of 1 waiter")
    return results


HISTORIES = (10, 4_000)
"""Hand-offs a resource has seen before the history-cost benchmark times its decisions."""


def _decide_then_evolve(book: Any, command: LockCommand, now: int, cause: Cause) -> None:
    """What a caller of the public functions does: ``decide``, then fold each event with ``evolve``."""
    for event in decide(book, command, now, cause):
        evolve(book, event)


def after_history(hand_offs: int, fused: bool, sample: int = 100) -> float:
    """The median cost (µs) of one decision, a release handing the resource on or a request queueing
    behind it, on a resource that has seen ``hand_offs`` hand-offs with a queue of one; through
    ``step`` (``fused``) or ``decide`` then ``evolve``. The history is built untimed, by the same path."""
    cause = Cause(topic="bench", partition=0, offset=0)
    setup, work = _handoffs(1, hand_offs + sample // 2)
    apply: Callable[[Any, LockCommand, int, Cause], object] = step if fused else _decide_then_evolve
    book = new_book("hot")
    for command in setup:
        apply(book, command, command.at_ms, cause)
    for release, queue_up in work[:hand_offs]:
        apply(book, release, release.at_ms, cause)
        apply(book, queue_up, queue_up.at_ms, cause)
    samples = []
    for pair in work[hand_offs:]:
        for command in pair:
            started = time.perf_counter()
            apply(book, command, command.at_ms, cause)
            samples.append(time.perf_counter() - started)
    assert book.last_token == hand_offs + sample // 2 + 1 and len(book.queue) == 1
    return statistics.median(samples) * 1e6


def history_cost(reps: int = 5) -> dict[str, dict[int, float]]:
    """µs per decision after 10 and after 4,000 hand-offs, through ``decide``/``evolve`` and through
    ``step``: a core's cost must not grow with a resource's history. Best of interleaved rounds."""
    results: dict[str, dict[int, float]] = {}
    for label, fused in (("decide+evolve", False), ("step", True)):
        best = dict.fromkeys(HISTORIES, float("inf"))
        for _ in range(reps):
            for hand_offs in HISTORIES:
                best[hand_offs] = min(best[hand_offs], after_history(hand_offs, fused))
        results[label] = best
        first, last = HISTORIES[0], HISTORIES[-1]
        print(f"history cost, one decision with a queue of one, pure core ({label}): "
              + ", ".join(f"after {n:,} hand-offs {best[n]:.1f} µs" for n in HISTORIES)
              + f"; after {last:,} at {best[last] / best[first]:.2f}x of after {first:,}")
    return results


async def grant_latency(rate: float, count: int, **overrides: Any) -> list[float]:
    """Uncontended acquire: produced until the SDK sees the grant, at a steady rate (ms, each)."""
    async with bench_arbiter(**overrides) as settings, ArbiterClient("bench-agent", settings) as client:
        samples = []
        interval, next_at = 1.0 / rate, time.perf_counter()
        for i in range(count):
            started = time.perf_counter()
            lease = await client.acquire(f"uncontended:{i}", ttl=30, wait=0)
            samples.append((time.perf_counter() - started) * 1000)
            await client.release_token(lease.resource, lease.token)
            next_at += interval
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
        print(f"grant latency, uncontended at ~{rate:.0f}/s, one worker: {percentiles(samples)}")
    return samples


async def handoff_latency(count: int, **overrides: Any) -> list[float]:
    """Release by the holder until the queued waiter sees its grant (ms, each)."""
    async with bench_arbiter(**overrides) as settings, ArbiterClient("holder", settings) as holder, \
            ArbiterClient("waiter", settings) as waiter:
        samples = []
        for i in range(count):
            name = f"handoff:{i}"
            held = await holder.acquire(name, ttl=30, wait=0)
            queued = asyncio.Event()

            def on_queued(_event: object, queued: asyncio.Event = queued) -> None:
                queued.set()

            waiting = asyncio.create_task(waiter.acquire(name, ttl=30, wait=30, on_queued=on_queued))
            await queued.wait()
            started = time.perf_counter()
            await holder.release_token(name, held.token)
            granted = await waiting
            samples.append((time.perf_counter() - started) * 1000)
            await waiter.release_token(name, granted.token)
        print(f"handoff latency, release until the waiter sees its grant: {percentiles(samples)}")
    return samples


async def grant_throughput(total: int, workers: int = 1, **overrides: Any) -> float:
    """Grants per second of ``workers`` workers: a burst of acquires on distinct resources; and the workers'
    CPU per grant (``/proc/<pid>/stat``, around the burst)."""
    codec = default_codec()
    async with bench_workers(workers, **overrides) as (settings, pool):
        run = uuid.uuid4().hex[:6]
        sent = now_ms()  # (within the id window: an old send time is refused request_expired)
        payloads = [(f"burst:{run}:{i}".encode(), codec.encode(LockRequested(
            request_id=f"{run}-{i}", agent_id=f"agent-{i % 100}", resource=f"burst:{run}:{i}", mode="exclusive",
            ttl_ms=60_000, at_ms=sent))) for i in range(total)]
        pids = [w.proc.pid for w in pool.workers]
        cpu = cpu_seconds(pids)
        produced, elapsed = await burst(settings, payloads, LockGranted)
        cpu = cpu_seconds(pids) - cpu
        print(f"grant throughput, {workers} worker{'s' if workers > 1 else ''} on {settings.partitions} partitions, "
              f"{total} acquires: {total / elapsed:>8,.0f} grants/s "
              f"(produced in {produced:.2f} s, all granted after {elapsed:.2f} s; worker CPU "
              f"{cpu / total * 1e6:,.0f} µs a grant)")
    return total / elapsed
