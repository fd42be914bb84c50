"""The audit and ``lock status`` across the trust boundary, against a real worker.

A clean signed run passes the ``authenticated`` check with its signatures counted, and the
commands the worker refused (unsigned, or signed by one agent acting as another) are fine
because the worker refused them, as the replay does. Forged decisions written straight to
the event topic and an inbox (unsigned, or signed by an agent's key) fail the audit at their
positions, and ``lock status`` never shows the forger as a holder. An operator's override
is listed as a human action. Without the admin public key the audit says what to set.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer
from click.testing import CliRunner, Result

from arbiter.agents import ArbiterClient
from arbiter.agents.identities import Operator, Registrar, ensure_identity
from arbiter.audit import TrustAnchorsMissing, audit
from arbiter.audit.html import render
from arbiter.audit.log import Log, read_log, write_archive
from arbiter.cli import main as arbiter_cli
from arbiter.edge.clock import now_ms
from arbiter.edge.kafkaauth import kafka_client_options
from arbiter.edge.settings import Settings
from arbiter.history import lease_book
from arbiter.processes import WorkerPool
from arbiter.schemas import (
    Cause,
    DeadLetter,
    Holder,
    IdentityRegistered,
    LockGranted,
    LockRequested,
    LockRevokeRequested,
    Record,
    WorkerStarted,
    default_codec,
)
from arbiter.schemas.identity import Signer
from arbiter.streams.runtime.topics import ensure_topics
from tests.conftest import isolated_settings

pytestmark = pytest.mark.kafka


async def _produce(settings: Settings, topic: str, key: str, record: Record, signer: Signer | None) -> str:
    """Write one message as anyone with topic access could; its position, topic[partition]@offset."""
    value = default_codec(settings.max_message_bytes).encode(record)
    headers = signer.sign(topic, key.encode(), value, now_ms()) if signer is not None else None
    producer = AIOKafkaProducer(bootstrap_servers=settings.bootstrap, acks="all", linger_ms=0,
                                **kafka_client_options(settings))
    await producer.start()
    try:
        sent = await producer.send_and_wait(topic, value, key=key.encode(), headers=headers)
    finally:
        await producer.stop()
    return f"{topic}[{sent.partition}]@{sent.offset}"


async def _settled_log(settings: Settings, letters: int = 0, timeout: float = 20.0) -> Log:
    """The log once the worker has dead-lettered at least ``letters`` inputs."""
    deadline = time.monotonic() + timeout
    while True:
        log = await read_log(settings)
        found = sum(isinstance(e.record, DeadLetter) for e in log.of(settings.topics.dead_letter))
        if found >= letters or time.monotonic() > deadline:
            assert found >= letters, f"only {found} of {letters} dead letters after {timeout} s"
            return log
        await asyncio.sleep(0.3)


async def _cli(env: dict[str, str], *args: str) -> Result:
    """The CLI in a thread of its own (it runs its own event loop)."""
    return await asyncio.to_thread(CliRunner(env=env).invoke, arbiter_cli, list(args), catch_exceptions=False)


def _authenticated(report: dict[str, Any]) -> list[dict[str, Any]]:
    return [f for f in report["findings"] if f["check"] == "authenticated"]


def _problems(report: dict[str, Any]) -> list[str]:
    return [f"{f['check']}: {f['message']} at {f['where']}" for f in report["findings"]]


async def test_a_clean_signed_run_passes_with_its_signatures_counted(kafka_settings: Settings,
                                                                     worker: WorkerPool) -> None:
    settings = kafka_settings
    async with ArbiterClient("alice", settings) as alice, ArbiterClient("bob", settings) as bob:
        for resource in ("doc:a", "doc:b", "doc:a"):
            async with alice.lease(resource, ttl=30):
                await asyncio.sleep(0.05)
        async with bob.lease("doc:b", ttl=30):
            await asyncio.sleep(0.05)
    # Commands the worker must refuse: unsigned, and mallory's key acting as alice.
    mallory = await ensure_identity(settings, "mallory")
    command = LockRequested(request_id="forged-1", agent_id="alice", resource="doc:a", mode="exclusive",
                            ttl_ms=30_000, at_ms=now_ms())
    unsigned = await _produce(settings, settings.topics.resource_commands, "doc:a", command, None)
    as_other = await _produce(settings, settings.topics.resource_commands, "doc:a",
                              command.model_copy(update={"request_id": "forged-2"}), mallory)
    # And one that looks like the deadlock detector's own command (which no replayed decision sends).
    detector = await _produce(settings, settings.topics.resource_commands, "doc:a", LockRevokeRequested(
        request_id="forged-3", resource="doc:a", agent_id="alice", reason="deadlock", requested_by="deadlock-detector",
        at_ms=now_ms()), None)
    log = await _settled_log(settings, letters=3)
    letters = {f"{e.record.source.topic}[{e.record.source.partition}]@{e.record.source.offset}": e.record.reason
               for e in log.of(settings.topics.dead_letter) if isinstance(e.record, DeadLetter)}
    assert letters.get(unsigned) == "unauthenticated" and letters.get(as_other) == "forbidden", letters
    assert letters.get(detector) == "unauthenticated", letters
    assert any(e.record is not None for e in log.of(settings.topics.registry)), "the registry topic is read"
    assert all(e.headers for e in log.entries() if e.where not in (unsigned, detector)), "the others are signed"

    report = await audit(log, settings)
    assert report["verdict"] == "pass" and not report["findings"], "\n".join(_problems(report))
    assert report["checks"]["authenticated"]["violations"] == 0
    stats = report["stats"]
    assert stats["signatures_verified"] >= 20 and stats["registry_records"] >= 4, stats
    assert stats["refused_commands"] == 3 and stats["human_actions"] == 0, stats
    assert stats["grants"] >= 4


async def test_forged_decisions_are_intrusions_detected_and_never_hold_a_lease(
        kafka_settings: Settings, worker: WorkerPool, tmp_path: Path) -> None:
    settings = kafka_settings
    async with ArbiterClient("alice", settings) as alice, alice.lease("doc:x", ttl=30) as lease:
        token = lease.token
    mallory = await ensure_identity(settings, "mallory")
    at = now_ms()

    def grant(request_id: str) -> LockGranted:
        holder = Holder(agent_id="mallory", request_id=request_id, token=token + 1, mode="exclusive",
                        expires_at_ms=at + 600_000)
        return LockGranted(request_id=request_id, agent_id="mallory", resource="doc:x", token=token + 1,
                           mode="exclusive", expires_at_ms=at + 600_000, holders=[holder], resource_version=0,
                           at_ms=at, cause=Cause(topic=settings.topics.resource_commands, partition=0,
                                                         offset=0))

    t = settings.topics
    forged = {
        "unsigned event": await _produce(settings, t.resource_events, "doc:x", grant("f-1"), None),
        "unsigned inbox": await _produce(settings, t.agent_inbox, "mallory", grant("f-1"), None),
        "agent-signed event": await _produce(settings, t.resource_events, "doc:x", grant("f-2"), mallory),
        "agent-signed inbox": await _produce(settings, t.agent_inbox, "mallory", grant("f-2"), mallory),
    }
    log = await _settled_log(settings)
    report = await audit(log, settings)
    # Detected and named, and no safety rule broken: the verdict passes, unless the audit is strict.
    assert report["verdict"] == "pass" and report["violations"] == 0 and report["intrusions"] == len(forged)
    assert all(f["severity"] == "intrusion" for f in _authenticated(report))
    assert (await audit(log, settings, strict=True))["verdict"] == "fail"
    named = {w: f["message"] for f in _authenticated(report) for w in f["where"]}
    assert set(forged.values()) <= set(named), (forged, named)
    assert "not signed" in named[forged["unsigned event"]]
    assert "'mallory' (role agent)" in named[forged["agent-signed inbox"]]
    assert all(f["where"][0] in forged.values() for f in _authenticated(report)), _authenticated(report)
    # The forgeries are not drawn as leases on the timeline.
    leases = [lease for r in report["timeline"]["resources"] for lease in r["leases"]]
    assert leases and all(lease["agent"] != "mallory" for lease in leases)
    assert report["timeline"]["skipped_forged"] >= 2
    page = render(report)
    for where in forged.values():
        assert where in page

    skipped: list[str] = []
    book = await lease_book(settings, "doc:x", skipped)
    assert not book.holders and book.last_token == token, book
    assert sorted(s.split(":")[0] for s in skipped) == sorted([forged["unsigned event"],
                                                                forged["agent-signed event"]])
    env = {"ARBITER_HOME": str(settings.home), "ARBITER_PARTITIONS": str(settings.partitions),
           **{"ARBITER_TOPICS__" + name.upper(): topic for name, topic in t.model_dump().items()}}
    result = await _cli(env, "--bootstrap", settings.bootstrap, "lock", "status", "doc:x")
    assert result.exit_code == 0, result.output
    status = json.loads(result.stdout)
    assert status["holders"] == [] and status["high_water_token"] == token, status

    # The same log in an archive audits the same.
    archive = tmp_path / "forged.jsonl"
    write_archive(archive, log)
    result = await _cli(env, "audit", "--log", str(archive))
    assert result.exit_code == 0, "intrusions detected, no rule broken: " + result.output
    assert all(where in result.output for where in forged.values()), result.output
    strict = await _cli(env, "audit", "--log", str(archive), "--strict")
    assert strict.exit_code == 1, strict.output


async def _started(settings: Settings, count: int, pool: WorkerPool, timeout: float = 90.0) -> Log:
    """The log once ``count`` workers have announced themselves (each registered its key before that)."""
    deadline = time.monotonic() + timeout
    while True:
        pool.check_alive()
        log = await read_log(settings)
        if sum(isinstance(e.record, WorkerStarted) for e in log.of(settings.topics.workers)) >= count:
            return log
        assert time.monotonic() < deadline, f"{count} workers did not start within {timeout} s"
        await asyncio.sleep(0.2)


async def test_workers_starting_together_on_a_fresh_registry_register_their_key_once(
        bootstrap: str, tmp_path: Path) -> None:
    """Finding: in a home where a worker had run, two workers of a new run each registered the worker key
    in the run's empty registry, a few ms apart; the record written first but reaching the log second was
    refused as older than the one in effect, and the audit called that an intrusion. Now the processes of
    one home register a key one at a time, and a repeat would be a no-op anyway: round after round, every
    worker key is registered once, and the audit finds nothing."""
    home = tmp_path / "home"  # shared by the rounds: the first issues the key, the others reuse it
    for round_ in range(4):
        settings = isolated_settings(bootstrap, home, auto_enroll=False)
        await ensure_topics(settings)
        pool = WorkerPool(settings)
        try:
            pool.start(3)
            await _started(settings, 3, pool)
        finally:
            await asyncio.to_thread(pool.stop)
        log = await read_log(settings)
        records = [e.record for e in log.of(settings.topics.registry) if isinstance(e.record, IdentityRegistered)]
        keys = [r.key_id for r in records]
        assert records and len(keys) == len(set(keys)), f"round {round_}: a key registered twice: {records}"
        report = await audit(log, settings)
        assert report["verdict"] == "pass" and report["intrusions"] == 0 and not report["findings"], \
            f"round {round_}: " + "\n".join(_problems(report))
    # A process of another home (no shared lock) registering the same key a moment earlier, its record
    # reaching the log second: a repeat the audit counts, not an intrusion.
    (worker_key,) = records
    earlier = worker_key.model_copy(update={"at_ms": worker_key.at_ms - 22, "valid_from_ms": worker_key.at_ms - 22})
    await Registrar(settings, create_admin=False).publish([earlier])
    report = await audit(await read_log(settings), settings)
    assert report["verdict"] == "pass" and report["intrusions"] == 0 and not report["findings"], \
        "\n".join(_problems(report))
    assert report["stats"]["registry_repeats"] == 1 and report["stats"]["registry_records"] == 2, report["stats"]


async def test_an_operator_override_is_a_human_action(kafka_settings: Settings, worker: WorkerPool) -> None:
    settings = kafka_settings
    async with ArbiterClient("alice", settings) as alice, alice.lease("doc:stuck", ttl=30) as lease:
        await Operator(settings).revoke("doc:stuck", "alice", "stuck after a deploy")
        assert await asyncio.wait_for(lease.wait_lost(), 10) == "revoked: stuck after a deploy"
    log = await _settled_log(settings)
    report = await audit(log, settings)
    assert report["verdict"] == "pass", "\n".join(_problems(report))
    (action,) = report["human_actions"]
    assert action["who"] == "admin" and action["action"] == "LockRevokeRequested"
    assert action["reason"] == "stuck after a deploy" and action["resource"] == "doc:stuck"
    assert action["agent_id"] == "alice" and "LockRevoked" in action["outcome"]
    assert action["where"].startswith(f"{settings.topics.resource_commands}[")
    assert report["stats"]["human_actions"] == 1
    page = render(report)
    assert "Human actions (1)" in page and "stuck after a deploy" in page and action["where"] in page


async def test_without_the_admin_key_the_audit_says_what_to_set(kafka_settings: Settings, worker: WorkerPool,
                                                                tmp_path: Path) -> None:
    settings = kafka_settings
    async with ArbiterClient("alice", settings) as alice, alice.lease("doc:k", ttl=30):
        pass
    log = await _settled_log(settings)
    elsewhere = settings.model_copy(update={"home": tmp_path / "not-the-admin", "admin_public_keys": ""})
    with pytest.raises(TrustAnchorsMissing, match="ARBITER_ADMIN_PUBLIC_KEYS"):
        await audit(log, elsewhere)
    archive = tmp_path / "log.jsonl"
    write_archive(archive, log)
    result = await _cli({"ARBITER_HOME": str(tmp_path / "not-the-admin"), "ARBITER_ADMIN_PUBLIC_KEYS": ""},
                        "audit", "--log", str(archive))
    assert result.exit_code == 2, result.output
    assert "ARBITER_ADMIN_PUBLIC_KEYS" in result.output and "ARBITER_HOME" in result.output
    # Another admin's key is no anchor for this log: nothing verifies.
    stranger = settings.model_copy(update={"admin_public_keys": Signer.generate("admin").public_text()})
    report = await audit(log, stranger)
    assert report["verdict"] == "fail" and len(_authenticated(report)) > 5


async def test_a_checkpointed_audit_of_the_live_topics_resumes_with_the_whole_registry(
        kafka_settings: Settings, worker: WorkerPool, tmp_path: Path) -> None:
    """The resumed audit reads the live topics from the checkpoint on, but the registry whole: with it
    read from the checkpoint too, every signed input re-derived as refused and the audit failed."""
    settings = kafka_settings
    env = {"ARBITER_HOME": str(settings.home), "ARBITER_PARTITIONS": str(settings.partitions),
           "ARBITER_BOOTSTRAP": settings.bootstrap,
           **{"ARBITER_TOPICS__" + name.upper(): topic for name, topic in settings.topics.model_dump().items()}}
    checkpoint = tmp_path / "audit.ckpt"

    async def leases(resource: str) -> None:
        async with ArbiterClient("carol", settings) as carol:
            for _ in range(3):
                async with carol.lease(resource, ttl=30):
                    await asyncio.sleep(0.02)
        await _settled_log(settings)

    await leases("doc:before")
    first = await _cli(env, "audit", "--checkpoint", str(checkpoint))
    assert first.exit_code == 0 and "checkpoint written" in first.output, first.output
    again = await _cli(env, "audit", "--checkpoint", str(checkpoint))  # nothing new
    assert again.exit_code == 0 and "resumed from a checkpoint" in again.output, again.output
    await leases("doc:after")  # new inputs, by an agent issued a key after the checkpoint was made
    async with ArbiterClient("dave", settings) as dave, dave.lease("doc:after", ttl=30):
        pass
    resumed = await _cli(env, "audit", "--checkpoint", str(checkpoint), "--json")
    assert resumed.exit_code == 0, resumed.output
    report = json.loads(resumed.stdout)
    whole = await audit(await read_log(settings), settings)
    assert report["verdict"] == whole["verdict"] == "pass", _problems(report)
    assert report["stats"]["grants"] == whole["stats"]["grants"] >= 7, (report["stats"], whole["stats"])


async def test_forged_outcomes_never_change_the_verdict_on_honest_records(kafka_settings: Settings,
                                                                          worker: WorkerPool) -> None:
    """Two forgeries that once swayed the replay: the honest records replay with their own outcomes.

    - Alice and bob each write their own document with the same intent id: an intent is its resource plus
      its id, so each replays with its own result (keyed by the id alone, bob's got alice's).
    - Before alice's saga is aborted, mallory writes a ToolApplied for its compensation's intent id, which
      anyone can predict (``<saga>|undo|<step>|<attempt>``), unsigned and signed by her: an intrusion each,
      while the honest compensation replays with the worker's outcome.
    - First of all, she announces herself as a worker that does not verify signatures (a WorkerStarted,
      unsigned and signed by her): taken at its word, ahead of the workers' own it turned the audit's
      signature checks off (and her outcomes then fed the replay), after it it made the workers' rules look
      disputed; now each is an intrusion, and the rules are the workers'.
    """
    from arbiter.schemas import ToolApplied
    from arbiter.streams.shells.rules import Rules
    from tests.streams.shells.test_trust_kafka import seeded_ledger

    settings = kafka_settings
    seeded_ledger(settings, {"alice": 10_000})
    mallory = await ensure_identity(settings, "mallory")
    unverified = Rules.from_settings(settings.model_copy(update={"verify_signatures": False})).to_json()
    forged = [await _produce(settings, settings.topics.workers, "mallory-worker", WorkerStarted(
        worker_id="mallory-worker", rules_json=unverified, processing_guarantee="at_least_once",
        partitions=settings.partitions, at_ms=now_ms()), signer) for signer in (None, mallory)]
    shared = "same-intent-id"
    async with ArbiterClient("alice", settings) as alice, ArbiterClient("bob", settings) as bob:
        mine = await alice.commit("doc:alice-notes", 0, {"by": "alice"}, intent_id=shared)
        theirs = await bob.commit("doc:bob-notes", 0, {"by": "bob"}, intent_id=shared)
        assert mine.applied and theirs.applied and mine.result != theirs.result, (mine.result, theirs.result)
        with pytest.raises(RuntimeError, match="cancelled"):
            async with alice.saga("refund") as saga:
                async with saga.lease("account:alice", ttl=60) as lease:
                    base = (await alice.snapshot("account:alice")).version
                    await saga.step(lease, "refund", {"order_id": "o-1", "amount": 250}, base_version=base,
                                    compensate=lambda o: ("reverse_refund", {"refund_intent_id": o.intent_id}))
                undo = f"{saga.saga_id}|undo|0|1"
                lie = ToolApplied(intent_id=undo, agent_id=saga.saga_id, resource="account:alice",
                                  tool="reverse_refund", token=1, version=99, content_hash="0" * 32,
                                  result_json=json.dumps({"reversed": "nothing, says mallory"}),
                                  at_ms=now_ms(),
                                  cause=Cause(topic=settings.topics.resource_commands, partition=0, offset=0))
                for signer in (None, mallory):
                    forged.append(await _produce(settings, settings.topics.resource_events, "account:alice", lie,
                                                 signer))
                raise RuntimeError("cancelled")
    log = await _settled_log(settings)
    honest = [e for e in log.of(settings.topics.resource_events)
              if isinstance(e.record, ToolApplied) and e.record.intent_id == undo and e.where not in forged]
    assert honest, "the compensation ran"
    report = await audit(log, settings)
    assert report["verdict"] == "pass" and report["violations"] == 0, "\n".join(_problems(report))
    assert report["intrusions"] == len(forged)
    assert {w for f in _authenticated(report) for w in f["where"]} == set(forged)
    assert report["signatures"].startswith("verified") and report["rules"]["verify_signatures"]
