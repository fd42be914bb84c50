"""One process's Kafka clients for its SDK agents: one producer, one inbox reader, one registry feed.

Theory of operation
-------------------
Every ``ArbiterClient`` in a process that connects with the same settings (bootstrap,
Kafka login, inbox and registry topics, verification and its trust anchors, message
size) shares one ``InboxHub``: one producer for every agent's commands, one
``RegistryFeed`` for checking the workers' signatures, and one consumer reading the
inbox. Different settings get different hubs. Hubs belong to an event loop: a hub is
only found from the loop that made it, so one from a closed loop is never reused.
The first client to join starts the hub; the last to leave closes it.

The consumer is assigned the union of the inbox partitions its agents' ids land on
(``arbiter.schemas.partitioning``, the workers' rule), committed records only. The reader
looks each record's key up in a dict of the agents that joined; a record for any
other agent is skipped there, never decoded or verified. A joined agent's records go
to its ``Member.deliver``, which decodes, verifies and counts forgeries for that agent
alone (``arbiter.agents.transport``). Delivery is in order and one at a time, so a record
signed by a key the registry does not know yet holds the reader (every agent of the
hub) while the feed catches up: one round trip, five seconds at most.

Joining pins the agent's start before ``join`` returns, so no outcome of a command it
sends afterwards is missed. ``join`` asks for the end offset of the agent's partition,
and the agent gets only records from that offset on: on a partition it already reads,
the reader may still be behind it, and what it reads there first is from before the
agent started. A partition no one read yet is added to the assignment at that offset.
``assign`` replaces a whole assignment and forgets its positions, so the hub keeps its
own: for each assigned partition, the offset after the last record ``getmany`` handed
the reader, recorded before any of them is dispatched. A new assignment seeks every
partition back to that offset, in the same step with no await between (the reader
cannot fetch in between), so the partitions already read lose and repeat nothing. A
partition whose last agent leaves is dropped the same way.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections import Counter
from typing import Any, Protocol

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from arbiter.edge.kafkaauth import kafka_client_options
from arbiter.edge.kafkaconn import close_client
from arbiter.edge.keys import anchors_for
from arbiter.edge.registryfeed import RegistryFeed
from arbiter.edge.settings import Settings
from arbiter.schemas.identity import Registry
from arbiter.schemas.partitioning import partition_for

log = logging.getLogger(__name__)


class Member(Protocol):
    """What the reader hands an agent's inbox records to."""

    async def deliver(self, message: Any) -> None:
        """Handle one raw inbox message keyed by this agent (an aiokafka ``ConsumerRecord``)."""


HubKey = tuple[object, ...]

_HUBS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[HubKey, InboxHub]] = weakref.WeakKeyDictionary()


def hub_key(settings: Settings) -> HubKey:
    """Which clients may share a hub: those whose connection and trust settings are all equal."""
    anchors = tuple(sorted(anchors_for(settings.home, settings.admin_public_keys))) \
        if settings.verify_signatures else ()
    return (settings.bootstrap, settings.kafka_security_protocol, settings.kafka_sasl_mechanism,
            settings.kafka_username, settings.kafka_password, settings.topics.agent_inbox,
            settings.topics.registry, settings.verify_signatures, anchors, settings.max_message_bytes)


async def join(settings: Settings, agent_id: str, member: Member) -> InboxHub:
    """Join this loop's hub for ``settings`` (starting it if needed) and start reading ``agent_id``'s inbox.

    Returns once the start position is pinned. ``hub.leave(agent_id, member)`` undoes it.
    """
    hubs = _HUBS.setdefault(asyncio.get_running_loop(), {})
    key = hub_key(settings)
    hub = hubs.get(key)
    if hub is None:
        hub = hubs[key] = InboxHub(settings, key)
    hub.refs += 1  # before any await: a client leaving meanwhile must not close it under us
    try:
        await hub.started()
        await hub.add(agent_id, member)
    except BaseException:
        await hub.release()
        raise
    return hub


