"""The execution gateway end to end: SDK -> broker -> worker -> PostgreSQL ledger -> SDK."""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from arbiter.agents import ArbiterClient, LeaseDenied, Outcome
from arbiter.edge.settings import Settings
from arbiter.processes import WorkerPool, wait_until_served
from arbiter.schemas.partitioning import key_for_partition
from arbiter.streams.runtime.topics import ensure_topics
from arbiter.streams.tools.ledger import Ledger
from tests.conftest import assert_clean_audit, fresh_postgres_schema, isolated_settings

pytestmark = pytest.mark.kafka

ACCOUNTS = {"cust_8492": 10_000, "a": 5_000, "b": 5_000, "c": 5_000, "d": 5_000}


async def start_worker(settings: Settings, pool: WorkerPool, env: dict[str, str] | None = None) -> None:
    pool.start(1, **({"extra_env": env} if env else {}))
    keys = [key_for_partition(p, settings.partitions) for p in range(settings.partitions)]
    async with ArbiterClient("warmup", settings) as client:
        await wait_until_served(client, pool, keys)


@pytest.fixture(scope="module")
def module_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gateway")


@pytest.fixture(scope="module")
def gateway(bootstrap: str, module_tmp: Path) -> Iterator[tuple[Settings, Ledger]]:
    """One worker with a PostgreSQL ledger, shared by this module's tests (distinct resources each)."""
    settings = isolated_settings(bootstrap, module_tmp, ledger_dsn=fresh_postgres_schema())
    asyncio.run(ensure_topics(settings))
    ledger = Ledger(settings.ledger_dsn)
    ledger.seed(ACCOUNTS)
    pool = WorkerPool(settings)
    asyncio.run(start_worker(settings, pool))
    yield settings, ledger
    pool.stop()
    ledger.close()


@pytest.fixture
async def clients(gateway: tuple[Settings, Ledger]) -> AsyncIterator[dict[str, ArbiterClient]]:
    settings, _ledger = gateway
    async with ArbiterClient("alpha", settings) as alpha, ArbiterClient("beta", settings) as beta:
        yield {"alpha": alpha, "beta": beta}


async def test_both_seed_zombies_are_rejected_and_the_live_holder_writes(
    gateway: tuple[Settings, Ledger], clients: dict[str, ArbiterClient]
) -> None:
    _settings, ledger = gateway
    alpha, beta = clients["alpha"], clients["beta"]
    resource = "account:a"
    base = (await alpha.snapshot(resource)).version
    stalled = await alpha.acquire(resource, ttl=1.0, wait=0)
    fresh = await beta.acquire(resource, ttl=30, wait=20)  # granted once alpha's lease expired
    assert fresh.token == stalled.token + 1
    # The token-N-after-N+1 write:
    early = await alpha.execute(stalled, "transfer", {"to": "b", "amount": 100}, base_version=base)
    assert early.reason == "stale_fencing_token"
    assert early.diagnostic["current"]["high_water_token"] == fresh.token
    assert early.diagnostic["current"]["holder"]["agent_id"] == "beta"
    # Beta writes twice with its one token; alpha's N is refused again after N+1 wrote.
    one = await beta.execute(fresh, "transfer", {"to": "b", "amount": 100}, base_version=base)
    two = await beta.execute(fresh, "transfer", {"to": "b", "amount": 100}, base_version=base + 1)
    assert one.applied and two.applied and two.version == base + 2
    late = await alpha.execute(stalled, "transfer", {"to": "b", "amount": 100}, base_version=base + 2)
    assert late.reason == "stale_fencing_token"
    assert ledger.balances()["a"] == 5_000 - 200
    await beta.release(fresh)


async def test_a_dead_lease_cannot_write_while_nobody_newer_holds_it(
    gateway: tuple[Settings, Ledger], clients: dict[str, ArbiterClient]
) -> None:
    alpha = clients["alpha"]
    lease = await alpha.acquire("account:c", ttl=1.0, wait=0)
    assert await asyncio.wait_for(lease.wait_lost(), 10) == "expired"
    snap = await alpha.snapshot("account:c")
    assert snap.holders == [] and snap.high_water_token == lease.token
    outcome = await alpha.execute(lease, "transfer", {"to": "d", "amount": 1}, base_version=snap.version)
    assert outcome.reason == "lease_not_live"
    assert "re-acquire" in outcome.diagnostic["what_to_do"]


