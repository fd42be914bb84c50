"""The simulation's scenarios on the real broker, for what only a broker shows.

``arbiter.sim.scenarios.PLANS`` draws a scenario's plan from a seed: which workers start, when one
crashes (SIGKILL), leaves (SIGTERM) or joins, how many agents act on which resources. The
simulation runs it on virtual time with faults of its own (``./dev sim``); here the same plan runs
with real ``arbiter worker`` processes on the real Kafka, in real time, with the agents going through
the SDK (``sdk_agent``, the simulation's own), and the same checks judge the log: the audit, then
``liveness_of`` (every input decided, every request sent once the group settled answered in time).
The broker brings its own faults: real rebalances, a real session timeout, real fetch timing.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from arbiter.agents import ArbiterClient
from arbiter.audit import audit
from arbiter.audit.log import read_log
from arbiter.edge.clock import now_ms
from arbiter.edge.kafkaio import TopicPartition, reader_for
from arbiter.processes import WorkerPool, wait_until_served
from arbiter.schemas.partitioning import key_for_partition
from arbiter.sim.scenarios import ACCOUNTS, PLANS, agents_of, ledger_balances, liveness_of
from arbiter.streams.runtime.topics import ensure_topics
from arbiter.streams.tools.ledger import Ledger
from tests.conftest import isolated_settings, settled_log

pytestmark = [pytest.mark.kafka, pytest.mark.e2e]

SESSION_S = 6.0
"""The workers' session timeout here: a crashed worker's partitions move after it."""


@pytest.mark.parametrize(("name", "seed"), [("rebalances", 3), ("stories", 1)])
async def test_a_scenario_of_the_simulation_on_the_real_broker(name: str, seed: int, bootstrap: str,
                                                              tmp_path: Path) -> None:
    plan = PLANS[name](random.Random(seed))
    settings = isolated_settings(bootstrap, tmp_path, partitions=plan.partitions, session_timeout=SESSION_S,
                                 heartbeat_interval=1.0)
    await ensure_topics(settings)
    if plan.stories:
        Ledger(settings.ledger_url()).seed(ACCOUNTS)
    pool = WorkerPool(settings)
    by_name = {}
    try:
        for worker in plan.workers:
            pool.start(1, extra_env={"ARBITER_WORKER_ID": worker})
            by_name[worker] = pool.workers[-1]
        keys = [key_for_partition(p, plan.partitions) for p in range(plan.partitions)]
        async with ArbiterClient("warmup", settings) as client:
            await wait_until_served(client, pool, keys)

        loop = asyncio.get_running_loop()
        start = loop.time()
        # Once the last event's rebalance settled (a crash is noticed after the session), the bound holds.
        last = max((at for at, _kind, _worker in plan.events), default=0.0)
        quiet_from = max(plan.quiet_from, last + SESSION_S + 6.0)
        until = quiet_from + 4.0  # and some requests are sent after it

        async def happen() -> None:
            for at, kind, worker in plan.events:
                await asyncio.sleep(max(0.0, start + at - loop.time()))
                if kind == "start":
                    pool.start(1, extra_env={"ARBITER_WORKER_ID": worker})
                    by_name[worker] = pool.workers[-1]
                elif kind == "crash":
                    by_name[worker].kill()
                else:
                    await asyncio.to_thread(by_name[worker].stop)

        agents = agents_of(plan, settings, random.Random(seed), start + until)  # all through the SDK
        quiet_ms = now_ms() + round(quiet_from * 1000)
        await asyncio.gather(happen(), *agents)
        await settled_log(settings)  # every wait answered (the workers' ticks time the last ones out)
    finally:
        await asyncio.to_thread(pool.stop)  # SIGTERM: each commits its last batch

    log = await read_log(settings)
    report = await audit(log, settings)
    problems = [f"{f['check']}: {f['message']} at {f['where']}" for f in report["findings"]]
    reader = reader_for(settings)
    await reader.start()
    try:
        committed = await reader.committed(settings.app_id, [TopicPartition(topic, p) for topic in settings.topics.all()
                                                             for p in range(plan.partitions)])
    finally:
        await reader.stop()
    problems += liveness_of(log, committed, quiet_ms)
    if plan.stories:
        problems += ledger_balances(settings)
    assert not problems, f"{name} seed {seed} on the real broker:\n" + "\n".join(problems)
    assert report["stats"]["decisions"] > 0
