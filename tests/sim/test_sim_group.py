"""The simulated Kafka's consumer groups and transactions: what the worker relies on from Kafka's.

A partition has one owner at a time, and a rebalance revokes before it assigns; a crashed member's
partitions move after the session timeout, and what it had not committed is read again; a commit
from a generation that is over is refused; a transaction's records and offsets become visible
together or never, and a producer fenced by a newer one with its id cannot commit.
"""

from __future__ import annotations

import asyncio
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from arbiter.edge.kafkaio import KafkaIOError, Received, TopicPartition
from arbiter.sim import SimGroup, SimKafka, SimReader, SimTxnProducer, run

TOPICS = ("commands", "edges")


class Owners:
    """A listener that keeps who owns what, and fails the test if two members ever own one partition."""

    def __init__(self, ledger: dict[TopicPartition, str], name: str, trace: list[str]) -> None:
        self.ledger, self.name, self.trace = ledger, name, trace
        self.assigned: asyncio.Event | None = None
        """Set at this member's next assignment (when a test asks, by creating it)."""

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        for tp in revoked:
            assert self.ledger.pop(tp) == self.name
        self.trace.append(f"{self.name} -{len(revoked)}")

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        for tp in assigned:
            assert tp not in self.ledger, f"{tp} owned by {self.ledger.get(tp)} and {self.name} at once"
            self.ledger[tp] = self.name
        self.trace.append(f"{self.name} +{len(assigned)}")
        if self.assigned is not None:
            self.assigned.set()


def _kafka(partitions: int = 4) -> SimKafka:
    kafka = SimKafka()
    for topic in TOPICS:
        kafka.create_topic(topic, partitions)
    return kafka


def _member(kafka: SimKafka, name: str, ledger: dict[TopicPartition, str], trace: list[str]) -> SimGroup:
    member = SimGroup(kafka, member_id=name, group_id="workers", session_ms=6_000)
    member.subscribe(TOPICS, listener=Owners(ledger, name, trace))
    return member


def test_members_share_the_partitions_co_partitioned_and_a_rebalance_revokes_before_it_assigns() -> None:
    kafka = _kafka()
    ledger: dict[TopicPartition, str] = {}
    trace: list[str] = []

    async def main() -> tuple[set[TopicPartition], set[TopicPartition]]:
        a = _member(kafka, "a", ledger, trace)
        b = _member(kafka, "b", ledger, trace)
        await a.start()
        await b.start()
        return a.assignment(), b.assignment()

    mine, theirs = run(main())
    assert trace == ["a +8", "a -8", "a +4", "b +4"]
    assert not mine & theirs and len(mine | theirs) == 8
    for owned in (mine, theirs):  # partition i of every topic with the same member
        assert {tp.partition for tp in owned if tp.topic == "commands"} == {tp.partition for tp in owned
                                                                            if tp.topic == "edges"}


def test_a_crashed_members_partitions_move_after_the_session_timeout_and_its_uncommitted_records_come_again() -> None:
    kafka = _kafka(partitions=2)
    for i in range(6):
        kafka.append("commands", 0, b"k", bytes([i]), [])
    ledger: dict[TopicPartition, str] = {}

    async def main() -> tuple[list[int], float, list[int]]:
        a = _member(kafka, "a", ledger, [])
        b = _member(kafka, "b", ledger, [])
        await a.start()
        await b.start()
        owner, other = (a, b) if TopicPartition("commands", 0) in a.assignment() else (b, a)
        read = [r.offset for r in (await owner.getmany(0, 100)).get(TopicPartition("commands", 0), [])]
        await owner.commit({TopicPartition("commands", 0): 2})  # decided and committed the first two
        listener = other._listener
        assert isinstance(listener, Owners)
        listener.assigned = asyncio.Event()
        for tp in owner.assignment():
            del ledger[tp]  # dead: it owns nothing it can act on, and is told nothing
        owner.crash()
        crashed = asyncio.get_running_loop().time()
        await listener.assigned.wait()
        assert TopicPartition("commands", 0) in other.assignment()
        moved_after = asyncio.get_running_loop().time() - crashed
        again = [r.offset for r in (await other.getmany(0, 100)).get(TopicPartition("commands", 0), [])]
        return read, moved_after, again

    read, moved_after, again = run(main())
    assert read == [0, 1, 2, 3, 4, 5]
    assert 6.0 <= moved_after < 6.2
    assert again == [2, 3, 4, 5]


