"""``arbiter demo``: the command, its options, and the order of the run: broker, topics, workers, swarms, audit."""

from __future__ import annotations

import asyncio
import signal
import sys
import uuid
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from arbiter.cli.audit import verdict_line
from arbiter.demo.runs import (
    RunResult,
    audit_run,
    coding_story,
    print_invariants,
    print_rogue,
    print_safe,
    print_side_by_side,
    result_of,
    run_settings,
    safe_swarm,
    unsafe_swarm,
)
from arbiter.demo.view import Screen, SwarmView
from arbiter.edge.kafkaauth import kafka_client_options
from arbiter.edge.settings import Settings
from arbiter.kafka import LocalKafka, LocalKafkaError, broker_answers
from arbiter.processes import DoorProcess, WorkerPool
from arbiter.streams.runtime.topics import delete_topics_named, ensure_topics

if TYPE_CHECKING:  # (the coding story and the rogue are imported when a run needs them)
    from arbiter.demo.coding import CodingResult
    from arbiter.demo.rogue import RogueReport


def _delete_run_topics(settings: Settings) -> None:
    """The run is archived and audited: its topics go (nothing else on the broker is touched)."""
    try:
        deleted = asyncio.run(delete_topics_named(settings, (f"{settings.topics.registry.rsplit('.', 1)[0]}.",
                                                              f"{settings.app_id}-")))
        click.echo(f"deleted the run's {deleted} topics (--keep keeps them)")
    except Exception as exc:  # the run's results are in its folder either way
        click.echo(f"could not delete the run's topics: {exc}")


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
@click.option("--keep", is_flag=True, help="Keep the run's topics (default: deleted once the log is archived and "
              "audited; the archive, ledger and report stay in the run's folder).")
@click.pass_context
def demo(ctx: click.Context, workers: int, speed: float, seed: int, unsafe: bool, ledger_dsn: str | None,
         via_http: bool, keep: bool) -> None:
    """A swarm of simulated LLM agents on shared state, kept safe by Arbiter. Starts and stops what it needs."""
    def stop(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    # A closed terminal or a kill stops the demo like Ctrl-C does: what it started stops too.
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGHUP, stop)
    try:
        _demo(ctx, workers, speed, seed, unsafe, ledger_dsn, via_http, keep)
    except KeyboardInterrupt:
        # Outside the swarm (start-up, the unsafe run, the audit): what was started is
        # already stopped on the way out here.
        click.echo("\ninterrupted; everything the demo started is stopped")
        sys.exit(130)


def _demo(ctx: click.Context, workers: int, speed: float, seed: int, unsafe: bool, ledger_dsn: str | None,
          via_http: bool = False, keep: bool = False) -> None:
    """The run in order: the unsafe swarm (asked for), Kafka and topics, workers, door, the swarm, the audit."""
    from arbiter.cli.terminal import fail, settings_of
    from arbiter.demo.swarm import Plan

    if workers < 1 or speed <= 0:
        fail("--workers must be at least 1 and --speed above 0")
    run = f"{seed}-{uuid.uuid4().hex[:6]}"
    settings = run_settings(settings_of(ctx), run, ledger_dsn)
    folder = settings.home / "demo" / run
    html = (folder / "audit.html").resolve()

    def new_plan() -> Any:
        return Plan(seed=seed, speed=speed, run=run.replace("-", "_"))

    unsafe_result, unsafe_coding = _unsafe_run(run, folder, new_plan) if unsafe else (None, None)
    with ExitStack() as stack:
        _kafka_and_topics(ctx, settings, run, stack)
        pool, stop_workers = _start_workers(settings, workers, stack)
        plan = new_plan()
        click.echo(f"started {workers} worker(s); the swarm: {plan.triage_agents} triage agents on "
                   f"{plan.customers} customers, {plan.slow_agents} slow agents and their backups, a delegation "
                   f"ring of 4, {plan.drafters} drafters on one document (seed {seed}, speed x{speed:g})")
        door_url = _start_door(settings, folder, via_http, stack)
        live, screen = SwarmView(), Screen()
        interrupted = False
        coding = None
        try:
            tally, ledger, rogue = asyncio.run(safe_swarm(settings, plan, pool, live, screen, door_url))
            coding = asyncio.run(coding_story(settings))
        except KeyboardInterrupt:
            interrupted = True
            click.echo("\ninterrupted: stopping the swarm; auditing the partial log")
        except Exception as exc:  # report, then the exit stack cleans up what was started
            fail(f"demo failed: {type(exc).__name__}: {exc}")
        stop_workers()  # nothing more is decided: the audit reads a log at rest
        try:
            report = audit_run(settings, not interrupted, html)
        except Exception as exc:
            fail(f"could not audit the run's log: {type(exc).__name__}: {exc}")
        # The rogue's forged decisions are in the log for good: the audit must name each of them as an
        # intrusion detected (and find nothing else).
        expected = set() if interrupted else rogue.forged_positions()
        judged = _Judged.of(report, expected)
        if not interrupted:
            safe = result_of("with Arbiter", plan, tally, ledger, live)
            ledger.close()
            _print_results(safe, rogue, unsafe_result, unsafe_coding, coding)
        _print_audit(report, judged, html)
        if not keep:
            stack.callback(lambda: _delete_run_topics(settings))
        click.echo(f"log archive: {html.with_name('log.jsonl')} (audit it again: arbiter audit --log "
                   f"{html.with_name('log.jsonl')}; the same verdict)")
    if interrupted:
        sys.exit(130)
    if not judged.verdict or not rogue.ok or (coding is not None and not coding.ok()):
        sys.exit(1)


