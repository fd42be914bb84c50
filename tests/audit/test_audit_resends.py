"""Audit on a log where old commands were sent again after their ids were forgotten: each copy is
refused for its send time (``request_expired``), which answers that copy and is not a second outcome
of its id; a command sent too far ahead is refused ``clock_skew`` and decided when sent again in time.

The log is made, not recorded: the commands are decided by the processors' own code
(``arbiter.audit.replay.simulate``), as ``bench.replay`` does.
"""

from __future__ import annotations

import json

from arbiter.audit import audit
from arbiter.audit.log import Entry, Log
from arbiter.audit.replay import simulate
from arbiter.edge.settings import Settings
from arbiter.schemas import (
    LockDenied,
    LockGranted,
    LockReleaseRequested,
    LockRequested,
    Record,
    ToolApplied,
    ToolIntent,
    ToolRejected,
)

T0 = 1_700_000_000_000
RESOURCE = "account:resent"
SETTINGS = Settings(partitions=2)
WINDOW = SETTINGS.id_window_ms


def _entry(at: int, record: Record) -> Entry:
    return Entry(SETTINGS.topics.resource_commands, -1, -1, at, RESOURCE.encode(), record)


def _acquire(request_id: str, agent: str, sent: int) -> LockRequested:
    return LockRequested(request_id=request_id, agent_id=agent, resource=RESOURCE, mode="exclusive", ttl_ms=30_000,
                         wait_ms=0, at_ms=sent)


def _release(request_id: str, agent: str, token: int, sent: int) -> LockReleaseRequested:
    return LockReleaseRequested(request_id=request_id, agent_id=agent, resource=RESOURCE, token=token,
                                at_ms=sent)


def _refund(intent_id: str, agent: str, token: int, base: int, sent: int) -> ToolIntent:
    return ToolIntent(intent_id=intent_id, agent_id=agent, resource=RESOURCE, token=token, base_version=base,
                      tool="refund", arguments_json=json.dumps({"amount": 100, "order_id": intent_id}),
                      at_ms=sent)


async def _decided(commands: list[Entry]) -> Log:
    return await simulate(Log(SETTINGS.topics, source="test", partition_count=SETTINGS.partitions), SETTINGS,
                          outside=commands)


async def test_old_commands_sent_again_after_their_ids_were_forgotten_leave_the_verdict_pass() -> None:
    acquire, refund = _acquire("acquire-1", "alpha", T0), _refund("refund-1", "alpha", 1, 0, T0 + 1)
    commands = [_entry(T0, acquire), _entry(T0 + 1, refund), _entry(T0 + 2, _release("release-1", "alpha", 1, T0 + 2))]
    later = T0 + WINDOW + 1_000
    # Past the window, the resource is used again, and the memory forgets alpha's ids.
    commands += [_entry(later, _acquire("acquire-2", "beta", later)), _entry(later + 1, _refund(
        "refund-2", "beta", 2, 1, later + 1)), _entry(later + 2, _release("release-2", "beta", 2, later + 2))]
    later += 10
    for copy in range(5):  # the same signed commands, sent again by anyone who read the log
        commands += [_entry(later + 2 * copy, acquire), _entry(later + 2 * copy + 1, refund)]
    log = await _decided(commands)
    events = [e.record for e in log.of(SETTINGS.topics.resource_events)]
    assert sum(isinstance(e, LockGranted) for e in events) == 2 and sum(isinstance(e, ToolApplied) for e in events) == 2
    refused = [e for e in events if isinstance(e, LockDenied | ToolRejected)]
    assert len(refused) == 10 and {e.reason for e in refused} == {"request_expired"}
    report = await audit(log, SETTINGS)
    assert report["verdict"] == "pass" and report["findings"] == [], report["findings"]


async def test_a_command_refused_for_its_clock_and_sent_again_in_time_has_one_outcome() -> None:
    ahead = _acquire("acquire-1", "alpha", T0 + 10 * 60_000)  # ten minutes ahead of the broker
    commands = [_entry(T0, ahead), _entry(T0 + 1, ahead.model_copy(update={"at_ms": T0 + 1})),
                _entry(T0 + 2, _release("release-1", "alpha", 1, T0 + 2))]
    log = await _decided(commands)
    answers = [e.record for e in log.of(SETTINGS.topics.resource_events)
               if isinstance(e.record, LockDenied | LockGranted)]
    assert [type(e).__name__ for e in answers] == ["LockDenied", "LockGranted"]
    report = await audit(log, SETTINGS)
    assert report["verdict"] == "pass" and report["findings"] == [], report["findings"]


async def test_a_refusal_for_the_send_time_that_the_command_does_not_bear_out_is_still_an_outcome() -> None:
    """The command a refusal names must show it: an expired refusal whose command was sent after the floor it
    states is no answer to a stale copy, and a second outcome of its id is reported."""
    acquire = _acquire("acquire-1", "alpha", T0)
    later = T0 + WINDOW + 1_000
    log = await _decided([_entry(T0, acquire), _entry(T0 + 1, _release("release-1", "alpha", 1, T0 + 1)),
                          _entry(later, _acquire("acquire-2", "beta", later)),
                          _entry(later + 1, _release("release-2", "beta", 2, later + 1)), _entry(later + 2, acquire)])
    topic = SETTINGS.topics.resource_events
    for (t, p), entries in log.partitions.items():
        for i, entry in enumerate(entries):
            record = entry.record
            if t == topic and isinstance(record, LockDenied):
                detail = json.loads(record.detail)
                detail["refused_at_or_before_ms"] = T0 - 1
                entries[i] = Entry(t, p, entry.offset, entry.timestamp_ms, entry.key,
                                   record.model_copy(update={"detail": json.dumps(detail, sort_keys=True)}))
    report = await audit(log, SETTINGS)
    assert any(f["check"] == "one_outcome" and "2 final outcomes" in f["message"] for f in report["findings"]), \
        report["findings"]
