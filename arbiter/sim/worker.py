"""Arbiter's own worker (``arbiter.streams.runtime.worker.Worker``, not a copy) on the simulated Kafka.

``SimClients`` hands a worker the simulation's consumer group, producers and reader in place of
librdkafka's; ``seam_of`` (``arbiter.sim.kafka``) does the same for what reaches Kafka through the
seam (the registry feed, the SDK). The worker runs its real batches, commits, rebalances,
restores and ticks, on virtual time.
"""

from __future__ import annotations

from typing import Any

from arbiter.edge.kafkaio import Reader
from arbiter.edge.settings import Settings

from .group import SimGroup, SimTxnProducer
from .kafka import SimKafka, SimProducer, SimReader


class SimClients:
    """A worker's Kafka clients on ``kafka`` (``arbiter.streams.runtime.worker.Clients``)."""

    def __init__(self, kafka: SimKafka, settings: Settings) -> None:
        self.kafka, self.settings = kafka, settings
        self.owner = settings.worker_id
        self.member: SimGroup | None = None
        """The worker's group membership, once it joined (``crash`` ends it)."""

    def crash(self) -> None:
        """The worker's process dies: its clients fail from now on, and the group notices after its session."""
        self.kafka.kill(self.owner)
        if self.member is not None:
            self.member.crash()

    async def prepare(self, changelogs: list[str]) -> None:
        for topic in [*self.settings.topics.all(), *changelogs]:
            self.kafka.create_topic(topic, self.settings.partitions)

    def producer(self) -> Any:
        return SimProducer(self.kafka, self.owner)

    def reader(self) -> Reader:
        return SimReader(self.kafka, owner=self.owner)

    def group(self, member_id: str, group_id: str, session_ms: int) -> Any:
        self.member = SimGroup(self.kafka, member_id=member_id, group_id=group_id, session_ms=session_ms,
                               owner=self.owner)
        return self.member

    def transactional(self, transactional_id: str) -> Any:
        return SimTxnProducer(self.kafka, transactional_id, self.owner)