async def test_occ_conflict_rebases_and_the_retry_succeeds(
    gateway: tuple[Settings, Ledger], clients: dict[str, ArbiterClient]
) -> None:
    _settings, ledger = gateway
    alpha, beta = clients["alpha"], clients["beta"]
    doc = "doc:spec"
    base = (await alpha.snapshot(doc)).version
    assert (await beta.commit(doc, base, {"title": "Arbiter"})).applied
    seen: list[dict[str, Any]] = []

    async def replan(conflict: Outcome) -> tuple[int, dict[str, Any]]:
        seen.append(conflict.diagnostic)
        current = conflict.diagnostic["current"]["version"]
        return current, {"intro": "Leases and fencing tokens"}

    outcome = await alpha.commit_rebasing(doc, base, {"intro": "Leases"}, replan)
    assert outcome.applied and outcome.version == base + 2
    (diagnostic,) = seen
    assert diagnostic["reason"] == "version_conflict"
    assert [c["arguments"] for c in diagnostic["changes_since_base"]] == [{"patch": {"title": "Arbiter"}}]
    assert ledger.document(doc) == (2, {"title": "Arbiter", "intro": "Leases and fencing tokens"})


async def test_a_snapshot_with_content_reads_the_document_and_the_balance_in_order(
    gateway: tuple[Settings, Ledger], clients: dict[str, ArbiterClient]
) -> None:
    _settings, ledger = gateway
    alpha, beta = clients["alpha"], clients["beta"]
    doc = "doc:read-me"
    empty = await alpha.snapshot(doc, content=True)
    assert empty.version == 0 and empty.content is None
    assert (await alpha.snapshot(doc)).content is None  # not asked: not read
    first = await beta.commit(doc, 0, {"title": "Arbiter", "parts": {"a": 1}})
    assert first.applied
    # Sent right after the commit's decision: read after it in the resource's order, never before.
    seen = await alpha.snapshot(doc, content=True)
    assert seen.version == 1
    assert seen.content == {"document": doc, "revision": 1, "body": {"title": "Arbiter", "parts": {"a": 1}}}

    def replan(conflict: Outcome) -> tuple[int, dict[str, Any]]:  # a plain function is a replan too
        return conflict.diagnostic["current"]["version"], {"parts": {"b": 2}}

    assert (await alpha.commit_rebasing(doc, 0, {"parts": {"b": 2}}, replan)).applied
    body = (await beta.snapshot(doc, content=True)).content
    assert body is not None and body["body"] == {"title": "Arbiter", "parts": {"a": 1, "b": 2}}
    assert ledger.document(doc) == (2, body["body"])
    account = await alpha.snapshot("account:c", content=True)
    assert account.content == {"account": "c", "balance": ledger.balances()["c"]}
    await assert_clean_audit(_settings)  # the audit re-derives each answer with the content it recorded


async def test_a_duplicate_intent_executes_once(
    gateway: tuple[Settings, Ledger], clients: dict[str, ArbiterClient]
) -> None:
    _settings, ledger = gateway
    alpha = clients["alpha"]
    async with alpha.lease("account:d", ttl=30) as lease:
        base = (await alpha.snapshot("account:d")).version
        intent_id = uuid.uuid4().hex
        first = await alpha.execute(lease, "refund", {"order_id": "dup-1", "amount": 300}, base_version=base,
                                    intent_id=intent_id)
        again = await alpha.execute(lease, "refund", {"order_id": "dup-1", "amount": 300}, base_version=base,
                                    intent_id=intent_id)
    assert first.applied and again == first
    assert [r["order_id"] for r in ledger.refunds()].count("dup-1") == 1


async def test_bad_input_is_rejected_with_a_reason_and_nothing_is_applied(
    gateway: tuple[Settings, Ledger], clients: dict[str, ArbiterClient]
) -> None:
    _settings, ledger = gateway
    alpha = clients["alpha"]
    before = ledger.balances()
    async with alpha.lease("account:b", ttl=30) as lease:
        base = (await alpha.snapshot("account:b")).version
        unknown = await alpha.execute(lease, "wire_to_offshore", {"amount": 1}, base_version=base)
        schema = await alpha.execute(lease, "transfer", {"to": "a", "amount": -5}, base_version=base)
    huge = await alpha.commit("doc:big", 0, {"text": "x" * (1024 * 1024)})
    nopolicy = await alpha.execute("misc:thing", "commit", {"patch": {}}, base_version=0)
    assert unknown.reason == "unknown_tool" and "transfer" in unknown.diagnostic["known_tools"]
    assert schema.reason == "invalid_arguments" and "amount" in schema.diagnostic["problem"]
    assert huge.reason == "arguments_too_large"
    assert nopolicy.reason == "no_policy"
    assert ledger.balances() == before and ledger.document("doc:big") is None


