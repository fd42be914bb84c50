"""Scenarios on the simulation, each a function of a seed, and the checks every run goes through.

A scenario runs Arbiter's own workers (``arbiter.sim.worker``) on the simulated Kafka with agents
acting on shared resources (some through the real SDK), with workers crashing, leaving and joining
and the broker misbehaving as the seed says, and hands back the whole log. ``check`` judges it with
the audit (replay, mutual exclusion with fencing, one outcome per request, every request answered,
every saga finished, every cycle broken) and with ``liveness`` (every input decided, every request
sent after the faults stopped answered within a bound). One seed, one run: ``./dev sim --seed S``
replays it.

To add a scenario: write a function of a seed that draws a ``Fleet`` (or runs its own ``main``, as
``worker_crash`` does) from ``random.Random(seed)`` alone, ends with ``check``, and add it to
``SCENARIOS``; ``tests/sim/`` runs every scenario for one-seed-one-log and the planted bugs.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import tempfile
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from arbiter.agents import client as client_module
from arbiter.agents.client import ArbiterClient
from arbiter.agents.errors import ArbiterTimeout, ArbiterUnavailable, LeaseDenied
from arbiter.audit.log import Entry, Log
from arbiter.audit.report import audit
from arbiter.edge.clock import now_ms
from arbiter.edge.kafkaio import KafkaIOError, TopicPartition
from arbiter.edge.settings import Settings
from arbiter.schemas import (
    ContractError,
    LockCancelled,
    LockDenied,
    LockGranted,
    LockReleaseRequested,
    LockRequested,
    LockWaitTimedOut,
    Record,
    default_codec,
)
from arbiter.schemas.identity import Signer
from arbiter.schemas.partitioning import partition_for
from arbiter.streams.runtime import worker as worker_module
from arbiter.streams.runtime.worker import Worker
from arbiter.streams.tools.ledger import Ledger

from .kafka import Faults, SimKafka, SimReader, SimSender, seam_of
from .loop import EPOCH_MS, run
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
    quiet_from_ms: int = 0
    """When the faults stopped (virtual ms since the start)."""


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
        await _send(out, settings.topics.resource_commands, resource.encode(), codec.encode(request))
        token = await _granted(inbox, codec, name, request.request_id, deadline=loop.time() + 6)
        await asyncio.sleep(rng.uniform(0.05, 2.0))  # thinking
        if token is not None and rng.random() < 0.8:  # the others go silent: their lease expires
            release = LockReleaseRequested(request_id=f"{name}-{n}-release", agent_id=name, resource=resource,
                                           token=token, at_ms=now_ms())
            await _send(out, settings.topics.resource_commands, resource.encode(), codec.encode(release))


async def _send(out: SimSender, topic: str, key: bytes, value: bytes) -> None:
    """Send, and while the broker is away try again (as a producer does, within its delivery timeout)."""
    while True:
        try:
            await out.send(topic, key, value, [])
            return
        except KafkaIOError as exc:
            if not exc.retriable:
                raise
            await asyncio.sleep(0.1)


async def _granted(inbox: SimReader, codec: Any, name: str, request_id: str, deadline: float) -> int | None:
    loop = asyncio.get_running_loop()
    while loop.time() < deadline:
        try:
            got = await inbox.read(max(0.0, deadline - loop.time()))
        except KafkaIOError:  # the broker is away: read again in a while
            await asyncio.sleep(0.1)
            continue
        for record in got:
            if record.key != name.encode():
                continue
            try:
                decided = codec.decode(record.value)
            except ContractError:
                continue
            if isinstance(decided, LockGranted) and decided.request_id == request_id:
                return decided.token
    return None


@dataclass
class Fleet:
    """What one run of a fleet does, all of it drawn from the seed before the run starts."""

    partitions: int = 2
    workers: tuple[str, ...] = ("w1", "w2")
    """The workers started at once."""
    events: tuple[tuple[float, str, str], ...] = ()
    """(virtual second, "crash" | "stop" | "start", worker): a crash dies where it stands, a stop leaves
    the group as ``arbiter worker`` does on SIGTERM, a start brings a new worker in."""
    agents: int = 6
    sdk_agents: int = 0
    """Of ``agents``, how many go through the real SDK (``arbiter.agents.ArbiterClient``) on the simulated log."""
    resources: tuple[str, ...] = ("account:a", "account:b", "doc:c")
    stories: bool = False
    """Also the main job's stories, through the SDK: refunds under a lease (a slow agent's late write is
    fenced off), two editors of one shared document (commits that conflict and rebase), and a delegation
    ring that the detector must break; the ledger is the workers' real SQLite, and must balance."""
    until: float = 12.0
    """Agents start no new request after this virtual second."""
    faults: Faults = field(default_factory=Faults)
    quiet_from: float = 0.0
    """From this virtual second on there are no more faults: every request sent after it must be answered
    within its wait plus ``ANSWER_BOUND_MS``, and every input decided by the end."""


