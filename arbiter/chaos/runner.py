"""One chaos run from start to finish: set up, warm up, (calm phase,) campaign, rest, audit, check.

``run_chaos`` returns the run's whole result as a JSON-friendly dict (``report`` prints it);
its ``ok`` is False when the audit failed or an invariant broke.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from arbiter.agents import ArbiterClient
from arbiter.edge.settings import Settings
from arbiter.schemas import ToolApplied
from arbiter.streams.runtime.topics import group_session_bounds

from .campaigns import CAMPAIGNS, Campaign, Check, FreezeAgent, decided_twice
from .rig import BALANCE, Broker, Rig, close_quietly, create_topics, open_broker, run_settings
from .workload import Workload

if TYPE_CHECKING:  # (the ledger is imported when a run opens it)
    from arbiter.streams.tools.ledger import Ledger

TARGET_SHARE = 0.5
"""The issue's target: during a campaign, at least this share of the calm phase's successful operations
per second."""
TARGET_P99_S = 5.0
"""The issue's target: acquire latency p99 during a campaign."""


@dataclass
class ChaosOptions:
    """What to run, and how hard."""

    campaign: str
    duration: float
    every: float
    workers: int = 3
    agents: int = 8
    seed: int = 7
    calm: bool = False
    """First run the same workload without faults for as long, on the same setup (the baseline)."""
    freeze_ttl: float = 2.0
    keep_topics: bool = False
    broker_home: Path | None = None
    private_broker: bool = False


def check_ledger(ledger: Any, log: Any, intents: dict[tuple[str, str], bool]) -> dict[str, Any]:
    """No lost and no duplicated effect: the ledger's refunds are exactly the writes the log says were
    applied (every write an agent saw applied among them), each once, and money is conserved."""
    with ledger.transaction() as cur:
        effects = {(str(r), str(i)) for r, i in cur.run(
            "SELECT resource, intent_id FROM intent_results WHERE tool = 'refund'")}
        rows = cur.run("SELECT account, intent_id, order_id FROM refunds")
    applied: dict[tuple[str, str], set[int]] = {}
    for entry in log.of(log.topics.resource_events):
        record = entry.record
        if isinstance(record, ToolApplied) and record.tool == "refund":
            applied.setdefault((record.resource, record.intent_id), set()).add(record.version)
    seen = {key for key, ok in intents.items() if ok}
    lost = sorted((set(applied) | seen) - effects)
    without_decision = sorted(effects - set(applied))
    orders = Counter(str(order) for _account, _intent, order in rows)
    duplicated = sorted({o for o, n in orders.items() if n > 1}
                        | {f"{r} {i}" for (r, i), versions in applied.items() if len(versions) > 1})
    invariants = ledger.invariants()
    ok = not lost and not without_decision and not duplicated and len(rows) == len(effects) and invariants["ok"]
    return {"ok": ok, "effects": len(effects), "applied_in_log": len(applied), "seen_applied_by_agents": len(seen),
            "writes_sent": len(intents), "lost": len(lost), "lost_examples": [" ".join(k) for k in lost[:5]],
            "without_applied_decision": len(without_decision), "duplicated": len(duplicated),
            "duplicated_examples": duplicated[:5], "money_conserved": invariants["money_conserved"]}


async def run_chaos(base: Settings, opts: ChaosOptions, configured: bool,
                    say: Callable[[str], None]) -> dict[str, Any]:
    """Run one campaign against a live setup it starts itself; the result (see the module's docstring)."""
    run = f"{opts.campaign}-{opts.seed}-{uuid.uuid4().hex[:6]}"
    broker: Broker = await asyncio.to_thread(open_broker, base, opts.campaign, configured, opts.broker_home,
                                             opts.private_broker, say)
    try:
        return await _run(base, opts, run, broker, say)
    finally:
        await asyncio.to_thread(broker.close, say)


async def _run(base: Settings, opts: ChaosOptions, run: str, broker: Broker,
               say: Callable[[str], None]) -> dict[str, Any]:
    settings = run_settings(base, run, broker.bootstrap)
    if broker.private_home is not None:
        settings = settings.model_copy(update={"replication_factor": 1})  # one node
    folder = (base.home / "chaos" / run).resolve()
    rig = Rig(settings, run, folder, say, broker=broker.killable)
    campaign: Campaign = CAMPAIGNS[opts.campaign](rig, opts.every, opts.seed)
    if isinstance(campaign, FreezeAgent):
        campaign.ttl = opts.freeze_ttl
    tag = rig.tag
    names = [f"agent-{i + 1}" for i in range(opts.agents)]
    resources = [f"account:{tag}-w{i}" for i in range(max(2 * opts.agents, 2 * settings.partitions))]
    say(f"run {run}: kafka at {settings.bootstrap}; topics arbiter.chaos.{run}.*; {opts.workers} workers, "
        f"{opts.agents} agents on {len(resources)} accounts; folder {folder}")
    topics = {"created": await create_topics(settings), "deleted": 0, "kept": bool(opts.keep_topics),
              "private_broker": bool(broker.private_home)}
    try:
        result = await _exercise(opts, rig, campaign, names, resources, say)
    finally:
        if not opts.keep_topics and not broker.private_home:
            topics["deleted"] = await _clean_up(rig, say)
    result["topics"] = topics
    result["options"]["broker"] = (
        ("private, killed and restarted" if broker.killable else "private") if broker.private_home
        else f"{broker.bootstrap}, killed and restarted (--broker-home)" if broker.killable else broker.bootstrap)
    return result


