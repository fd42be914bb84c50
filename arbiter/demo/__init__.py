"""``arbiter demo``: a live swarm of agents on shared state, with Arbiter, and (``--unsafe``) without.

Start-up: with nothing configured, the demo starts the local Kafka broker, creates
this run's own topics, starts ``--workers`` stream processors and opens an embedded
SQLite ledger; given ``--bootstrap`` and ``--ledger-dsn`` it uses those. It stops
what it started on the way out, Ctrl-C included, and audits the log it wrote (a
partial one too).

Trust: the demo is secure by default, as a deployment is. It issues each agent of the
swarm a key of its own (``Registrar.add``, signed by the home's admin key), allowed only
its story's resources, and hands it to the agent's SDK in memory; the workers issue
theirs as they start (``arbiter worker``); nothing is enrolled on first use. Mid-run a
rogue agent, mallory (``arbiter.demo.rogue``), joins with prefixes of her own and attacks
on the wire; the summary lists each attempt and how it was refused, and one that is not
refused fails the demo.

The swarm (``arbiter.demo.swarm``) uses only the public SDK. While it runs, a read-only
consumer of the run's decision topics draws the live view: leases held and queued per
resource, grants, rejections by reason, deadlocks and compensations, and progress.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
from aiokafka import AIOKafkaConsumer, TopicPartition

from arbiter.localkafka import LocalKafka, LocalKafkaError, broker_answers
from arbiter.processes import DoorProcess, WorkerPool
from contract import (
    Compensated,
    ContractError,
    DeadlockDetected,
    LockCancelled,
    LockDenied,
    LockExpired,
    LockGranted,
    LockQueued,
    LockReleased,
    LockRevoked,
    LockWaitTimedOut,
    Record,
    SagaFinished,
    ToolApplied,
    ToolRejected,
    WaitEdgeAdded,
    default_codec,
)
from contract.kafkaauth import kafka_client_options
from contract.partitioning import key_for_partition
from contract.settings import Settings, Topics
from runtime.topics import ensure_topics

# -- the live view -------------------------------------------------------------------------


@dataclass
class LiveState:
    """What the run's decisions say, folded as they arrive."""

    holders: dict[str, dict[int, str]] = field(default_factory=lambda: defaultdict(dict))
    queued: dict[str, dict[str, str]] = field(default_factory=lambda: defaultdict(dict))
    counts: Counter[str] = field(default_factory=Counter)
    rejections: Counter[str] = field(default_factory=Counter)
    victims: list[str] = field(default_factory=list)
    sagas: dict[str, str] = field(default_factory=dict)
    """Each agent's saga, by the delegation edges it sends (anyone who reads the log sees them)."""

    seen: set[tuple[str, str]] = field(default_factory=set)

    def feed(self, record: Record) -> None:
        """Fold one decision (a redelivered copy counts once)."""
        from arbiter.audit.log import identity

        if isinstance(record, LockGranted | LockQueued | DeadlockDetected | Compensated | SagaFinished | ToolApplied
                      | ToolRejected | LockDenied):
            ident = identity(record)
            if ident in self.seen:
                return
            self.seen.add(ident)
        if isinstance(record, LockGranted):
            self.counts["grants"] += 1
            if self.queued[record.resource].pop(record.request_id, None) is not None:
                self.counts["granted after waiting"] += 1
            self.holders[record.resource][record.token] = record.agent_id
        elif isinstance(record, LockQueued):
            self.queued[record.resource][record.request_id] = record.agent_id
        elif isinstance(record, LockReleased | LockExpired | LockRevoked):
            self.holders[record.resource].pop(record.token, None)
            if isinstance(record, LockExpired):
                self.counts["expired"] += 1
        elif isinstance(record, LockCancelled | LockWaitTimedOut):
            self.queued[record.resource].pop(record.request_id, None)
        elif isinstance(record, LockDenied | ToolRejected):
            self.rejections[record.reason] += 1
        elif isinstance(record, ToolApplied):
            self.counts["writes"] += 1
        elif isinstance(record, DeadlockDetected):
            self.counts["deadlocks"] += 1
            self.victims.append(record.victim)
        elif isinstance(record, Compensated):
            self.counts["compensations"] += 1
        elif isinstance(record, SagaFinished):
            self.counts[f"sagas {record.outcome.lower()}"] += 1
        elif isinstance(record, WaitEdgeAdded) and record.source == "delegation" and record.saga_id:
            self.sagas.setdefault(record.waiter, record.saga_id)

    def leases(self, agents: Iterable[str]) -> list[tuple[str, str, int]]:
        """(agent, resource, token) of each lease one of ``agents`` holds now."""
        wanted = set(agents)
        return sorted((agent, resource, token) for resource, held in self.holders.items()
                      for token, agent in held.items() if agent in wanted)

    def lines(self, done: int, total: int, elapsed: float, width: int = 30) -> list[str]:
        """The view, as lines of text."""
        filled = round(width * done / max(total, 1))
        out = [f"swarm [{'#' * filled}{'-' * (width - filled)}] {done}/{total} steps, {elapsed:5.1f} s"]
        busy = sorted(r for r in set(self.holders) | set(self.queued) if self.holders[r] or self.queued[r])
        out.append(f"leases: {sum(len(h) for h in self.holders.values())} held, "
                   f"{sum(len(q) for q in self.queued.values())} queued")
        for resource in busy[:8]:
            held = ", ".join(f"{agent} (token {token})" for token, agent in sorted(self.holders[resource].items()))
            waiting = ", ".join(sorted(self.queued[resource].values()))
            out.append(f"  {resource[:44]:<44} held by {held or '-'}" + (f"; queued: {waiting}" if waiting else ""))
        if len(busy) > 8:
            out.append(f"  ... and {len(busy) - 8} more resources")
        reasons = ", ".join(f"{reason} {n}" for reason, n in self.rejections.most_common()) or "none"
        out.append(f"grants {self.counts['grants']}, writes {self.counts['writes']}, rejections: {reasons}")
        out.append(f"deadlocks {self.counts['deadlocks']}"
                   + (f" (victim {', '.join(self.victims)})" if self.victims else "")
                   + f", compensations {self.counts['compensations']}")
        return out


