"""The deadlock processor's shell: a wait-for graph per key, detection on every edge, victims told.

Both the worker and a replay keep the graphs as one row per edge (``RowGraphStore`` over a
table of bytes: the worker's changelog, or a dict), and both go through
``DeadlockShell.handle``, so the log is replayed through exactly the code that wrote it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass

from arbiter.schemas import (
    Cause,
    CompensationRequested,
    ContractError,
    DeadlockDetected,
    Record,
    WaitEdgeAdded,
    WaitEdgeRemoved,
)
from arbiter.schemas.identity import Verified
from arbiter.schemas.reasons import Reason
from arbiter.streams.cores.waitgraph import Edge, VictimPolicy, WaitGraph, detect, revocations
from arbiter.streams.cores.waitgraph import evolve as evolve_graph
from arbiter.streams.shells.routes import Routes, Send
from arbiter.streams.shells.tables import InputScope


def edge_problem(key: bytes | None, edge: Record) -> ContractError | None:
    """Why a message cannot be decided on the wait-edge topic (None: it can)."""
    if not isinstance(edge, WaitEdgeAdded | WaitEdgeRemoved | DeadlockDetected):
        return ContractError(Reason.UNSUPPORTED_COMMAND,
                             f"{type(edge).__name__} does not belong on the wait-edge topic")
    if not key:
        return ContractError(Reason.KEY_MISMATCH, "wait-edge messages are keyed by their graph's namespace; "
                                                  "this one has no key")
    return None


REMOVED = b"removed:"
EDGE_FIELDS = len(Edge("", "", "", "", None, 0, 0).to_row())


class RowGraphStore:
    """Wait-for graphs kept as one row per edge in a table of bytes (the worker's changelog).

    Row key: graph key, NUL, edge id; value: the edge as a JSON row (then the position of the
    message that added it, and the partition and offset of the decision that did), ``cancelled``, or
    ``removed:<position>[:<partition>:<offset>]`` (a recent removal, and its decision's).
    A graph is rebuilt from its rows on first use after a rebalance (``generation``
    changes), then kept in memory; ``save`` writes only the rows of the edges it touched.
    """

    def __init__(self, rows: MutableMapping[bytes, bytes], generation: Callable[[], int | None]) -> None:
        self.rows = rows
        self.generation = generation
        self._cache: dict[bytes, WaitGraph] = {}
        self._cached_generation: int | None = None

    def get(self, key: bytes) -> WaitGraph:
        """The graph under ``key``."""
        if self._cached_generation != self.generation():
            self._cache.clear()
            self._cached_generation = self.generation()
        graph = self._cache.get(key)
        if graph is None:
            graph = WaitGraph()
            prefix = key + b"\x00"
            for row_key, row in list(self.rows.items()):
                if row_key.startswith(prefix):
                    edge_id = row_key[len(prefix):].decode()
                    if row == b"cancelled":
                        graph.cancelled[edge_id] = None
                    elif row.startswith(REMOVED):
                        position, *cause = (int(n) for n in row[len(REMOVED):].split(b":"))
                        graph.removed[edge_id] = position
                        if len(cause) == 2:  # (rows written before causes were kept have none)
                            graph.caused[edge_id] = (cause[0], cause[1])
                    else:
                        fields = json.loads(row)
                        graph.add(Edge.from_row(fields[:EDGE_FIELDS]))
                        if len(fields) > EDGE_FIELDS:  # (rows written before positions were kept have none)
                            graph.at[edge_id] = fields[EDGE_FIELDS]
                        if len(fields) > EDGE_FIELDS + 2:
                            graph.caused[edge_id] = (fields[EDGE_FIELDS + 1], fields[EDGE_FIELDS + 2])
            graph.touched.clear()
            self._cache[key] = graph
        return graph

    def discard(self, key: bytes) -> None:
        """Forget the graph in memory; the next ``get`` rebuilds it from the rows."""
        self._cache.pop(key, None)

    def save(self, key: bytes, graph: WaitGraph) -> None:
        """Write the rows of the edges ``graph`` touched since it was last saved."""
        prefix = key + b"\x00"
        for edge_id in sorted(graph.touched):
            row_key = prefix + edge_id.encode()
            edge = graph.edges.get(edge_id)
            cause = graph.caused.get(edge_id)
            if edge is not None:
                position = graph.at.get(edge_id)
                row = edge.to_row() if position is None else [*edge.to_row(), position, *(cause or ())]
                self.rows[row_key] = json.dumps(row).encode()
            elif edge_id in graph.cancelled:
                self.rows[row_key] = b"cancelled"
            elif edge_id in graph.removed:
                caused = b"" if cause is None else f":{cause[0]}:{cause[1]}".encode()
                self.rows[row_key] = REMOVED + str(graph.removed[edge_id]).encode() + caused
            else:
                self.rows.pop(row_key, None)
        graph.touched.clear()


@dataclass
class DeadlockShell:
    """The deadlock processor: folds wait-for edges and breaks the cycles they close."""

    store: RowGraphStore
    routes: Routes
    send: Send
    victim_policy: VictimPolicy = "priority"
    on_detection: Callable[[DeadlockDetected], None] = lambda _detection: None
    """Told of each detection (the worker logs it)."""
    scope: InputScope | None = None
    """The input being decided: if it fails, the graph it changed in memory is rebuilt from its rows."""

    async def handle(self, key: bytes | None, edge: Record, now_ms: int, cause: Cause,
                     sender: Verified | None = None) -> ContractError | None:
        """Fold one wait-edge message into its graph and act on the deadlocks it closes."""
        problem = edge_problem(key, edge)
        if problem is not None:
            return problem
        if isinstance(edge, DeadlockDetected):
            return None  # our own decisions, logged beside the edges they were made from
        assert key is not None and isinstance(edge, WaitEdgeAdded | WaitEdgeRemoved)
        graph = self.store.get(key)
        decided = None if edge.cause is None else (edge.cause.partition, edge.cause.offset)
        if graph.folded(edge.edge_id, cause.offset, decided):
            return None  # redelivered, or decided again upstream (see WaitGraph.folded): in the graph already
        if self.scope is not None:
            # The graph in memory changes in place: an input that fails is rebuilt from its rows (whose
            # writes the scope drops).
            self.scope.on_discard(lambda: self.store.discard(key))
        detections = await self._fold(graph, key, edge, now_ms, cause)
        for detection in detections:
            self.on_detection(detection)
        self.store.save(key, graph)
        return None

    async def _fold(self, graph: WaitGraph, key: bytes, edge: WaitEdgeAdded | WaitEdgeRemoved, now_ms: int,
                    cause: Cause) -> list[DeadlockDetected]:
        routes = self.routes
        found = detect(graph, edge, now_ms, cause, self.victim_policy) if isinstance(edge, WaitEdgeAdded) else []
        evolve_graph(graph, edge, now_ms, cause.offset)
        for detection in found:
            for revoke in revocations(graph, detection, now_ms):
                await self.send(routes.resource_commands, revoke.resource.encode(), revoke)
            evolve_graph(graph, detection)
            if detection.saga_id:
                # The detector starts the victim's compensation itself: the victim may be
                # stuck, or gone, and must not be trusted to do it.
                await self.send(routes.saga_commands, detection.saga_id.encode(), CompensationRequested(
                    saga_id=detection.saga_id, reason="deadlock_victim", requested_by="deadlock-detector",
                    at_ms=now_ms, cause=cause))
            await self.send(routes.wait_edges, key, detection)
            await self.send(routes.agent_inbox, detection.victim.encode(), detection)
        return found