ANSWER_BOUND_MS = 3_000
"""Once the faults stop: how long past its wait a request may go unanswered (ticks every 250 ms, a batch
in flight, a rebalance that takes a session to notice a member that left)."""


def worker_crash(seed: int) -> Outcome:
    """Six agents on three resources under two workers; one worker dies at a moment drawn from the seed
    (between batches, mid-batch, before or after its commit: wherever the schedule has it), a third starts
    later; the run goes on until every agent is done and the workers have decided everything.

    (Written before ``Fleet``, and kept as it was: its seeds replay the runs that found bugs, seed 17 among
    them, and the same draws in another order would be other runs.)"""
    rng = random.Random(seed)
    quiet_from = 0.0
    with tempfile.TemporaryDirectory(prefix="arbiter-sim-") as home:
        settings = settings_for(rng, Path(home))
        kafka = SimKafka(rng=rng)

        async def main() -> None:
            nonlocal quiet_from
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
                # the group notices the dead worker after its session (3 s), then one more rebalance
                quiet_from = asyncio.get_running_loop().time() + 2 * settings.session_timeout
                await asyncio.gather(*agents)
                await asyncio.sleep(10)  # every lease expires, every waiter is answered
                for worker, _clients, _task in workers.values():
                    worker.stop()
                await asyncio.gather(*(task for _w, _c, task in workers.values()))

        # (A worker collects and freezes the heap after a restore; in one process with every worker and
        # agent that walks all of them each time, and changes nothing a scenario checks.)
        with mock.patch.object(worker_module, "_settle_heap", lambda: None):
            run(main())
        outcome = Outcome("worker-crash", seed, kafka, settings, quiet_from_ms=round(quiet_from * 1000))
        check(outcome)
        return outcome


def churn(seed: int) -> Outcome:
    """Workers crash, leave and join at moments drawn from the seed, while the simulated broker is slow,
    sends land late and out of order or twice, readers lag, and the broker is away for a while; half the
    agents go through the real SDK. Then the faults stop, and every request must be answered in time."""
    rng = random.Random(seed)
    return run_fleet("churn", seed, rng, churn_plan(rng))


def churn_plan(rng: random.Random) -> Fleet:
    """``churn``'s plan, drawn from ``rng``."""
    partitions = rng.choice([2, 3, 4])
    first = ("w1", "w2", "w3")[:rng.choice([1, 2, 3])]
    live, events, n = list(first), [], len(first)
    at = 0.5
    for _ in range(rng.randrange(2, 6)):
        at += rng.uniform(0.3, 3.0)
        kind = rng.choice(["crash", "stop", "start"]) if live else "start"
        if kind == "start" or (len(live) == 1 and rng.random() < 0.5):
            n += 1
            events.append((at, "start", f"w{n}"))
            live.append(f"w{n}")
        if kind != "start" and live:
            events.append((at, kind, live.pop(rng.randrange(len(live)))))
    if not live:
        n += 1
        events.append((at + rng.uniform(0.0, 2.0), "start", f"w{n}"))
    outage_at = rng.uniform(1.0, 9.0)
    faults = Faults(send_delay_s=rng.choice([0.0, 0.01, 0.2]), duplicate_p=rng.choice([0.0, 0.05, 0.2]),
                    read_delay_s=rng.choice([0.0, 0.05, 0.5]), produce_s=rng.choice([0.002, 0.02, 0.1]),
                    outages=((outage_at, outage_at + rng.uniform(0.2, 3.0)),) if rng.random() < 0.5 else ())
    return Fleet(partitions=partitions, workers=first, events=tuple(events), agents=8, sdk_agents=4,
                 resources=("account:a", "account:b", "doc:c", "doc:d", "refund:e"), until=14.0,
                 faults=faults, quiet_from=max(at, outage_at + 3.0, 12.0) + 2.0)


