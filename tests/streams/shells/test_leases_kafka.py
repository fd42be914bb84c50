"""Leases end to end: SDK -> broker -> worker -> broker -> SDK, with real processes."""

from __future__ import annotations

import asyncio
import random
from collections import defaultdict

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from arbiter.agents import ArbiterClient, LeaseDenied
from arbiter.agents.identities import Operator
from arbiter.edge.settings import Settings
from arbiter.processes import WorkerPool
from arbiter.schemas import (
    LockDenied,
    LockExpired,
    LockGranted,
    LockReleased,
    LockRevoked,
    Record,
    default_codec,
)

pytestmark = pytest.mark.kafka


async def read_events(settings: Settings) -> list[Record]:
    """Every event on the resource-event topic, per partition in log order."""
    codec = default_codec()
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.bootstrap, group_id=None, enable_auto_commit=False,
                                auto_offset_reset="earliest", isolation_level="read_committed")
    await consumer.start()
    try:
        tps = [TopicPartition(settings.topics.resource_events, p) for p in range(settings.partitions)]
        consumer.assign(tps)
        ends = await consumer.end_offsets(tps)
        out: list[Record] = []
        for tp in tps:
            while await consumer.position(tp) < ends[tp]:
                for messages in (await consumer.getmany(tp, timeout_ms=5000)).values():
                    out.extend(codec.decode(m.value) for m in messages)
        return out
    finally:
        await consumer.stop()


async def test_the_zombie_story(kafka_settings: Settings, worker: WorkerPool) -> None:
    async with ArbiterClient("alpha", kafka_settings) as alpha, ArbiterClient("beta", kafka_settings) as beta:
        stalled = await alpha.acquire("account:482", ttl=1.0, wait=0)  # alpha never renews: it stalls
        fresh = await beta.acquire("account:482", ttl=30, wait=20)  # queued until alpha's lease expires
        assert fresh.token == stalled.token + 1
        assert await asyncio.wait_for(stalled.wait_lost(), 10) == "expired"
        with pytest.raises(LeaseDenied) as renewal:
            await alpha.renew(stalled)
        assert renewal.value.reason == "stale_fencing_token"
        assert renewal.value.diagnostic["current"]["high_water_token"] == fresh.token
        release = await alpha.release_token("account:482", stalled.token)
        assert isinstance(release, LockDenied) and release.reason == "stale_fencing_token"
        await beta.renew(fresh)  # beta's lease is untouched
        assert not fresh.lost
        await beta.release(fresh)


async def test_context_manager_renews_in_the_background(kafka_settings: Settings, worker: WorkerPool) -> None:
    async with ArbiterClient("slow", kafka_settings) as slow, ArbiterClient("rival", kafka_settings) as rival:
        async with slow.lease("repo:services/auth", ttl=1.5) as lease:
            await asyncio.sleep(3.0)  # "thinking" for two TTLs: the renewals keep the lease alive
            assert not lease.lost
            with pytest.raises(LeaseDenied) as busy:
                await rival.acquire("repo:services/auth", wait=0)
            assert busy.value.reason == "busy"
        assert lease.lost_reason == "released"
        again = await rival.acquire("repo:services/auth", wait=0)
        assert again.token > lease.token


async def test_an_acquire_cancelled_after_its_client_closed_ends_cancelled(kafka_settings: Settings,
                                                                           worker: WorkerPool) -> None:
    """A waiting acquire whose client is closed under it, then cancelled (a program shutting down), ends
    with its CancelledError: it used to try to withdraw through the closed client and raise RuntimeError
    instead ("Task exception was never retrieved" at exit)."""
    async with ArbiterClient("closing-holder", kafka_settings) as holder, \
            ArbiterClient("closing-waiter", kafka_settings) as waiter:
        await holder.acquire("doc:closing", ttl=30)
        queued = asyncio.Event()
        waiting = asyncio.create_task(waiter.acquire("doc:closing", ttl=30, wait=60,
                                                     on_queued=lambda _event: queued.set()))
        await asyncio.wait_for(queued.wait(), 30)
        await waiter.close()
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting


async def test_revocation_reaches_the_holder_at_once(kafka_settings: Settings, worker: WorkerPool) -> None:
    async with ArbiterClient("victim", kafka_settings) as victim, victim.lease("ticket:cust_8492", ttl=30) as lease:
        # An operator's override: signed with the admin key, with a reason.
        await Operator(kafka_settings).revoke("ticket:cust_8492", "victim", "operator_says_so")
        assert await asyncio.wait_for(lease.wait_lost(), 10) == "revoked: operator_says_so"
        assert lease.lost