async def follow(settings: Settings, state: LiveState, stop: asyncio.Event,
                 catch_up: asyncio.Event | None = None) -> None:
    """Fold the run's decision topics into ``state`` until ``stop`` (read-only, no group).

    Once ``catch_up`` is set, it reads on to the topics' end offsets as of then, and
    returns. A message that does not decode is skipped and counted; a bug in the fold
    is raised.
    """
    codec = default_codec(settings.max_message_bytes)
    t = settings.topics
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.bootstrap, group_id=None, enable_auto_commit=False,
                                **kafka_client_options(settings),
                                auto_offset_reset="earliest", fetch_max_wait_ms=100)
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for topic in (t.resource_events, t.wait_edges, t.saga_events)
               for p in range(settings.partitions)]
        consumer.assign(tps)
        ends: dict[TopicPartition, int] | None = None
        while not stop.is_set():
            if ends is None and catch_up is not None and catch_up.is_set():
                ends = await consumer.end_offsets(tps)
            if ends is not None and all([await consumer.position(tp) >= ends[tp] for tp in tps]):
                return
            batch = await consumer.getmany(timeout_ms=200)
            for messages in batch.values():
                for message in messages:
                    try:
                        record: Record = codec.decode(message.value)
                    except ContractError:
                        state.counts["messages the view could not decode"] += 1
                        continue
                    state.feed(record)
    finally:
        await consumer.stop()


class Screen:
    """Redraws the live view in place on a terminal; elsewhere prints it every few seconds."""

    def __init__(self) -> None:
        self.tty = sys.stdout.isatty()
        self.drawn = 0
        self.last_print = 0.0

    def draw(self, lines: list[str]) -> None:
        if self.tty:
            up = f"\x1b[{self.drawn}F" if self.drawn else ""
            sys.stdout.write(up + "".join(f"\x1b[2K{line}\n" for line in lines))
            sys.stdout.flush()
            self.drawn = len(lines)
        elif time.monotonic() - self.last_print >= 5:
            self.last_print = time.monotonic()
            click.echo(lines[0])


# -- the runs ------------------------------------------------------------------------------


