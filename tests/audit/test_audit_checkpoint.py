"""An audit resumed from a checkpoint judges a log exactly as an audit of the whole log does, from the
checkpoint's slice and the new messages only; a checkpoint that was changed, signed by another key,
made for other topics or not continued by the log is refused (``arbiter.audit.checkpoint``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from arbiter.audit import audit, audit_from
from arbiter.audit.checkpoint import Checkpoint, CheckpointError
from arbiter.audit.log import Entry, Log, load_archive
from arbiter.edge.settings import Settings
from arbiter.schemas import LockGranted, ToolApplied
from arbiter.schemas.identity import Signer
from tests.conftest import REPO
from tests.golden.record import STORIES, golden_settings

GOLDEN = REPO / "tests" / "golden"
ADMIN = Signer.generate("admin")
STATS = ("grants", "writes", "rejected_writes", "expiries", "revocations", "acquires", "intents", "sagas",
         "deadlocks", "compensated_steps", "sagas_compensated", "decisions", "dead_lettered")


def _prefix(log: Log, fraction: float) -> Log:
    """The log as an audit read it earlier: each partition up to the same moment."""
    start, end = log.span_ms()
    moment = start + (end - start) * fraction
    out = Log(log.topics, source=log.source, partition_count=log.partition_count, archived_rules=log.archived_rules)
    for entries in log.partitions.values():
        for entry in entries:
            if entry.timestamp_ms <= moment:
                out.add(entry)
            else:
                break
    return out


def _settings(log: Log, tmp_path: Path) -> Settings:
    """The golden histories' settings (no trust anchor: their messages are not signed, and an auditor
    with one would check, and refuse, every one); checkpoints are signed and verified with ``ADMIN``."""
    return golden_settings(log).model_copy(update={"home": tmp_path})


def _judged(report: dict[str, Any]) -> tuple[str, set[tuple[str, str, str, tuple[str, ...]]], dict[str, int]]:
    findings = {(f["check"], f["severity"], f["message"], tuple(f["where"])) for f in report["findings"]}
    return report["verdict"], findings, {k: report["stats"].get(k, 0) for k in STATS}


def _read_since(log: Log, since: dict[tuple[str, int], int]) -> Log:
    """The log as ``read_log(settings, since=...)`` reads it from the live topics: each partition
    ``since`` names from that offset on, every other one whole."""
    out = Log(log.topics, source=log.source, partition_count=log.partition_count, archived_rules=log.archived_rules)
    for (topic, partition), entries in log.partitions.items():
        for entry in entries:
            if entry.offset >= since.get((topic, partition), 0):
                out.add(entry)
    return out


async def _resumed(
    log: Log, settings: Settings, fraction: float, tmp_path: Path, horizon_ms: int | None, live: bool = False
) -> dict[str, Any]:
    _first, done = await audit_from(_prefix(log, fraction), settings, checkpointing=True)
    if horizon_ms is not None:
        done.horizon_ms = horizon_ms
    path = tmp_path / "audit.checkpoint"
    done.checkpoint(settings, ADMIN).write(path)
    checkpoint = Checkpoint.read(path)
    checkpoint.verify([ADMIN.public_raw])
    checkpoint.check_settings(settings)
    fresh = _read_since(log, checkpoint.since(settings.topics.registry)) if live else log
    combined, _slice = checkpoint.continue_with(fresh, settings)
    report, _done = await audit_from(combined, settings, checkpoint, checkpointing=True)
    assert report["messages"] == len(log)
    return report


@pytest.mark.parametrize("name", sorted(STORIES))
@pytest.mark.parametrize("fraction", [0.3, 0.6, 0.9])
@pytest.mark.parametrize("horizon_ms", [0, None], ids=["live-state-only", "id-window"])
@pytest.mark.parametrize("read", ["archive", "live"])
async def test_a_resumed_audit_judges_as_the_whole_audit(name: str, fraction: float, horizon_ms: int | None,
                                                         read: str, tmp_path: Path) -> None:
    """Horizon 0 keeps only the live state (what is still open however old): the hardest case. ``live``
    reads only what the live topics give from the checkpoint on (the registry whole), as the CLI does."""
    log = load_archive(GOLDEN / f"{name}.jsonl")
    settings = _settings(log, tmp_path)
    whole = await audit(log, settings)
    assert whole["verdict"] == "pass", "the history is audited as it was decided"
    resumed = await _resumed(log, settings, fraction, tmp_path, horizon_ms, live=read == "live")
    assert _judged(resumed) == _judged(whole)


def _edit(log: Log, pick: Callable[[Entry], bool], change: Callable[[Any], Any]) -> tuple[Log, Entry]:
    """A copy of ``log`` with the last message ``pick`` chooses changed (a buggy worker's decision)."""
    chosen = [e for e in log.entries() if pick(e)][-1]
    out = Log(log.topics, source=log.source, partition_count=log.partition_count, archived_rules=log.archived_rules)
    for entry in log.entries():
        out.add(replace(entry, record=change(entry.record), value=None) if entry is chosen else entry)
    return out, chosen


@pytest.mark.parametrize("edit", ["stale-write", "second-holder"])
async def test_a_rule_broken_after_the_checkpoint_fails_the_resumed_audit(edit: str, tmp_path: Path) -> None:
    log = load_archive(GOLDEN / "zombie.jsonl")
    if edit == "stale-write":
        bad, chosen = _edit(log, lambda e: isinstance(e.record, ToolApplied),
                            lambda r: r.model_copy(update={"version": r.version + 5}))
    else:
        bad, chosen = _edit(log, lambda e: isinstance(e.record, LockGranted),
                            lambda r: r.model_copy(update={"token": 1}))
    settings = _settings(bad, tmp_path)
    whole = await audit(bad, settings)
    assert whole["verdict"] == "fail", "the edit breaks a rule"
    start, end = bad.span_ms()
    fraction = max(0.05, (chosen.timestamp_ms - start) / max(1, end - start) - 0.05)
    resumed = await _resumed(bad, settings, fraction, tmp_path, 0)
    assert _judged(resumed) == _judged(whole)


async def test_a_checkpoint_that_was_changed_or_is_someone_elses_is_refused(tmp_path: Path) -> None:
    log = load_archive(GOLDEN / "ring.jsonl")
    settings = _settings(log, tmp_path)
    _report, done = await audit_from(_prefix(log, 0.5), settings, checkpointing=True)
    path = tmp_path / "audit.checkpoint"
    done.checkpoint(settings, ADMIN).write(path)

    data = json.loads(path.read_text())
    data["findings"].append({"check": "mutual_exclusion", "severity": "violation", "message": "made up",
                             "where": [], "resource": None, "at_ms": None})  # or hide one, or change a figure
    data["messages"] += 1
    path.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match="does not verify"):
        Checkpoint.read(path).verify([ADMIN.public_raw])

    done.checkpoint(settings, Signer.generate("admin")).write(path)
    with pytest.raises(CheckpointError, match="not one of the admin public keys"):
        Checkpoint.read(path).verify([ADMIN.public_raw])

    done.checkpoint(settings, ADMIN).write(path)
    checkpoint = Checkpoint.read(path)
    other = settings.model_copy(update={"topics": settings.topics.model_copy(update={"resource_events": "x.y"})})
    with pytest.raises(CheckpointError, match="other topics"):
        checkpoint.check_settings(other)

    # A log that does not continue the audited one (its last audited message differs).
    last = max((e for e in checkpoint_entries(log, checkpoint)), key=lambda e: e.offset)
    changed, _ = _edit(log, lambda e: e is last, lambda r: r.model_copy(update={"at_ms": getattr(r, "at_ms", 0) + 1})
                       if hasattr(r, "at_ms") else r.model_copy())
    moved = Log(log.topics, source=log.source, partition_count=log.partition_count)
    for entry in changed.entries():
        moved.add(replace(entry, timestamp_ms=entry.timestamp_ms + 1) if entry.where == last.where else entry)
    with pytest.raises(CheckpointError, match="is not the message the checkpoint audited"):
        checkpoint.continue_with(moved, settings)


