"""The audit judges honest records by honest records: a record no worker signed never decides how the
others are judged.

Whether signatures are checked and the rules the replay decides by come from the workers'
announcements (``WorkerStarted``); which inputs were refused, from their dead letters; how far the
workers got, from the causes their decisions name; what an audit checkpoint keeps, from what ended
and what superseded what. Each of these, forged (unsigned, or signed by an agent) and written where it
would count, is an intrusion and changes nothing else.

The logs are made, not recorded: an agent's signed commands are decided by the processors' own code
(``arbiter.audit.replay.simulate``), and every decision is then signed with a worker key the admin
registered, as a worker signs what it sends.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from arbiter.audit import audit, audit_from
from arbiter.audit.checkpoint import Checkpoint
from arbiter.audit.log import Entry, Log
from arbiter.audit.replay import simulate
from arbiter.edge.settings import Settings
from arbiter.schemas import (
    Cause,
    DeadLetter,
    IdentityRegistered,
    LockDenied,
    LockReleaseRequested,
    LockRequested,
    Record,
    ToolApplied,
    ToolIntent,
    WorkerStarted,
    default_codec,
)
from arbiter.schemas.identity import ACTIVE, ROLE_AGENT, ROLE_WORKER, Signer
from arbiter.streams.shells.rules import Rules

T0 = 1_700_000_000_000
RESOURCE = "account:honest"
ADMIN = Signer.generate("admin")
WORKER = Signer.generate("worker")
ALICE = Signer.generate("alice")
MALLORY = Signer.generate("mallory")
SETTINGS = Settings(partitions=2, admin_public_keys=ADMIN.public_text())
"""An auditor with the admin public key: a trust anchor."""
CODEC = default_codec(SETTINGS.max_message_bytes)


def _signed(entry: Entry, signer: Signer | None) -> Entry:
    """``entry`` as ``signer`` sent it (None: unsigned, as anyone with topic access can write)."""
    value = entry.value_bytes(CODEC)
    headers = tuple(signer.sign(entry.topic, entry.key, value, entry.timestamp_ms)) if signer else ()
    return replace(entry, headers=headers)


def _command(at: int, record: Record) -> Entry:
    return _signed(Entry(SETTINGS.topics.resource_commands, -1, -1, at, RESOURCE.encode(), record), ALICE)


def _acquire(request_id: str, at: int) -> Entry:
    return _command(at, LockRequested(request_id=request_id, agent_id="alice", resource=RESOURCE, mode="exclusive",
                                      ttl_ms=600_000, wait_ms=0, at_ms=at))


def _refund(intent_id: str, token: int, base: int, at: int) -> Entry:
    return _command(at, ToolIntent(intent_id=intent_id, agent_id="alice", resource=RESOURCE, token=token,
                                   base_version=base, tool="refund",
                                   arguments_json=json.dumps({"amount": 100, "order_id": intent_id}), at_ms=at))


def _release(request_id: str, token: int, at: int) -> Entry:
    return _command(at, LockReleaseRequested(request_id=request_id, agent_id="alice", resource=RESOURCE, token=token,
                                             at_ms=at))


def _announcement(at: int, signer: Signer | None, **rules: Any) -> Entry:
    """A worker's ``WorkerStarted``, with ``rules`` changed from the ones it decides by."""
    text = json.dumps({**json.loads(Rules.from_settings(SETTINGS).to_json()), **rules}, sort_keys=True)
    record = WorkerStarted(worker_id="worker-1", rules_json=text, processing_guarantee="at_least_once",
                           partitions=SETTINGS.partitions, at_ms=at)
    return _signed(Entry(SETTINGS.topics.workers, 0, -1, at, b"worker-1", record), signer)


def _registered(signer: Signer, role: str, at: int) -> Entry:
    record = IdentityRegistered(key_id=signer.key_id, name=signer.name, role=role, public_key=signer.public_raw,
                                status=ACTIVE, valid_from_ms=at, at_ms=at)
    return _signed(Entry(SETTINGS.topics.registry, 0, -1, at, signer.key_id.encode(), record), ADMIN)


