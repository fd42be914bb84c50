"""Hard edges against real workers: no single input stops a worker, and a fuzzed log stays auditable."""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from arbiter.agents import ArbiterClient
from arbiter.audit import audit
from arbiter.audit.log import read_log
from arbiter.edge.clock import now_ms
from arbiter.edge.keys import signer_for
from arbiter.edge.settings import Settings
from arbiter.processes import WorkerPool, wait_until_served
from arbiter.schemas import MODELS, DeadLetter, LockGranted, LockRequested, Record, WaitEdgeAdded, default_codec
from arbiter.schemas.codec import SCHEMA_DIR
from arbiter.schemas.identity import ROLE_WORKER
from arbiter.schemas.partitioning import key_for_partition
from arbiter.streams.runtime.topics import ensure_topics
from tests.conftest import isolated_settings

pytestmark = pytest.mark.kafka

SCHEMAS = {raw["namespace"] + "." + raw["name"]: raw for raw in
           (json.loads(p.read_text()) for p in SCHEMA_DIR.rglob("*.avsc")
            if "history" not in p.relative_to(SCHEMA_DIR).parts)}


async def wait_until_processed(settings: Settings, timeout: float = 120.0) -> None:
    """Wait on the log: until the workers' consumer group has committed every input partition to its end."""
    t = settings.topics
    tps = [TopicPartition(topic, p) for topic in (t.resource_commands, t.wait_edges, t.saga_commands)
           for p in range(settings.partitions)]
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.bootstrap)
    reader = AIOKafkaConsumer(bootstrap_servers=settings.bootstrap, group_id=None)
    await admin.start()
    await reader.start()
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            committed = await admin.list_consumer_group_offsets(settings.app_id)
            ends = await reader.end_offsets(tps)
            behind = {tp: ends[tp] - (committed[tp].offset if tp in committed else 0) for tp in tps}
            if all(lag <= 0 for lag in behind.values()):
                return
            if loop.time() > deadline:
                raise AssertionError(f"the workers did not process every input within {timeout}s: {behind}")
            await asyncio.sleep(0.2)  # between two reads of the committed offsets
    finally:
        await reader.stop()
        await admin.close()


async def start_one_worker(settings: Settings, pool: WorkerPool, env: dict[str, str] | None = None) -> None:
    pool.start(1, extra_env=env)
    keys = [key_for_partition(p, settings.partitions) for p in range(settings.partitions)]
    async with ArbiterClient("warmup", settings) as client:
        await wait_until_served(client, pool, keys)


async def test_a_batch_whose_outputs_were_not_taken_leaves_no_state_behind(bootstrap: str, tmp_path: Path) -> None:
    """A batch's changelog is sent only once its outputs are acknowledged (at_least_once). The failpoint
    leaves a grant's outputs (its event, the agent's answer) out of a batch and fails it: the worker
    rewinds, restores a state without that grant, decides the request again and sends its answer. With
    the changelog sent beside the outputs, the restored state held the grant, the request was a repeat
    that decides nothing, and the agent never heard: its lease stood on the books with no event."""
    from tests.conftest import assert_clean_audit

    settings = isolated_settings(bootstrap, tmp_path, partitions=1)
    await ensure_topics(settings)
    pool = WorkerPool(settings)
    try:
        await start_one_worker(settings, pool, {"ARBITER_FAILPOINT": "lose_outputs_once:lost"})
        async with ArbiterClient("lost-agent", settings) as agent:
            lease = await agent.acquire("lost:r1", ttl=30, wait=10)
            assert lease.token == 1
            await agent.release(lease)
        text = pool.workers[0].log.read_text(errors="replace")
        assert "failpoint lose_outputs_once" in text and "rewinding" in text, "the failpoint did not fire"
        log = await read_log(settings)
        granted = [e.record for e in log.of(settings.topics.resource_events)
                   if isinstance(e.record, LockGranted) and e.record.resource == "lost:r1"]
        assert [g.token for g in granted] == [1], granted
        await assert_clean_audit(settings)
        pool.check_alive()
    finally:
        pool.stop()


async def test_a_processor_bug_quarantines_the_input_and_the_worker_goes_on(bootstrap: str, tmp_path: Path) -> None:
    settings = isolated_settings(bootstrap, tmp_path, ledger_dsn=str(tmp_path / "ledger.sqlite3"), partitions=1)
    await ensure_topics(settings)
    pool = WorkerPool(settings)
    try:
        await start_one_worker(settings, pool, {"ARBITER_FAILPOINT": "raise_after_tool:poison-"})
        async with ArbiterClient("writer", settings) as writer:
            first = await writer.commit("doc:plan", 0, {"a": 1})
            assert first.applied and first.version == 1
            with pytest.raises(Exception, match="no answer"):
                await writer.commit("doc:plan", 1, {"b": 2}, intent_id="poison-1")  # quarantined: no answer
            after = await writer.commit("doc:plan", 1, {"c": 3})  # the same resource is served, as it was
            assert after.applied and after.version == 2
            pool.check_alive()
        log = await read_log(settings)
        letters = [e.record for e in log.of(settings.topics.dead_letter) if isinstance(e.record, DeadLetter)]
        (letter,) = letters
        assert letter.reason == "processor_failed" and "failpoint raise_after_tool" in letter.detail
        assert "Traceback" in letter.detail and letter.source.topic == settings.topics.resource_commands
        decided = [e.record for e in log.of(settings.topics.resource_events)]
        assert all(getattr(r, "intent_id", "") != "poison-1" for r in decided), "nothing of it was sent"
    finally:
        pool.stop()


