"""The three processors as one: the ``Shell`` each is, ``Shells`` (which reads which input topic), and
``build_shells``, which makes them over one set of stores (the worker's tables, or audit's dicts)."""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import Protocol

from arbiter.edge.settings import Topics
from arbiter.schemas import Cause, ContractError, DeadlockDetected, Record, ToolIntent
from arbiter.schemas.identity import Verified
from arbiter.streams.cores.gateway import ContentState
from arbiter.streams.cores.leases import LeaseBook
from arbiter.streams.cores.saga import Saga
from arbiter.streams.shells.deadlock import DeadlockShell, RowGraphStore
from arbiter.streams.shells.resource import ResourceShell, ToolRunner
from arbiter.streams.shells.routes import Routes, Send
from arbiter.streams.shells.rules import Rules
from arbiter.streams.shells.saga import SagaShell
from arbiter.streams.shells.tables import InputScope


class Shell(Protocol):
    """One processor: decide one decoded input; an error says why it must be dead-lettered."""

    async def handle(self, key: bytes | None, record: Record, now_ms: int, cause: Cause,
                     sender: Verified | None = None) -> ContractError | None:
        """Decide ``record`` (keyed ``key``) at the broker time ``now_ms``; send what it causes."""


@dataclass
class Shells:
    """The three processors, and which input topic each reads."""

    resource: ResourceShell
    deadlock: DeadlockShell
    saga: SagaShell
    topics: Topics

    def for_topic(self, topic: str) -> Shell | None:
        """The processor that reads ``topic`` (None: no processor reads it)."""
        readers: dict[str, Shell] = {self.topics.resource_commands: self.resource,
                                     self.topics.wait_edges: self.deadlock, self.topics.saga_commands: self.saga}
        return readers.get(topic)


def build_shells(
    rules: Rules,
    topics: Topics,
    partitions: int,
    *,
    books: MutableMapping[bytes, LeaseBook],
    contents: MutableMapping[bytes, ContentState],
    graphs: RowGraphStore,
    sagas: MutableMapping[bytes, Saga],
    tools: ToolRunner,
    send: Send,
    scope: InputScope | None = None,
    worker_id: str = "replay",
    generation: Callable[[], int | None] = lambda: 0,
    after_tool: Callable[[ToolIntent], None] = lambda _intent: None,
    on_detection: Callable[[DeadlockDetected], None] = lambda _detection: None,
) -> Shells:
    """The three shells over the given stores, deciding by ``rules`` and sending with ``send``; changes
    made in place are undone through ``scope`` when the input fails."""
    routes = Routes.of(topics, rules.graph_key)
    return Shells(
        resource=ResourceShell(books=books, contents=contents, partitions=partitions, rules=rules.leases,
                               gate_rules=rules.gateway, tools=tools, routes=routes, send=send, worker_id=worker_id,
                               generation=generation, after_tool=after_tool,
                               hide_tokens=rules.verify_signatures, scope=scope),
        deadlock=DeadlockShell(graphs, routes, send, rules.victim_policy, on_detection, scope),
        saga=SagaShell(sagas, routes, send),
        topics=topics,
    )