@dataclass
class RunResult:
    """What one swarm run did to the world."""

    mode: str
    tally: Any
    invariants: dict[str, Any]
    sections: int
    drafters: int
    live: LiveState | None = None

    def corruption(self) -> dict[str, str]:
        """One line per kind of corruption (the side-by-side table's rows)."""
        counts = self.tally.counts
        lost = self.drafters - self.sections
        ring_timeouts = counts["ring: gave up after a timeout, change left half-done"]
        deadlocks = self.live.counts["deadlocks"] if self.live else 0
        raced = [order for order in self.invariants["double_refunds"] if order.startswith("order-cust_")]
        return {
            "double refunds by racing triage agents": str(len(raced)),
            "zombie refunds applied after the TTL": str(counts["slow agent: zombie refund applied"]),
            "lost updates (document sections lost)": f"{lost} of {self.drafters}",
            "delegation ring": (f"stalled {self.tally.ring_stalled_s:.1f} s until a timeout cut it; "
                                f"{ring_timeouts} change(s) left half-done" if ring_timeouts else
                                f"{deadlocks} deadlock detected, victim compensated"
                                if deadlocks and counts["ring: deadlock victim, change compensated"] else
                                "no deadlock detected" if not deadlocks else "deadlock detected, NOT compensated"),
            "money conserved": "yes" if self.invariants["money_conserved"] else "NO",
        }


WARMUP = "demo-warmup"
"""The agent that pings every partition until the workers serve them all (before the swarm starts)."""


async def _enroll(settings: Settings, name: str, allow: list[str], door: bool = False) -> Settings:
    """Issue ``name`` a key allowed ``allow`` and register it (signed by this home's admin key);
    the settings its SDK client signs with. The key is handed over in memory, as from a secret
    store: each run registers its agents in a registry of its own, and no key file is left over.
    ``door``: also a front-door credential, the API key its client hands the door (the agent's own
    key never goes there)."""
    from agents.identities import Registrar

    registrar = Registrar(settings)
    signer = await registrar.add(name, allow=allow, keep_key=False)
    update = {"identity": name, "identity_key": signer.private_pem().decode()}
    if door:
        credential, _entry = await registrar.issue_credential(name, label="demo")
        update["api_key"] = credential.api_key()
    return settings.model_copy(update=update)


async def _enroll_all(settings: Settings, agents: dict[str, list[str]], door: bool) -> dict[str, Settings]:
    return {name: await _enroll(settings, name, allow, door) for name, allow in agents.items()}


async def _safe_swarm(settings: Settings, plan: Any, pool: WorkerPool, live: LiveState, screen: Screen,
                      door_url: str | None = None) -> Any:
    from agents import ArbiterClient
    from arbiter.demo.rogue import Mallory, RogueReport
    from arbiter.demo.swarm import RING, SafeWorkspace, Tally, run_swarm
    from arbiter.processes import wait_until_served
    from tools.ledger import Ledger

    ledger = Ledger(settings.ledger_url())
    ledger.add_accounts(plan.accounts())
    tally = Tally()
    stop = asyncio.Event()
    agents: dict[str, list[str]] = plan.agents()
    async with contextlib.AsyncExitStack() as stack:
        # Every agent gets a key of its own, good only for its own story's resources; the
        # workers issue theirs as they start, meanwhile.
        warm = await stack.enter_async_context(ArbiterClient(WARMUP, await _enroll(settings, WARMUP, ["probe:"])))
        keys = [key_for_partition(p, settings.partitions) for p in range(settings.partitions)]
        enrolling, serving = await asyncio.gather(_enroll_all(settings, agents, door_url is not None),
                                                  wait_until_served(warm, pool, keys, timeout=120),
                                                  return_exceptions=True)  # both end before either is raised
        for failed in (serving, enrolling):
            if isinstance(failed, BaseException):
                raise failed
        enrolled: dict[str, Settings] = enrolling  # type: ignore[assignment]
        loop = asyncio.get_running_loop()
        opened: dict[str, asyncio.Future[ArbiterClient]] = {name: loop.create_future() for name in agents}

        def connect(agent_id: str) -> ArbiterClient:
            agent = enrolled[agent_id]
            if door_url is None:
                return ArbiterClient(agent_id, agent)
            # Through the front door, with the agent's credential (its API key), never its own key.
            return ArbiterClient(agent_id, agent, url=door_url, api_key=agent.api_key)

        async def workspace(agent_id: str) -> SafeWorkspace:
            client = await stack.enter_async_context(connect(agent_id))
            opened[agent_id].set_result(client)
            return SafeWorkspace(client, ledger)

        async def client_of(agent_id: str) -> ArbiterClient:
            return await asyncio.shield(opened[agent_id])

        account = f"account:cust_{plan.run}_0"
        mallory = Mallory(settings, client_of, held=lambda: live.leases(agents), sagas=lambda: dict(live.sagas),
                          outside=account, fallback=("triage-1", account, 1), ring_victim=RING[0])

        async def swarm_and_rogue() -> RogueReport:
            _, report = await asyncio.gather(run_swarm(plan, workspace, tally), mallory.run())
            return report

        caught_up = asyncio.Event()
        follower = asyncio.create_task(follow(settings, live, stop, caught_up))
        swarm = asyncio.create_task(swarm_and_rogue())
        started = time.monotonic()
        try:
            while not swarm.done():
                pool.check_alive()
                screen.draw(live.lines(tally.done, plan.steps(), time.monotonic() - started))
                await asyncio.wait({swarm}, timeout=0.25)
            rogue = await swarm
            # Every agent has had its answers, so their decisions are in the log: the view
            # reads up to the decision topics' end offsets as of now (a bug in it is raised).
            caught_up.set()
            try:
                await asyncio.wait_for(follower, timeout=30)
            except TimeoutError:
                raise RuntimeError("the live view did not reach the end of the decision topics within 30 s") from None
            screen.draw(live.lines(tally.done, plan.steps(), time.monotonic() - started))
        finally:
            stop.set()
            swarm.cancel()
            await asyncio.gather(swarm, follower, return_exceptions=True)
    return tally, ledger, rogue