def rebalances(seed: int) -> Outcome:
    """Workers join and leave (as a deploy rolls, or an autoscaler moves) every second or two while their
    batches take a while to be acknowledged: each rebalance lands on batches in flight."""
    rng = random.Random(seed)
    return run_fleet("rebalances", seed, rng, rebalances_plan(rng))


def rebalances_plan(rng: random.Random) -> Fleet:
    """``rebalances``'s plan, drawn from ``rng``."""
    live, events, n, at = ["w1", "w2"], [], 2, 0.5
    while at < 12.0:
        at += rng.uniform(0.3, 2.0)
        if len(live) > 1 and rng.random() < 0.5:
            events.append((at, "stop", live.pop(rng.randrange(len(live)))))
        else:
            n += 1
            events.append((at, "start", f"w{n}"))
            live.append(f"w{n}")
    return Fleet(partitions=rng.choice([2, 3, 4]), workers=("w1", "w2"), events=tuple(events), agents=8,
                 sdk_agents=2, resources=("account:a", "account:b", "doc:c", "doc:d"), until=14.0,
                 faults=Faults(produce_s=rng.choice([0.05, 0.2, 0.5]), read_delay_s=rng.choice([0.0, 0.05])),
                 quiet_from=at + 4.0)


def stories(seed: int) -> Outcome:
    """The main job's stories, all at once, under a worker crash and a join, with late, duplicated and
    slowly acknowledged sends: refunds paid under leases by agents that are sometimes too slow, editors
    rebasing on a shared document, a delegation ring, and lease agents besides."""
    rng = random.Random(seed)
    return run_fleet("stories", seed, rng, stories_plan(rng))


def stories_plan(rng: random.Random) -> Fleet:
    """``stories``'s plan, drawn from ``rng``."""
    crash_at = rng.uniform(2.0, 9.0)
    faults = Faults(send_delay_s=rng.choice([0.0, 0.05]), duplicate_p=rng.choice([0.0, 0.1]),
                    produce_s=rng.choice([0.002, 0.05, 0.2]))
    return Fleet(partitions=rng.choice([2, 3]), workers=("w1", "w2"),
                 events=((crash_at, "crash", rng.choice(["w1", "w2"])),
                         (crash_at + rng.uniform(0.5, 4.0), "start", "w3")),
                 agents=3, sdk_agents=3, resources=("account:c", "doc:d"), stories=True, until=14.0, faults=faults,
                 quiet_from=crash_at + 10.0)


ACCOUNTS = {"a": 1_000_000, "b": 1_000_000}
"""The ledger's accounts in ``stories`` (cents): refunds are paid from account:a and account:b."""


async def refunder(settings: Settings, rng: random.Random, name: str, until: float) -> None:
    """Pay refunds under a lease: acquire the account, think (sometimes past the lease), pay with the lease's
    fencing token, release. A payment after the lease ran out must be refused, not made."""
    loop, n = asyncio.get_running_loop(), 0
    async with ArbiterClient(name, settings) as client:
        while loop.time() < until:
            n += 1
            account = rng.choice(["account:a", "account:b"])
            try:
                lease = await client.acquire(account, ttl=rng.uniform(1.0, 3.0), wait=rng.uniform(1.0, 4.0))
            except (LeaseDenied, ArbiterTimeout, ArbiterUnavailable):
                await asyncio.sleep(rng.uniform(0.1, 0.5))
                continue
            await asyncio.sleep(rng.uniform(0.05, 3.5))  # thinking, sometimes too long
            with contextlib.suppress(ArbiterTimeout, ArbiterUnavailable):
                await client.execute(lease, "refund", {"order_id": f"{name}-{n}", "amount": rng.randrange(1, 500)},
                                     base_version=lease.resource_version)
            with contextlib.suppress(LeaseDenied, ArbiterTimeout, ArbiterUnavailable):
                await client.release(lease)


