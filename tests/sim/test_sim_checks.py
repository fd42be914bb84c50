"""The simulation's own checks, beyond the audit: liveness once the faults stop."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

from arbiter.edge.kafkaio import TopicPartition
from arbiter.schemas import Cause, LockGranted, LockRequested, default_codec
from arbiter.sim.kafka import SimKafka
from arbiter.sim.loop import EPOCH_MS, run
from arbiter.sim.scenarios import Outcome, liveness, settings_for


def _outcome(tmp_path: Path, answer_after_ms: int | None, quiet_from_ms: int = 1_000) -> Outcome:
    settings = settings_for(random.Random(0), tmp_path)
    kafka, codec = SimKafka(), default_codec()
    for topic in settings.topics.all():
        kafka.create_topic(topic, settings.partitions)
    commands = settings.topics.resource_commands

    async def main() -> None:
        await asyncio.sleep(2.0)
        request = LockRequested(request_id="r1", agent_id="ann", resource="doc:a", mode="exclusive", ttl_ms=1_000,
                                wait_ms=500, at_ms=EPOCH_MS + 2_000)
        kafka.append(commands, 0, b"doc:a", codec.encode(request), [])
        if answer_after_ms is not None:
            await asyncio.sleep(answer_after_ms / 1000)
            granted = LockGranted(request_id="r1", agent_id="ann", resource="doc:a", mode="exclusive", token=1,
                                  expires_at_ms=EPOCH_MS + 9_000, holders=[], resource_version=0,
                                  at_ms=EPOCH_MS + 2_000 + answer_after_ms,
                                  cause=Cause(topic=commands, partition=0, offset=0))
            kafka.append(settings.topics.resource_events, 0, b"doc:a", codec.encode(granted), [])

    run(main())
    kafka.committed[settings.app_id] = {TopicPartition(commands, 0): 1, TopicPartition(commands, 1): 0}
    return Outcome("test", 0, kafka, settings, quiet_from_ms=quiet_from_ms)


def test_a_request_answered_in_time_passes(tmp_path: Path) -> None:
    assert liveness(_outcome(tmp_path, answer_after_ms=400)) == []


def test_a_request_answered_late_or_never_is_found(tmp_path: Path) -> None:
    (late,) = liveness(_outcome(tmp_path, answer_after_ms=500 + 3_100))
    assert "r1" in late and "answered after 3600 ms" in late
    (never,) = liveness(_outcome(tmp_path, answer_after_ms=None))
    assert "never answered" in never
    # Sent before the faults stopped: only the audit's "every request answered" judges it.
    assert liveness(_outcome(tmp_path, answer_after_ms=None, quiet_from_ms=5_000)) == []


def test_an_input_left_undecided_is_found(tmp_path: Path) -> None:
    outcome = _outcome(tmp_path, answer_after_ms=100)
    outcome.kafka.committed[outcome.settings.app_id][TopicPartition(outcome.settings.topics.resource_commands, 0)] = 0
    (short,) = liveness(outcome)
    assert "1 inputs left undecided" in short