async def _unsafe_swarm(plan: Any, ledger_path: Path) -> Any:
    from arbiter.demo.swarm import Tally, UnsafeWorkspace, run_swarm
    from tools.ledger import Ledger, register_ledger_tools
    from tools.registry import ToolRegistry

    ledger = Ledger(str(ledger_path))
    ledger.add_accounts(plan.accounts())
    registry = ToolRegistry()
    register_ledger_tools(registry, ledger)
    tally = Tally()

    async def workspace(agent_id: str) -> UnsafeWorkspace:
        return UnsafeWorkspace(agent_id, ledger, registry)

    await run_swarm(plan, workspace, tally)
    return tally, ledger


def _result(mode: str, plan: Any, tally: Any, ledger: Any, live: LiveState | None = None
            ) -> RunResult:
    found = ledger.document(plan.document)
    sections = len(found[1].get("sections", [])) if found else 0
    return RunResult(mode, tally, ledger.invariants(), sections, plan.drafters, live)


def _print_safe(result: RunResult) -> None:
    live = result.live or LiveState()
    counts, rejected = result.tally.counts, live.rejections
    rows = [
        ("fencing tokens", f"{rejected['stale_fencing_token'] + rejected['lease_not_live']} zombie writes "
                           "rejected (stale_fencing_token / lease_not_live)"),
        ("lease TTL", f"{live.counts['expired']} leases of stalled agents expired and were handed on"),
        ("optimistic versions", f"{counts['triage: double refund prevented (version_conflict)']} double refunds "
                                f"prevented, {counts['document: conflict rebased (version_conflict)']} document "
                                "conflicts rebased"),
        ("wait queues", f"{live.counts['grants']} grants, {live.counts['granted after waiting']} after waiting in "
                        "a FIFO queue"),
        ("deadlock detection", f"{live.counts['deadlocks']} cycle(s) broken"
                               + (f", victim {', '.join(live.victims)}" if live.victims else "")),
        ("sagas", f"{live.counts['compensations']} completed step(s) compensated, "
                  f"{live.counts['sagas completed']} sagas completed"),
    ]
    click.echo("what each safety mechanism caught:")
    for name, caught in rows:
        click.echo(f"  {name:<20} {caught}")
    for note in result.tally.notes[:6]:
        click.echo(f"    {note}")


def _print_side_by_side(unsafe: RunResult, safe: RunResult) -> None:
    left, right = unsafe.corruption(), safe.corruption()
    width = max(len(v) for v in [*left.values(), "without Arbiter (--unsafe)"])
    click.echo(f"  {'':<38} | {'without Arbiter (--unsafe)':<{width}} | with Arbiter")
    for row, value in left.items():
        click.echo(f"  {row:<38} | {value:<{width}} | {right[row]}")


def _print_invariants(result: RunResult) -> None:
    inv = result.invariants
    ok = inv["ok"]
    click.secho(f"ledger invariants ({result.mode}): " + ("hold" if ok else "VIOLATED") +
                f": money conserved {inv['money_conserved']}, negative balances {len(inv['negative_balances'])}, "
                f"double refunds {len(inv['double_refunds'])}", fg="green" if ok else "red")