async def editor(settings: Settings, rng: random.Random, name: str, until: float) -> None:
    """Edit the shared document optimistically: read its version, think, commit a patch on it; on a conflict,
    read again and rebase (``commit_rebasing``)."""
    loop, n, doc = asyncio.get_running_loop(), 0, "doc:shared"
    async with ArbiterClient(name, settings) as client:

        async def replan(_outcome: Any) -> tuple[int, dict[str, Any]]:
            return (await client.snapshot(doc)).version, {name: n}

        while loop.time() < until:
            n += 1
            try:
                base = (await client.snapshot(doc)).version
                await asyncio.sleep(rng.uniform(0.05, 1.5))
                await client.commit_rebasing(doc, base, {name: n}, replan)
            except (LeaseDenied, ArbiterTimeout, ArbiterUnavailable):
                await asyncio.sleep(rng.uniform(0.1, 0.5))


async def delegator(settings: Settings, rng: random.Random, name: str, to: str, until: float) -> None:
    """One of a delegation ring: wait on the next agent until told it is the victim (or a while passes)."""
    loop = asyncio.get_running_loop()
    async with ArbiterClient(name, settings) as client:
        while loop.time() < until:
            with contextlib.suppress(TimeoutError, ArbiterTimeout, ArbiterUnavailable):
                async with client.waiting_on(to):
                    await client.wait_for_deadlock(timeout=rng.uniform(1.0, 4.0))
            await asyncio.sleep(rng.uniform(0.1, 2.0))


def ledger_balances(settings: Settings) -> list[str]:
    """Money is neither made nor lost: the accounts and payouts add up to what was put in, and every refund
    the log says was applied is in the ledger once, and no other."""
    ledger = Ledger(settings.ledger_url())
    found = []
    with ledger.transaction() as cur:
        total = sum(int(row[0]) for row in cur.run("SELECT balance FROM accounts", ()))
        refunds = [row[0] for row in cur.run("SELECT intent_id FROM refunds", ())]
    if total != sum(ACCOUNTS.values()):
        found.append(f"ledger: the accounts add up to {total}, not {sum(ACCOUNTS.values())}")
    if len(refunds) != len(set(refunds)):
        found.append("ledger: a refund was paid twice")
    return found


def agents_of(plan: Fleet, settings: Settings, rng: random.Random, until: float,
              raw: Callable[[int, random.Random], Coroutine[Any, Any, None]] | None = None
              ) -> list[Coroutine[Any, Any, None]]:
    """The agents of ``plan``, each with a random source of its own drawn from ``rng``, acting until the loop's
    time ``until``: lease agents (the first ``plan.sdk_agents`` through the SDK, the others ``raw``, or all
    through the SDK when there is no ``raw``), then the stories' agents if the plan has them."""
    agents: list[Coroutine[Any, Any, None]] = []
    for i in range(plan.agents):
        own_rng = random.Random(rng.random())
        agents.append(sdk_agent(settings, own_rng, f"agent-{i}", list(plan.resources), until)
                      if i < plan.sdk_agents or raw is None else raw(i, own_rng))
    if plan.stories:
        story_rng = random.Random(rng.random())
        agents += [refunder(settings, random.Random(story_rng.random()), f"refunder-{i}", until) for i in range(2)]
        agents += [editor(settings, random.Random(story_rng.random()), f"editor-{i}", until) for i in range(2)]
        ring = ["planner", "coder", "tester"]
        agents += [delegator(settings, random.Random(story_rng.random()), who, ring[(i + 1) % 3], until)
                   for i, who in enumerate(ring)]
    return agents


