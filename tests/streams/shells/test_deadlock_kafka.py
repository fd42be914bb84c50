"""Deadlocks found and broken end to end: lock-order inversion and a delegation ring."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from pathlib import Path
from typing import Any

import pytest

from arbiter.agents import ArbiterClient, LeaseDenied, SagaAborted
from arbiter.edge.settings import Settings
from arbiter.processes import WorkerPool, wait_until_served
from arbiter.schemas import CompensationRequested, DeadlockDetected, WaitEdgeAdded, WaitEdgeRemoved
from arbiter.schemas.partitioning import key_for_partition
from arbiter.streams.runtime.topics import ensure_topics
from arbiter.streams.tools.ledger import Ledger
from tests.conftest import assert_clean_audit, fresh_postgres_schema, isolated_settings

pytestmark = pytest.mark.kafka


async def test_lock_order_inversion_is_detected_and_resolved(kafka_settings: Settings, worker: WorkerPool) -> None:
    async with ArbiterClient("alpha", kafka_settings) as alpha, ArbiterClient("beta", kafka_settings) as beta:
        a_on_x = await alpha.acquire("res:x", ttl=60, wait=0)
        b_on_y = await beta.acquire("res:y", ttl=60, wait=0)
        alpha_queued = asyncio.Event()
        alpha_wants_y = asyncio.create_task(alpha.acquire("res:y", ttl=60, wait=60,
                                                          on_queued=lambda _e: alpha_queued.set()))
        await asyncio.wait_for(alpha_queued.wait(), 30)  # alpha queues first: beta is the younger waiter
        with pytest.raises(LeaseDenied) as victim:
            await beta.acquire("res:x", ttl=60, wait=60)
        assert victim.value.reason == "deadlock_victim"
        assert victim.value.diagnostic["message"] == "Circular dependency detected with alpha. Aborting subtask."
        assert {e["waiter"] for e in victim.value.diagnostic["cycle"]} == {"alpha", "beta"}
        granted = await asyncio.wait_for(alpha_wants_y, 30)
        assert granted.token > b_on_y.token, "the waiter gets a new token; the victim's is stale"
        assert await asyncio.wait_for(b_on_y.wait_lost(), 10) == "revoked: deadlock_victim"
        assert not a_on_x.lost and alpha.deadlocks == []


async def test_the_four_agent_delegation_ring_is_broken(kafka_settings: Settings, worker: WorkerPool) -> None:
    names = ["routing", "refactoring", "testing", "documentation"]
    async with contextlib.AsyncExitStack() as stack:
        clients = {}
        for name in names:  # connected in this order: documentation is the youngest
            clients[name] = await stack.enter_async_context(ArbiterClient(name, kafka_settings))
        for name, nxt in zip(names, names[1:] + names[:1], strict=True):
            await stack.enter_async_context(clients[name].delegate(to=nxt, task=f"{name} hands off to {nxt}"))
        notice = await clients["documentation"].wait_for_deadlock(timeout=30)
        assert notice.victim == "documentation"
        assert notice.cycle == ["documentation", "routing", "refactoring", "testing"]
        assert notice.message == "Circular dependency detected with routing. Aborting subtask."
        for name in names[:3]:
            assert clients[name].deadlocks == [], f"{name} must not be told to abort"


async def test_ring_of_sagas_victim_is_compensated_and_the_others_finish(bootstrap: str, tmp_path: Path) -> None:
    names = ["routing", "refactoring", "testing", "documentation"]
    settings = isolated_settings(bootstrap, tmp_path, ledger_dsn=fresh_postgres_schema())
    await ensure_topics(settings)
    ledger = Ledger(settings.ledger_dsn)
    ledger.seed({name: 1_000 for name in names})
    pool = WorkerPool(settings)
    pool.start(1)
    ring_broken = asyncio.Event()
    results: dict[str, str] = {}
    try:
        keys = [key_for_partition(p, settings.partitions) for p in range(settings.partitions)]
        async with ArbiterClient("warmup", settings) as warm:
            await wait_until_served(warm, pool, keys)

        async def agent(client: ArbiterClient, nxt: str, all_connected: asyncio.Event) -> None:
            await all_connected.wait()
            name = client.agent_id
            try:
                async with client.saga(f"{name}-task") as saga:
                    async with saga.lease(f"account:{name}", ttl=60) as lease:
                        base = (await client.snapshot(f"account:{name}")).version
                        await saga.step(lease, "refund", {"order_id": f"{name}-order", "amount": 100},
                                        base_version=base,
                                        compensate=lambda o: ("reverse_refund", {"refund_intent_id": o.intent_id}))
                    async with saga.delegate(to=nxt, task=f"{name} waits on {nxt}"):
                        done = await asyncio.wait({asyncio.ensure_future(client.wait_for_deadlock()),
                                                   asyncio.ensure_future(ring_broken.wait())},
                                                  return_when=asyncio.FIRST_COMPLETED)
                        for task in done[1]:
                            task.cancel()
                        if client.deadlocks:
                            raise RuntimeError(client.deadlocks[-1].message)
                results[name] = "COMPLETED"
            except (SagaAborted, RuntimeError) as exc:
                results[name] = f"COMPENSATED: {exc}"
                ring_broken.set()

        async with contextlib.AsyncExitStack() as stack:
            clients = [await stack.enter_async_context(ArbiterClient(n, settings)) for n in names]
            go = asyncio.Event()
            tasks = [asyncio.create_task(agent(c, names[(i + 1) % 4], go)) for i, c in enumerate(clients)]
            go.set()
            await asyncio.wait_for(asyncio.gather(*tasks), 90)
        # The victim is the youngest on the ring: the agent whose delegation the broker appended last
        # (agents' own clocks do not count); two appended in the same millisecond are equally young,
        # and then the smaller agent id loses.
        (detection,) = [r for _o, r in await _read_edge_log(settings) if isinstance(r, DeadlockDetected)]
        victim = detection.victim
        appended: dict[str, int] = {}
        for at, r in await _read_edge_log(settings, times=True):
            if isinstance(r, WaitEdgeAdded) and r.source == "delegation":
                appended.setdefault(r.waiter, at)  # an agent's age: its earliest delegation
        assert victim == min(appended, key=lambda name: (-appended[name], name)), appended
        successor = names[(names.index(victim) + 1) % 4]
        assert results[victim].startswith(f"COMPENSATED: Circular dependency detected with {successor}"), results
        assert all(results[n] == "COMPLETED" for n in names if n != victim), results
        refunds = {r["account"]: r for r in ledger.refunds()}
        assert refunds[victim]["reversed_by"], "the victim's step was compensated"
        assert all(refunds[n]["reversed_by"] is None for n in names if n != victim)
        balances = ledger.balances()
        assert balances[victim] == 1_000 and all(balances[n] == 900 for n in names if n != victim)
        assert ledger.invariants()["ok"]
        assert detection.saga_id and detection.saga_id.startswith(f"saga:{victim}/{victim}-task:")
        from arbiter.audit.log import read_log
        from arbiter.schemas.partitioning import partition_for

        partition = partition_for(detection.saga_id.encode(), settings.partitions)
        sagas = await read_log(settings, only=[(settings.topics.saga_commands, partition)])
        aborts = [e.record for e in sagas.of(settings.topics.saga_commands)
                  if e.key == detection.saga_id.encode() and isinstance(e.record, CompensationRequested)]
        assert "deadlock-detector" in {a.requested_by for a in aborts}, "the detector starts the compensation"
        await assert_clean_audit(settings, tmp_path / "ring.log")
    finally:
        pool.stop()
        ledger.close()


async def test_sigkill_mid_compensation_still_ends_compensated_and_runs_nothing_twice(
    bootstrap: str, tmp_path: Path
) -> None:
    settings = isolated_settings(bootstrap, tmp_path, ledger_dsn=fresh_postgres_schema(), partitions=1)
    await ensure_topics(settings)
    ledger = Ledger(settings.ledger_dsn)
    ledger.seed({"a": 1_000, "b": 1_000})
    pool = WorkerPool(settings)
    # Die right after the first compensation's tool ran, before its outcome is recorded.
    pool.start(1, extra_env={"ARBITER_FAILPOINT": "crash_after_tool:saga:worker-agent/crashy:"})
    try:
        async with ArbiterClient("warmup", settings) as warm:
            await wait_until_served(warm, pool, [key_for_partition(0, 1)])
        async with ArbiterClient("worker-agent", settings) as client:

            async def run_saga() -> None:
                async with client.saga("crashy") as saga:
                    for name in ("a", "b"):
                        async with client.lease(f"account:{name}", ttl=60) as lease:
                            base = (await client.snapshot(f"account:{name}")).version
                            await saga.step(lease, "refund", {"order_id": f"o-{name}", "amount": 100},
                                            base_version=base,
                                            compensate=lambda o: ("reverse_refund",
                                                                  {"refund_intent_id": o.intent_id}))
                    raise RuntimeError("the agent gives up after two steps")

            running = asyncio.create_task(run_saga())
            crashed = pool.workers[0].proc
            await asyncio.wait_for(asyncio.to_thread(crashed.wait), 60)
            assert crashed.returncode == -9, "the failpoint should have killed the worker mid-compensation"
            pool.workers.clear()
            pool.start(1)  # recovery: the saga resumes from its changelogged state
            with pytest.raises(RuntimeError, match="gives up"):
                await asyncio.wait_for(running, 120)
        refunds = ledger.refunds()
        assert sorted(r["order_id"] for r in refunds) == ["o-a", "o-b"]
        assert all(r["reversed_by"] for r in refunds), "both steps compensated"
        undo_runs = ledger.applied("reverse_refund")
        assert len(undo_runs) == 2 and all("|undo|" in i for i in undo_runs), f"a compensation ran twice: {undo_runs}"
        assert ledger.balances()["a"] == 1_000 and ledger.balances()["b"] == 1_000
        assert ledger.invariants()["ok"]
    finally:
        pool.stop()
        ledger.close()


def _cyclic(edges: set[tuple[str, str]]) -> bool:
    """Independent of the detector: repeatedly strip nodes with no outgoing edge (Kahn)."""
    remaining = set(edges)
    while True:
        waiters = {w for w, _ in remaining}
        sinks = {h for _, h in remaining if h not in waiters}
        stripped = {(w, h) for w, h in remaining if h not in sinks}
        if stripped == remaining:
            return bool(remaining)
        remaining = stripped


async def _read_edge_log(settings: Settings, times: bool = False) -> list[tuple[int, Any]]:
    """(offset, record) of every wait-edge message; (broker append time, record) with ``times``."""
    from arbiter.audit.log import read_log
    from arbiter.schemas.partitioning import partition_for

    partition = partition_for(settings.graph_key.encode(), settings.partitions)
    log = await read_log(settings, only=[(settings.topics.wait_edges, partition)])
    return [(e.timestamp_ms if times else e.offset, e.record) for e in log.of(settings.topics.wait_edges)
            if e.record is not None]


@pytest.mark.parametrize("agents", [2, 5, 8])
async def test_random_workloads_every_cycle_broken_no_false_positive_everyone_answered(
    kafka_settings: Settings, worker: WorkerPool, agents: int
) -> None:
    rng = random.Random(agents)
    names = [f"agent-{i}" for i in range(agents)]
    resources = [f"res:{i}" for i in range(max(2, agents // 2 + 1))]
    outcomes: dict[str, str] = {}

    async def agent(client: ArbiterClient) -> None:
        me = client.agent_id
        plan = rng.sample(resources, k=min(len(resources), rng.randint(2, 3)))  # random order: inversions
        delegate_to = rng.choice([n for n in names if n != me]) if rng.random() < 0.5 else None
        try:
            async with contextlib.AsyncExitStack() as held:
                for name in plan:
                    await held.enter_async_context(client.lease(name, ttl=30, wait=15))
                    await asyncio.sleep(rng.uniform(0, 0.2))  # "thinking" while holding
                if delegate_to is not None:
                    async with client.delegate(to=delegate_to):
                        with contextlib.suppress(asyncio.TimeoutError):
                            await client.wait_for_deadlock(timeout=rng.uniform(0.2, 0.6))
                        if client.deadlocks:
                            raise LeaseDenied("deadlock_victim", {"message": client.deadlocks[-1].message})
            outcomes[me] = "finished"
        except LeaseDenied as denied:
            assert denied.reason in {"deadlock_victim", "wait_timed_out"}, denied.diagnostic
            if denied.reason == "deadlock_victim":
                assert denied.diagnostic["message"].startswith("Circular dependency detected with ")
            outcomes[me] = denied.reason

    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(ArbiterClient(n, kafka_settings)) for n in names]
        await asyncio.wait_for(asyncio.gather(*(agent(c) for c in clients)), 120)
    assert sorted(outcomes) == sorted(names), "every agent finishes or is told why it stopped"

    # Offline check over the recorded log, with an independent cycle search.
    log = await _read_edge_log(kafka_settings)
    detections: dict[int, list[DeadlockDetected]] = {}
    for _offset, record in log:
        if isinstance(record, DeadlockDetected):
            detections.setdefault(record.cause.offset, []).append(record)
    assert any(isinstance(r, WaitEdgeAdded) for _o, r in log), "the workload must have made agents wait"
    edges: dict[str, tuple[str, str]] = {}
    cancelled: set[str] = set()
    for offset, record in log:
        if isinstance(record, WaitEdgeAdded) and record.edge_id not in cancelled:
            edges[record.edge_id] = (record.waiter, record.holder)
        elif isinstance(record, WaitEdgeRemoved):
            edges.pop(record.edge_id, None)
        else:
            continue
        for detection in detections.get(offset, []):
            cycle = json.loads(detection.cycle_json)
            assert all(edges.get(e["edge_id"]) == (e["waiter"], e["holder"]) for e in cycle), \
                "no false positive: every edge of a reported cycle was present"
            for edge_id, (waiter, _holder) in list(edges.items()):
                if waiter == detection.victim:
                    cancelled.add(edge_id)
                    del edges[edge_id]
        assert not _cyclic(set(edges.values())), f"a cycle survived offset {offset}"