async def test_the_double_refund_story(gateway: tuple[Settings, Ledger]) -> None:
    """Two triage agents handle the same refund at once: exactly one refund is applied."""
    settings, ledger = gateway
    resource, order = "account:cust_8492", "order-77"

    async def triage(agent: str) -> Outcome:
        async with ArbiterClient(agent, settings) as client:
            seen = await client.snapshot(resource)  # both read "no refund yet" at t=0
            await asyncio.sleep(0.2)  # model time
            async with client.lease(resource, ttl=30, wait=30) as lease:
                outcome = await client.execute(lease, "refund", {"order_id": order, "amount": 2_500},
                                               base_version=seen.version)
                if outcome.conflict:
                    # The loser's rebase: someone refunded this order since it looked.
                    changes = outcome.diagnostic["changes_since_base"]
                    assert any(c["tool"] == "refund" and c["arguments"]["order_id"] == order for c in changes)
                return outcome

    outcomes = await asyncio.gather(triage("triage-1"), triage("triage-2"))
    assert sorted(o.applied for o in outcomes) == [False, True]
    loser = next(o for o in outcomes if not o.applied)
    assert loser.reason == "version_conflict" and loser.diagnostic_json.startswith("{")
    assert [r["order_id"] for r in ledger.refunds()].count(order) == 1
    report = ledger.invariants()
    assert report["ok"], report
    assert ledger.balances()["cust_8492"] == 10_000 - 2_500


async def test_concurrent_transfers_conserve_money(gateway: tuple[Settings, Ledger]) -> None:
    settings, ledger = gateway
    names = ["a", "b", "c", "d"]
    total_before = sum(ledger.balances()[n] for n in names)
    rng = random.Random(11)
    applied = 0

    async def agent(n: int) -> None:
        nonlocal applied
        async with ArbiterClient(f"mover-{n}", settings) as client:
            for _ in range(5):
                src, dst = rng.sample(names, 2)
                try:
                    async with client.leases([f"account:{src}", f"account:{dst}"], ttl=30, wait=30) as held:
                        base = (await client.snapshot(f"account:{src}")).version
                        outcome = await client.execute(held[f"account:{src}"], "transfer",
                                                       {"to": dst, "amount": rng.randint(1, 4_000)},
                                                       base_version=base)
                        applied += outcome.applied
                except LeaseDenied:
                    continue

    await asyncio.gather(*(agent(n) for n in range(6)))
    balances = ledger.balances()
    assert sum(balances[n] for n in names) == total_before
    assert min(balances.values()) >= 0
    assert applied > 0
    assert ledger.invariants()["money_conserved"]


async def test_killed_between_tool_and_offset_commit_the_tool_runs_once(bootstrap: str, tmp_path: Path) -> None:
    """SIGKILL right after the tool ran: the next worker redelivers, the ledger answers from its record."""
    settings = isolated_settings(bootstrap, tmp_path, ledger_dsn=fresh_postgres_schema(), partitions=1)
    await ensure_topics(settings)
    ledger = Ledger(settings.ledger_dsn)
    ledger.seed(ACCOUNTS)
    intent_id = uuid.uuid4().hex
    pool = WorkerPool(settings)
    try:
        await start_worker(settings, pool, {"ARBITER_FAILPOINT": f"crash_after_tool:{intent_id}"})
        async with ArbiterClient("alpha", settings) as alpha:
            lease = await alpha.acquire("account:cust_8492", ttl=120, wait=0)
            base = (await alpha.snapshot("account:cust_8492")).version
            pending = asyncio.create_task(alpha.execute(
                lease, "refund", {"order_id": "crash-1", "amount": 1_000}, base_version=base,
                intent_id=intent_id, timeout=120))
            crashed = pool.workers[0].proc
            await asyncio.wait_for(asyncio.to_thread(crashed.wait), 60)
            assert crashed.returncode == -9, "the failpoint should have killed the worker"
            assert [r["order_id"] for r in ledger.refunds()] == ["crash-1"], "the tool ran before the crash"
            pool.workers.clear()
            pool.start(1)  # no failpoint: this one redelivers the intent
            outcome = await pending
        assert outcome.applied and outcome.version == base + 1
        assert outcome.result["balance"] == 10_000 - 1_000
        assert [r["order_id"] for r in ledger.refunds()] == ["crash-1"], "the redelivered intent ran again"
        assert ledger.balances()["cust_8492"] == 9_000
        assert ledger.invariants()["ok"]
    finally:
        pool.stop()
        ledger.close()
