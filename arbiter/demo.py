"""``arbiter demo``: bring a whole Arbiter up, prove the round trip, take it down.

Until the lease, gateway and deadlock processors land, the main job shows the
foundation end to end: a real broker, the topics, N workers sharing the partitions,
Avro single-object round trips through every partition, and a malformed message
that lands in the dead-letter topic while the partition keeps flowing.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from contextlib import ExitStack

import click
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.partitioner import DefaultPartitioner

from .contract import DeadLetter, default_codec
from .localkafka import LocalKafka, LocalKafkaError, broker_answers
from .processes import WorkerPool
from .settings import Settings
from .topics import ensure_topics


def key_for_partition(partition: int, partitions: int, prefix: str = "demo:") -> str:
    """A message key that the default partitioner sends to ``partition``."""
    all_parts = list(range(partitions))
    partitioner = DefaultPartitioner()
    for i in range(100_000):
        key = f"{prefix}{i}"
        if partitioner(key.encode(), all_parts, all_parts) == partition:
            return key
    raise RuntimeError(f"no key found for partition {partition}")


async def _round_trips(settings: Settings, rounds: int, ready_timeout: float, pool: WorkerPool) -> list[float]:
    from agents import ArbiterClient, ArbiterTimeout

    keys = [key_for_partition(p, settings.partitions) for p in range(settings.partitions)]
    expected = min(len(pool.workers), settings.partitions)
    async with ArbiterClient("demo-agent", settings) as client:
        deadline = time.monotonic() + ready_timeout
        owners: dict[int, str] = {}
        # Ready when every partition answers and every worker owns one: the group settled.
        while len(owners) < settings.partitions or len(set(owners.values())) < expected:
            pool.check_alive()
            if time.monotonic() > deadline:
                raise ArbiterTimeout(f"workers did not take all partitions within {ready_timeout:.0f}s")
            for key in keys:
                try:
                    result = await client.ping(key, timeout=2)
                except ArbiterTimeout:
                    continue
                owners[result.partition] = result.worker_id
        for partition, owner in sorted(owners.items()):
            click.echo(f"  partition {partition}: owned by {owner}")
        rtts = []
        with click.progressbar(range(rounds), label="  round trips") as bar:
            for i in bar:
                rtts.append((await client.ping(keys[i % len(keys)], timeout=10)).rtt_ms)
        return rtts


async def _dead_letter_check(settings: Settings) -> DeadLetter:
    """Send garbage, then a good ping on the same partition; read the dead letter back."""
    from agents import ArbiterClient

    codec = default_codec()
    dlq = AIOKafkaConsumer(bootstrap_servers=settings.bootstrap, group_id=None, enable_auto_commit=False)
    await dlq.start()
    try:
        tps = [TopicPartition(settings.topics.dead_letter, p) for p in range(settings.partitions)]
        dlq.assign(tps)
        await dlq.seek_to_end(*tps)
        for tp in tps:
            await dlq.position(tp)
        key = key_for_partition(0, settings.partitions)
        producer = AIOKafkaProducer(bootstrap_servers=settings.bootstrap)
        await producer.start()
        try:
            await producer.send_and_wait(settings.topics.resource_commands, key=key.encode(),
                                         value=b"\xc3\x01not-a-real-fingerprint")
        finally:
            await producer.stop()
        async with ArbiterClient("demo-agent", settings) as client:
            await client.ping(key, timeout=10)  # the same partition still flows
        batch = await dlq.getmany(timeout_ms=10_000)
        for messages in batch.values():
            for message in messages:
                letter = codec.decode(message.value, DeadLetter)
                if letter.key == key.encode():
                    return letter
        raise RuntimeError("the malformed message did not reach the dead-letter topic")
    finally:
        await dlq.stop()


async def _zombie_story(settings: Settings) -> None:
    """The seed's zombie: Alpha stalls past its TTL, Beta gets N+1, Alpha is fenced off."""
    from agents import ArbiterClient, LeaseDenied

    resource = f"account:482-{int(time.time())}"
    async with ArbiterClient("alpha", settings) as alpha, ArbiterClient("beta", settings) as beta:
        stalled = await alpha.acquire(resource, ttl=1.0, wait=0)
        click.echo(f"  alpha holds {resource} with token {stalled.token} (TTL 1 s) and stalls in 'inference'")
        fresh = await beta.acquire(resource, ttl=30, wait=20)
        click.echo(f"  beta waited in the queue, got token {fresh.token} when alpha's lease expired")
        click.echo(f"  alpha's SDK saw its lease lost: {await asyncio.wait_for(stalled.wait_lost(), 10)}")
        try:
            await alpha.renew(stalled)
            raise RuntimeError("the zombie's renewal was accepted")
        except LeaseDenied as refused:
            click.echo(f"  alpha wakes up and renews: refused, {refused.reason} "
                       f"(high-water token {refused.diagnostic['current']['high_water_token']})")
        await beta.release(fresh)