async def test_on_acquired_runs_before_the_body(kafka_settings: Settings, worker: WorkerPool) -> None:
    seen: list[str] = []

    async def refresh(lease: object) -> None:
        seen.append("refresh")

    async with ArbiterClient("a", kafka_settings) as client, \
            client.lease("doc:spec", ttl=10, on_acquired=refresh) as lease:
        seen.append("body")
        assert lease.resource_version == 0
    assert seen == ["refresh", "body"]


async def test_leases_acquire_in_global_order_and_release_in_reverse(
    kafka_settings: Settings, worker: WorkerPool
) -> None:
    names = ["tenant:9:billing", "account:2", "repo:x", "account:10"]
    async with ArbiterClient("orderly", kafka_settings) as client, client.leases(names, ttl=10) as held:
        assert sorted(held) == sorted(names)
    events = [e for e in await read_events(kafka_settings) if getattr(e, "agent_id", None) == "orderly"]
    grants = sorted((e for e in events if isinstance(e, LockGranted)), key=lambda e: (e.at_ms, e.resource))
    releases = [e for e in events if isinstance(e, LockReleased)]
    assert [g.resource for g in grants] == sorted(names)
    assert [r.resource for r in sorted(releases, key=lambda e: (e.at_ms, [-ord(c) for c in e.resource]))] \
        == sorted(names, reverse=True)


async def test_a_request_against_the_global_order_is_flagged(kafka_settings: Settings, worker: WorkerPool) -> None:
    async with ArbiterClient("sloppy", kafka_settings) as client:
        later = await client.acquire("zeta:1", ttl=10)
        earlier = await client.acquire("alpha:1", ttl=10)
        assert later.warnings == []
        assert earlier.warnings and "lock order" in earlier.warnings[0]


async def test_mutual_exclusion_under_load(kafka_settings: Settings, worker: WorkerPool) -> None:
    """Many agents, few resources, random TTLs, holds and stalls: the log never shows overlap."""
    resources = ["hot:1", "hot:2", "hot:3"]
    rng = random.Random(7)

    async def agent(n: int) -> None:
        async with ArbiterClient(f"agent-{n}", kafka_settings) as client:
            for _ in range(6):
                name = rng.choice(resources)
                ttl = rng.uniform(0.3, 1.5)
                try:
                    lease = await client.acquire(name, ttl=ttl, wait=8)
                except LeaseDenied:
                    continue
                stall = rng.random() < 0.25
                await asyncio.sleep(ttl * 1.5 if stall else rng.uniform(0, ttl / 2))
                await client.release(lease)

    await asyncio.gather(*(agent(n) for n in range(10)))
    events = await read_events(kafka_settings)
    live: dict[str, set[int]] = defaultdict(set)
    last: dict[str, int] = defaultdict(int)
    grants = 0
    for e in events:
        if isinstance(e, LockGranted) and e.resource in resources:
            assert not live[e.resource], f"overlapping exclusive grants on {e.resource}: {live[e.resource]}"
            assert e.token > last[e.resource], "tokens must strictly increase per resource"
            live[e.resource].add(e.token)
            last[e.resource] = e.token
            grants += 1
        elif isinstance(e, LockReleased | LockExpired | LockRevoked) and e.resource in resources:
            live[e.resource].discard(e.token)
    assert grants >= 30
    assert any(isinstance(e, LockExpired) for e in events), "some agents should have stalled past their TTL"


async def test_a_lease_granted_after_waiting_longer_than_its_ttl_is_live_on_arrival(
        kafka_settings: Settings, worker: WorkerPool) -> None:
    async with ArbiterClient("holder", kafka_settings) as holder, ArbiterClient("waiter", kafka_settings) as waiter:
        held = await holder.acquire("account:slow-queue", ttl=30, wait=0)
        queued = asyncio.Event()
        pending = asyncio.create_task(waiter.acquire("account:slow-queue", ttl=1.0, wait=20,
                                                     on_queued=lambda _q: queued.set()))
        await asyncio.wait_for(queued.wait(), 10)
        await asyncio.sleep(1.5)  # the scenario itself: the waiter queues for longer than its 1 s TTL
        await holder.release(held)
        lease = await asyncio.wait_for(pending, 10)
        assert not lease.lost, lease.lost_reason
        lease.check()  # a fresh grant is usable at once
        await waiter.release(lease)
        assert lease.lost_reason == "released"


async def test_a_lease_lost_only_by_the_local_clock_is_still_released(
        kafka_settings: Settings, worker: WorkerPool) -> None:
    async with ArbiterClient("forgetful", kafka_settings) as agent, ArbiterClient("next", kafka_settings) as other:
        lease = await agent.acquire("account:local-loss", ttl=30, wait=0)
        lease.mark_lost("ttl_elapsed_locally")  # as if the local clock ran out first
        await agent.release(lease)  # must still tell the broker
        granted = await other.acquire("account:local-loss", ttl=5, wait=0)  # free at once, not after 30 s
        assert granted.token == lease.token + 1
