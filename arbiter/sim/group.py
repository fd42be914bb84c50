"""Consumer groups and transactions on the simulated Kafka (``arbiter.sim.kafka``).

Theory of operation
-------------------
``SimGroup`` is one member of a consumer group, with the operations the worker uses on
librdkafka's (``arbiter.edge.kafkaio.group.RdGroup``): subscribe with a listener, join, read
what arrived per partition, seek, commit. The group's coordinator lives in ``SimKafka``: a
member joining or leaving starts a rebalance, which (as Kafka's classic protocol does) first
revokes every member's partitions, each member's listener running to its end, then assigns
anew, partition *i* of every topic to the same member (co-partitioned, as Arbiter's inputs
are), and each member reads its partitions from what the group committed. A member that
crashes leaves nothing: the coordinator notices after the session timeout, and its
partitions move without a revoke; whatever it had not committed is read again by the next
owner. A commit from a member of an older generation is refused, as Kafka refuses it.

``SimTxnProducer`` is a transactional producer: the records of a transaction and the input
offsets sent with it become visible together when it commits, or never. A producer started
with the same transactional id fences the older one (its commit is refused), and a commit
whose offsets were sent for an older generation of the group is refused too. Records of a
transaction land at commit, so a reader sees only committed records (``read_committed``);
unlike Kafka, no offset is spent on transaction markers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from arbiter.edge.kafkaio import Headers, KafkaIOError, Received, TopicPartition
from arbiter.schemas.partitioning import partition_for

from .kafka import SimKafka


class Listener(Protocol):
    """What a rebalance tells a member (as ``arbiter.edge.kafkaio.group.Listener``)."""

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None: ...

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None: ...


@dataclass
class _Coordinator:
    """One group: its members in join order, its generation, its committed offsets."""

    name: str
    members: dict[str, SimGroup] = field(default_factory=dict)
    generation: int = 0
    owner: dict[TopicPartition, str] = field(default_factory=dict)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


@dataclass(frozen=True, slots=True)
class GroupMetadata:
    """What a transaction's offsets are sent with: the group, and the member's generation."""

    group: str
    member: str
    generation: int


class SimGroup:
    """A consumer-group member on the simulated Kafka (see the module's docstring)."""

    def __init__(self, kafka: SimKafka, *, member_id: str, group_id: str, session_ms: int = 6_000,
                 owner: str = "") -> None:
        self.kafka, self.member_id, self.group_id, self.session_ms = kafka, member_id, group_id, session_ms
        self.owner = owner
        self._topics: list[str] = []
        self._listener: Listener | None = None
        self._assigned: set[TopicPartition] = set()
        self._next: dict[TopicPartition, int] = {}
        self._generation = -1
        self._alive = False

    def subscribe(self, topics: Iterable[str], *, listener: Listener) -> None:
        self._topics, self._listener = sorted(topics), listener

    async def start(self) -> None:
        """Join the group: a rebalance, whose assignment this returns after."""
        self.kafka.check_up("joining the group")
        self._alive = True
        group = _coordinator(self.kafka, self.group_id)
        group.members[self.member_id] = self
        # The coordinator runs the rebalance, not the joiner: a joiner that gives up (its start cancelled)
        # stops waiting for it, and cancels no other member's revoke (which once cut a settling batch short).
        await asyncio.shield(self.kafka.spawn(rebalance(self.kafka, group)))

    async def stop(self) -> None:
        """Leave the group at once: the others get its partitions in a rebalance this does not wait for (as
        Kafka's coordinator runs it with the members that stay); its own listener is not run."""
        if not self._alive:
            return
        self._alive = False
        group = _coordinator(self.kafka, self.group_id)
        group.members.pop(self.member_id, None)
        self._assigned.clear()
        self.kafka.spawn(rebalance(self.kafka, group))

    def crash(self) -> None:
        """Die where it stands: no revoke, no commit; the group notices after the session timeout."""
        self._alive = False
        self._assigned.clear()
        group = _coordinator(self.kafka, self.group_id)

        async def notice() -> None:
            await asyncio.sleep(self.session_ms / 1000)
            if group.members.get(self.member_id) is self:
                del group.members[self.member_id]
                await rebalance(self.kafka, group)

        self.kafka.spawn(notice())

    def assignment(self) -> set[TopicPartition]:
        return set(self._assigned)

    def highwater(self, tp: TopicPartition) -> int | None:
        return len(self.kafka.records(tp.topic, tp.partition))

    def seek(self, tp: TopicPartition, offset: int) -> None:
        if tp in self._assigned:
            self._next[tp] = max(0, offset)

    async def seek_to_beginning(self, tp: TopicPartition) -> None:
        self.seek(tp, 0)

    async def committed(self, tp: TopicPartition) -> int | None:
        self.kafka.check_up("reading a committed offset")
        return self.kafka.committed.get(self.group_id, {}).get(tp)

    async def group_metadata(self) -> GroupMetadata:
        return GroupMetadata(self.group_id, self.member_id, self._generation)

    async def commit(self, offsets: dict[TopicPartition, int]) -> None:
        """Commit for the group; refused (not retriable) from a member that no longer owns a partition."""
        self.kafka.check_up("committing offsets", self.owner)
        _commit(self.kafka, GroupMetadata(self.group_id, self.member_id, self._generation), offsets)

    async def getmany(self, timeout_ms: int, max_records: int) -> dict[TopicPartition, list[Received]]:
        """The records of its partitions from its positions on (waiting up to ``timeout_ms`` for some)."""
        if not self._alive:
            raise KafkaIOError("the member has stopped", retriable=False)
        if not await self.kafka.fetched(timeout_ms / 1000):
            return {}
        out = self._take(max_records)
        if not out and timeout_ms > 0:
            await self.kafka.appended(timeout_ms / 1000, sorted(self._assigned))
            out = self._take(max_records)
        return out

    def _take(self, max_records: int) -> dict[TopicPartition, list[Received]]:
        out: dict[TopicPartition, list[Received]] = {}
        left = max_records
        for tp in sorted(self._assigned):
            if left <= 0:
                break
            records = self.kafka.records(tp.topic, tp.partition, self._next.get(tp, 0), left)
            if records:
                out[tp] = records
                self._next[tp] = records[-1].offset + 1
                left -= len(records)
        return out

    async def _revoked(self) -> None:
        revoked, self._assigned = self._assigned, set()
        if revoked and self._listener is not None and self._alive:
            await self._listener.on_partitions_revoked(revoked)

    async def _assign(self, partitions: set[TopicPartition], generation: int) -> None:
        self._generation = generation
        self._assigned = set(partitions)
        committed = self.kafka.committed.get(self.group_id, {})
        self._next = {tp: committed.get(tp, 0) for tp in partitions}
        # Told even of an empty assignment, as librdkafka and aiokafka tell it: a member left with nothing
        # must hear that what was revoked is not coming back.
        if self._listener is not None and self._alive:
            await self._listener.on_partitions_assigned(set(partitions))


def _coordinator(kafka: SimKafka, name: str) -> _Coordinator:
    group = kafka.groups.get(name)
    if group is None:
        group = kafka.groups[name] = _Coordinator(name)
    assert isinstance(group, _Coordinator)
    return group


def _commit(kafka: SimKafka, meta: GroupMetadata, offsets: dict[TopicPartition, int]) -> None:
    """Commit ``offsets`` for a member as of ``meta``; refused unless the member owns each in that generation."""
    group = _coordinator(kafka, meta.group)
    if meta.generation != group.generation:
        raise KafkaIOError(f"committing offsets: generation {meta.generation} is over (the group is at "
                           f"{group.generation}): a rebalance moved the partitions", retriable=False)
    foreign = sorted(tp for tp in offsets if group.owner.get(TopicPartition(*tp)) != meta.member)
    if foreign:
        raise KafkaIOError(f"committing offsets: {meta.member} does not own {foreign}", retriable=False)
    kafka.committed.setdefault(meta.group, {}).update({TopicPartition(*tp): o for tp, o in offsets.items()})


async def rebalance(kafka: SimKafka, group: _Coordinator) -> None:
    """Revoke every member's partitions (each listener to its end), then assign anew, co-partitioned."""
    async with group.lock:
        group.generation += 1
        members = [m for m in group.members.values() if m._alive]
        for member in members:
            await member._revoked()
        group.owner.clear()
        members = [m for m in group.members.values() if m._alive]
        if not members:
            return
        plan: dict[str, set[TopicPartition]] = {m.member_id: set() for m in members}
        for topic in sorted({t for m in members for t in m._topics}):
            count = len(kafka.topics.get(topic, []))
            for partition in range(count):
                member = members[partition * len(members) // max(count, 1)]
                plan[member.member_id].add(TopicPartition(topic, partition))
                group.owner[TopicPartition(topic, partition)] = member.member_id
        for member in members:
            await member._assign(plan[member.member_id], group.generation)


class SimTxnProducer:
    """A transactional producer on the simulated Kafka (see the module's docstring)."""

    def __init__(self, kafka: SimKafka, transactional_id: str, owner: str = "") -> None:
        self.kafka, self.transactional_id, self.owner = kafka, transactional_id, owner
        self._epoch = -1
        self._pending: list[tuple[str, int, bytes | None, bytes | None, Headers]] | None = None
        self._offsets: tuple[GroupMetadata, dict[TopicPartition, int]] | None = None

    async def start(self) -> None:
        """Register the transactional id: any older producer with it is fenced from now on."""
        self.kafka.check_up("initializing transactions")
        self._epoch = self.kafka.txn_epochs[self.transactional_id] = self.kafka.txn_epochs.get(
            self.transactional_id, -1) + 1

    def begin(self) -> None:
        if self.owner and self.owner in self.kafka.dead:
            raise KafkaIOError(f"{self.owner} is dead", retriable=False)
        self._check_fenced()
        self._pending, self._offsets = [], None

    async def produce(self, records: list[tuple[str, int | None, bytes | None, bytes | None, Headers]]
                      ) -> asyncio.Future[None]:
        """Add records (topic, partition or None for the key's, key, value, headers) to the open transaction;
        a future done at once (they land, or not, with the transaction)."""
        self._check_fenced()
        if self._pending is None:
            raise KafkaIOError("no transaction is open", retriable=False)
        for topic, partition, key, value, headers in records:
            where = partition if partition is not None else partition_for(key or b"", len(self.kafka.topics[topic]))
            self._pending.append((topic, where, key, value, headers))
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done

    async def stop(self) -> None:
        self._pending, self._offsets = None, None

    async def send_offsets(self, offsets: dict[TopicPartition, int], group: GroupMetadata) -> None:
        self._check_fenced()
        self._offsets = (group, dict(offsets))

    async def commit(self) -> None:
        """Make the transaction's records and offsets visible together; refused if fenced or if the offsets
        were sent for a generation the group has left behind (the transaction is then aborted)."""
        self.kafka.check_up("committing a transaction", self.owner)
        self._check_fenced()
        pending, offsets, self._pending, self._offsets = self._pending or [], self._offsets, None, None
        if offsets is not None:
            _commit(self.kafka, *offsets)  # refused before anything lands: nothing of it is visible
        for topic, partition, key, value, headers in pending:
            self.kafka.append(topic, partition, key, value or b"", headers)

    async def abort(self) -> None:
        self._pending, self._offsets = None, None

    def _check_fenced(self) -> None:
        if self.kafka.txn_epochs.get(self.transactional_id) != self._epoch:
            raise KafkaIOError(f"producer {self.transactional_id} (epoch {self._epoch}) is fenced by a newer one",
                               retriable=False)

