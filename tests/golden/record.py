"""Record the golden histories: each seed story, run live against a real broker and a real worker.

    python -m tests.golden.record [STORY ...]

For each story: topics of its own, one ``arbiter worker`` process, the story's agents
through the public SDK (``arbiter.demo.swarm``). When the agents are done, the
recorder waits until the worker has decided every input in the log (``settle``),
reads the run's whole log and checks it BEFORE writing anything: the audit passes
with no finding at all (its determinism check: every decision the live worker made is
the one the processors' code re-derives from the recorded inputs; and no safety rule
broken), every decision, agent inbox copies included, is re-derived identically
(``first_difference``), and the story's own outcome holds (``OUTCOMES``). Only then is
the live log itself written, as an archive (``write_archive``): the commands that came
from outside, the clock's ticks, and every decision the worker made from them.

``tests/streams/shells/test_golden.py`` re-derives every decision of every history through the
processors' current code and fails on the first difference, naming it. There is no
offline rewrite: a history is only ever what a live worker decided. When a change of
decisions is intended, re-record the stories it affects with this command, against a
real broker with the changed code, and commit the histories with the change.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from arbiter.audit.log import Entry, Log, read_log, write_archive
from arbiter.edge.settings import Settings, Topics, load_settings
from arbiter.schemas import DeadLetter, LockTick, Pong, Record
from arbiter.streams.shells.pipeline import input_topics

HERE = Path(__file__).resolve().parent
STORIES = {
    "zombie": "slow",
    "double-refund": "refunds",
    "ring": "ring",
    "occ-rebase": "document",
}
"""History name -> the swarm story it records (arbiter.demo.swarm)."""
PARTITIONS = 2
SPEED = 50.0
"""The agents' think times divided by this (a story takes a few seconds)."""


def golden_settings(log: Log) -> Settings:
    """The settings a history is replayed with: its own topics and partition count (the rules
    are the ones its worker announced, kept in the log), and no trust anchor whatever the
    environment says: the histories were recorded before messages were signed, and an auditor
    with the admin's public key checks every message's signature (and finds none)."""
    return Settings(topics=log.topics, partitions=log.partition_count or PARTITIONS, home=HERE, admin_public_keys="")


def golden_plan(stories: Iterable[str], speed: float = SPEED) -> Any:
    """The swarm a history records (``stories``: history names); several stories run at once."""
    from arbiter.demo.swarm import Plan

    return Plan(seed=1, speed=speed, run="golden", stories=tuple(STORIES[name] for name in stories), customers=2,
                triage_agents=3, racers_per_ticket=2, slow_agents=1, drafters=3)


# -- running a story live ------------------------------------------------------------------


async def run_live(settings: Settings, plan: Any, workers: int = 1, settle_timeout: float = 60.0) -> Log:
    """Run ``plan``'s swarm against real workers (started and stopped here) on ``settings``' topics,
    which this creates; return the run's log once the workers have decided everything in it."""
    from arbiter.agents import ArbiterClient
    from arbiter.demo.swarm import SafeWorkspace, Tally, run_swarm
    from arbiter.processes import WorkerPool, wait_until_served
    from arbiter.schemas.partitioning import key_for_partition
    from arbiter.streams.runtime.topics import ensure_topics
    from arbiter.streams.tools.ledger import Ledger

    await ensure_topics(settings)
    ledger = Ledger(settings.ledger_url())
    ledger.add_accounts(plan.accounts())
    pool = WorkerPool(settings)
    pool.start(workers)
    try:
        async with contextlib.AsyncExitStack() as stack:
            warm = await stack.enter_async_context(ArbiterClient("golden-warmup", settings))
            keys = [key_for_partition(p, settings.partitions) for p in range(settings.partitions)]
            await wait_until_served(warm, pool, keys)

            async def workspace(agent_id: str) -> SafeWorkspace:
                return SafeWorkspace(await stack.enter_async_context(ArbiterClient(agent_id, settings)), ledger)

            await run_swarm(plan, workspace, Tally())
        return await settle(settings, settle_timeout, alive=pool.check_alive)
    except Exception as exc:
        try:  # while the workers still run: is a partition stuck behind an open transaction?
            notes = await unreadable_inputs(settings)
        except Exception as failed:
            notes = [f"(could not look for uncommitted transactions: {type(failed).__name__}: {failed})"]
        for note in notes:
            exc.add_note(note)
        raise
    finally:
        pool.stop()
        ledger.close()