def _value(avro: Any, rng: random.Random) -> Any:
    """A random value of an Avro type, absurd ones included."""
    if isinstance(avro, list):
        return _value(rng.choice(avro), rng)
    if isinstance(avro, dict):
        kind = avro["type"]
        if kind == "record":
            return {f["name"]: _value(f["type"], rng) for f in avro["fields"]}
        if kind == "array":
            return [_value(avro["items"], rng) for _ in range(rng.randint(0, 3))]
        if kind == "map":
            return {_text(rng): _value(avro["values"], rng) for _ in range(rng.randint(0, 2))}
        return _value(kind, rng)
    if avro == "null":
        return None
    if avro == "string":
        return _text(rng)
    if avro == "long":
        return rng.choice([0, -1, 1, rng.randint(-(2**63), 2**63 - 1), rng.randint(0, 10**13), 2**63 - 1])
    if avro == "int":
        return rng.choice([0, -1, rng.randint(-(2**31), 2**31 - 1)])
    if avro == "boolean":
        return rng.random() < 0.5
    if avro == "bytes":
        return rng.randbytes(rng.randint(0, 32))
    raise AssertionError(avro)


def _text(rng: random.Random) -> str:
    roll = rng.random()
    if roll < 0.3:
        return f"fuzz:{rng.randint(0, 40)}"
    if roll < 0.4:
        return f"saga:fuzz-{rng.randint(0, 20)}"
    if roll < 0.45:
        return "x" * rng.choice([300, 5_000, 200_000])  # over every name limit
    if roll < 0.5:
        return ""
    return "".join(chr(rng.randint(32, 0x2FFF)) for _ in range(rng.randint(1, 12)))


def fuzz(settings: Settings, count: int, seed: int) -> list[tuple[str, bytes | None, bytes]]:
    """``count`` hostile or broken records for the three input topics: random bytes, truncated and
    bit-flipped messages, well-typed records with absurd values, on the wrong topic, with null or
    mismatched keys."""
    rng = random.Random(seed)
    codec = default_codec(settings.max_message_bytes)
    t = settings.topics
    topics = [t.resource_commands, t.wait_edges, t.saga_commands]
    out: list[tuple[str, bytes | None, bytes]] = []
    for _ in range(count):
        topic = rng.choice(topics)
        model = rng.choice(MODELS)
        try:
            record: Record = model.model_validate(_value(SCHEMAS[model.AVRO_NAME], rng))
            value = codec.encode(record)
        except Exception:
            record, value = None, rng.randbytes(rng.randint(0, 64))  # type: ignore[assignment]
        roll = rng.random()
        if roll < 0.1:
            value = rng.randbytes(rng.randint(0, 200))
        elif roll < 0.2:
            value = value[: rng.randint(0, max(0, len(value) - 1))]
        elif roll < 0.35:
            flipped = bytearray(value)
            for _ in range(rng.randint(1, 3)):
                if flipped:
                    flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
            value = bytes(flipped)
        named = getattr(record, "resource", None) or getattr(record, "saga_id", None)
        key_roll = rng.random()
        if key_roll < 0.15:
            key = None
        elif key_roll < 0.3:
            key = rng.randbytes(rng.randint(0, 16))
        elif isinstance(named, str) and key_roll < 0.9:
            key = named.encode()
        else:
            key = settings.graph_key.encode() if topic == t.wait_edges else _text(rng).encode()
        out.append((topic, key, value))
    return out