def run_fleet(name: str, seed: int, rng: random.Random, plan: Fleet) -> Outcome:
    """Run ``plan``: its workers, agents and events on the simulated Kafka; then check the log."""
    with tempfile.TemporaryDirectory(prefix="arbiter-sim-") as home:
        settings = settings_for(rng, Path(home)).model_copy(update={"partitions": plan.partitions})
        kafka = SimKafka(rng=rng, faults=plan.faults)
        ids = itertools.count()
        if plan.stories:
            Ledger(settings.ledger_url()).seed(ACCOUNTS)

        async def main() -> None:
            with seam_of(kafka):
                workers: dict[str, _Supervised] = {}
                loop = asyncio.get_running_loop()

                def start(worker_name: str) -> None:
                    workers[worker_name] = _Supervised(kafka, settings.model_copy(update={"worker_id": worker_name}))

                async def happen() -> None:
                    for at, kind, worker_name in plan.events:
                        await asyncio.sleep(max(0.0, at - loop.time()))
                        if kind == "start":
                            start(worker_name)
                        elif kind == "crash":
                            await workers.pop(worker_name).crash()
                        else:
                            await workers.pop(worker_name).stop()

                for worker_name in plan.workers:
                    start(worker_name)
                events = asyncio.create_task(happen())
                await asyncio.sleep(0.5)
                sdk = settings.model_copy(update={"identity_key": ""})  # unsigned, as verification is off

                def raw(i: int, own_rng: random.Random) -> Coroutine[Any, Any, None]:
                    return _agent(kafka, settings, own_rng, f"agent-{i}", list(plan.resources), plan.until)

                agents = [asyncio.create_task(agent) for agent in agents_of(plan, sdk, rng, plan.until, raw)]
                await events
                await asyncio.gather(*agents)
                await asyncio.sleep(max(10.0, plan.quiet_from + 10.0 - loop.time()))  # every lease expires
                await asyncio.gather(*(worker.stop() for worker in workers.values()))

        # (A worker collects and freezes the heap after a restore; in one process with every worker and
        # agent that walks all of them each time, and changes nothing a scenario checks. The SDK's
        # request ids come from the seed, so that one seed gives one log.)
        with mock.patch.object(worker_module, "_settle_heap", lambda: None), \
                mock.patch.object(client_module, "_new_id", lambda: f"{seed}-{next(ids)}"):
            run(main())
        outcome = Outcome(name, seed, kafka, settings, quiet_from_ms=round(plan.quiet_from * 1000))
        check(outcome)
        if plan.stories:
            outcome.findings += ledger_balances(settings)
        return outcome


class _Supervised:
    """A worker under a supervisor, as ``arbiter worker`` runs under systemd with Restart=on-failure: one that
    could not start (the broker away) is started again a second later, under the same name."""

    def __init__(self, kafka: SimKafka, settings: Settings) -> None:
        self.kafka, self.settings = kafka, settings
        self.worker: Worker | None = None
        self.clients: SimClients | None = None
        self.stopping = False
        self.task = asyncio.get_running_loop().create_task(self._supervise())

    async def _supervise(self) -> None:
        while not self.stopping:
            self.clients = SimClients(self.kafka, self.settings)
            self.worker = Worker(self.settings, clients=self.clients)
            await self.worker.run()
            if not self.stopping:
                await asyncio.sleep(1.0)

    async def crash(self) -> None:
        """The process dies where it stands: no revoke, no commit, no goodbye."""
        assert self.clients is not None
        self.clients.crash()
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)

    async def stop(self) -> None:
        """SIGTERM: the batch in flight commits, the worker leaves the group."""
        self.stopping = True
        if self.worker is not None:
            self.worker.stop()
        await self.task