async def unreadable_inputs(settings: Settings) -> list[str]:
    """Input partitions whose newest messages no reader may see, because a transaction that
    holds them has not committed: the last stable offset lags the high watermark by more
    than the few messages a worker writes between two commits."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    tps = [TopicPartition(topic, p) for topic in input_topics(settings.topics) for p in range(settings.partitions)]
    ends: dict[str, dict[TopicPartition, int]] = {}
    for isolation in ("read_committed", "read_uncommitted"):
        consumer = AIOKafkaConsumer(bootstrap_servers=settings.bootstrap, group_id=None, isolation_level=isolation)
        await consumer.start()
        try:
            ends[isolation] = await consumer.end_offsets(tps)
        finally:
            await consumer.stop()
    return [f"{tp.topic}[{tp.partition}]: offsets {ends['read_committed'][tp]} to {ends['read_uncommitted'][tp] - 1} "
            "are held by a transaction that has not committed: no worker can read them yet"
            for tp in tps if ends["read_uncommitted"][tp] - ends["read_committed"][tp] > 10]


async def settle(settings: Settings, timeout: float = 60.0, alive: Callable[[], None] | None = None) -> Log:
    """Wait until the workers have decided every input in the run's log; return the log then.

    The workers' consumer group commits an input's offset only once the decisions made
    from it are written: faust flushes its producer before it commits. (Under
    ``exactly_once`` it commits the offsets in a transaction instead, and the decisions on
    topics the worker does not read, sent outside that transaction before it, are not
    flushed first; one still in flight would show up in the audit as a finding, never
    pass unnoticed.) So when the group's committed offsets pass the last input read here,
    every decision made from those inputs is in the log. Inputs written meanwhile
    (decisions that are commands too, a compensation say) are waited for the same way;
    the clock's ticks, which never stop while a worker runs, are not. Raises
    ``TimeoutError`` naming the partitions behind.
    """
    deadline = time.monotonic() + timeout
    log = await read_log(settings)
    while True:
        targets = {(topic, partition): entries[-1].offset + 1
                   for (topic, partition), entries in log.partitions.items()
                   if topic in input_topics(settings.topics) and entries}
        await _committed_past(settings, targets, deadline, alive)
        after = await read_log(settings)
        fresh = [e for topic in input_topics(settings.topics) for e in after.of(topic)
                 if e.offset >= targets.get((e.topic, e.partition), 0) and not isinstance(e.record, LockTick)]
        if not fresh:
            return after
        log = after


async def _committed_past(settings: Settings, targets: dict[tuple[str, int], int], deadline: float,
                          alive: Callable[[], None] | None) -> None:
    """Until the workers' group has committed at least ``targets`` (bounded by ``deadline``)."""
    from aiokafka import TopicPartition
    from aiokafka.admin import AIOKafkaAdminClient

    if not targets:
        return
    tps = [TopicPartition(topic, partition) for topic, partition in sorted(targets)]
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.bootstrap)
    await admin.start()
    try:
        while True:
            if alive is not None:
                alive()
            committed = await admin.list_consumer_group_offsets(settings.app_id, partitions=tps)
            behind = {tp: committed[tp].offset if tp in committed else -1 for tp in tps
                      if (committed[tp].offset if tp in committed else -1) < targets[tp.topic, tp.partition]}
            if not behind:
                return
            if time.monotonic() > deadline:
                raise TimeoutError("the workers did not decide every input in time: " + ", ".join(
                    f"{tp.topic}[{tp.partition}] committed up to {offset}, last input at "
                    f"{targets[tp.topic, tp.partition] - 1}" for tp, offset in behind.items()))
            await asyncio.sleep(0.1)  # polling the group's offsets, not waiting for luck
    finally:
        await admin.close()


