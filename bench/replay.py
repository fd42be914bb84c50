"""Audit benchmark: replay and check a large log in-process, with no broker.

The log is made, not recorded: agents' commands on many ``account:`` resources
(acquire, queue behind the holder, refund, release, a version conflict now and then a
lease left to expire and a write by its dead holder), with the worker's ticks, at
increasing fake append times, are run through ``arbiter.audit.replay.simulate``,
which decides them with the processors' own code and appends every event, inbox
copy and wait-for edge the worker would have sent. The figures are then audit's
own: ``rederive`` alone, the whole ``audit`` (rederive, checks, timeline), and an
archive written and read back.

Replay decides inputs: the messages on the input topics (resource commands with the
worker's ticks, wait-for edges, saga commands), which is what ``rederive`` feeds the
processors' code. The rest of the log (events, inbox copies) is what those decisions
produced: replay compares it, it does not decide it. So the replay figure, and its
target, is in inputs per second; log messages per second are printed beside it,
labelled as such.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from arbiter.audit import audit
from arbiter.audit.log import Entry, Log, load_archive, write_archive
from arbiter.audit.replay import from_outside, inputs, rederive, simulate
from arbiter.edge.settings import Settings
from arbiter.schemas import LockReleaseRequested, LockRequested, LockTick, Record, ToolIntent

ROUND_MESSAGES = 28
"""About how many messages one round of the workload leaves in the log."""
TICK_MS = 100
T0 = 1_700_000_000_000


def workload(settings: Settings, rounds: int, resources: int = 2_000, spacing_ms: int = 1) -> list[Entry]:
    """The agents' commands and the ticks, in time order, for ``rounds`` rounds.

    A round on one resource: A acquires it, B queues behind A, A refunds, A releases
    (B is granted), B refunds on A's base (version conflict) and again on the new one,
    B releases. Every 10th round on a resource, C then takes a 50 ms lease, lets it
    expire, writes with its dead token (refused) and releases it (refused). Tokens and
    versions are predicted here, as the agents would have read them. A round starts ``spacing_ms`` after
    the one before.
    """
    topic = settings.topics.resource_commands
    tokens = [0] * resources
    versions = [0] * resources
    out: list[Entry] = []

    def send(at: int, resource: str, record: Record) -> None:
        out.append(Entry(topic, -1, -1, at, resource.encode(), record))

    def acquire(at: int, agent: str, resource: str, n: str, ttl_ms: int = 30_000, wait_ms: int = 0) -> None:
        send(at, resource, LockRequested(request_id=f"q{n}{agent}", agent_id=agent, resource=resource,
                                         mode="exclusive", ttl_ms=ttl_ms, wait_ms=wait_ms, at_ms=at))

    def refund(at: int, agent: str, resource: str, n: str, token: int, base: int) -> None:
        send(at, resource, ToolIntent(intent_id=f"i{n}{agent}{base}", agent_id=agent, resource=resource, token=token,
                                      base_version=base, tool="refund", at_ms=at,
                                      arguments_json=json.dumps({"amount": 100, "order_id": f"o{n}"})))

    def release(at: int, agent: str, resource: str, n: str, token: int) -> None:
        send(at, resource, LockReleaseRequested(request_id=f"r{n}{agent}", agent_id=agent, resource=resource,
                                                token=token, at_ms=at))

    for j in range(rounds):
        i = j % resources
        resource, n, t = f"account:r{i}", str(j), T0 + j * spacing_ms
        a, b, c = f"agent-{j % 97}", f"agent-{(j + 31) % 97}", f"agent-{(j + 63) % 97}"
        first, second, base = tokens[i] + 1, tokens[i] + 2, versions[i]
        acquire(t, a, resource, n)
        acquire(t + 1, b, resource, n, wait_ms=5_000)
        refund(t + 2, a, resource, n, first, base)
        release(t + 3, a, resource, n, first)
        refund(t + 4, b, resource, n, second, base)  # version_conflict: A wrote since
        refund(t + 5, b, resource, n, second, base + 1)
        release(t + 6, b, resource, n, second)
        tokens[i], versions[i] = second, base + 2
        if j // resources % 10 == i % 10:
            zombie = tokens[i] = second + 1
            acquire(t + 7, c, resource, n, ttl_ms=50)
            refund(t + 7 + 3 * TICK_MS, c, resource, n, zombie, base + 2)  # lease_not_live: expired and ticked
            release(t + 8 + 3 * TICK_MS, c, resource, n, zombie)
    end = max(e.timestamp_ms for e in out) + 2 * TICK_MS
    for at in range(T0, end, TICK_MS):
        for p in range(settings.partitions):
            out.append(Entry(topic, p, -1, at, b"__tick__", LockTick(request_id=f"t{at}:{p}", partition=p,
                                                                       at_ms=at)))
    out.sort(key=lambda e: e.timestamp_ms)
    return out


async def _build(settings: Settings, messages: int) -> Log:
    commands = workload(settings, max(1, messages // ROUND_MESSAGES))
    return await simulate(Log(settings.topics, source="bench", partition_count=settings.partitions), settings,
                          outside=commands)


async def _timed_rederive(log: Log, settings: Settings) -> tuple[float, int]:
    started = time.perf_counter()
    _engine, decided = await rederive(log, settings)
    return time.perf_counter() - started, len(decided)  # not the time to free what it built


async def _timed_audit(log: Log, settings: Settings) -> tuple[float, dict[str, Any]]:
    started = time.perf_counter()
    report = await audit(log, settings)
    return time.perf_counter() - started, report


def audit_throughput(messages: int = 200_000) -> None:
    """Replay and audit rates on a generated log of about ``messages`` messages."""
    settings = Settings(partitions=4)
    asyncio.run(audit(asyncio.run(_build(settings, 2_000)), settings))  # warm up: imports, schemas
    started = time.perf_counter()
    log = asyncio.run(_build(settings, messages))
    built = time.perf_counter() - started
    size = len(log)
    fed = list(inputs(log, settings))
    ticks = sum(isinstance(e.record, LockTick) for e in fed)
    agents = sum(from_outside(e) for e in fed) - ticks
    made = Counter(type(e.record).__name__ for e in fed if not from_outside(e))
    print(f"replay: generated log of {size:,} messages in {built:.1f} s; {len(fed):,} of them inputs "
          f"({agents:,} agents' commands, {ticks:,} worker ticks, {sum(made.values()):,} sent by processors: "
          f"{', '.join(f'{n:,} {name}' for name, n in sorted(made.items()))}), "
          f"the other {size - len(fed):,} what was decided")

    whole, report = asyncio.run(_timed_audit(log, settings))
    timing = report["timing"]
    rest = whole - timing["replay_s"] - timing["checks_s"]
    print(f"replay: audit {whole:.2f} s (rederive {timing['replay_s']:.2f} s, checks {timing['checks_s']:.2f} s, "
          f"timeline {rest:.2f} s): {len(fed) / whole:,.0f} inputs/s, {size / whole:,.0f} log messages/s; "
          f"verdict {report['verdict']}, "
          f"{len(report['findings'])} findings")
    stats = report["stats"]
    print(f"replay: the log holds {stats['grants']:,} grants, {stats['writes']:,} applied and "
          f"{stats['rejected_writes']:,} rejected writes, {stats['expiries']:,} expiries")
    if report["verdict"] != "pass":
        raise SystemExit(f"the generated log should audit clean: {report['findings'][:3]}")

    alone, decided = asyncio.run(_timed_rederive(log, settings))
    assert decided == len(fed), (decided, len(fed))
    print(f"replay: rederive alone {alone:.2f} s: {decided / alone:,.0f} inputs/s (target 50,000); "
          f"counted in log messages instead: {size / alone:,.0f} log messages/s")

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "log.jsonl"
        started = time.perf_counter()
        write_archive(path, log)
        written = time.perf_counter() - started
        megabytes = path.stat().st_size / 1e6
        started = time.perf_counter()
        back = load_archive(path)
        read = time.perf_counter() - started
    assert len(back) == size
    print(f"replay: archive of {megabytes:.0f} MB written at {size / written:>9,.0f} messages/s, "
          f"read at {size / read:>9,.0f} messages/s")
