"""Inputs redelivered onto a state that already holds them decide nothing new; what one
processor sends another is never refused.

Under ``at_least_once`` a worker that dies after writing a batch's changelog and before
committing its offsets leaves the next owner a state ahead of the committed offsets: the
inputs between are decided again on a state that holds them. Every processor must then leave
its state as it was and send nothing it had not sent (a repeated answer is fine; a new event,
such as a deadlock that no longer exists, is not). The log here is routed between the
processors in process, as a replay's what-if routes it: no broker is needed.
"""

from __future__ import annotations

import asyncio
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from arbiter.audit.log import Entry
from arbiter.audit.replay import Engine
from arbiter.edge.settings import Settings
from arbiter.schemas import (
    CompensationRequested,
    LockCancelRequested,
    LockReleaseRequested,
    LockRequested,
    LockRevokeRequested,
    Record,
    SagaStep,
    ToolIntent,
    WaitEdgeAdded,
    WaitEdgeRemoved,
)
from arbiter.schemas.partitioning import partition_for
from arbiter.streams.runtime.common import TABLES
from tests.streams.shells.test_shells import _Tools

AGENTS = ["ann", "bob", "cy"]
RESOURCES = ["ticket:a", "doc:b"]  # a pessimistic policy and an optimistic one
GRAPH = b"global"

_steps = st.lists(st.one_of(
    st.tuples(st.just("lock"), st.sampled_from(AGENTS), st.sampled_from(RESOURCES)),
    st.tuples(st.just("release"), st.sampled_from(AGENTS), st.sampled_from(RESOURCES)),
    st.tuples(st.just("wait"), st.sampled_from(AGENTS), st.sampled_from(AGENTS)),
    st.tuples(st.just("unwait"), st.sampled_from(AGENTS), st.sampled_from(AGENTS)),
    st.tuples(st.just("write"), st.sampled_from(AGENTS), st.sampled_from(RESOURCES)),
    st.tuples(st.just("step"), st.sampled_from(AGENTS), st.sampled_from(RESOURCES)),
    st.tuples(st.just("abort"), st.sampled_from(AGENTS), st.just("")),
    st.tuples(st.just("finish"), st.sampled_from(AGENTS), st.just("")),
    # The detector takes a lease or a wait away: an agent's, or a saga's compensation's.
    # A release and a cancel sent before there is anything to release or cancel (the next lock's id).
    st.tuples(st.just("stray"), st.sampled_from(AGENTS), st.sampled_from(RESOURCES)),
    st.tuples(st.just("revoke"), st.sampled_from([*AGENTS, *(f"saga:{a}/work:1" for a in AGENTS)]),
              st.sampled_from(RESOURCES)),
), min_size=1, max_size=40)


class _Log:
    """The processors' inputs, appended as they are sent, and what each one decided."""

    def __init__(self, engine: Engine, settings_: Settings) -> None:
        self.engine = engine
        self.settings = settings_
        self.inbound = {settings_.topics.resource_commands, settings_.topics.wait_edges,
                        settings_.topics.saga_commands}
        self.entries: list[Entry] = []
        self.sent: list[tuple[str, bytes | None, Record]] = []
        self.ends: dict[tuple[str, int], int] = {}
        self.now = 1_000_000

    async def send(self, topic: str, key: bytes, record: Record) -> None:
        """Append one input, decide it, and route what it sends to the processors (in order)."""
        queue = [(topic, key, record)]
        while queue:
            topic, key, record = queue.pop(0)
            self.now += 7
            partition = partition_for(key, self.settings.partitions)
            offset = self.ends.get((topic, partition), 0)
            self.ends[(topic, partition)] = offset + 1
            entry = Entry(topic, partition, offset, self.now, key, record)
            self.entries.append(entry)
            for out in await self.engine.decide(entry, trusted=True):
                self.sent.append(out)
                if out[0] in self.inbound:
                    queue.append((out[0], out[1] or b"", out[2]))


def _state(engine: Engine) -> dict[str, Any]:
    return {"books": {k: TABLES["books"].dumps(v) for k, v in engine.books.items()},
            "contents": {k: TABLES["contents"].dumps(v) for k, v in engine.contents.items()},
            "graphs": dict(engine.graph_rows),
            "sagas": {k: TABLES["sagas"].dumps(v) for k, v in engine.sagas.items()}}