def _unsafe_run(run: str, folder: Path, new_plan: Callable[[], Any]) -> tuple[RunResult, CodingResult]:
    """The swarm and the coding story without Arbiter, before anything is started: what goes wrong then."""
    click.echo(f"run {run}: the swarm WITHOUT Arbiter first (same agents, same seed, nothing checked)")
    tally, ledger = asyncio.run(unsafe_swarm(new_plan(), folder / "unsafe-ledger.sqlite3"))
    unsafe_result = result_of("without Arbiter", new_plan(), tally, ledger)
    print_invariants(unsafe_result)
    ledger.close()
    from arbiter.demo.coding import unsafe_story

    return unsafe_result, unsafe_story(folder)


def _kafka_and_topics(ctx: click.Context, settings: Settings, run: str, stack: ExitStack) -> None:
    """Start the local broker unless one was named (stopped on ``stack``'s way out), check it answers,
    and create the run's topics."""
    from arbiter.cli.terminal import fail, unreachable

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
        unreachable(settings.bootstrap)
    click.echo(f"kafka at {settings.bootstrap}; run {run}: topics arbiter.demo.{run}.*, "
               f"ledger {settings.ledger_url()}")
    asyncio.run(ensure_topics(settings))


def _start_workers(settings: Settings, workers: int, stack: ExitStack) -> tuple[WorkerPool, Callable[[], None]]:
    """Start the pool (stopped on ``stack``'s way out); the pool, and what stops it early (once)."""
    pool = WorkerPool(settings)

    def stop_workers() -> None:
        if pool.workers:
            pool.stop()
            click.echo("workers stopped")

    stack.callback(stop_workers)
    pool.start(workers)  # each worker registers its key in this run's registry (ensure_identity)
    return pool, stop_workers


def _start_door(settings: Settings, folder: Path, via_http: bool, stack: ExitStack) -> str | None:
    """Start a front door (stopped on ``stack``'s way out); the URL the swarm's agents go through (``via_http``)."""
    from arbiter.cli.terminal import fail

    # A front door: the swarm's agents go through it with --via-http; either way it serves the live console.
    door = DoorProcess(settings, log_dir=folder)

    def stop_door() -> None:
        door.stop()
        click.echo("front door stopped")

    stack.callback(stop_door)
    try:
        started: str | None = door.start().url
    except RuntimeError as exc:
        if via_http:
            fail(f"the front door did not start: {exc}")
        started = None  # (an install without arbiter[door]): the run goes on without a console
        click.echo(f"live console: not started ({exc}); 'pip install arbiter[door]' adds it, and arbiter top "
                   "shows the run in a terminal")
    door_url: str | None = None
    if via_http:
        door_url = started
        click.echo(f"front door on {door_url}: the swarm's agents go through it (log {door.log})")
    if started is not None:
        click.echo(f"live console: {started}/ (open it while the swarm runs; arbiter top shows it in a "
                   "terminal)")
    return door_url


def _print_results(safe: RunResult, rogue: RogueReport, unsafe_result: RunResult | None,
                   unsafe_coding: CodingResult | None, coding: CodingResult | None) -> None:
    """What the finished run did: the safe swarm, the rogue's attempts, the side by side, the coding story."""
    print_safe(safe)
    print_invariants(safe)
    print_rogue(rogue)
    if unsafe_result is not None:
        print_side_by_side(unsafe_result, safe)
    if coding is not None:
        from arbiter.demo.coding import describe

        for line in describe(unsafe_coding, coding):
            click.secho(line, fg=None if coding.ok() or line.startswith("  without") else "red")


@dataclass(frozen=True)
class _Judged:
    """The audit's verdict on the demo's log: the audit's own, and the intrusions it found exactly the
    rogue's forgeries."""

    expected: set[str]
    """Where the rogue put forged decisions (none when the run was interrupted)."""
    intruded: set[str]
    """Where the audit found an intrusion."""
    others: list[dict[str, Any]]
    """Every other finding."""
    verdict: bool

    @classmethod
    def of(cls, report: dict[str, Any], expected: set[str]) -> _Judged:
        """Judge ``report`` (the audit's) against the forgeries ``expected``."""
        intruded = {w for f in report["findings"] if f["severity"] == "intrusion" for w in f["where"]}
        others = [f for f in report["findings"] if f["severity"] != "intrusion"]
        verdict = report["verdict"] == "pass" and not others and intruded == expected
        return cls(expected, intruded, others, verdict)


def _print_audit(report: dict[str, Any], judged: _Judged, html: Path) -> None:
    """The audit's verdict, as 'arbiter audit' prints it, then what it found beside what the rogue staged."""
    expected, intruded = judged.expected, judged.intruded
    stats = report["stats"]
    click.secho(f"audit of the run's log ({report['messages']} messages, {stats.get('decisions', 0)} decisions "
                f"re-derived): {verdict_line(report)}" + ("" if report["complete"] else " (partial log)"),
                fg="green" if judged.verdict else "red")
    if expected and expected == intruded:
        click.echo(f"  the intrusions are the rogue's {len(expected)} forged inbox message(s), as they must be: "
                   f"{', '.join(sorted(expected))}")
    if expected - intruded:
        click.secho(f"  the audit missed forged messages at {', '.join(sorted(expected - intruded))}", fg="red")
    if intruded - expected:
        click.secho(f"  intrusions nobody staged, at {', '.join(sorted(intruded - expected))}", fg="red")
    for finding in judged.others[:10]:
        click.echo(f"  {finding['severity']}: [{finding['check']}] {finding['message']} "
                   f"at {', '.join(finding['where'])}")
    click.echo(f"audit report: {html}")