# -- checking a log -----------------------------------------------------------------------


async def audit_problems(log: Log, settings: Settings) -> list[str]:
    """Every audit finding (determinism, violations, open items), one line each; [] when clean."""
    from arbiter.audit import audit

    report = await audit(log, settings)
    problems = [f"{f['check']} ({f['severity']}): {f['message']} at {', '.join(f['where'])}"
                for f in report["findings"]]
    if report["verdict"] != "pass" and not problems:
        problems.append(f"audit verdict {report['verdict']}")
    return problems


async def first_difference(log: Log, settings: Settings) -> str | None:
    """Re-derive every decision in ``log`` through the processors' code; the first one that
    differs from the recorded one, described, or None.

    Stricter than the audit's determinism check: each input's decisions are compared on
    every topic they were written to, the agents' inbox copies included, and a decision
    without a cause (a command a processor sends, such as a compensation's intent) must be
    in the log as re-derived. Identical redelivered copies count once. Answers to pings
    are not compared: they name the worker that answered.
    """
    from arbiter.audit.replay import rederive

    _engine, decided = await rederive(log, settings)
    names = set(settings.topics.all())
    recorded: dict[tuple[str, int, int], dict[tuple[str, bytes], list[Entry]]] = defaultdict(
        lambda: defaultdict(list))
    letters: dict[tuple[str, int, int], set[tuple[str, str]]] = defaultdict(set)
    anywhere: set[tuple[str, bytes, tuple[str, str]]] = set()
    for entry in log.entries():
        record = entry.record
        if record is None:
            continue
        anywhere.add((entry.topic, entry.key or b"", _content(record)))
        if isinstance(record, DeadLetter):
            letters[record.source.topic, record.source.partition, record.source.offset].add(_content(record))
            continue
        cause = getattr(record, "cause", None)
        if cause is not None and not isinstance(record, Pong):
            recorded[cause.topic, cause.partition, cause.offset][entry.topic, entry.key or b""].append(entry)
    for source, outputs in decided:
        position = source.topic, source.partition, source.offset
        want: dict[tuple[str, bytes], list[Record]] = defaultdict(list)
        lettered = 0
        for topic, key, record in outputs:
            if isinstance(record, Pong):  # names the worker that answered: a replay is not one
                continue
            if topic not in names:  # the replay's mark of an input the processors dead-letter
                lettered += 1
            elif getattr(record, "cause", None) is None:
                if (topic, key, _content(record)) not in anywhere:
                    return (f"{source.where} ({_name(source)}): the processors now send {_show(record)} to "
                            f"{topic} (key {key!r}); the log has no such message")
            else:
                want[topic, key].append(record)
        if bool(lettered) != bool(letters.pop(position, None)):
            return (f"{source.where} ({_name(source)}): the processors now "
                    + ("dead-letter this input; the log has no letter for it" if lettered else
                       "accept this input; the log dead-lettered it"))
        got = recorded.pop(position, {})
        for topic, key in sorted(want.keys() | got.keys()):
            now = want.get((topic, key), [])
            then = _firsts(e.record for e in got.get((topic, key), []))
            if now != then:
                index = next((i for i, (a, b) in enumerate(zip(then, now, strict=False)) if a != b),
                             min(len(then), len(now)))
                a, b = then[index] if index < len(then) else None, now[index] if index < len(now) else None
                return (f"{source.where} ({_name(source)}), decision {index + 1} on {topic} (key {key!r}): "
                        f"{_fields_differing(a, b)}\n  recorded: {_show(a)}\n  now:      {_show(b)}")
    for (topic, partition, offset), groups in sorted(recorded.items()):
        entry = next(e for entries in groups.values() for e in entries)
        return (f"{entry.where}: the log records {_show(entry.record)}, caused by {topic}[{partition}]@{offset}, "
                "which the processors no longer decide (or which is not an input in the log)")
    return None