async def test_ten_thousand_fuzzed_records_stop_no_worker_and_the_audit_agrees(bootstrap: str,
                                                                                 tmp_path: Path) -> None:
    settings = isolated_settings(bootstrap, tmp_path, ledger_dsn=str(tmp_path / "ledger.sqlite3"))
    await ensure_topics(settings)
    pool = WorkerPool(settings)
    records = fuzz(settings, 10_000, seed=20261130)
    try:
        pool.start(2)
        keys = [key_for_partition(p, settings.partitions) for p in range(settings.partitions)]
        async with ArbiterClient("honest", settings) as honest:
            await wait_until_served(honest, pool, keys)
            producer = AIOKafkaProducer(bootstrap_servers=settings.bootstrap, linger_ms=5,
                                        max_request_size=4 * settings.max_message_bytes)
            await producer.start()
            served: Counter[str] = Counter()

            async def valid_traffic() -> None:
                """Real work on real names, interleaved with the fuzz: every operation must succeed."""
                tokens: dict[str, int] = {}
                for i in range(40):
                    name = f"real:{i % 4}"
                    lease = await honest.acquire(name, ttl=30, wait=30)
                    assert lease.token > tokens.get(name, 0)
                    tokens[name] = lease.token
                    await honest.release(lease)
                    served["grants"] += 1

            honest_work = asyncio.create_task(valid_traffic())
            try:
                # Two thirds are signed by the workers' own identity, which may send anything: those
                # get past the trust gate to the processors' own checks; the rest are refused at it.
                worker = signer_for(settings.home, ROLE_WORKER)
                for i, (topic, key, value) in enumerate(records):
                    headers = worker.sign(topic, key, value, now_ms()) if i % 3 else None
                    await producer.send(topic, value=value, key=key, headers=headers)
                    if i % 500 == 0:
                        await producer.flush()
                await producer.flush()
            finally:
                await producer.stop()
            await asyncio.wait_for(honest_work, 180)
        assert served["grants"] == 40
        await wait_until_processed(settings, timeout=240)
        pool.check_alive()  # no worker exited
        # Still serving after the storm:
        async with ArbiterClient("after", settings) as after:
            await wait_until_served(after, pool, keys)
        log = await read_log(settings)
        report = await audit(log, settings, complete=False)
        # The audit re-derives every input as the workers decided it. What it does flag are the signed
        # fuzz's look-alikes of the processors' own messages (a DeadlockDetected, a saga's own lease
        # request): forgeries, named as such. The unsigned third is refused at the trust gate.
        forgeries = [f for f in report["findings"] if f["check"] == "determinism" and "forged" in f["message"]]
        disagreements = [f for f in report["findings"] if f["check"] == "determinism" and f not in forgeries]
        assert disagreements == [], disagreements[:5]
        assert report["stats"]["inputs"] >= len(records)
        # Safety rules hold whatever the fuzz asked for (a saga whose compensation it made impossible
        # is a finding for a human, not a broken rule).
        broken = [f for f in report["findings"] if f["severity"] == "violation" and f["check"] != "sagas_finished"
                  and f not in forgeries]
        assert broken == [], broken[:5]
        letters = [e.record for e in log.of(settings.topics.dead_letter) if isinstance(e.record, DeadLetter)]
        reasons = Counter(letter.reason for letter in letters)
        assert reasons["processor_failed"] == 0, "a fuzzed input raised inside a processor"
        assert sum(reasons.values()) > 1_000 and all(reasons), reasons
        assert reasons["unauthenticated"] > 1_000 and reasons["key_mismatch"] > 0, reasons
        # The honest resources were touched by nobody else's input.
        for entry in log.of(settings.topics.resource_events):
            if entry.key is not None and entry.key.startswith(b"real:"):
                assert getattr(entry.record, "agent_id", "honest") in ("honest",), entry.record
    finally:
        pool.stop()


async def test_a_null_key_edge_and_a_lease_request_on_the_saga_topic_are_dead_lettered(
        bootstrap: str, tmp_path: Path) -> None:
    settings = isolated_settings(bootstrap, tmp_path, partitions=1)
    await ensure_topics(settings)
    pool = WorkerPool(settings)
    codec = default_codec()
    try:
        await start_one_worker(settings, pool)
        producer = AIOKafkaProducer(bootstrap_servers=settings.bootstrap)
        await producer.start()
        # Signed by the workers' own identity, which may send anything: past the trust gate, the
        # shells' own checks of shape are what refuses these.
        worker = signer_for(settings.home, ROLE_WORKER)
        try:
            edge = WaitEdgeAdded(edge_id="e", waiter="a", holder="b", source="delegation", resource=None,
                                 waiter_priority=0, waiter_registered_at_ms=0, at_ms=0)
            value = codec.encode(edge)
            await producer.send_and_wait(settings.topics.wait_edges, value=value, key=None,
                                         headers=worker.sign(settings.topics.wait_edges, None, value, now_ms()))
            lock = LockRequested(request_id="r", agent_id="a", resource="saga:x", mode="exclusive", ttl_ms=1000,
                                 wait_ms=0, at_ms=0)
            value = codec.encode(lock)
            await producer.send_and_wait(settings.topics.saga_commands, value=value, key=b"saga:x",
                                         headers=worker.sign(settings.topics.saga_commands, b"saga:x", value, now_ms()))
        finally:
            await producer.stop()
        await wait_until_processed(settings)
        pool.check_alive()
        log = await read_log(settings)
        reasons = sorted(e.record.reason for e in log.of(settings.topics.dead_letter)
                         if isinstance(e.record, DeadLetter))
        assert reasons == ["key_mismatch", "unsupported_command"]
        report = await audit(log, settings)
        assert report["verdict"] == "pass", report["findings"][:3]
    finally:
        pool.stop()
