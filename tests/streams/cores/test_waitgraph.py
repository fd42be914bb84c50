"""Deadlock detection on the wait-for graph (pure core)."""

from __future__ import annotations

import itertools
import json

from hypothesis import given, settings
from hypothesis import strategies as st

from arbiter.schemas import Cause, DeadlockDetected, WaitEdgeAdded, WaitEdgeRemoved
from arbiter.streams.cores.waitgraph import WaitGraph, detect, evolve

CAUSE = Cause(topic="edges", partition=0, offset=0)
REGISTERED = {"routing": 1_000, "refactoring": 2_000, "testing": 3_000, "documentation": 4_000}


def added(waiter: str, holder: str, *, priority: int = 0, registered: int | None = None,
          edge_id: str | None = None, source: str = "delegation") -> WaitEdgeAdded:
    return WaitEdgeAdded(edge_id=edge_id or f"{waiter}->{holder}", waiter=waiter, holder=holder, source=source,
                         resource=None, waiter_priority=priority,
                         waiter_registered_at_ms=REGISTERED.get(waiter, 0) if registered is None else registered,
                         at_ms=0)


def removed(waiter: str, holder: str) -> WaitEdgeRemoved:
    return WaitEdgeRemoved(edge_id=f"{waiter}->{holder}", waiter=waiter, holder=holder, source="delegation",
                           at_ms=0)


_APPENDED = itertools.count(1)


def feed(graph: WaitGraph, event: WaitEdgeAdded | WaitEdgeRemoved, now: int | None = None) -> list[DeadlockDetected]:
    """Decide ``event`` as the detector does, at its append time ``now`` (each feed a moment later)."""
    now = next(_APPENDED) if now is None else now
    found = detect(graph, event, now, CAUSE) if isinstance(event, WaitEdgeAdded) else []
    evolve(graph, event, now)
    for d in found:
        evolve(graph, d)
    return found


def test_the_four_agent_ring_is_broken_at_the_youngest() -> None:
    g = WaitGraph()
    ring = ["routing", "refactoring", "testing", "documentation"]
    for a, b in itertools.pairwise(ring):
        assert feed(g, added(a, b)) == []
    (d,) = feed(g, added("documentation", "routing"))
    assert d.victim == "documentation"  # equal priority: the latest registered loses
    assert d.cycle == ["documentation", "routing", "refactoring", "testing"]
    assert d.message == "Circular dependency detected with routing. Aborting subtask."
    assert [e["holder"] for e in json.loads(d.cycle_json)] == ["routing", "refactoring", "testing", "documentation"]
    assert not g.has_cycle() and "documentation" not in g.out


def test_lowest_priority_loses_before_age() -> None:
    g = WaitGraph()
    feed(g, added("routing", "refactoring", priority=5))
    feed(g, added("refactoring", "testing", priority=1))
    feed(g, added("testing", "documentation", priority=5))
    (d,) = feed(g, added("documentation", "routing", priority=5))
    assert d.victim == "refactoring"


def test_ties_go_to_the_smaller_agent_id() -> None:
    g = WaitGraph()
    feed(g, added("b", "a", registered=7))
    (d,) = feed(g, added("a", "b", registered=7))
    assert d.victim == "a"


def test_an_agents_own_clock_does_not_make_it_older() -> None:
    """The younger agent (its first delegation appended later) loses, whatever registration time it claims."""
    g = WaitGraph()
    feed(g, added("elder", "junior", registered=10_000_000), now=1_000)
    (d,) = feed(g, added("junior", "elder", registered=10_000_000 - 3_600_000), now=2_000)  # clock 1 h behind
    assert d.victim == "junior"


def test_lock_order_inversion() -> None:
    g = WaitGraph()
    assert feed(g, added("alice", "bob", source="lock", edge_id="lock|B|r1|bob")) == []
    (d,) = feed(g, added("bob", "alice", source="lock", edge_id="lock|A|r2|alice", registered=9))
    assert d.victim == "bob" and sorted(d.cycle) == ["alice", "bob"]


def test_a_cycle_whose_edge_is_gone_claims_no_victim() -> None:
    g = WaitGraph()
    feed(g, added("routing", "refactoring"))
    feed(g, added("refactoring", "testing"))
    feed(g, removed("refactoring", "testing"))
    assert feed(g, added("testing", "routing")) == []


def test_a_redelivered_edge_has_no_second_effect() -> None:
    g = WaitGraph()
    feed(g, added("a", "b"))
    (d,) = feed(g, added("b", "a"))
    assert feed(g, added("b", "a")) == [] and feed(g, added("a", "b")) == []
    assert not g.has_cycle() and d.victim in {"a", "b"}


def test_waiting_on_yourself_is_a_deadlock() -> None:
    (d,) = feed(WaitGraph(), added("loop", "loop"))
    assert d.victim == "loop" and d.cycle == ["loop"]


def independent_cycle_search(edges: set[tuple[str, str]]) -> bool:
    """A plain recursive search, written separately from the detector's."""
    nodes = {a for a, _ in edges} | {b for _, b in edges}

    def reach(start: str, goal: str, seen: set[str]) -> bool:
        return any(a == start and (b == goal or (b not in seen and reach(b, goal, seen | {b}))) for a, b in edges)

    return any(reach(n, n, {n}) for n in nodes)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 7), st.integers(0, 7), st.integers(0, 2)), max_size=60))
