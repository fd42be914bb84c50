"""faust's aiokafka transport with the one knob faust does not expose: fetch wait.

faust-streaming 0.15 builds its worker consumer with ``fetch_max_wait_ms=1500``
hard-coded. The broker answers a fetch as soon as any data arrives, so the wait only
matters when a fetch returns empty, but aiokafka does not start the next fetch for a
partition until the previous one returns: a partition whose fetch is parked on the
broker, e.g. right after a rebalance or when the fetch went to a partition with no
data while a sibling partition got some, can leave a ready message waiting up to 1.5 s.
Arbiter's lease hand-offs are latency critical, so the wait comes from
``Settings.fetch_max_wait_ms`` instead. ``tests/test_transport.py`` fails if a new
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