async def _clean_up(rig: Rig, say: Callable[[str], None]) -> int:
    """Delete the run's topics, once its log is archived (archived here if the run failed before)."""
    try:
        if not (rig.folder / "log.jsonl").exists():
            from arbiter.audit.log import read_log, write_archive

            write_archive(rig.folder / "log.jsonl", await read_log(rig.settings))
        return await rig.delete_topics()
    except Exception as exc:  # cleanup: never hide the run's own result or error
        say(f"could not delete the run's topics (arbiter.chaos.{rig.run}.*): {type(exc).__name__}: {exc}")
        return 0


async def _exercise(opts: ChaosOptions, rig: Rig, campaign: Campaign, names: list[str], resources: list[str],
                    say: Callable[[str], None]) -> dict[str, Any]:
    """Everything between the topics' creation and their deletion."""
    ledger = _open_ledger(opts, rig, resources)
    result: dict[str, Any] = {"campaign": opts.campaign, "run": rig.run, "folder": str(rig.folder),
                              "options": await _options(opts, rig.settings, resources)}
    timings: dict[str, float] = {}
    started = time.monotonic()
    workload = await _drive(opts, rig, campaign, names, resources, say, timings, started)
    say("workers stopped; auditing the run's whole log")
    audit_started = time.monotonic()
    log, report = await rig.audit()
    timings["audit_s"] = round(time.monotonic() - audit_started, 2)
    ledger_result = check_ledger(ledger, log, workload.intents)
    ledger.close()
    violations = sum(row["violations"] for row in report["checks"].values())
    checks = _checks(rig, campaign, log, report, ledger_result, violations)
    phases = [p.summary() for p in workload.phases]
    result.update({
        "phases": phases,
        "faults": campaign.faults,
        "campaign_rows": campaign.rows(),
        "ledger": ledger_result,
        "audit": {"verdict": report["verdict"], "messages": report["messages"], "violations": violations,
                  "decisions": report["stats"].get("decisions", 0),
                  "findings": [f"{f['check']}: {f['message']} at {', '.join(f['where'][:3])}"
                               for f in report["findings"][:10]],
                  "archive": str(rig.folder / "log.jsonl"), "html": str(rig.folder / "audit.html")},
        "checks": [c.to_dict() for c in checks],
        "timings_s": {**timings, "total": round(time.monotonic() - started, 1)},
        "workers_exited_on_their_own": rig.unexpected_exits,
        "operations_cut_short_at_the_end": workload.cut_short,
    })
    if opts.calm and len(phases) == 2:
        result["targets"] = targets(phases[0], phases[1], violations)
    result["ok"] = all(c.ok for c in checks)
    return result


def _open_ledger(opts: ChaosOptions, rig: Rig, resources: list[str]) -> Ledger:
    """The run's ledger, with an account per resource the agents write, per account a frozen agent may
    take (one per freeze cycle the run's length allows, and some to spare), and one more."""
    from arbiter.streams.tools.ledger import Ledger

    ledger = Ledger(rig.settings.ledger_url())
    accounts = [r.removeprefix("account:") for r in resources]
    accounts += [f"{rig.tag}-f{k}" for k in range(1, int(opts.duration / max(opts.freeze_ttl, 0.5)) + 10)]
    accounts += [f"{rig.tag}-x0"]
    ledger.add_accounts(dict.fromkeys(accounts, BALANCE))
    return ledger


async def _options(opts: ChaosOptions, settings: Settings, resources: list[str]) -> dict[str, Any]:
    """The run's options as the result reports them, with the session timeout the brokers accept."""
    bounds = await group_session_bounds(settings)
    session = settings.session_timeout if bounds is None else min(max(settings.session_timeout, bounds[0]), bounds[1])
    return {"duration_s": opts.duration, "every_s": opts.every, "workers": opts.workers,
            "agents": opts.agents, "accounts": len(resources), "seed": opts.seed,
            "calm_baseline": opts.calm, "partitions": settings.partitions,
            "session_timeout_s": session,
            "session_timeout_asked_s": settings.session_timeout}