def _content(record: Record) -> tuple[str, str]:
    return type(record).__name__, json.dumps(record.model_dump(), sort_keys=True, default=repr)


def _firsts(records: Iterable[Record | None]) -> list[Record]:
    """The first copy of each record, in order (a redelivery writes a decision again)."""
    seen: set[tuple[str, str]] = set()
    out = []
    for record in records:
        if record is not None and _content(record) not in seen:
            seen.add(_content(record))
            out.append(record)
    return out


def _fields_differing(then: Record | None, now: Record | None) -> str:
    if then is None or now is None:
        return "recorded but no longer decided" if now is None else "decided now but not recorded"
    if type(then) is not type(now):
        return f"recorded {type(then).__name__}, now {type(now).__name__}"
    a, b = then.model_dump(), now.model_dump()
    return "; ".join(f"{name}: recorded {a[name]!r}, now {b[name]!r}" for name in a if a[name] != b.get(name))


def _name(entry: Entry) -> str:
    return type(entry.record).__name__ if entry.record is not None else "undecodable"


def _show(record: Record | None) -> str:
    if record is None:
        return "(nothing)"
    return f"{type(record).__name__} {json.dumps(record.model_dump(), sort_keys=True, default=repr)[:400]}"


# -- what each story must show --------------------------------------------------------------


def decisions(log: Log, kind: str, resource: str = "") -> list[dict[str, Any]]:
    """The decisions of one kind, as written on the decision topics (not the agents' inbox
    copies), each once, on resources whose name starts with ``resource``."""
    topics = (log.topics.resource_events, log.topics.wait_edges, log.topics.saga_events)
    found = [e.record for topic in topics for e in log.of(topic)
             if e.record is not None and type(e.record).__name__ == kind
             and str(getattr(e.record, "resource", "") or "").startswith(resource)]
    return [r.model_dump() for r in _firsts(found)]


def zombie_is_fenced(log: Log) -> None:
    """The stalled agent's lease expires, its late write is refused, the backup's applies."""
    vip = "account:vip_"
    expired = decisions(log, "LockExpired", vip)
    rejected = [r for r in decisions(log, "ToolRejected", vip) if r["reason"] == "stale_fencing_token"]
    applied = decisions(log, "ToolApplied", vip)
    assert [e["agent_id"] for e in expired] == ["slow-1"], expired
    assert [r["agent_id"] for r in rejected] == ["slow-1"], rejected
    assert [a["agent_id"] for a in applied] == ["backup-1"], applied


def each_order_refunded_once(log: Log) -> None:
    """Racing triage agents: one refund applied per order, the late racers refused with the refund listed."""
    customers = "account:cust_"
    refunds = [json.loads(str(a["arguments_json"]))["order_id"]
               for a in decisions(log, "ToolApplied", customers) if a["tool"] == "refund"]
    assert len(refunds) == len(set(refunds)) == 2, f"one refund applied per order: {refunds}"
    conflicts = [r for r in decisions(log, "ToolRejected", customers) if r["reason"] == "version_conflict"]
    assert conflicts, "a racer that read before the refund is refused"
    assert all("refund" in r["diagnostic_json"] for r in conflicts), "the refusal lists the refund"


def saga_name(saga_id: object) -> str:
    """The name a saga was opened with: ``saga:<agent>/<name>:<uuid>`` (or, recorded before sagas
    carried their owner, ``saga:<name>:<uuid>``)."""
    return str(saga_id).split(":")[1].rsplit("/", 1)[-1]


