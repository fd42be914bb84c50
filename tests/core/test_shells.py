"""The processors' input checks that decide whether a message is dead-lettered."""

from __future__ import annotations

from contract import Ping, SagaStep
from shells.saga import saga_key_problem


def step(saga_id: str) -> SagaStep:
    return SagaStep(saga_id=saga_id, step=0, agent_id="a", status="completed", intent_id="i", resource="r",
                    tool="t", arguments_json="{}", at_ms=0)


def test_saga_keys_must_be_utf8_saga_ids_matching_the_record() -> None:
    assert saga_key_problem(b"saga:x", step("saga:x")) is None
    assert saga_key_problem(b"saga:x", step("saga:y")).reason == "key_mismatch"  # type: ignore[union-attr]
    assert saga_key_problem(b"other", step("other")).reason == "key_mismatch"  # type: ignore[union-attr]
    assert saga_key_problem(None, step("saga:x")).reason == "key_mismatch"  # type: ignore[union-attr]
    # Not UTF-8, and a record without a saga id: dead-lettered, not a crash loop.
    ping = Ping(ping_id="p", agent_id="a", sent_at_ms=0)
    assert saga_key_problem(b"saga:\xff", ping).reason == "key_mismatch"  # type: ignore[union-attr]