async def sdk_agent(settings: Settings, rng: random.Random, name: str, resources: list[str], until: float) -> None:
    """``_agent`` through the real SDK, on the simulated Kafka or on a real one: acquire, think, release (or go
    silent); every refusal is an answer."""
    loop = asyncio.get_running_loop()
    async with ArbiterClient(name, settings) as client:
        while loop.time() < until:
            resource = rng.choice(resources)
            try:
                lease = await client.acquire(resource, ttl=rng.uniform(0.5, 3.0), wait=rng.uniform(0.0, 4.0))
            except (LeaseDenied, ArbiterTimeout):
                await asyncio.sleep(rng.uniform(0.05, 0.5))
                continue
            except ArbiterUnavailable:  # the broker is away: as an agent would, try again later
                await asyncio.sleep(1.0)
                continue
            await asyncio.sleep(rng.uniform(0.05, 2.0))  # thinking
            if rng.random() < 0.8:
                with contextlib.suppress(LeaseDenied, ArbiterTimeout, ArbiterUnavailable):
                    await client.release(lease)


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
    """Judge the run's log with the audit (every violation becomes a finding), then its liveness."""
    log = log_of(outcome.kafka, outcome.settings)

    async def judged() -> dict[str, Any]:
        return await audit(log, outcome.settings)

    report = run(judged())
    outcome.decisions = int(report.get("stats", {}).get("decisions", 0) or 0)
    outcome.findings = [f"{f['check']}: {f['message']} at {', '.join(f['where'])}"
                        for f in report["findings"] if f["severity"] == "violation"]
    outcome.findings += liveness(outcome)


_FINAL = (LockGranted, LockDenied, LockWaitTimedOut, LockCancelled)
"""The answers that end a request (a ``LockQueued`` is on the way to one of them)."""


def liveness(outcome: Outcome) -> list[str]:
    """``liveness_of`` the simulated log (the faults stopped ``outcome.quiet_from_ms`` after the start)."""
    kafka, settings = outcome.kafka, outcome.settings
    return liveness_of(log_of(kafka, settings), kafka.committed.get(settings.app_id, {}),
                       EPOCH_MS + outcome.quiet_from_ms if outcome.quiet_from_ms else None)


def liveness_of(log: Log, committed: dict[TopicPartition, int], quiet_from_ms: int | None) -> list[str]:
    """What the audit cannot see, as it judges decisions and not how long they took to come:

    - every input of the workers' group (each topic it ``committed`` on) is decided and committed by
      the end: no partition left short;
    - every lock request appended at or after ``quiet_from_ms`` (the faults stopped) has its final answer
      within its wait plus ``ANSWER_BOUND_MS`` (a tick that never comes, a partition nobody decides,
      would hold it longer).
    """
    found = []
    for topic in sorted({tp.topic for tp in committed}):
        for (name, partition), entries in sorted(log.partitions.items()):
            if name != topic or not entries:
                continue
            end = entries[-1].offset + 1
            at = committed.get(TopicPartition(topic, partition), 0)
            if at < end:
                found.append(f"liveness: {topic}[{partition}] is committed to {at}, and its last input is "
                             f"at {end - 1}: {len([e for e in entries if e.offset >= at])} inputs left undecided")
    if quiet_from_ms is None:
        return found
    answered = dict[str, int]()
    requests: list[tuple[LockRequested, int, str]] = []
    for entries in log.partitions.values():
        for entry in entries:
            record = entry.record
            if isinstance(record, _FINAL):
                answered.setdefault(record.request_id, entry.timestamp_ms)
            elif isinstance(record, LockRequested) and entry.timestamp_ms >= quiet_from_ms:
                requests.append((record, entry.timestamp_ms, entry.where))
    for request, sent, where in requests:
        bound = sent + request.wait_ms + ANSWER_BOUND_MS
        took = answered.get(request.request_id)
        if took is None or took > bound:
            found.append(f"liveness: request {request.request_id} ({where}, wait {request.wait_ms} ms) "
                         + (f"answered after {took - sent} ms" if took is not None else "never answered"))
    return found


PLANS: dict[str, Callable[[random.Random], Fleet]] = {"churn": churn_plan, "rebalances": rebalances_plan,
                                                      "stories": stories_plan}
"""The scenarios drawn as a ``Fleet``: what the real-broker tier runs too (tests/stories/test_scenarios_kafka.py)."""

SCENARIOS: dict[str, Callable[[int], Outcome]] = {"worker-crash": worker_crash, "churn": churn,
                                                   "rebalances": rebalances, "stories": stories}
"""Every scenario by name (``./dev sim --scenario NAME``)."""
