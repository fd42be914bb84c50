"""The demo's two runs, the swarm with Arbiter and without it, and what each did to the world."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from arbiter.demo.view import Screen, SwarmView, follow, progress_line
from arbiter.edge.settings import Settings, Topics
from arbiter.processes import RunnerProcess, WorkerPool
from arbiter.schemas.partitioning import key_for_partition

if TYPE_CHECKING:  # (the SDK and the rogue are imported when a run needs them)
    from arbiter.agents import ArbiterClient
    from arbiter.demo.rogue import RogueReport

# -- the runs ------------------------------------------------------------------------------


@dataclass
class RunResult:
    """What one swarm run did to the world."""

    mode: str
    tally: Any
    invariants: dict[str, Any]
    sections: int
    drafters: int
    live: SwarmView | None = None

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
    from arbiter.agents.identities import Registrar

    registrar = Registrar(settings)
    signer = await registrar.add(name, allow=allow, keep_key=False)
    update = {"identity": name, "identity_key": signer.private_pem().decode()}
    if door:
        credential, _entry = await registrar.issue_credential(name, label="demo")
        update["api_key"] = credential.api_key()
    return settings.model_copy(update=update)


async def coding_story(settings: Settings) -> Any:
    """The coding story with Arbiter, its agents enrolled like the swarm's (allowed repo: only)."""
    from arbiter.demo.coding import make_repo, safe_story

    make_repo(settings.repositories()["demo"].path)
    from arbiter.agents.identities import Registrar
    from arbiter.schemas.identity import ROLE_RUNNER

    # The check runner an operator runs, with a key of its own handed over in memory like the agents'. The
    # demo is one user that trusts its agents: not root, its checks run as this very user (as root, nobody).
    signer = await Registrar(settings).add("demo-checks", role=ROLE_RUNNER, allow=["repo:"], keep_key=False)
    own = settings.model_copy(update={"identity": "demo-checks", "identity_key": signer.private_pem().decode()})
    runner = RunnerProcess(own, name="demo-checks", depth=2, trusted_agents=True).start()
    try:
        return await safe_story(settings, lambda name: _enroll(settings, name, ["repo:"]))
    finally:
        await asyncio.to_thread(runner.stop)


async def _enroll_all(settings: Settings, agents: dict[str, list[str]], door: bool) -> dict[str, Settings]:
    return {name: await _enroll(settings, name, allow, door) for name, allow in agents.items()}


async def _enroll_while_served(settings: Settings, agents: dict[str, list[str]], door: bool,
                               warm: ArbiterClient, pool: WorkerPool) -> dict[str, Settings]:
    """Enroll every agent while ``warm`` pings each partition until the workers serve them all; both end
    before either's failure is raised. The agents' settings, by name."""
    from arbiter.processes import wait_until_served

    keys = [key_for_partition(p, settings.partitions) for p in range(settings.partitions)]
    enrolling, serving = await asyncio.gather(_enroll_all(settings, agents, door),
                                              wait_until_served(warm, pool, keys, timeout=120),
                                              return_exceptions=True)
    if isinstance(serving, BaseException):
        raise serving
    if isinstance(enrolling, BaseException):
        raise enrolling
    return enrolling


async def safe_swarm(settings: Settings, plan: Any, pool: WorkerPool, live: SwarmView, screen: Screen,
                     door_url: str | None = None) -> Any:
    """The swarm and the rogue with Arbiter, drawn live; its tally, its ledger and the rogue's report."""
    from arbiter.agents import ArbiterClient
    from arbiter.demo.rogue import Mallory
    from arbiter.demo.swarm import RING, SafeWorkspace, Tally, run_swarm
    from arbiter.streams.tools.ledger import Ledger

    ledger = Ledger(settings.ledger_url())
    ledger.add_accounts(plan.accounts())
    tally = Tally()
    agents: dict[str, list[str]] = plan.agents()
    async with contextlib.AsyncExitStack() as stack:
        # Every agent gets a key of its own, good only for its own story's resources; the
        # workers issue theirs as they start, meanwhile.
        warm = await stack.enter_async_context(ArbiterClient(WARMUP, await _enroll(settings, WARMUP, ["probe:"])))
        enrolled = await _enroll_while_served(settings, agents, door_url is not None, warm, pool)
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

        rogue = await _draw_until_done(settings, plan, pool, live, screen, tally, swarm_and_rogue)
    return tally, ledger, rogue


async def _draw_until_done(settings: Settings, plan: Any, pool: WorkerPool, live: SwarmView, screen: Screen,
                           tally: Any, swarm_and_rogue: Callable[[], Coroutine[Any, Any, RogueReport]]) -> RogueReport:
    """Run ``swarm_and_rogue`` while the live view follows the log and is drawn (and the workers are
    checked alive); once it is done, draw the view caught up with the log. The rogue's report."""
    stop = asyncio.Event()
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
        screen.close()  # before anything else is printed: no fragment of the live view is left over
        stop.set()
        swarm.cancel()
        await asyncio.gather(swarm, follower, return_exceptions=True)
    return rogue


