"""Golden histories: the recorded decisions of the seed stories must not change by accident.

Each history under tests/golden/ holds the commands that came from outside and the
decisions the processors made from them. A code change that alters any decision
fails here, with the first differing line. If the change is intended, re-derive the
histories (``python -m tests.golden.record --rewrite``) and commit them with it: the
diff shows which decisions changed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from arbiter.audit import audit
from arbiter.audit.log import Log, load_archive, to_line
from arbiter.audit.replay import outside_inputs, simulate
from tests.golden.record import STORIES, golden_settings

GOLDEN = Path(__file__).resolve().parent / "golden"


def history(name: str) -> Log:
    return load_archive(GOLDEN / f"{name}.jsonl")


def records(log: Log, kind: str) -> list[dict[str, object]]:
    """The decisions of one kind, as logged on the decision topics (not the agents' inbox copies)."""
    topics = (log.topics.resource_events, log.topics.wait_edges, log.topics.saga_events)
    return [e.record.model_dump() for topic in topics for e in log.of(topic)
            if e.record is not None and type(e.record).__name__ == kind]


def test_every_story_has_a_history() -> None:
    assert sorted(p.stem for p in GOLDEN.glob("*.jsonl")) == sorted(STORIES)


@pytest.mark.parametrize("name", sorted(STORIES))
async def test_the_decisions_are_the_recorded_ones(name: str) -> None:
    log = history(name)
    settings = golden_settings(log)
    replayed = await simulate(log, settings, outside=outside_inputs(log, settings))
    want = [to_line(e) for e in log.entries()]
    got = [to_line(e) for e in replayed.entries()]
    first = next((i for i, (a, b) in enumerate(zip(want, got, strict=False)) if a != b), min(len(want), len(got)))
    assert got == want, (
        f"{name}: the code now decides differently from the recorded history, first at message {first + 1}:\n"
        f"  recorded: {want[first][:400] if first < len(want) else '(nothing)'}\n"
        f"  now:      {got[first][:400] if first < len(got) else '(nothing)'}\n"
        "If the change is intended: python -m tests.golden.record --rewrite, and commit the histories with it.")


@pytest.mark.parametrize("name", sorted(STORIES))
async def test_every_history_passes_audit(name: str) -> None:
    log = history(name)
    report = await audit(log, golden_settings(log))
    assert report["verdict"] == "pass" and report["findings"] == []


def test_zombie_history_fences_the_stalled_agent() -> None:
    log = history("zombie")
    expired = records(log, "LockExpired")
    rejected = [r for r in records(log, "ToolRejected") if r["reason"] == "stale_fencing_token"]
    applied = records(log, "ToolApplied")
    assert [e["agent_id"] for e in expired] == ["slow-1"]
    assert [r["agent_id"] for r in rejected] == ["slow-1"]
    assert [a["agent_id"] for a in applied] == ["backup-1"]


def test_double_refund_history_refunds_each_order_once() -> None:
    log = history("double-refund")
    refunds = [json.loads(str(a["arguments_json"]))["order_id"] for a in records(log, "ToolApplied")]
    assert len(refunds) == len(set(refunds)) == 2
    conflicts = [r for r in records(log, "ToolRejected") if r["reason"] == "version_conflict"]
    assert conflicts, "a racer that read before the refund is refused, with the refund listed"
    assert all("refund" in r["diagnostic_json"] for r in conflicts)


def test_ring_history_breaks_the_cycle_and_compensates_the_victim() -> None:
    log = history("ring")
    (detection,) = records(log, "DeadlockDetected")
    assert detection["victim"] == "documentation"
    assert detection["cycle"] == ["documentation", "routing", "refactoring", "testing"]
    finished = {str(r["saga_id"]).split(":")[1]: r["outcome"] for r in records(log, "SagaFinished")}
    assert finished == {"documentation-change": "COMPENSATED", "routing-change": "COMPLETED",
                        "refactoring-change": "COMPLETED", "testing-change": "COMPLETED"}
    assert len(records(log, "Compensated")) == 1


def test_occ_history_rebases_every_conflict() -> None:
    log = history("occ-rebase")
    commits = [a for a in records(log, "ToolApplied") if a["tool"] == "commit"]
    conflicts = [r for r in records(log, "ToolRejected") if r["reason"] == "version_conflict"]
    assert [c["version"] for c in commits] == [1, 2, 3], "three drafters, three versions, nothing lost"
    assert conflicts, "the drafters raced"