async def _honest(commands: list[Entry]) -> Log:
    """The log a verifying worker writes for ``commands``: the admin's registry, the worker's
    announcement, the commands, and every decision signed by the worker."""
    decided = await simulate(Log(SETTINGS.topics, source="test", partition_count=SETTINGS.partitions), SETTINGS,
                             outside=commands)
    log = Log(SETTINGS.topics, source="test", partition_count=SETTINGS.partitions)
    for number, (signer, role) in enumerate(((WORKER, ROLE_WORKER), (ALICE, ROLE_AGENT), (MALLORY, ROLE_AGENT))):
        log.add(replace(_registered(signer, role, T0 - 1_000), offset=number))
    log.add(replace(_announcement(T0 - 500, WORKER), offset=0))
    for entry in decided.entries():
        log.add(entry if entry.headers else _signed(entry, WORKER))
    return log


def _insert(log: Log, forged: Entry, before: Entry | None = None) -> Entry:
    """``forged`` written into its partition ahead of ``before`` (else at its end); where it landed."""
    entries = log.partitions.setdefault((forged.topic, forged.partition), [])
    # (by its record: a message's offset changes as forgeries go in ahead of it)
    index = next(i for i, e in enumerate(entries) if e.record is before.record) if before is not None \
        else len(entries)
    entries.insert(index, forged)
    log.partitions[forged.topic, forged.partition] = [replace(e, offset=i) for i, e in enumerate(entries)]
    return log.partitions[forged.topic, forged.partition][index]


def _first(log: Log, kind: type[Record]) -> Entry:
    return next(e for e in log.of(SETTINGS.topics.resource_events) if isinstance(e.record, kind))


def _summary(report: dict[str, Any]) -> list[str]:
    return [f"{f['check']} ({f['severity']}): {f['message']} at {f['where']}" for f in report["findings"]]


def _where(report: dict[str, Any], severity: str) -> set[str]:
    return {w for f in report["findings"] if f["severity"] == severity for w in f["where"]}


@pytest.mark.parametrize("honest_announcement", [True, False], ids=["before-the-workers-own", "alone"])
async def test_a_forged_announcement_turns_no_check_off_and_forged_outcomes_feed_nothing(
        honest_announcement: bool) -> None:
    """Finding: the first announcement was taken at its word, signed or not. One that says
    ``verify_signatures: false``, written ahead of the workers' own, turned the signature checks off,
    and a forged outcome then fed the replay of the honest intent: a violation on honest records, and
    no intrusion reported."""
    log = await _honest([_acquire("acquire-1", T0), _refund("refund-1", 1, 0, T0 + 10),
                         _release("release-1", 1, T0 + 20)])
    clean = await audit(log, SETTINGS)
    assert clean["verdict"] == "pass" and not clean["findings"], _summary(clean)
    assert clean["signatures"].startswith("verified") and clean["stats"]["writes"] == 1
    workers = SETTINGS.topics.workers, 0
    if not honest_announcement:
        log.partitions[workers] = []  # an auditor with anchors never takes the lack of one as "not verified"
    forged = [
        _insert(log, _announcement(T0 - 900, None, verify_signatures=False, leases={}), log.partitions[workers][0]
                if log.partitions[workers] else None),
        _insert(log, _announcement(T0 - 800, MALLORY, verify_signatures=False)),
    ]
    applied = _first(log, ToolApplied)
    assert isinstance(applied.record, ToolApplied)
    lie = applied.record.model_copy(update={"result_json": json.dumps({"refunded": 1_000_000}), "version": 7})
    forged += [_insert(log, _signed(replace(applied, record=lie, value=None), signer), applied)
               for signer in (None, MALLORY)]
    request = next(e for e in log.of(SETTINGS.topics.resource_commands) if isinstance(e.record, LockRequested))
    letter = DeadLetter(reason="unauthenticated", detail="forged", processor="resources", source=request.cause,
                        value=request.value_bytes(CODEC), at_ms=T0 + 1)
    forged.append(_insert(log, Entry(SETTINGS.topics.dead_letter, 0, -1, T0 + 1, None, letter)))

    report = await audit(log, SETTINGS)
    assert report["verdict"] == "pass" and report["violations"] == 0, _summary(report)
    assert report["signatures"].startswith("verified"), report["signatures"]
    assert _where(report, "intrusion") == {e.where for e in forged}, _summary(report)
    assert report["intrusions"] == len(forged)
    assert report["refused_inputs"] == [], "a forged dead letter refuses nothing"
    assert report["rules"]["verify_signatures"] and report["rules"]["leases"] == clean["rules"]["leases"]
    assert {k: report["stats"][k] for k in ("grants", "writes", "acquires", "intents")} == \
        {k: clean["stats"][k] for k in ("grants", "writes", "acquires", "intents")}


