"""Scenarios on the simulation, each a function of a seed, and the checker every run goes through.

A scenario runs Arbiter's own workers (``arbiter.sim.worker``) on the simulated Kafka with agents
acting on shared resources, faults drawn from the seed, and hands back the whole log. ``check``
judges it with the audit (replay, mutual exclusion with fencing, one outcome per request, every
request answered) and reports what it found. One seed, one run: ``./dev sim --seed S`` replays it.
"""

from __future__ import annotations

import asyncio
import random
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from arbiter.audit.log import Entry, Log
from arbiter.audit.report import audit
from arbiter.edge.clock import now_ms
from arbiter.edge.settings import Settings
from arbiter.schemas import ContractError, LockGranted, LockReleaseRequested, LockRequested, Record, default_codec
from arbiter.schemas.identity import Signer
from arbiter.schemas.partitioning import partition_for
from arbiter.streams.runtime import worker as worker_module
from arbiter.streams.runtime.worker import Worker

from .kafka import SimKafka, SimReader, SimSender, seam_of
from .loop import run
from .worker import SimClients


@dataclass
class Outcome:
    """What one seeded run left: its log, its settings, and what the checker found in it."""

    scenario: str
    seed: int
    kafka: SimKafka
    settings: Settings
    findings: list[str] = field(default_factory=list)
    decisions: int = 0


def settings_for(rng: random.Random, home: Path) -> Settings:
    """Settings of a simulated fleet: two partitions, a worker key drawn from the seed, short ticks."""
    key = Signer("worker", Ed25519PrivateKey.from_private_bytes(rng.randbytes(32))).private_pem().decode()
    return Settings(home=home, partitions=2, verify_signatures=False, identity_key=key, metrics_port=0,
                    worker_id="w0", session_timeout=3.0, heartbeat_interval=1.0, tick_interval_ms=250)


async def _agent(kafka: SimKafka, settings: Settings, rng: random.Random, name: str, resources: list[str],
                 until: float) -> None:
    """Take a lease on a resource, think, release it (or go silent and let it expire); again until ``until``."""
    codec, out = default_codec(), SimSender(kafka)
    inbox = SimReader(kafka)
    topic = settings.topics.agent_inbox
    mine = partition_for(name.encode(), settings.partitions)  # its inbox's partition, as the SDK reads it
    inbox.add(topic, mine, len(kafka.records(topic, mine)))
    loop, n = asyncio.get_running_loop(), 0
    while loop.time() < until:
        n += 1
        resource = rng.choice(resources)
        request = LockRequested(request_id=f"{name}-{n}", agent_id=name, resource=resource, mode="exclusive",
                                ttl_ms=rng.randrange(500, 3_000), wait_ms=rng.randrange(0, 4_000), at_ms=now_ms())
        await out.send(settings.topics.resource_commands, resource.encode(), codec.encode(request), [])
        token = await _granted(inbox, codec, name, request.request_id, deadline=loop.time() + 6)
        await asyncio.sleep(rng.uniform(0.05, 2.0))  # thinking
        if token is not None and rng.random() < 0.8:  # the others go silent: their lease expires
            release = LockReleaseRequested(request_id=f"{name}-{n}-release", agent_id=name, resource=resource,
                                           token=token, at_ms=now_ms())
            await out.send(settings.topics.resource_commands, resource.encode(), codec.encode(release), [])


async def _granted(inbox: SimReader, codec: Any, name: str, request_id: str, deadline: float) -> int | None:
    loop = asyncio.get_running_loop()
    while loop.time() < deadline:
        for record in await inbox.read(max(0.0, deadline - loop.time())):
            if record.key != name.encode():
                continue
            try:
                decided = codec.decode(record.value)
            except ContractError:
                continue
            if isinstance(decided, LockGranted) and decided.request_id == request_id:
                return decided.token
    return None


def worker_crash(seed: int) -> Outcome:
    """Six agents on three resources under two workers; one worker dies at a moment drawn from the seed
    (between batches, mid-batch, before or after its commit: wherever the schedule has it), a third starts
    later; the run goes on until every agent is done and the workers have decided everything."""
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="arbiter-sim-") as home:
        settings = settings_for(rng, Path(home))
        kafka = SimKafka(rng=rng)

        async def main() -> None:
            with seam_of(kafka):
                workers: dict[str, tuple[Worker, SimClients, asyncio.Task[None]]] = {}

                def start(name: str) -> None:
                    own = settings.model_copy(update={"worker_id": name})
                    clients = SimClients(kafka, own)
                    worker = Worker(own, clients=clients)
                    workers[name] = (worker, clients, asyncio.get_running_loop().create_task(worker.run()))

                start("w1")
                start("w2")
                await asyncio.sleep(0.5)
                agents = [asyncio.create_task(_agent(kafka, settings, random.Random(rng.random()), f"agent-{i}",
                                                     ["account:a", "account:b", "doc:c"], until=12.0))
                          for i in range(6)]
                await asyncio.sleep(rng.uniform(1.0, 8.0))
                victim = rng.choice(["w1", "w2"])
                _worker, clients, task = workers.pop(victim)
                clients.crash()
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                await asyncio.sleep(rng.uniform(0.0, 4.0))
                start("w3")
                await asyncio.gather(*agents)
                await asyncio.sleep(10)  # every lease expires, every waiter is answered
                for worker, _clients, _task in workers.values():
                    worker.stop()
                await asyncio.gather(*(task for _w, _c, task in workers.values()))

        # (A worker collects and freezes the heap after a restore; in one process with every worker and
        # agent that walks all of them each time, and changes nothing a scenario checks.)
        with mock.patch.object(worker_module, "_settle_heap", lambda: None):
            run(main())
        outcome = Outcome("worker-crash", seed, kafka, settings)
        check(outcome)
        return outcome


def log_of(kafka: SimKafka, settings: Settings) -> Log:
    """The simulated log as the audit reads a real one."""
    codec = default_codec()
    log = Log(settings.topics, source="simulation", partition_count=settings.partitions)
    for topic, partitions in kafka.topics.items():
        for records in partitions:
            for r in records:
                record: Record | None = None
                raw: bytes | None = None
                try:
                    record = codec.decode(r.value or b"")
                except ContractError:
                    raw = r.value
                log.add(Entry(topic, r.partition, r.offset, r.timestamp, r.key, record, raw, tuple(r.headers)))
    log.sort_partitions()
    return log


def check(outcome: Outcome) -> None:
    """Judge the run's log with the audit; every violation becomes a finding."""
    log = log_of(outcome.kafka, outcome.settings)

    async def judged() -> dict[str, Any]:
        return await audit(log, outcome.settings)

    report = run(judged())
    outcome.decisions = int(report.get("stats", {}).get("decisions", 0) or 0)
    outcome.findings = [f"{f['check']}: {f['message']} at {', '.join(f['where'])}"
                        for f in report["findings"] if f["severity"] == "violation"]


SCENARIOS: dict[str, Callable[[int], Outcome]] = {"worker-crash": worker_crash}
"""Every scenario by name (``./dev sim --scenario NAME``)."""
