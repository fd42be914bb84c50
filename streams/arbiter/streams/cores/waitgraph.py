"""The wait-for graph: deadlock detection with deterministic victim choice.

Theory of operation
-------------------
Nodes are agents; an edge ``waiter -> holder`` says the waiter cannot move until the
holder does. Edges come from the lease processor (a request queued behind holders)
and from agents that delegate and wait on another agent. Everything that decides
deadlocks lives in this file, as pure functions:

    detect(graph, edge_added, now_ms, cause) -> list[DeadlockDetected]
    evolve(graph, event) -> graph

``detect`` runs on every edge insertion. Only a cycle through the new edge can be
new, so it searches, depth first and in sorted order, for a path from the edge's
holder back to its waiter; the same log therefore always gives the same answer.
For each cycle found it picks exactly one victim: the lowest priority, then the
youngest (latest registration), then the smallest agent id. The victim's outgoing
edges leave the graph at once (its waits are being cancelled), and the search runs
again, until the new edge closes no cycle.

No false positives: detection sees only edges that are present. An edge removed
before the insertion that would have closed a cycle is gone, so that cycle claims
no victim.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from arbiter.schemas import Cause, DeadlockDetected, LockRevokeRequested, WaitEdgeAdded, WaitEdgeRemoved

GraphEvent = WaitEdgeAdded | WaitEdgeRemoved | DeadlockDetected
VictimPolicy = Literal["priority", "youngest", "oldest"]
"""How a cycle's victim is chosen. ``priority`` (the default): lowest priority, then
youngest, then smallest agent id. ``youngest``/``oldest`` ignore priority (what-if
replays compare them)."""
VICTIM_POLICIES: tuple[VictimPolicy, ...] = ("priority", "youngest", "oldest")


@dataclass(frozen=True, slots=True)
class Edge:
    """One wait: ``waiter`` cannot move until ``holder`` does."""

    edge_id: str
    waiter: str
    holder: str
    source: str
    resource: str | None
    waiter_priority: int
    waiter_registered_at_ms: int
    saga_id: str | None = None

    def to_row(self) -> list[Any]:
        """A compact JSON row (the edge table's changelog value)."""
        return [self.edge_id, self.waiter, self.holder, self.source, self.resource, self.waiter_priority,
                self.waiter_registered_at_ms, self.saga_id]

    @classmethod
    def from_row(cls, row: list[Any]) -> Edge:
        """Inverse of ``to_row``."""
        return cls(*row)


@dataclass(slots=True)
class WaitGraph:
    """The current wait-for edges, indexed by waiter."""

    edges: dict[str, Edge] = field(default_factory=dict)
    out: dict[str, dict[str, Edge]] = field(default_factory=dict)
    """waiter -> {edge_id: edge}"""
    cancelled: dict[str, None] = field(default_factory=dict)
    """Recent edges of deadlock victims: a redelivered add of one must not revive it."""
    cancelled_window: int = 4096
    touched: set[str] = field(default_factory=set)
    """Ids of the edges added, removed or cancelled since a store last saved the graph (so a
    store writes what changed, not the whole graph)."""
    at: dict[str, int] = field(default_factory=dict)
    """Per edge present, the position (input offset) of the message that last added it."""
    removed: dict[str, int] = field(default_factory=dict)
    """Recently removed edges, oldest first, and the position of the message that removed each."""
    removed_window: int = 4096
    caused: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Per edge present or recently removed whose changes a processor decided (the lease book's), the
    (partition, offset) of the decision that last changed it."""

    def folded(self, edge_id: str, position: int, cause: tuple[int, int] | None = None) -> bool:
        """Whether the message at ``position`` (its input offset) about ``edge_id``, decided by ``cause``
        (a processor's decision: its input's partition and offset), is in the graph already.

        Two ways the same change comes again. A worker of this graph that died after writing a batch's
        state and before committing its offsets leaves the next owner a graph ahead of the inputs it is
        redelivered: positions say which inputs the graph holds. And a worker of the lease books that
        died before committing is redelivered its inputs, and decides them again: the same changes,
        sent again, at new positions; their causes say which decisions the graph holds (a book decides
        one resource's changes in its partition's order). Folding either again would bring back edges
        removed since, and close cycles that no longer exist; neither hides a later, real change.

        A copy is a change of an earlier decision: one decision may change an edge more than once (a waiter
        put behind one holder, then the next, as a cascade of grants and expiries moves its queue), and its
        later changes are no copies of its first (a simulated run found the removal skipped, and a phantom
        deadlock detected on the edge left behind). A copy of the last decision is folded again: its
        changes, in order, end where the first delivery ended."""
        if position <= max(self.at.get(edge_id, -1), self.removed.get(edge_id, -1)):
            return True
        last = self.caused.get(edge_id)
        return cause is not None and last is not None and last[0] == cause[0] and cause[1] < last[1]

    def touching(self, agent: str) -> list[Edge]:
        """Every edge into or out of ``agent``, sorted by id."""
        return sorted((e for e in self.edges.values() if agent in (e.waiter, e.holder)), key=lambda e: e.edge_id)

    def add(self, edge: Edge) -> None:
        """Insert an edge (idempotent by id)."""
        self.edges[edge.edge_id] = edge
        self.out.setdefault(edge.waiter, {})[edge.edge_id] = edge
        self.touched.add(edge.edge_id)

    def remove(self, edge_id: str) -> None:
        """Delete an edge; unknown ids are ignored."""
        edge = self.edges.pop(edge_id, None)
        self.at.pop(edge_id, None)
        if edge is not None:
            self.touched.add(edge_id)
            bucket = self.out.get(edge.waiter)
            if bucket is not None:
                bucket.pop(edge_id, None)
                if not bucket:
                    del self.out[edge.waiter]

    def has_cycle(self) -> bool:
        """Whether any cycle exists (for checks; detection never needs a full scan)."""
        state: dict[str, int] = {}
        for start in sorted(self.out):
            if state.get(start):
                continue
            stack = [(start, iter(sorted({e.holder for e in self.out.get(start, {}).values()})))]
            state[start] = 1
            while stack:
                node, children = stack[-1]
                child = next(children, None)
                if child is None:
                    state[node] = 2
                    stack.pop()
                elif state.get(child) == 1:
                    return True
                elif not state.get(child):
                    state[child] = 1
                    stack.append((child, iter(sorted({e.holder for e in self.out.get(child, {}).values()}))))
        return False


def _path(graph: WaitGraph, start: str, goal: str) -> list[Edge] | None:
    """Edges of the first path from ``start`` to ``goal`` in sorted depth-first order."""
    seen = {start}
    stack: list[tuple[str, list[Edge]]] = [(start, [])]
    while stack:
        node, path = stack.pop()
        edges = sorted(graph.out.get(node, {}).values(), key=lambda e: (e.holder, e.edge_id), reverse=True)
        for edge in edges:  # reversed onto the stack, so the smallest holder is explored first
            if edge.holder == goal:
                return [*path, edge]
            if edge.holder not in seen:
                seen.add(edge.holder)
                stack.append((edge.holder, [*path, edge]))
    return None


def _victim(cycle: list[Edge], policy: VictimPolicy = "priority") -> Edge:
    """The edge whose waiter loses under ``policy`` (ties: smallest agent id)."""
    if policy == "youngest":
        return min(cycle, key=lambda e: (-e.waiter_registered_at_ms, e.waiter))
    if policy == "oldest":
        return min(cycle, key=lambda e: (e.waiter_registered_at_ms, e.waiter))
    return min(cycle, key=lambda e: (e.waiter_priority, -e.waiter_registered_at_ms, e.waiter))


def detect(graph: WaitGraph, added: WaitEdgeAdded, now_ms: int, cause: Cause,
           victim_policy: VictimPolicy = "priority") -> list[DeadlockDetected]:
    """The deadlocks ``added`` closes, one victim each. Does not change ``graph``."""
    if added.edge_id in graph.edges or added.edge_id in graph.cancelled:
        return []  # seen before: no second effect
    if added.waiter != added.holder and _path(graph, added.holder, added.waiter) is None:
        return []  # the common case: no cycle, and no copy of the graph
    scratch = WaitGraph(dict(graph.edges), {k: dict(v) for k, v in graph.out.items()}, dict(graph.cancelled),
                        graph.cancelled_window)
    new = _edge(graph, added, now_ms)
    scratch.add(new)
    found: list[DeadlockDetected] = []
    while new.edge_id in scratch.edges:
        path = [new] if new.holder == new.waiter else None
        if path is None:
            rest = _path(scratch, new.holder, new.waiter)
            path = None if rest is None else [new, *rest]
        if path is None:
            break
        victim = _victim(path, victim_policy)
        start = path.index(victim)
        ordered = path[start:] + path[:start]  # the victim's own wait first
        waited_on = victim.holder
        event = DeadlockDetected(
            detection_id=f"deadlock|{added.edge_id}|{len(found)}",
            victim=victim.waiter,
            cycle=[e.waiter for e in ordered],
            cycle_json=json.dumps([{"waiter": e.waiter, "holder": e.holder, "resource": e.resource,
                                    "source": e.source, "edge_id": e.edge_id} for e in ordered]),
            message=f"Circular dependency detected with {waited_on}. Aborting subtask.",
            saga_id=next((e.saga_id for e in scratch.out.get(victim.waiter, {}).values() if e.saga_id), None),
            at_ms=now_ms,
            cause=cause,
        )
        found.append(event)
        evolve(scratch, event)
    return found


def revocations(graph: WaitGraph, detection: DeadlockDetected, now_ms: int) -> list[LockRevokeRequested]:
    """What breaks the victim's hold: one revoke per resource it holds or waits for.

    Read from the graph *before* the detection is folded in. A revoke without a token
    takes the victim's leases on that resource and cancels its queued requests there,
    so the waiters behind it are granted with new tokens and its own token goes stale.
    """
    resources = sorted({e.resource for e in graph.touching(detection.victim)
                        if e.source == "lock" and e.resource is not None})
    return [LockRevokeRequested(request_id=f"{detection.detection_id}|{resource}", resource=resource,
                                agent_id=detection.victim, token=None, reason="deadlock_victim",
                                requested_by="deadlock-detector", at_ms=now_ms)
            for resource in resources]


def _edge(graph: WaitGraph, event: WaitEdgeAdded, now_ms: int | None) -> Edge:
    """The edge an event adds. An agent's age (victims: youngest loses) comes from the log, never
    from its own clock: a lock wait's is its queue time (the broker's); a delegating agent's is
    the broker time of its earliest delegation still in the graph (``now_ms``, the edge's
    append time, when it has none), not the registration time its message claims."""
    registered = event.waiter_registered_at_ms
    if event.source != "lock" and now_ms is not None:
        earlier = [e.waiter_registered_at_ms for e in graph.out.get(event.waiter, {}).values() if e.source != "lock"]
        registered = min(earlier, default=now_ms)
    return Edge(event.edge_id, event.waiter, event.holder, event.source, event.resource, event.waiter_priority,
                registered, event.saga_id)


def evolve(graph: WaitGraph, event: GraphEvent, now_ms: int | None = None, position: int | None = None) -> WaitGraph:
    """Fold one event into the graph (in place) and return it. ``now_ms``: the append time of the
    message that carried ``event`` (a delegating agent's age is taken from it, see ``_edge``);
    ``position``: its input offset, remembered per edge with its cause (``WaitGraph.folded``)."""
    if isinstance(event, WaitEdgeAdded | WaitEdgeRemoved) and position is not None and event.cause is not None:
        graph.caused[event.edge_id] = (event.cause.partition, event.cause.offset)
    if isinstance(event, WaitEdgeAdded):
        if event.edge_id not in graph.cancelled:
            graph.add(_edge(graph, event, now_ms))
            if position is not None:
                graph.at[event.edge_id] = position
                graph.removed.pop(event.edge_id, None)
    elif isinstance(event, WaitEdgeRemoved):
        graph.remove(event.edge_id)
        if position is not None:
            graph.removed.pop(event.edge_id, None)  # (re-inserted: the window keeps the newest)
            graph.removed[event.edge_id] = position
            graph.touched.add(event.edge_id)
            while len(graph.removed) > graph.removed_window:
                forgotten = next(iter(graph.removed))
                del graph.removed[forgotten]
                graph.caused.pop(forgotten, None)
                graph.touched.add(forgotten)
    else:
        # The victim's waits are being cancelled: it waits on nobody from now on.
        for edge_id in list(graph.out.get(event.victim, {})):
            graph.remove(edge_id)
            graph.cancelled[edge_id] = None
        while len(graph.cancelled) > graph.cancelled_window:
            forgotten = next(iter(graph.cancelled))
            del graph.cancelled[forgotten]
            graph.caused.pop(forgotten, None)
            graph.touched.add(forgotten)
    return graph