def test_a_commit_from_a_generation_that_is_over_is_refused() -> None:
    kafka = _kafka()
    ledger: dict[TopicPartition, str] = {}

    async def main() -> None:
        a = _member(kafka, "a", ledger, [])
        await a.start()
        stale = await a.group_metadata()
        await _member(kafka, "b", ledger, []).start()
        kept = next(iter(a.assignment()))
        await a.commit({kept: 1})  # its own, in the current generation: fine
        lost = next(tp for tp in [TopicPartition(t, p) for t in TOPICS for p in range(4)] if tp not in a.assignment())
        with pytest.raises(KafkaIOError, match="does not own"):
            await a.commit({lost: 1})
        producer = SimTxnProducer(kafka, "workers-0")
        await producer.start()
        producer.begin()
        await producer.produce([("edges", 0, b"k", b"late", [])])
        await producer.send_offsets({kept: 5}, stale)
        with pytest.raises(KafkaIOError, match="generation"):
            await producer.commit()

    run(main())
    assert kafka.records("edges", 0) == [], "a refused transaction leaves nothing visible"


def test_a_transaction_is_visible_whole_at_commit_or_never_and_a_fenced_producer_cannot_commit() -> None:
    kafka = _kafka(partitions=1)
    ledger: dict[TopicPartition, str] = {}

    async def main() -> list[bytes | None]:
        member = _member(kafka, "a", ledger, [])
        await member.start()
        reader = SimReader(kafka)
        reader.add("edges", 0, 0)
        first = SimTxnProducer(kafka, "workers-0")
        await first.start()
        first.begin()
        await first.produce([("edges", 0, b"k", b"one", []), ("edges", 0, b"k", b"two", [])])
        assert await reader.read(0) == []  # nothing before the commit
        await first.send_offsets({TopicPartition("commands", 0): 3}, await member.group_metadata())
        await first.commit()
        first.begin()
        await first.produce([("edges", 0, b"k", b"aborted", [])])
        await first.abort()
        zombie = first
        successor = SimTxnProducer(kafka, "workers-0")
        await successor.start()
        with pytest.raises(KafkaIOError, match="fenced"):
            zombie.begin()
        got: list[Received] = await reader.read(0)
        return [r.value for r in got]

    assert run(main()) == [b"one", b"two"]
    assert kafka.committed["workers"] == {TopicPartition("commands", 0): 3}


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(min_value=0, max_value=2**32))
def test_churn_never_gives_a_partition_two_owners_and_one_seed_replays_it(seed: int) -> None:
    """Members join, stop and crash at times drawn from the seed; at every moment each partition has at most one
    owner (the listener asserts it), and the same seed gives the same sequence of rebalances."""

    def churn() -> list[str]:
        rng = random.Random(seed)
        kafka = _kafka()
        ledger: dict[TopicPartition, str] = {}
        trace: list[str] = []

        async def main() -> None:
            members = []
            for n in range(6):
                member = _member(kafka, f"w{n}", ledger, trace)
                await member.start()
                members.append(member)
                await asyncio.sleep(rng.uniform(0, 3))
                if rng.random() < 0.5:
                    victim = members.pop(rng.randrange(len(members)))
                    # Gone (dead, or left after its last commit, as RdGroup.stop: no listener runs): it owns
                    # nothing it can act on any more.
                    for tp in [tp for tp, owner in ledger.items() if owner == victim.member_id]:
                        del ledger[tp]
                    if rng.random() < 0.5:
                        victim.crash()
                    else:
                        await victim.stop()
            await asyncio.sleep(10)  # every crash noticed
            owners = {tp: next(m.member_id for m in members if tp in m.assignment()) for tp in ledger}
            assert owners == ledger and len(ledger) == (8 if members else 0)

        run(main())
        return trace

    assert churn() == churn()