async def _drive(opts: ChaosOptions, rig: Rig, campaign: Campaign, names: list[str], resources: list[str],
                 say: Callable[[str], None], timings: dict[str, float], started: float) -> Workload:
    """Start the workers and the agents, run the phases, wait until the workers have processed every input,
    and stop agents and workers (whatever happened); the workload, at rest. ``timings`` gets the phases'."""
    clients: list[ArbiterClient] = []
    try:
        rig.start_workers(opts.workers)
        enrolled = await rig.enroll({"probe": ["probe:"], **{n: [f"account:{rig.tag}-w"] for n in names},
                                     **campaign.agents()})
        for name in ["probe", *names]:
            clients.append(ArbiterClient(name, enrolled[name]))
            await clients[-1].start()
        rig.probe = clients[0]
        timings["workers_serving_s"] = round(await rig.wait_served(settled=True), 2)
        say(f"{opts.workers} workers serve every partition ({time.monotonic() - started:.1f} s after the start)")
        workload = await _phases(opts, rig, campaign, clients[1:], resources, say)
        say("agents stopped; waiting until the workers have processed every input")
        ends = await rig.input_ends()
        timings["drain_s"] = round(await rig.wait_processed(ends), 2)
    finally:
        await close_quietly(*clients)
        await asyncio.to_thread(rig.pool.stop)
    return workload


async def _phases(opts: ChaosOptions, rig: Rig, campaign: Campaign, agents: list[ArbiterClient],
                  resources: list[str], say: Callable[[str], None]) -> Workload:
    """The calm phase (asked for), then the campaign's, while workers that exit are replaced; the
    workload, stopped."""
    supervisor = asyncio.create_task(_supervise(rig))
    workload: Workload | None = None
    try:
        await campaign.setup()
        workload = campaign.workload = Workload(agents, resources, opts.seed, rig.settings.partitions)
        if opts.calm:
            say(f"calm: the workload without faults for {opts.duration:g} s")
            workload.begin("calm")
            await asyncio.sleep(opts.duration)  # the phase's length (a schedule, not a wait for a race)
        say(f"{campaign.name}: {opts.duration:g} s" + (f", a fault every {opts.every:g} s"
                                                        if campaign.name not in ("calm", "freeze-agent") else ""))
        campaign.phase = workload.begin(campaign.name)
        injector = asyncio.create_task(campaign.run())
        await asyncio.wait({injector}, timeout=opts.duration)
        campaign.stop.set()
        await injector  # a campaign's error is the run's
    finally:
        campaign.stop.set()
        if workload is not None:
            await workload.stop()
        supervisor.cancel()
        await asyncio.gather(supervisor, return_exceptions=True)
        await campaign.teardown()
    return workload


def _checks(rig: Rig, campaign: Campaign, log: Any, report: dict[str, Any], ledger_result: dict[str, Any],
            violations: int) -> list[Check]:
    """What must hold after the run: the audit passed, the ledger agrees with the log, every id was decided
    once, the campaign's own invariants, and (but for broker-restart) no worker exited on its own."""
    twice = decided_twice(log)
    checks = [
        Check("audit", report["verdict"] == "pass",
              f"{report['messages']} messages, {report['stats'].get('decisions', 0)} decisions re-derived, "
              f"{violations} violations"),
        Check("ledger: no lost or duplicated effect", ledger_result["ok"],
              f"{ledger_result['effects']} refunds = {ledger_result['applied_in_log']} applied in the log "
              f"(agents saw {ledger_result['seen_applied_by_agents']}); lost {ledger_result['lost']}, "
              f"duplicated {ledger_result['duplicated']}, "
              f"without a decision {ledger_result['without_applied_decision']}, "
              f"money conserved: {'yes' if ledger_result['money_conserved'] else 'NO'}"),
        Check("every id decided once", not twice, "yes" if not twice else f"decided twice: {twice[:5]}"),
        *campaign.verify(log),
    ]
    if campaign.name != "broker-restart":
        checks.append(Check("no worker exited on its own", not rig.unexpected_exits,
                            "; ".join(rig.unexpected_exits[:3]) or "none did"))
    return checks


def targets(calm: dict[str, Any], chaos: dict[str, Any], violations: int) -> dict[str, Any]:
    """The issue's targets for a campaign beside its calm baseline."""
    share = chaos["succeeded_per_s"] / calm["succeeded_per_s"] if calm["succeeded_per_s"] else None
    rate_share = (chaos["success_rate"] / calm["success_rate"]
                  if calm["success_rate"] and chaos["success_rate"] is not None else None)
    p99 = chaos["acquire_p99_s"]
    return {
        "succeeded_per_s_share_of_calm": None if share is None else round(share, 3),
        "success_rate_share_of_calm": None if rate_share is None else round(rate_share, 3),
        "share_target": TARGET_SHARE, "share_met": share is not None and share >= TARGET_SHARE,
        "acquire_p99_s": p99, "p99_target_s": TARGET_P99_S, "p99_met": p99 is not None and p99 <= TARGET_P99_S,
        "audit_violations": violations, "violations_met": violations == 0,
    }


async def _supervise(rig: Rig) -> None:
    """Replace workers that exit on their own, as a supervisor would, while the run goes on."""
    while True:
        rig.supervise()
        await asyncio.sleep(0.5)