async def _double_refund_story(settings: Settings) -> dict[str, object]:
    """Two triage agents race to refund the same order: exactly one refund is applied."""
    from agents import ArbiterClient, Outcome
    from tools.ledger import Ledger

    account = f"cust_{int(time.time() * 1000)}"
    resource, order = f"account:{account}", "order-8492"
    ledger = Ledger(settings.ledger_url())
    try:
        ledger.add_accounts({account: 10_000})

        async def triage(agent: str) -> Outcome:
            async with ArbiterClient(agent, settings) as client:
                seen = await client.snapshot(resource)
                await asyncio.sleep(0.3)  # "thinking" with what it saw
                async with client.lease(resource, ttl=30, wait=30) as lease:
                    return await client.execute(lease, "refund", {"order_id": order, "amount": 2_500},
                                                base_version=seen.version)

        outcomes = await asyncio.gather(triage("triage-1"), triage("triage-2"))
        for agent, outcome in zip(("triage-1", "triage-2"), outcomes, strict=True):
            if outcome.applied:
                click.echo(f"  {agent}: refund applied (version {outcome.version}, "
                           f"balance now {outcome.result['balance']} cents)")
            else:
                changes = outcome.diagnostic.get("changes_since_base", [])
                click.echo(f"  {agent}: refused, {outcome.reason}; the diagnostic lists {len(changes)} change(s) "
                           f"since its read: {', '.join(c['tool'] for c in changes)}")
        refunds = [r for r in ledger.refunds() if r["order_id"] == order and r["account"] == account]
        report = ledger.invariants()
        click.echo(f"  refunds for {order}: {len(refunds)}; ledger invariants: "
                   f"{'hold' if report['ok'] else 'VIOLATED ' + str(report)}")
        if len(refunds) != 1 or not report["ok"]:
            raise RuntimeError("the double-refund story broke an invariant")
        return report
    finally:
        ledger.close()


@click.command()
@click.option("--workers", default=2, show_default=True, help="How many stream-processor workers to start.")
@click.option("--rounds", default=200, show_default=True, help="How many round trips to measure.")
@click.pass_context
def demo(ctx: click.Context, workers: int, rounds: int) -> None:
    """Bring up Kafka, topics and workers, run round trips, take everything down."""
    from .cli import _fail, _settings

    settings = _settings(ctx)
    if workers < 1 or rounds < 1:
        _fail("--workers and --rounds must be at least 1")
    with ExitStack() as stack:
        if not ctx.obj.get("bootstrap"):
            local = LocalKafka(settings, say=lambda m: click.echo(f"  {m}"))
            if local.pid() is None:
                click.echo("starting the local Kafka broker...")
                try:
                    click.echo(f"  {local.up()}")
                except LocalKafkaError as exc:
                    _fail(str(exc), exc.log_tail)
                stack.callback(lambda: click.echo(f"kafka: {local.down()}"))
        if not broker_answers(settings.bootstrap):
            _fail(f"no Kafka answers at {settings.bootstrap}")
        click.echo(f"kafka at {settings.bootstrap}")
        for state in asyncio.run(ensure_topics(settings)):
            click.echo(f"  topic {state.name}: {'created' if state.created else 'exists'}")
        pool = WorkerPool(settings)

        def stop_workers() -> None:
            pool.stop()
            click.echo("workers stopped")

        stack.callback(stop_workers)
        pool.start(workers)
        click.echo(f"started {workers} worker(s); waiting for them to own all {settings.partitions} partitions")
        try:
            rtts = asyncio.run(_round_trips(settings, rounds, 120.0, pool))
            q = statistics.quantiles(rtts, n=100, method="inclusive") if len(rtts) > 1 else rtts * 99
            click.echo(f"round trips through the workers: {len(rtts)}; "
                       f"p50 {q[49]:.1f} ms, p99 {q[98]:.1f} ms, max {max(rtts):.1f} ms")
            letter = asyncio.run(_dead_letter_check(settings))
            click.echo(f"malformed message dead-lettered: reason={letter.reason} "
                       f"from {letter.source.topic}[{letter.source.partition}]@{letter.source.offset}; "
                       "the partition kept flowing")
            click.echo("zombie story (leases and fencing tokens):")
            asyncio.run(_zombie_story(settings))
            click.echo("double-refund story (execution gateway, SQL ledger):")
            asyncio.run(_double_refund_story(settings))
        except Exception as exc:  # report, then the exit stack cleans up what was started
            _fail(f"demo failed: {exc}")