def _print_rogue(report: Any) -> None:
    head, *rows = report.lines()
    click.secho(head, fg="green" if report.ok else "red", bold=not report.ok)
    for row in rows:
        click.secho(row, fg=None if " -> NOT REFUSED" not in row and "UNEXPECTED" not in row else "red")
    if not report.ok:
        click.secho(f"SECURITY: the rogue agent {report.agent} was not refused as she should have been "
                    f"({report.failed} of {len(report.attempts)} attempts got through "
                    "or were refused for the wrong reason): the trust boundary is broken", fg="red", bold=True)


def run_settings(settings: Settings, run: str, ledger_dsn: str | None) -> Settings:
    """This run's topics (its own registry among them), consumer group and ledger. Its agents are
    enrolled by the demo itself, never on first use (``auto_enroll`` is off)."""
    topics = Topics(**{name: f"arbiter.demo.{run}.{name}" for name in Topics.model_fields})
    folder = settings.home / "demo" / run
    folder.mkdir(parents=True, exist_ok=True)
    return settings.model_copy(update={
        "topics": topics, "app_id": f"arbiter-demo-{run}", "auto_enroll": False,
        "ledger_dsn": ledger_dsn or str((folder / "ledger.sqlite3").resolve()),
    })


def _audit_run(settings: Settings, complete: bool, html: Path) -> dict[str, Any]:
    from arbiter.audit import audit
    from arbiter.audit.html import render
    from arbiter.audit.log import read_log, write_archive

    log = asyncio.run(read_log(settings))
    write_archive(html.with_name("log.jsonl"), log)
    report = asyncio.run(audit(log, settings, complete=complete))
    html.write_text(render(report), encoding="utf-8")
    return report


@click.command()
@click.option("--workers", default=2, show_default=True, help="How many stream-processor workers to start.")
@click.option("--speed", default=4.0, show_default=True,
              help="Divide the agents' 3-30 s thinking time by this (4: a run of about a minute).")
@click.option("--seed", default=7, show_default=True, help="Seed of the agents' choices and timings.")
@click.option("--unsafe", is_flag=True, help="Also run the same swarm without Arbiter and show the corruption "
              "side by side with the safe run.")
@click.option("--ledger-dsn", envvar="ARBITER_LEDGER_DSN", help="Ledger database (postgresql://... or an SQLite "
              "path). Default: a new embedded SQLite file for this run.")
@click.option("--via-http", is_flag=True, help="Run the swarm's agents through a front door (arbiter serve, "
              "started for the run) instead of straight to Kafka.")
@click.pass_context
def demo(ctx: click.Context, workers: int, speed: float, seed: int, unsafe: bool, ledger_dsn: str | None,
         via_http: bool) -> None:
    """A swarm of simulated LLM agents on shared state, kept safe by Arbiter. Starts and stops what it needs."""
    def stop(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    # A closed terminal or a kill stops the demo like Ctrl-C does: what it started stops too.
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGHUP, stop)
    try:
        _demo(ctx, workers, speed, seed, unsafe, ledger_dsn, via_http)
    except KeyboardInterrupt:
        # Outside the swarm (start-up, the unsafe run, the audit): what was started is
        # already stopped on the way out here.
        click.echo("\ninterrupted; everything the demo started is stopped")
        sys.exit(130)


