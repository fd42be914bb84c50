"""faust's aiokafka transport with the one knob faust does not expose: fetch wait.

faust-streaming 0.15 builds its worker consumer with ``fetch_max_wait_ms=1500``
hard-coded. The broker answers a fetch as soon as any data arrives, so the wait only
matters when a fetch returns empty, but aiokafka does not start the next fetch for a
partition until the previous one returns: a partition whose fetch is parked on the
broker, e.g. right after a rebalance or when the fetch went to a partition with no
data while a sibling partition got some, can leave a ready message waiting up to 1.5 s.
Arbiter's lease hand-offs are latency critical, so the wait comes from
``Settings.fetch_max_wait_ms`` instead. ``tests/bench/test_faust_baseline.py`` fails if a new
aiokafka renames the attribute this relies on.
"""

from __future__ import annotations

from typing import Any

import aiokafka
from faust.transport.drivers import aiokafka as faust_aiokafka


class ConsumerThread(faust_aiokafka.AIOKafkaConsumerThread):
    """Consumer thread that applies Arbiter's fetch wait to the worker consumer."""

    def _create_worker_consumer(self, transport: Any) -> aiokafka.AIOKafkaConsumer:
        consumer = super()._create_worker_consumer(transport)
        wait_ms = getattr(self.app, "arbiter_fetch_max_wait_ms", None)
        if wait_ms is not None:
            # Read by AIOKafkaConsumer.start() when it builds its Fetcher.
            consumer._fetch_max_wait_ms = int(wait_ms)
        return consumer


class Consumer(faust_aiokafka.Consumer):
    """faust consumer that uses ``ConsumerThread``."""

    def _new_consumer_thread(self) -> ConsumerThread:
        return ConsumerThread(self, loop=self.loop, beacon=self.beacon)


class Transport(faust_aiokafka.Transport):
    """faust aiokafka transport with Arbiter's consumer."""

    Consumer = Consumer


class GapGuard:
    """Notices when faust hands a processor a partition's messages with a hole in them.

    faust can drop messages it fetched while a rebalance paused its flow, and then
    mark the hole as done ("gap" offsets count as acknowledged), so the messages are
    never processed: seen here as commands that never got an answer, right after a
    worker joined (and caught by ``arbiter audit``). Deciding the message after the
    hole would also decide out of log order. So the processor asks ``observe`` first,
    and on a hole it decides nothing and restarts the worker, which resumes from the
    last committed offset, before the hole.

    Only for at-least-once processing: with Kafka transactions, commit markers take
    offsets and holes are normal. A hole that is still there after a restart is a real
    one (markers of an earlier transactional producer, deleted records): ``permanent``
    names it, and it is let through instead of restarting again.
    """

    RESTART_ENV = "ARBITER_RESTARTED_FOR_HOLE"
    """Set by a worker that restarts for a hole, to the hole (``topic|partition|first``)."""

    def __init__(self, permanent: str = "") -> None:
        self._next: dict[tuple[str, int], tuple[int, int]] = {}
        self._permanent = permanent

    @staticmethod
    def describe(topic: str, partition: int, first: int) -> str:
        """How a hole is named in ``RESTART_ENV``."""
        return f"{topic}|{partition}|{first}"

    def observe(self, topic: str, partition: int, generation: int, offset: int) -> tuple[int, int] | None:
        """Record a delivery; the missing offsets (first, last) when it skips some."""
        key = (topic, partition)
        seen = self._next.get(key)
        if (seen is not None and seen[0] == generation and offset > seen[1]
                and self.describe(topic, partition, seen[1]) != self._permanent):
            return seen[1], offset - 1
        # The first message of a generation, the next one, or one delivered again
        # after a seek back (decided again, idempotently).
        self._next[key] = (generation, offset + 1)
        return None