async def _play(steps: list[tuple[str, str, str]]) -> tuple[_Log, Engine]:
    settings_ = Settings()
    engine = Engine(settings_, _Tools())
    log = _Log(engine, settings_)
    topics = settings_.topics
    for n, (kind, agent, other) in enumerate(steps):
        if kind == "lock":
            await log.send(topics.resource_commands, other.encode(), LockRequested(
                request_id=f"q{n}", agent_id=agent, resource=other, mode="exclusive", ttl_ms=600_000,
                wait_ms=600_000, at_ms=log.now))
        elif kind == "release":
            book = engine.books.get(other.encode())
            tokens = [t for t, lease in (book.holders.items() if book else ()) if lease.agent_id == agent]
            if tokens:
                await log.send(topics.resource_commands, other.encode(), LockReleaseRequested(
                    request_id=f"r{n}", agent_id=agent, resource=other, token=tokens[0], at_ms=log.now))
        elif kind == "wait":
            # The same id each time a waiter waits on a holder again: ids recur, as lock edges' do.
            await log.send(topics.wait_edges, GRAPH, WaitEdgeAdded(
                edge_id=f"delegate|{agent}|{other}", waiter=agent, holder=other, source="delegation",
                waiter_registered_at_ms=0, at_ms=log.now))
        elif kind == "write":
            book = engine.books.get(other.encode())
            tokens = [t for t, lease in (book.holders.items() if book else ()) if lease.agent_id == agent]
            content = engine.contents.get(other.encode())
            await log.send(topics.resource_commands, other.encode(), ToolIntent(
                intent_id=f"w{n}", agent_id=agent, resource=other, token=tokens[0] if tokens else None,
                base_version=content.version if content else 0, tool="refund", arguments_json="{}",
                at_ms=log.now))
        elif kind in ("step", "finish"):
            saga = f"saga:{agent}/work:1"
            await log.send(topics.saga_commands, saga.encode(), SagaStep(
                saga_id=saga, step=n, agent_id=agent, status="completed" if kind == "step" else "saga_completed",
                intent_id=f"i{n}", resource=other or "ticket:a", tool="refund", arguments_json="{}",
                compensate_tool="refund", compensate_arguments_json="{}", at_ms=log.now))
        elif kind == "abort":
            saga = f"saga:{agent}/work:1"
            await log.send(topics.saga_commands, saga.encode(), CompensationRequested(
                saga_id=saga, reason="test", requested_by=agent, at_ms=log.now))
        elif kind == "stray":
            await log.send(topics.resource_commands, other.encode(), LockReleaseRequested(
                request_id=f"s{n}", agent_id=agent, resource=other, token=1, at_ms=log.now))
            await log.send(topics.resource_commands, other.encode(), LockCancelRequested(
                request_id=f"c{n}", agent_id=agent, resource=other, target_request_id=f"q{n + 1}",
                at_ms=log.now))
        elif kind == "revoke":
            await log.send(topics.resource_commands, other.encode(), LockRevokeRequested(
                request_id=f"v{n}", resource=other, agent_id=agent, reason="deadlock_victim",
                requested_by="deadlock-detector", at_ms=log.now))
        else:
            await log.send(topics.wait_edges, GRAPH, WaitEdgeRemoved(
                edge_id=f"delegate|{agent}|{other}", waiter=agent, holder=other, source="delegation",
                at_ms=log.now))
    return log, engine


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=_steps, cut=st.floats(min_value=0.0, max_value=1.0))
def test_decided_again_on_a_state_that_holds_them_inputs_change_nothing_and_send_nothing_new(
        steps: list[tuple[str, str, str]], cut: float) -> None:
    async def check() -> None:
        log, engine = await _play(steps)
        letters = [r for t, _k, r in log.sent if t == engine.settings.topics.dead_letter]
        assert not letters, f"a processor refused what another one sent it: {letters[:3]}"
        before = _state(engine)
        # Redeliver every input from the cut on, each at its own offset and append time.
        redelivered = log.entries[int(cut * len(log.entries)):]
        again: list[tuple[str, bytes | None, Record]] = []
        for entry in redelivered:
            again.extend(await engine.decide(entry, trusted=True))
        assert _state(engine) == before, "the state changed when inputs it holds were decided again"
        new = [out for out in again if out not in log.sent]
        assert not new, f"decided again, the inputs sent what they had not: {new[:3]}"

    asyncio.run(check())


def test_an_edge_removed_since_is_not_brought_back_by_its_add_redelivered() -> None:
    """The cluster test's failure, in small: a wait and its end, then the other way round; decided
    again on the state after both, the first wait must not come back and close a cycle."""
    steps = [("wait", "ann", "bob"), ("unwait", "ann", "bob"), ("wait", "bob", "ann")]

    async def check() -> None:
        log, engine = await _play(steps)
        assert [(e.waiter, e.holder) for e in engine.wait_edges()] == [("bob", "ann")]
        again = [out for entry in log.entries for out in await engine.decide(entry, trusted=True)]
        assert [(e.waiter, e.holder) for e in engine.wait_edges()] == [("bob", "ann")]
        assert again == []

    asyncio.run(check())


def test_a_wait_that_recurs_after_its_end_is_a_wait_again() -> None:
    """Positions tell a redelivery from a real add of the same id later."""
    steps = [("wait", "ann", "bob"), ("unwait", "ann", "bob"), ("wait", "ann", "bob"), ("wait", "bob", "ann")]

    async def check() -> None:
        log, engine = await _play(steps)
        edges = engine.settings.topics.wait_edges
        detections = [r for t, _k, r in log.sent if t == edges and type(r).__name__ == "DeadlockDetected"]
        assert len(detections) == 1, log.sent

    asyncio.run(check())


def test_a_compensation_taken_out_of_the_queue_is_tried_again_not_left_waiting() -> None:
    """A saga's compensation queued behind a holder and then chosen as a deadlock victim (a cycle can be
    made of compensations only) asks for the lease again; once the holder is gone the step is undone."""
    steps = [("lock", "ann", "ticket:a"), ("step", "bob", "ticket:a"), ("abort", "bob", ""),
             ("revoke", "saga:bob/work:1", "ticket:a"), ("release", "ann", "ticket:a")]

    async def check() -> None:
        log, engine = await _play(steps)
        names = [type(r).__name__ for _t, _k, r in log.sent]
        assert "LockCancelled" in names, names
        asks = [r for _t, _k, r in log.sent if isinstance(r, LockRequested) and r.agent_id == "saga:bob/work:1"]
        assert [a.request_id.split("|")[-2] for a in asks] == ["1", "2"], "the second attempt asks again"
        (saga,) = engine.sagas.values()
        assert saga.status == "COMPENSATED" and saga.compensated == [1]
        assert not [r for t, _k, r in log.sent if t == engine.settings.topics.dead_letter]

    asyncio.run(check())