class InboxHub:
    """The shared producer, registry feed and inbox reader of the clients with one ``hub_key``."""

    def __init__(self, settings: Settings, key: HubKey) -> None:
        self.settings = settings
        self.key = key
        self.refs = 0
        """Clients that joined, or are joining, and have not left."""
        self.producer: AIOKafkaProducer | None = None
        self.consumer: AIOKafkaConsumer | None = None
        self.feed: RegistryFeed | None = None
        """The registry the workers' signatures are checked against; None when verification is off."""
        self.members: dict[bytes, list[tuple[Member, int]]] = {}
        """Per inbox key (agent id): who gets its records, and from which offset on."""
        self._agents_on: Counter[TopicPartition] = Counter()
        self._next: dict[TopicPartition, int] = {}
        """The partitions to read, each with the offset after the last record the reader was handed."""
        self._partitions = 0
        self._starting: asyncio.Task[None] | None = None
        self._reader: asyncio.Task[None] | None = None

    # -- lifecycle --------------------------------------------------------------------

    async def started(self) -> None:
        """Start the Kafka clients once; every joiner awaits the same start."""
        if self._starting is None:
            self._starting = asyncio.ensure_future(self._start())
        await asyncio.shield(self._starting)

    async def _start(self) -> None:
        settings = self.settings
        kafka = kafka_client_options(settings)
        try:
            if settings.verify_signatures:
                registry = Registry(anchors_for(settings.home, settings.admin_public_keys))
                self.feed = RegistryFeed(registry, settings)
                await self.feed.start()
            # A front door sends for a thousand agents through this one producer: a batch as large
            # as a request (not aiokafka's 16 KiB) keeps a burst from queueing sends behind full batches.
            self.producer = AIOKafkaProducer(bootstrap_servers=settings.bootstrap, acks="all", linger_ms=0,
                                             max_request_size=2 * settings.max_message_bytes,
                                             max_batch_size=2 * settings.max_message_bytes, **kafka)
            await self.producer.start()
            self._partitions = len(await self.producer.partitions_for(settings.topics.agent_inbox))
            self.consumer = AIOKafkaConsumer(
                bootstrap_servers=settings.bootstrap,
                enable_auto_commit=False,
                fetch_max_wait_ms=50,
                group_id=None,
                # Under exactly_once, workers write in transactions: never act on an aborted one.
                isolation_level="read_committed",
                **kafka,
            )
            await self.consumer.start()
            # Every inbox partition assigned, and paused until an agent on it joins: the reader then
            # fetches only its agents' partitions, and the metadata asked for is the inbox topic's alone
            # (an empty assignment would ask for the whole cluster's).
            every = [TopicPartition(settings.topics.agent_inbox, p) for p in range(self._partitions)]
            self.consumer.assign(every)
            self.consumer.pause(*every)
        except BaseException:
            self._forget()  # later clients start a new hub; the joiners waiting on this one release it
            await self._close_clients()  # what did start is closed, not left for the garbage collector
            raise
        self._reader = asyncio.create_task(self._read(), name="arbiter-inbox")
        self._reader.add_done_callback(self._reader_ended)

    async def release(self) -> None:
        """One client less; the last one closes the Kafka clients."""
        self.refs -= 1
        if self.refs > 0:
            return
        self._forget()
        if self._starting is not None and not self._starting.done():
            self._starting.cancel()
        tasks = [task for task in (self._starting, self._reader) if task is not None]
        if self._reader is not None:
            self._reader.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._close_clients()

    async def _close_clients(self) -> None:
        consumer, producer, feed = self.consumer, self.producer, self.feed
        closing = [close_client(consumer) if consumer is not None else None,
                   close_client(producer) if producer is not None else None,
                   feed.stop() if feed is not None else None]
        for failed in await asyncio.gather(*(c for c in closing if c is not None), return_exceptions=True):
            if isinstance(failed, Exception):  # (closing after a failed start: the start's error is the news)
                log.debug("closing an inbox hub's client failed: %r", failed)

    def _forget(self) -> None:
        """No new client finds this hub any more."""
        hubs = _HUBS.get(asyncio.get_running_loop(), {})
        if hubs.get(self.key) is self:
            del hubs[self.key]

    # -- membership -------------------------------------------------------------------

    def partition_of(self, agent_id: str) -> TopicPartition:
        """The inbox partition ``agent_id``'s records land on."""
        return TopicPartition(self.settings.topics.agent_inbox, partition_for(agent_id.encode(), self._partitions))

    async def add(self, agent_id: str, member: Member) -> None:
        """Hand ``member`` ``agent_id``'s inbox records from the partition's current end on."""
        assert self.consumer is not None
        tp = self.partition_of(agent_id)
        end = (await self.consumer.end_offsets([tp]))[tp]
        # No await from here on: the reader cannot run in between.
        if tp not in self._next:
            self._next[tp] = end
            self._assign()
        self._agents_on[tp] += 1
        self.members.setdefault(agent_id.encode(), []).append((member, end))

    async def leave(self, agent_id: str, member: Member) -> None:
        """Stop handing ``member`` records, and release the hub."""
        key = agent_id.encode()
        rest = [entry for entry in self.members.get(key, []) if entry[0] is not member]
        if len(rest) < len(self.members.get(key, [])):
            if rest:
                self.members[key] = rest
            else:
                del self.members[key]
            self._agents_on[self.partition_of(agent_id)] -= 1
            idle = [tp for tp in self._next if self._agents_on[tp] <= 0]
            if idle and len(idle) < len(self._next):  # the last one stays: the hub closes, or reuses it
                for tp in idle:
                    del self._next[tp]
                self._assign()
        await self.release()

    def assignment(self) -> set[TopicPartition]:
        """The inbox partitions the reader reads."""
        if self.consumer is None:
            return set()
        return set(self.consumer.assignment()) - set(self.consumer.paused())

    def _assign(self) -> None:
        """Read exactly the partitions in ``_next``: each newly read one from its offset, the others
        paused (synchronous: no record is lost or repeated on the partitions already read)."""
        assert self.consumer is not None
        reading = self.assignment()
        for tp in reading - set(self._next):
            self.consumer.pause(tp)
        for tp in set(self._next) - reading:
            self.consumer.seek(tp, self._next[tp])
            self.consumer.resume(tp)

    # -- the reader -------------------------------------------------------------------

    @staticmethod
    def _reader_ended(reader: asyncio.Task[None]) -> None:
        if not reader.cancelled() and reader.exception() is not None:
            log.error("the inbox reader stopped: no client in this process gets outcomes any more",
                      exc_info=reader.exception())

    async def _read(self) -> None:
        consumer = self.consumer
        assert consumer is not None
        while True:
            batches = await consumer.getmany(timeout_ms=1000)
            for tp, messages in batches.items():
                if tp in self._next:
                    self._next[tp] = messages[-1].offset + 1
            for messages in batches.values():
                for message in messages:
                    entries = self.members.get(message.key)
                    if not entries:
                        continue  # another agent's: not decoded, not verified
                    for member, since in tuple(entries):
                        if message.offset < since:
                            continue  # appended before this agent started
                        try:
                            await member.deliver(message)
                        except Exception:  # one client's failure must not stop the others' inbox
                            log.exception("inbox record at %s[%d]@%d failed for %r", message.topic,
                                          message.partition, message.offset, message.key)
