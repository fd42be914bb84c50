"""Record the golden histories, or rewrite them after an intended change of decisions.

    python -m tests.golden.record [STORY ...]       run each story against a real broker
                                                     and one worker, and record it
    python -m tests.golden.record --rewrite          re-derive every history's decisions
                                                     from its own recorded commands (no broker)

A history keeps what came from outside (the agents' commands, delegation edges, saga
steps, and the clock ticks that decided something) and everything the processors
decided from them, replayed in one deterministic order (``arbiter.audit.replay.simulate``).
``tests/test_golden.py`` re-derives the decisions and fails on any difference; after an
intended change, ``--rewrite`` and commit the histories with the change, so that the
diff shows which decisions changed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
import uuid
from dataclasses import replace
from pathlib import Path

from arbiter.audit.log import Entry, Log, load_archive, write_archive
from arbiter.audit.replay import outside_inputs, simulate
from contract import LockTick, Ping
from contract.settings import Settings, Topics, load_settings

HERE = Path(__file__).resolve().parent
STORIES = {
    "zombie": "slow",
    "double-refund": "refunds",
    "ring": "ring",
    "occ-rebase": "document",
}
"""History name -> the swarm story it records (arbiter.demo.swarm)."""
PARTITIONS = 2


def golden_settings(log: Log | None = None) -> Settings:
    """The settings a history is replayed with: default topics and rules, its partition count."""
    return Settings(topics=log.topics if log else Topics(), partitions=(log.partition_count if log else None)
                    or PARTITIONS)


async def _run_story(story: str, bootstrap: str, home: Path) -> tuple[Log, Settings]:
    from agents import ArbiterClient
    from arbiter.audit.log import read_log
    from arbiter.demo import key_for_partition
    from arbiter.demo.swarm import Plan, SafeWorkspace, Tally, run_swarm
    from arbiter.processes import WorkerPool, wait_until_served
    from runtime.topics import ensure_topics
    from tools.ledger import Ledger

    run = uuid.uuid4().hex[:8]
    settings = Settings(bootstrap=bootstrap, home=home, partitions=PARTITIONS, app_id=f"golden-{run}",
                        topics=Topics(**{name: f"golden{run}.{name}" for name in Topics.model_fields}),
                        ledger_dsn=str(home / "ledger.sqlite3"))
    await ensure_topics(settings)
    plan = Plan(seed=1, speed=50, run="golden", stories=(STORIES[story],), customers=2, triage_agents=3,
                racers_per_ticket=2, slow_agents=1, drafters=3)
    ledger = Ledger(settings.ledger_url())
    ledger.add_accounts(plan.accounts())
    pool = WorkerPool(settings)
    pool.start(1)
    try:
        async with contextlib.AsyncExitStack() as stack:
            warm = await stack.enter_async_context(ArbiterClient("golden-warmup", settings))
            await wait_until_served(warm, pool, [key_for_partition(p, PARTITIONS) for p in range(PARTITIONS)])

            async def workspace(agent_id: str) -> SafeWorkspace:
                return SafeWorkspace(await stack.enter_async_context(ArbiterClient(agent_id, settings)), ledger)

            await run_swarm(plan, workspace, Tally())
        await asyncio.sleep(1.0)  # the last releases' decisions
        return await read_log(settings), settings
    finally:
        pool.stop()
        ledger.close()


def _inputs_worth_keeping(log: Log, settings: Settings) -> list[Entry]:
    """The outside inputs, minus pings and the clock ticks that decided nothing."""
    t = settings.topics
    caused = {(c.topic, c.partition, c.offset) for e in log.of(t.resource_events)
              if (c := getattr(e.record, "cause", None)) is not None}
    kept = []
    for entry in outside_inputs(log, settings):
        if isinstance(entry.record, Ping):
            continue
        if isinstance(entry.record, LockTick) and (entry.topic, entry.partition, entry.offset) not in caused:
            continue
        kept.append(entry)
    return kept


def _renamed(entries: list[Entry], source: Topics, target: Topics) -> list[Entry]:
    names = dict(zip(source.all(), target.all(), strict=True))
    return [replace(e, topic=names[e.topic]) for e in entries]


async def record(story: str, bootstrap: str) -> Path:
    """Run one story for real and write its history."""
    with tempfile.TemporaryDirectory() as home:
        log, settings = await _run_story(story, bootstrap, Path(home))
    inputs = _renamed(_inputs_worth_keeping(log, settings), settings.topics, Topics())
    log.topics = Topics()
    produced = await simulate(log, golden_settings(), outside=inputs)
    path = HERE / f"{story}.jsonl"
    write_archive(path, produced)
    return path


def rewrite(path: Path) -> bool:
    """Re-derive a history's decisions from its own inputs; True when anything changed."""
    log = load_archive(path)
    settings = golden_settings(log)
    produced = asyncio.run(simulate(log, settings, outside=outside_inputs(log, settings)))
    before = path.read_text(encoding="utf-8")
    write_archive(path, produced)
    return path.read_text(encoding="utf-8") != before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stories", nargs="*", metavar="STORY", help=f"any of: {', '.join(STORIES)} (default: all)")
    parser.add_argument("--rewrite", action="store_true", help="re-derive the recorded histories (no broker)")
    args = parser.parse_args()
    unknown = sorted(set(args.stories) - set(STORIES))
    if unknown:
        parser.error(f"unknown story {', '.join(unknown)}; choose from {', '.join(STORIES)}")
    names = args.stories or list(STORIES)
    if args.rewrite:
        for name in names:
            changed = rewrite(HERE / f"{name}.jsonl")
            print(f"{name}: {'decisions changed, see git diff' if changed else 'unchanged'}")
        return
    bootstrap = load_settings().bootstrap
    for name in names:
        print(f"{name}: recorded {asyncio.run(record(name, bootstrap))}")


if __name__ == "__main__":
    sys.exit(main())