async def unsafe_swarm(plan: Any, ledger_path: Path) -> Any:
    from arbiter.demo.swarm import Tally, UnsafeWorkspace, run_swarm
    from arbiter.streams.tools.ledger import Ledger, register_ledger_tools
    from arbiter.streams.tools.registry import ToolRegistry

    ledger = Ledger(str(ledger_path))
    ledger.add_accounts(plan.accounts())
    registry = ToolRegistry()
    register_ledger_tools(registry, ledger)
    tally = Tally()

    async def workspace(agent_id: str) -> UnsafeWorkspace:
        return UnsafeWorkspace(agent_id, ledger, registry)

    screen, started = Screen(), time.monotonic()
    swarm = asyncio.create_task(run_swarm(plan, workspace, tally))
    try:
        while not swarm.done():
            screen.draw([progress_line("swarm without Arbiter", tally.done, plan.steps(), time.monotonic() - started)])
            await asyncio.wait({swarm}, timeout=0.25)
        await swarm
        screen.draw([progress_line("swarm without Arbiter", tally.done, plan.steps(), time.monotonic() - started)])
    finally:
        screen.close()
        swarm.cancel()
        await asyncio.gather(swarm, return_exceptions=True)
    return tally, ledger


def result_of(mode: str, plan: Any, tally: Any, ledger: Any, live: SwarmView | None = None
            ) -> RunResult:
    found = ledger.document(plan.document)
    sections = len(found[1].get("sections", [])) if found else 0
    return RunResult(mode, tally, ledger.invariants(), sections, plan.drafters, live)


def print_safe(result: RunResult) -> None:
    live = result.live or SwarmView()
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


def print_side_by_side(unsafe: RunResult, safe: RunResult) -> None:
    left, right = unsafe.corruption(), safe.corruption()
    width = max(len(v) for v in [*left.values(), "without Arbiter (--unsafe)"])
    click.echo(f"  {'':<38} | {'without Arbiter (--unsafe)':<{width}} | with Arbiter")
    for row, value in left.items():
        click.echo(f"  {row:<38} | {value:<{width}} | {right[row]}")


def print_invariants(result: RunResult) -> None:
    inv = result.invariants
    ok = inv["ok"]
    click.secho(f"ledger invariants ({result.mode}): " + ("hold" if ok else "VIOLATED") +
                f": money conserved {inv['money_conserved']}, negative balances {len(inv['negative_balances'])}, "
                f"double refunds {len(inv['double_refunds'])}", fg="green" if ok else "red")


def print_rogue(report: Any) -> None:
    head, *rows = report.lines()
    click.secho(head, fg="green" if report.ok else "red", bold=not report.ok)
    for row in rows:
        click.secho(row, fg=None if " -> NOT REFUSED" not in row and "UNEXPECTED" not in row else "red")
    if not report.ok:
        click.secho(f"SECURITY: the rogue agent {report.agent} was not refused as she should have been "
                    f"({report.failed} of {len(report.attempts)} attempts got through "
                    "or were refused for the wrong reason): the trust boundary is broken", fg="red", bold=True)


def repos_file(path: Path, repository: Path) -> Path:
    """The demo's repository configuration: ``demo`` at ``repository``, with the story's check."""
    from arbiter.demo.coding import CHECK

    path.write_text(f"[repos.demo]\npath = {json.dumps(str(repository))}\ncheck = {json.dumps(CHECK)}\n"
                    "check_timeout_seconds = 60\n")
    return path


def run_settings(settings: Settings, run: str, ledger_dsn: str | None) -> Settings:
    """This run's topics (its own registry among them), consumer group and ledger. Its agents are
    enrolled by the demo itself, never on first use (``auto_enroll`` is off). The app id, and so every
    changelog's name, starts with the run's topic prefix: ``arbiter topics delete arbiter.demo.``
    removes kept runs whole."""
    topics = Topics(**{name: f"arbiter.demo.{run}.{name}" for name in Topics.model_fields})
    folder = settings.home / "demo" / run
    folder.mkdir(parents=True, exist_ok=True)
    return settings.model_copy(update={
        "topics": topics, "app_id": f"arbiter.demo.{run}.app", "auto_enroll": False,
        "ledger_dsn": ledger_dsn or str((folder / "ledger.sqlite3").resolve()),
        # The coding story's repository (made before it runs), and its check, as an operator sets them.
        "repos": "", "repos_file": repos_file(folder / "repos.toml", (folder / "coding").resolve()),
    })


def audit_run(settings: Settings, complete: bool, html: Path) -> dict[str, Any]:
    from arbiter.audit import audit
    from arbiter.audit.html import render
    from arbiter.audit.log import read_log, write_archive

    log = asyncio.run(read_log(settings))
    write_archive(html.with_name("log.jsonl"), log)
    report = asyncio.run(audit(log, settings, complete=complete))
    html.write_text(render(report), encoding="utf-8")
    return report
