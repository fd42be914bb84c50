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

The reader (``arbiter.edge.kafkaio``: librdkafka by default) reads the union of the inbox
partitions its agents' ids land on (``arbiter.schemas.partitioning``, the workers' rule),
committed records only. The hub looks each record's key up in a dict of the agents that
joined; a record for any other agent is skipped there, never decoded or verified. A joined
agent's records go to its ``Member.deliver``, which decodes, verifies and counts forgeries
for that agent alone (``arbiter.agents.transport``). Delivery is in order and one at a
time, so a record signed by a key the registry does not know yet holds the reader (every
agent of the hub) while the feed catches up: one round trip, five seconds at most.

Joining pins the agent's start before ``join`` returns, so no outcome of a command it
sends afterwards is missed. ``join`` asks for the end offset of the agent's partition,
and the agent gets only records from that offset on: on a partition the reader already
reads, it may still be behind that offset, and what it reads there first is from before
the agent started. A partition no one read yet is added to the reader at that offset, in
the same step with no await between. The reader keeps each partition's position itself and
hands out each record once, in order, however partitions are added and dropped around it
(``arbiter.edge.kafkaio``); a partition whose last agent leaves is dropped.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections import Counter
from typing import Protocol

from arbiter.edge.kafkaio import Reader, Received, Sender, reader_for, sender_for
from arbiter.edge.keys import anchors_for
from arbiter.edge.registryfeed import RegistryFeed
from arbiter.edge.settings import Settings
from arbiter.schemas.identity import Registry
from arbiter.schemas.partitioning import partition_for

log = logging.getLogger(__name__)


class Member(Protocol):
    """What the reader hands an agent's inbox records to."""

    async def deliver(self, message: Received) -> None:
        """Handle one raw inbox record keyed by this agent."""


HubKey = tuple[object, ...]

_HUBS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[HubKey, InboxHub]] = weakref.WeakKeyDictionary()


def hub_key(settings: Settings) -> HubKey:
    """Which clients may share a hub: those whose connection and trust settings are all equal."""
    anchors = tuple(sorted(anchors_for(settings.home, settings.admin_public_keys))) \
        if settings.verify_signatures else ()
    return (settings.bootstrap, settings.kafka_security_protocol, settings.kafka_sasl_mechanism,
            settings.kafka_username, settings.kafka_password, settings.topics.agent_inbox,
            settings.topics.registry, settings.verify_signatures, anchors, settings.max_message_bytes,
            settings.kafka_client, settings.send_retry_seconds)


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
        self.sender: Sender | None = None
        """Every agent's commands go out through this one."""
        self.reader: Reader | None = None
        self.feed: RegistryFeed | None = None
        """The registry the workers' signatures are checked against; None when verification is off."""
        self.members: dict[bytes, list[tuple[Member, int]]] = {}
        """Per inbox key (agent id): who gets its records, and from which offset on."""
        self._agents_on: Counter[int] = Counter()
        """Per inbox partition: how many joined agents' ids land on it."""
        self._partitions = 0
        self._starting: asyncio.Task[None] | None = None
        self._reading: asyncio.Task[None] | None = None
        self.closed = False
        """Whether the last client left and the Kafka clients are closed."""

    # -- lifecycle --------------------------------------------------------------------

    async def started(self) -> None:
        """Start the Kafka clients once; every joiner awaits the same start."""
        if self._starting is None:
            self._starting = asyncio.ensure_future(self._start())
        await asyncio.shield(self._starting)

    async def _start(self) -> None:
        settings = self.settings
        try:
            if settings.verify_signatures:
                registry = Registry(anchors_for(settings.home, settings.admin_public_keys))
                self.feed = RegistryFeed(registry, settings)
                await self.feed.start()
            self.sender = sender_for(settings)
            await self.sender.start()
            self._partitions = await self.sender.partitions(settings.topics.agent_inbox)
            self.reader = reader_for(settings)
            await self.reader.start()
        except BaseException:
            self._forget()  # later clients start a new hub; the joiners waiting on this one release it
            await self._close_clients()  # what did start is closed, not left for the garbage collector
            raise
        self._reading = asyncio.create_task(self._read(), name="arbiter-inbox")
        self._reading.add_done_callback(self._reader_ended)

    async def release(self) -> None:
        """One client less; the last one closes the Kafka clients."""
        self.refs -= 1
        if self.refs > 0:
            return
        self._forget()
        if self._starting is not None and not self._starting.done():
            self._starting.cancel()
        tasks = [task for task in (self._starting, self._reading) if task is not None]
        if self._reading is not None:
            self._reading.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._close_clients()

    async def _close_clients(self) -> None:
        closing = [client.stop() for client in (self.reader, self.sender, self.feed) if client is not None]
        for failed in await asyncio.gather(*closing, return_exceptions=True):
            if isinstance(failed, Exception):  # (closing after a failed start: the start's error is the news)
                log.debug("closing an inbox hub's client failed: %r", failed)
        self.closed = True

    def _forget(self) -> None:
        """No new client finds this hub any more."""
        hubs = _HUBS.get(asyncio.get_running_loop(), {})
        if hubs.get(self.key) is self:
            del hubs[self.key]

    # -- membership -------------------------------------------------------------------

    def partition_of(self, agent_id: str) -> tuple[str, int]:
        """The inbox partition ``agent_id``'s records land on, as (topic, partition)."""
        return self.settings.topics.agent_inbox, partition_for(agent_id.encode(), self._partitions)

    async def add(self, agent_id: str, member: Member) -> None:
        """Hand ``member`` ``agent_id``'s inbox records from the partition's current end on."""
        assert self.reader is not None
        topic, partition = self.partition_of(agent_id)
        end = await self.reader.end_offset(topic, partition)
        # No await from here on: the reader hands out nothing in between.
        self.reader.add(topic, partition, end)  # (a partition read already keeps its position)
        self._agents_on[partition] += 1
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
            topic, partition = self.partition_of(agent_id)
            self._agents_on[partition] -= 1
            if self._agents_on[partition] <= 0 and self.reader is not None:
                del self._agents_on[partition]
                self.reader.drop(topic, partition)
        await self.release()

    def assignment(self) -> set[tuple[str, int]]:
        """The inbox partitions the reader reads, as (topic, partition)."""
        return self.reader.reading() if self.reader is not None else set()

    # -- the reader -------------------------------------------------------------------

    @staticmethod
    def _reader_ended(reader: asyncio.Task[None]) -> None:
        if not reader.cancelled() and reader.exception() is not None:
            log.error("the inbox reader stopped: no client in this process gets outcomes any more",
                      exc_info=reader.exception())

    async def _read(self) -> None:
        reader = self.reader
        assert reader is not None
        while True:
            for message in await reader.read(1.0):
                entries = self.members.get(message.key) if message.key is not None else None
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