def checkpoint_entries(log: Log, checkpoint: Checkpoint) -> list[Entry]:
    """The last audited message of each partition the checkpoint names (but the registry's)."""
    out = []
    for where, through in checkpoint.through.items():
        topic, _, part = where.rpartition("[")
        if topic == log.topics.registry:
            continue
        found = log.find(topic, int(part.rstrip("]")), through - 1)
        if found is not None:
            out.append(found)
    return out


@pytest.mark.parametrize("name", sorted(STORIES))
async def test_checkpoints_chain(name: str, tmp_path: Path) -> None:
    """Each audit resumes from the last one's checkpoint and leaves the next: the last judges as one
    audit of the whole log does."""
    log = load_archive(GOLDEN / f"{name}.jsonl")
    settings = _settings(log, tmp_path)
    path = tmp_path / "audit.checkpoint"
    checkpoint: Checkpoint | None = None
    for fraction in (0.2, 0.45, 0.7, 0.95, 1.0):
        part = _prefix(log, fraction)
        if checkpoint is not None:
            part, _slice = checkpoint.continue_with(part, settings)
        report, done = await audit_from(part, settings, checkpoint, checkpointing=True)
        done.horizon_ms = 0
        done.checkpoint(settings, ADMIN).write(path)
        checkpoint = Checkpoint.read(path)
        checkpoint.verify([ADMIN.public_raw])
    assert _judged(report) == _judged(await audit(log, settings))
    assert report["messages"] == len(log)
