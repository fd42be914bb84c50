"""Golden histories: the decisions a live worker made in the seed stories must not change by accident.

Each history under tests/golden/ is the log of one story run live against a real broker
and a real ``arbiter worker`` (``python -m tests.golden.record``, which audited it before
writing it): the commands that came from outside, the clock's ticks, and every decision
the worker made from them. Here every decision is re-derived from the recorded inputs
through the processors' current code; a code change that alters any of them fails,
naming the first difference. If the change is intended, re-record the affected stories
live (``python -m tests.golden.record STORY ...``) and commit the histories with it.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from arbiter.audit.log import Log, load_archive
from arbiter.streams.shells.rules import Rules
from tests.conftest import REPO
from tests.golden.record import OUTCOMES, STORIES, audit_problems, first_difference, golden_settings

GOLDEN = REPO / "tests" / "golden"


def history(name: str) -> Log:
    return load_archive(GOLDEN / f"{name}.jsonl")


def test_every_story_has_a_history() -> None:
    assert sorted(p.stem for p in GOLDEN.glob("*.jsonl")) == sorted(STORIES)
    assert sorted(OUTCOMES) == sorted(STORIES)


@pytest.mark.parametrize("name", sorted(STORIES))
async def test_the_processors_still_make_the_recorded_decisions(name: str) -> None:
    log = history(name)
    difference = await first_difference(log, golden_settings(log))
    assert difference is None, (
        f"{name}: the code now decides differently from the live worker that recorded this history, first at\n"
        f"{difference}\nIf the change is intended: python -m tests.golden.record {name} (needs a broker), "
        "and commit the history with the change.")


@pytest.mark.parametrize("name", sorted(STORIES))
async def test_every_history_passes_audit(name: str) -> None:
    log = history(name)
    problems = await audit_problems(log, golden_settings(log))
    assert problems == [], "\n".join(problems)


@pytest.mark.parametrize("name", sorted(STORIES))
def test_the_story_turns_out_as_told(name: str) -> None:
    """zombie: fenced off; double-refund: one refund per order; ring: broken and compensated;
    occ-rebase: every conflict rebased (tests/golden/record.py, ``OUTCOMES``)."""
    OUTCOMES[name](history(name))


def test_each_history_was_recorded_from_a_worker() -> None:
    """Decisions came from a live worker: it announced its rules, answered the warm-up pings,
    and ticked the clock."""
    for name in STORIES:
        log = history(name)
        assert any(type(e.record).__name__ == "WorkerStarted" for e in log.of(log.topics.workers)), name
        assert any(type(e.record).__name__ == "Pong" for e in log.of(log.topics.agent_inbox)), name
        assert any(type(e.record).__name__ == "LockTick" for e in log.of(log.topics.resource_commands)), name


async def test_a_changed_decision_is_named() -> None:
    """The comparison is not vacuous: alter one recorded decision and it is the one reported."""
    log = history("double-refund")
    applied = next(e for e in log.of(log.topics.resource_events) if type(e.record).__name__ == "ToolApplied")
    entries = log.partitions[applied.topic, applied.partition]
    assert applied.record is not None
    entries[entries.index(applied)] = replace(applied, record=applied.record.model_copy(update={"version": 999}))
    difference = await first_difference(log, golden_settings(log))
    cause = applied.record.cause  # type: ignore[attr-defined]
    assert difference is not None
    assert difference.startswith(f"{cause.topic}[{cause.partition}]@{cause.offset} (ToolIntent)"), difference
    assert "version: recorded 999, now " in difference.splitlines()[0], difference



def test_rules_a_history_does_not_name_mean_what_was_decided_before_they_existed() -> None:
    """The histories were recorded before ``forget_window_refusals``: their rules read back without it,
    as the behaviour they were decided by; a worker today announces it, and its rules read back the same."""
    for name in STORIES:
        (text,) = history(name).announced_rules()
        assert "forget_window_refusals" not in text
        rules = Rules.from_json(text)
        assert not rules.leases.forget_window_refusals and not rules.gateway.forget_window_refusals, name
    today = Rules.from_settings(golden_settings(history("zombie")))
    assert today.leases.forget_window_refusals and today.gateway.forget_window_refusals
    assert Rules.from_json(today.to_json()) == today