async def test_a_forged_decision_does_not_move_how_far_the_workers_got() -> None:
    """A request the workers have not reached when the log is read is open, not unanswered: a forged
    decision naming a later input as its cause does not make it look processed (and so a violation)."""
    log = await _honest([_acquire("acquire-1", T0), _release("release-1", 1, T0 + 10), _acquire("acquire-2", T0 + 20)])
    last = max((e for e in log.of(SETTINGS.topics.resource_commands)), key=lambda e: e.timestamp_ms)
    for tp, entries in list(log.partitions.items()):  # the worker has not decided the last request yet
        log.partitions[tp] = [e for e in entries if getattr(e.record, "cause", None) != last.cause]
    behind = await audit(log, SETTINGS, complete=False)
    assert behind["verdict"] == "pass" and behind["violations"] == 0, _summary(behind)
    assert last.where in _where(behind, "open"), _summary(behind)
    denial = LockDenied(request_id="made-up", agent_id="mallory", resource=RESOURCE, reason="lease_not_live",
                        detail="{}", at_ms=T0 + 30, request_sent_at_ms=T0 + 30,
                        cause=Cause(topic=last.topic, partition=last.partition, offset=last.offset + 50))
    forged = [_insert(log, _signed(Entry(SETTINGS.topics.resource_events, last.partition, -1, T0 + 30,
                                         RESOURCE.encode(), denial), signer)) for signer in (None, MALLORY)]
    report = await audit(log, SETTINGS, complete=False)
    assert report["verdict"] == "pass" and report["violations"] == 0, _summary(report)
    assert _where(report, "intrusion") == {e.where for e in forged}
    assert last.where in _where(report, "open"), _summary(report)


async def test_a_forged_write_does_not_leave_the_last_honest_write_out_of_a_checkpoint(tmp_path: Path) -> None:
    """The checkpoint keeps each resource's last write (the next write's base is judged by it): a forged
    write after it kept the forgery instead, and the resumed audit found the next honest write on a stale
    base."""
    first = [_acquire("acquire-1", T0), _refund("refund-1", 1, 0, T0 + 10)]
    rest = [_refund("refund-2", 1, 1, T0 + 1_000), _release("release-1", 1, T0 + 1_010)]
    log = await _honest(first + rest)
    applied = _first(log, ToolApplied)
    assert isinstance(applied.record, ToolApplied)
    lie = applied.record.model_copy(update={"intent_id": "forged-1", "agent_id": "mallory"})
    later = next(e for e in log.partitions[applied.topic, applied.partition] if e.timestamp_ms > T0 + 20)
    forged = _insert(log, replace(applied, timestamp_ms=T0 + 20, record=lie, value=None, headers=()), later)
    whole = await audit(log, SETTINGS)
    assert whole["verdict"] == "pass" and whole["violations"] == 0, _summary(whole)
    assert _where(whole, "intrusion") == {forged.where}

    before = Log(log.topics, source=log.source, partition_count=log.partition_count)
    for entry in log.entries():
        if entry.timestamp_ms <= T0 + 500:
            before.add(entry)
    _report, done = await audit_from(before, SETTINGS, checkpointing=True)
    done.horizon_ms = 0  # the slice keeps only what is still live
    path = tmp_path / "audit.checkpoint"
    done.checkpoint(SETTINGS, ADMIN).write(path)
    checkpoint = Checkpoint.read(path)
    combined, _slice = checkpoint.continue_with(log, SETTINGS)
    resumed, _done = await audit_from(combined, SETTINGS, checkpoint)
    assert resumed["verdict"] == "pass" and resumed["violations"] == 0, _summary(resumed)
    assert resumed["stats"]["writes"] == whole["stats"]["writes"] == 2