def _demo(ctx: click.Context, workers: int, speed: float, seed: int, unsafe: bool, ledger_dsn: str | None,
          via_http: bool = False) -> None:
    from arbiter.console import fail, settings_of
    from arbiter.demo.swarm import Plan

    if workers < 1 or speed <= 0:
        fail("--workers must be at least 1 and --speed above 0")
    run = f"{seed}-{uuid.uuid4().hex[:6]}"
    settings = run_settings(settings_of(ctx), run, ledger_dsn)
    folder = settings.home / "demo" / run
    html = (folder / "audit.html").resolve()

    def new_plan() -> Any:
        return Plan(seed=seed, speed=speed, run=run.replace("-", "_"))

    unsafe_result: RunResult | None = None
    if unsafe:
        click.echo(f"run {run}: the swarm WITHOUT Arbiter first (same agents, same seed, nothing checked)")
        tally, ledger = asyncio.run(_unsafe_swarm(new_plan(), folder / "unsafe-ledger.sqlite3"))
        unsafe_result = _result("without Arbiter", new_plan(), tally, ledger)
        _print_invariants(unsafe_result)
        ledger.close()
    with ExitStack() as stack:
        if not ctx.obj.get("bootstrap"):
            local = LocalKafka(settings, say=lambda m: click.echo(f"  {m}"))
            if local.pid() is None:
                click.echo("starting the local Kafka broker...")
                # Registered first: a Ctrl-C while the JVM starts must stop it too.
                stack.callback(lambda: click.echo(f"kafka: {local.down()}"))
                try:
                    click.echo(f"  {local.up()}")
                except LocalKafkaError as exc:
                    fail(str(exc), exc.log_tail)
        if not broker_answers(settings.bootstrap, options=kafka_client_options(settings)):
            fail(f"no Kafka answers at {settings.bootstrap}")
        click.echo(f"kafka at {settings.bootstrap}; run {run}: topics arbiter.demo.{run}.*, "
                   f"ledger {settings.ledger_url()}")
        asyncio.run(ensure_topics(settings))
        pool = WorkerPool(settings)

        def stop_workers() -> None:
            if pool.workers:
                pool.stop()
                click.echo("workers stopped")

        stack.callback(stop_workers)
        pool.start(workers)  # each worker registers its key in this run's registry (ensure_identity)
        plan = new_plan()
        click.echo(f"started {workers} worker(s); the swarm: {plan.triage_agents} triage agents on "
                   f"{plan.customers} customers, {plan.slow_agents} slow agents and their backups, a delegation "
                   f"ring of 4, {plan.drafters} drafters on one document (seed {seed}, speed x{speed:g})")
        door_url: str | None = None
        if via_http:
            door = DoorProcess(settings, log_dir=folder)

            def stop_door() -> None:
                door.stop()
                click.echo("front door stopped")

            stack.callback(stop_door)
            try:
                door_url = door.start().url
            except RuntimeError as exc:
                fail(f"the front door did not start: {exc}")
            click.echo(f"front door on {door_url}: the swarm's agents go through it (log {door.log})")
        live, screen = LiveState(), Screen()
        interrupted = False
        try:
            tally, ledger, rogue = asyncio.run(_safe_swarm(settings, plan, pool, live, screen, door_url))
        except KeyboardInterrupt:
            interrupted = True
            click.echo("\ninterrupted: stopping the swarm; auditing the partial log")
        except Exception as exc:  # report, then the exit stack cleans up what was started
            fail(f"demo failed: {type(exc).__name__}: {exc}")
        stop_workers()  # nothing more is decided: the audit reads a log at rest
        try:
            report = _audit_run(settings, not interrupted, html)
        except Exception as exc:
            fail(f"could not audit the run's log: {type(exc).__name__}: {exc}")
        # The rogue's forged decisions are in the log for good: the audit must name each of them under
        # `authenticated` (and nothing else may be found). Any other finding fails the run.
        expected = set() if interrupted else rogue.forged_positions()
        named = {w for f in report["findings"] if f["check"] == "authenticated" for w in f["where"]}
        rogue_findings = [f for f in report["findings"]
                          if f["check"] == "authenticated" and set(f["where"]) <= expected]
        others = [f for f in report["findings"] if f not in rogue_findings]
        verdict = not others and expected <= named
        if not interrupted:
            safe = _result("with Arbiter", plan, tally, ledger, live)
            ledger.close()
            _print_safe(safe)
            _print_invariants(safe)
            _print_rogue(rogue)
            if unsafe_result is not None:
                _print_side_by_side(unsafe_result, safe)
        stats = report["stats"]
        click.secho(f"audit of the run's log ({report['messages']} messages, {stats.get('decisions', 0)} decisions "
                    f"re-derived): " + ("PASS, no safety rule broken" if verdict else "FAIL")
                    + ("" if report["complete"] else " (partial log)"), fg="green" if verdict else "red")
        if rogue_findings:
            click.echo(f"  the audit names the rogue's {len(expected)} forged inbox message(s) under authenticated, "
                       f"as it must: {', '.join(sorted(expected))}")
        if not expected <= named:
            click.secho(f"  the audit missed forged messages at {', '.join(sorted(expected - named))}", fg="red")
        for finding in others[:10]:
            click.echo(f"  {finding['severity']}: [{finding['check']}] {finding['message']} "
                       f"at {', '.join(finding['where'])}")
        click.echo(f"audit report: {html}")
        click.echo(f"log archive: {html.with_name('log.jsonl')} (arbiter audit --log ... to audit it again)")
    if interrupted:
        sys.exit(130)
    if not verdict or not rogue.ok:
        sys.exit(1)
