"""Arbiter's own worker on the simulation: seeded runs with a worker crash, judged by the audit.

The workers here are ``arbiter.streams.runtime.worker.Worker`` (not a copy) on the simulated Kafka and
virtual time; the agents take, hold, release and abandon leases; one worker dies at a moment drawn
from the seed. Every run must pass the audit; the same seed must leave the same log; and a bug planted
in the code (here by patching it for one run) must be found, each within a few seeds.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from arbiter.agents import ArbiterClient
from arbiter.edge.kafkaio import KafkaIOError
from arbiter.schemas import LockExpired, default_codec
from arbiter.sim.kafka import SimKafka, seam_of
from arbiter.sim.loop import run
from arbiter.sim.scenarios import SCENARIOS, Outcome, settings_for, worker_crash
from arbiter.sim.worker import SimClients
from arbiter.streams.cores import leases
from arbiter.streams.runtime import worker as worker_module

SEEDS = (0, 1, 2, 3, 17)
"""Seed 17 found a phantom deadlock: one decision that added and removed the same wait edge had its removal
taken for a copy (by the detector and by the audit alike)."""


def _log(outcome: Outcome) -> list[tuple[str, int, int, bytes | None, bytes | None, int]]:
    return [(topic, r.partition, r.offset, r.key, r.value, r.timestamp)
            for topic, parts in sorted(outcome.kafka.topics.items()) for records in parts for r in records]


@pytest.mark.parametrize("seed", SEEDS)
def test_a_worker_crash_at_any_moment_leaves_a_log_the_audit_passes(seed: int) -> None:
    outcome = worker_crash(seed)
    assert outcome.findings == [], f"seed {seed} (replay: ./dev sim --scenario worker-crash --seed {seed})"
    assert outcome.decisions > 0


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_one_seed_one_log(name: str) -> None:
    """Workers, agents (through the SDK too), faults and the simulated broker: one seed, one log, to the ms."""
    scenario = SCENARIOS[name]
    assert _log(scenario(7)) == _log(scenario(7))
    assert _log(scenario(7)) != _log(scenario(8))


def test_a_fencing_token_given_twice_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: the lease book forgets the token it just granted, so the next grant reuses it."""
    granted = leases._FOLD[leases.LockGranted]

    def forgetful(book: leases.LeaseBook, event: Any) -> None:
        granted(book, event)
        book.last_token = event.token - 1

    with monkeypatch.context() as patch:
        patch.setitem(leases._FOLD, leases.LockGranted, forgetful)
        found = next((seed for seed in SEEDS if worker_crash(seed).findings), None)
    assert found is not None, "the planted fencing bug went unnoticed"


def test_a_restore_that_brings_back_nothing_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: a worker taking over partitions starts them from an empty state instead of their changelog
    (the successor of a crashed worker forgets every lease and every id it decided)."""

    async def forgetful(self: worker_module.Worker, tps: set[Any]) -> int:
        self._forget(tps)
        return 0

    with monkeypatch.context() as patch:
        patch.setattr(worker_module.Worker, "_restore", forgetful)
        found = next((seed for seed in SEEDS if worker_crash(seed).findings), None)
    assert found is not None, "the planted restore bug went unnoticed"


def test_a_worker_cancelled_while_it_starts_leaves_nothing_behind(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path) -> None:
    """Found by the churn scenario: a worker whose process died while it was still starting (its task
    cancelled) left its start running, and the start's failure surfaced later, unheard of."""
    async def slow_start(self: worker_module.Worker) -> None:
        await asyncio.sleep(1.0)
        raise KafkaIOError("connecting: the broker never answered", retriable=True)

    monkeypatch.setattr(worker_module.Worker, "_start", slow_start)
    settings = settings_for(random.Random(0), tmp_path)
    kafka = SimKafka()

    async def main() -> bool:
        worker = worker_module.Worker(settings, clients=SimClients(kafka, settings))
        task = asyncio.get_running_loop().create_task(worker.run())
        await asyncio.sleep(0.1)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(2.0)  # past the moment the start would have failed
        return task.cancelled()

    assert run(main())  # (and no failure of a task left behind: ``run`` raises those)


def test_an_idle_worker_writes_nothing_for_an_hour(tmp_path: Path) -> None:
    """Idle costs nothing (the real-broker half is tests/streams/runtime/test_idle.py, over 15 s of real time):
    once a lease has expired and nothing waits on time, two workers write no record to any topic or
    changelog for an hour of virtual time, and a lease taken after it still expires on time."""
    settings = settings_for(random.Random(0), tmp_path)
    kafka = SimKafka()
    codec = default_codec()

    def written() -> int:
        return sum(len(records) for partitions in kafka.topics.values() for records in partitions)

    async def lease_expires(name: str) -> int:
        """Take a 2 s lease and let it lapse; the ms between its expiry time and the decision that expired it."""
        async with ArbiterClient(name, settings.model_copy(update={"identity_key": ""})) as client:
            lease = await client.acquire("doc:nap", ttl=2, wait=5)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60
        while loop.time() < deadline:
            for records in kafka.topics[settings.topics.resource_events]:
                for record in records:
                    event = codec.decode(record.value or b"")
                    if isinstance(event, LockExpired) and event.token == lease.token:
                        return event.at_ms - lease.expires_at_ms
            await asyncio.sleep(0.1)
        raise AssertionError("the lease never expired")

    async def main() -> tuple[int, int, int, int]:
        with seam_of(kafka):
            workers = []
            for name in ("w1", "w2"):
                own = settings.model_copy(update={"worker_id": name})
                worker = worker_module.Worker(own, clients=SimClients(kafka, own))
                workers.append((worker, asyncio.get_running_loop().create_task(worker.run())))
            await asyncio.sleep(1.0)
            late = await lease_expires("sleepy")
            await asyncio.sleep(5.0)  # the expiry's changelog and inbox copies
            before = written()
            await asyncio.sleep(3600.0)
            after = written()
            late_again = await lease_expires("sleepy-later")
            for worker, _task in workers:
                worker.stop()
            await asyncio.gather(*(task for _worker, task in workers))
            return late, before, after, late_again

    with mock.patch.object(worker_module, "_settle_heap", lambda: None):
        late, before, after, late_again = run(main())
    assert after == before, f"idle workers wrote {after - before} records in an hour"
    assert 0 <= late < 1_000 and 0 <= late_again < 1_000, (late, late_again)


@pytest.mark.parametrize(("name", "seed"), [("churn", 191), ("rebalances", 62), ("rebalances", 131),
                                            ("rebalances", 777)])
def test_the_seeds_that_found_bugs_pass(name: str, seed: int) -> None:
    """Churn 191: a detection applied by the audit where it was logged, not at its cause. Rebalances 62 and
    131: a commit a rebalance refused, carried by a next batch that never came (the worker now commits it
    once the partition is kept, and before it stops). Rebalances 777: a joiner's cancelled start cancelled
    another member's revoke mid-settle (the simulated coordinator now runs the rebalance)."""
    outcome = SCENARIOS[name](seed)
    assert outcome.findings == [], f"replay: ./dev sim --scenario {name} --seed {seed}"
