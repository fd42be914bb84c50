"""The librdkafka threads answer callers across threads; a caller that gave up must not stop them.

CI caught the class once: a commit's caller timed out (which cancels its future), the consumer's thread
then answered the cancelled future, ``set_exception`` raised ``InvalidStateError``, and the worker's
consumer thread died. Every thread-side answer goes through ``reply``/``refuse``.
"""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from arbiter.edge.kafkaio.group import RdGroup
from arbiter.edge.kafkaio.rdkafka import refuse, reply
from arbiter.edge.settings import Settings


def test_answers_to_a_caller_that_gave_up_are_dropped() -> None:
    for settle in (lambda f: reply(f, 1), lambda f: refuse(f, RuntimeError("late"))):
        gone: Future[int] = Future()
        assert gone.cancel()
        settle(gone)  # no InvalidStateError
        assert gone.cancelled()
    waiting: Future[int] = Future()
    reply(waiting, 7)
    assert waiting.result() == 7
    failing: Future[int] = Future()
    refuse(failing, RuntimeError("no"))
    with pytest.raises(RuntimeError, match="no"):
        failing.result()


def _group() -> RdGroup:
    return RdGroup(Settings(), client_id="t", group_id="t", session_ms=6000, heartbeat_ms=2000,
                   rebalance_ms=6000, max_batch=10)


def test_the_consumer_thread_skips_abandoned_work_and_survives_a_late_cancel() -> None:
    group = _group()
    ran: list[str] = []
    abandoned = group._ask(lambda consumer: ran.append("abandoned"))
    abandoned.cancel()
    answered = group._ask(lambda consumer: ran.append("answered") or "ok")

    def cancelled_meanwhile(consumer: object) -> None:
        gave_up.cancel()  # the caller's timeout fires while the thread works (the future is still pending)
        raise RuntimeError("Commit failed: Broker: Unknown member")

    gave_up = group._ask(cancelled_meanwhile)
    group._obey(consumer=None)  # type: ignore[arg-type]  # (the work above never touches the consumer)
    assert ran == ["answered"]
    assert answered.result() == "ok"
    assert gave_up.cancelled()
    group._fail_requests(RuntimeError("stopped"))  # nothing left; and it, too, must not raise