def ring_is_broken(log: Log) -> None:
    """The four-agent ring: one deadlock, with the whole ring in it; the victim is the youngest by the
    log's clock (its delegation was appended last); its change alone is compensated."""
    from arbiter.demo.swarm import RING

    (detection,) = decisions(log, "DeadlockDetected")
    cycle, victim = list(detection["cycle"]), detection["victim"]
    assert cycle in [list(RING[i:] + RING[:i]) for i in range(len(RING))], f"not the ring, in order: {cycle}"
    delegated = {e.record.waiter: e.timestamp_ms for e in log.of(log.topics.wait_edges)
                 if type(e.record).__name__ == "WaitEdgeAdded" and e.record.source == "delegation"}  # type: ignore[union-attr]
    assert sorted(delegated) == sorted(RING), delegated
    assert delegated[victim] == max(delegated.values()), f"victim {victim}, delegations appended at {delegated}"
    finished = {saga_name(r["saga_id"]): r["outcome"] for r in decisions(log, "SagaFinished")}
    assert finished == {f"{name}-change": "COMPENSATED" if name == victim else "COMPLETED" for name in RING}, finished
    compensated = decisions(log, "Compensated")
    assert [saga_name(c["saga_id"]) for c in compensated] == [f"{victim}-change"], compensated


def every_conflict_rebased(log: Log) -> None:
    """Three drafters on one document: they race, rebase, and all three sections are kept."""
    doc = "doc:"
    commits = [a for a in decisions(log, "ToolApplied", doc) if a["tool"] == "commit"]
    conflicts = [r for r in decisions(log, "ToolRejected", doc) if r["reason"] == "version_conflict"]
    assert [c["version"] for c in commits] == [1, 2, 3], "three drafters, three versions, nothing lost"
    assert conflicts, "the drafters raced"


OUTCOMES: dict[str, Callable[[Log], None]] = {
    "zombie": zombie_is_fenced,
    "double-refund": each_order_refunded_once,
    "ring": ring_is_broken,
    "occ-rebase": every_conflict_rebased,
}
"""History name -> what its log must show (raises ``AssertionError``). Each looks only at
its own story's resources, so they hold on a log of several stories run at once too."""


async def problems_with(log: Log, settings: Settings, stories: Iterable[str]) -> list[str]:
    """Everything wrong with a live run's log: audit findings, a re-derived decision that
    differs, a story outcome that does not hold. [] when it may become a golden history."""
    problems = await audit_problems(log, settings)
    difference = await first_difference(log, settings)
    if difference is not None:
        problems.append(f"re-derived differently: {difference}")
    for name in stories:
        try:
            OUTCOMES[name](log)
        except AssertionError as exc:
            problems.append(f"{name}: the story's outcome does not hold: {exc}")
    return problems


# -- recording ------------------------------------------------------------------------------


async def record(story: str, bootstrap: str) -> Path:
    """Run one story live and write its history, if its log passes every check."""
    run = uuid.uuid4().hex[:6]
    with tempfile.TemporaryDirectory() as home:
        settings = Settings(bootstrap=bootstrap, home=Path(home), partitions=PARTITIONS,
                            app_id=f"golden-{story}-{run}", ledger_dsn=str(Path(home) / "ledger.sqlite3"),
                            topics=Topics(**{name: f"golden.{story}.{run}.{name}" for name in Topics.model_fields}))
        log = await run_live(settings, golden_plan([story]))
    problems = await problems_with(log, golden_settings(log), [story])
    if problems:
        raise SystemExit(f"{story}: NOT recorded, the live run's log fails its checks:\n  " + "\n  ".join(problems))
    path = HERE / f"{story}.jsonl"
    write_archive(path, log)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stories", nargs="*", metavar="STORY", help=f"any of: {', '.join(STORIES)} (default: all)")
    args = parser.parse_args()
    unknown = sorted(set(args.stories) - set(STORIES))
    if unknown:
        parser.error(f"unknown story {', '.join(unknown)}; choose from {', '.join(STORIES)}")
    bootstrap = load_settings().bootstrap
    for name in args.stories or list(STORIES):
        path = asyncio.run(record(name, bootstrap))
        print(f"{name}: recorded live, audited, re-derived identically: {path}")


if __name__ == "__main__":
    sys.exit(main())