def test_every_cycle_is_broken_with_one_right_victim_and_no_false_positives(
    ops: list[tuple[bool, int, int, int]],
) -> None:
    g = WaitGraph()
    info = {f"a{i}": (i % 3, 1_000 * ((i * 5) % 8)) for i in range(8)}  # (priority, the age it claims)
    since: dict[str, int] = {}  # model: an agent's age is when its current run of waits began (broker time)
    for now, (add, w, h, _) in enumerate(ops, 1):
        for agent in [a for a in since if a not in g.out]:
            del since[agent]
        waiter, holder = f"a{w}", f"a{h}"
        if add:
            event = added(waiter, holder, priority=info[waiter][0], registered=info[waiter][1])
            before = {(e.waiter, e.holder) for e in g.edges.values()}
            if event.edge_id not in g.edges and event.edge_id not in g.cancelled:
                since.setdefault(waiter, now)
            found = feed(g, event, now)
            for d in found:
                cycle = json.loads(d.cycle_json)
                # No false positive: every edge of the cycle existed (or is the one just added).
                assert all((e["waiter"], e["holder"]) in before | {(waiter, holder)} for e in cycle)
                assert [e["waiter"] for e in cycle] == d.cycle
                assert all(cycle[i]["holder"] == cycle[(i + 1) % len(cycle)]["waiter"] for i in range(len(cycle)))
                # Exactly one victim, by the rule.
                rank = {a: (info[a][0], -since[a], a) for a in d.cycle}
                assert d.victim == min(d.cycle, key=lambda a: rank[a])
        else:
            feed(g, removed(waiter, holder), now)
        # Every cycle present is found: what is left never has one.
        assert not independent_cycle_search({(e.waiter, e.holder) for e in g.edges.values()})
        assert not g.has_cycle()


def test_a_lease_books_decisions_sent_again_at_new_positions_change_nothing() -> None:
    """Finding (worker-kill churn): a worker of the lease books killed before its commit is redelivered its
    inputs and decides them again, so the same wait edges come again, at new positions of the wait-edge
    topic. Folded as new, an edge removed since came back and closed a cycle that no longer existed (the
    audit's cycles_resolved, twice in one campaign). The graph knows them by the decision that made them
    (a book decides one resource in its partition's order), also after it is rebuilt from its rows."""
    import asyncio

    from arbiter.edge.settings import Settings
    from arbiter.schemas import Record
    from arbiter.streams.shells.deadlock import DeadlockShell, RowGraphStore
    from arbiter.streams.shells.routes import Routes

    rows: dict[bytes, bytes] = {}
    generation = [1]
    sent: list[Record] = []

    async def send(_topic: str, _key: bytes, record: Record) -> None:
        sent.append(record)

    shell = DeadlockShell(RowGraphStore(rows, lambda: generation[0]), Routes.of(Settings().topics, "global"), send)
    decided = Cause(topic="resource_commands", partition=2, offset=0)
    lock = {"source": "lock", "resource": "account:a"}
    x_added = WaitEdgeAdded(edge_id="lock|x", waiter="ann", holder="bob", waiter_priority=0,
                            waiter_registered_at_ms=1, at_ms=1, cause=decided.model_copy(update={"offset": 10}),
                            **lock)
    x_removed = WaitEdgeRemoved(edge_id="lock|x", waiter="ann", holder="bob", at_ms=2,
                                cause=decided.model_copy(update={"offset": 12}), **lock)
    back = added("bob", "ann", edge_id="bob->ann")

    def handle(record: WaitEdgeAdded | WaitEdgeRemoved, position: int) -> None:
        problem = asyncio.run(shell.handle(b"global", record, 1_000 + position,
                                           Cause(topic="wait_edges", partition=0, offset=position)))
        assert problem is None, problem

    for position, record in enumerate((x_added, x_removed, back)):
        handle(record, position)
    assert not sent, "ann's wait ended before bob waited on her: no cycle"
    handle(x_added, 3)  # the books' worker died: its decisions come again
    handle(x_removed, 4)
    assert not sent, "a decision sent again closed a cycle that no longer exists"
    generation[0] += 1  # a rebalance: the graph is rebuilt from its rows
    handle(x_added, 5)
    assert not sent and set(shell.store.get(b"global").edges) == {"bob->ann"}
    # One decision changes an edge twice (cy queued behind dan, then moved on, in one tick): its removal is
    # folded, not taken for a copy of its addition (./dev sim found a phantom deadlock on the edge left behind).
    same = decided.model_copy(update={"offset": 20})
    y_added = x_added.model_copy(update={"edge_id": "lock|y", "waiter": "cy", "holder": "dan", "cause": same})
    y_removed = x_removed.model_copy(update={"edge_id": "lock|y", "waiter": "cy", "holder": "dan", "cause": same})
    handle(y_added, 6)
    handle(y_removed, 7)
    handle(added("dan", "cy", edge_id="dan->cy"), 8)
    assert not sent, "a cycle through an edge its own decision removed"
    assert "lock|y" not in shell.store.get(b"global").edges
