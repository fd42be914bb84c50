"""``processing_guarantee="exactly_once"``: the seed stories, live, with the workers writing in Kafka transactions.

The four golden stories run at once against a real worker started under exactly_once:
zombie (leases, expiry, fencing), double refund and OCC rebase (the gateway's versions),
and the delegation ring (deadlock detection and saga compensation). The run's log must
pass the audit with no finding (the decisions the worker committed are the ones the
processors' code re-derives, and no safety rule is broken), every decision must be
re-derived identically, and each story must turn out as its golden history does.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest

from arbiter.audit.log import Log
from arbiter.edge.settings import Settings
from tests.conftest import isolated_settings
from tests.golden.record import OUTCOMES, STORIES, audit_problems, first_difference, golden_plan, run_live

pytestmark = pytest.mark.kafka

SPEED = 50.0
"""As fast as the golden recordings: a transaction commits with every batch, so answers are as
prompt as under at_least_once."""


@pytest.fixture(scope="module")
def run(bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Log, Settings]]:
    """One live run of all four stories under exactly_once (about 15 s with the worker's start)."""
    home: Path = tmp_path_factory.mktemp("exactly-once")
    settings = isolated_settings(bootstrap, home, processing_guarantee="exactly_once",
                                 ledger_dsn=str(home / "ledger.sqlite3"))
    yield asyncio.run(run_live(settings, golden_plan(STORIES, speed=SPEED))), settings


def _marker_gaps(log: Log, topic: str) -> int:
    """How many times a partition's offsets jump: a transaction's commit marker takes an offset."""
    return sum(b.offset - a.offset > 1 for (name, _p), entries in log.partitions.items() if name == topic
               for a, b in itertools.pairwise(entries))


def test_the_worker_ran_under_exactly_once(run: tuple[Log, Settings]) -> None:
    """Its clock ticks and the commands it sends itself are written in transactions: commit markers."""
    log, settings = run
    assert _marker_gaps(log, settings.topics.resource_commands) > 0, "no transaction commit marker at all"


async def test_the_decisions_are_written_in_the_transactions(run: tuple[Log, Settings]) -> None:
    """Each batch's decisions, dead letters and state go out in the transaction that commits its
    offsets (faust's runtime wrote them outside it: its TransactionManager found a transaction only
    for topics the worker consumes). A transaction ends with a commit marker, which takes an offset:
    every partition written to ends past its last record."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    log, settings = run
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.bootstrap, group_id=None)
    await consumer.start()
    try:
        for topic in (settings.topics.resource_events, settings.topics.agent_inbox, settings.topics.saga_events):
            written = {p: entries[-1].offset for (name, p), entries in log.partitions.items() if name == topic}
            assert written, f"nothing was decided onto {topic}"
            ends = await consumer.end_offsets([TopicPartition(topic, p) for p in written])
            for tp, end in ends.items():
                assert end > written[tp.partition] + 1, f"{tp.topic}[{tp.partition}] ends without a commit marker"
    finally:
        await consumer.stop()


async def test_the_log_passes_audit(run: tuple[Log, Settings]) -> None:
    log, settings = run
    problems = await audit_problems(log, settings)
    assert problems == [], "\n".join(problems)


async def test_every_decision_is_re_derived(run: tuple[Log, Settings]) -> None:
    log, settings = run
    difference = await first_difference(log, settings)
    assert difference is None, difference


@pytest.mark.parametrize("story", sorted(STORIES))
def test_the_story_turns_out_as_in_its_golden_history(run: tuple[Log, Settings], story: str) -> None:
    log, _settings = run
    OUTCOMES[story](log)
