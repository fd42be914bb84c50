"""Where the processors' outputs go, and how a shell hands them over (``Send``)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from arbiter.edge.settings import Topics
from arbiter.schemas import Record

SAGA_PREFIX = "saga:"
"""Saga ids start with this; a saga acts as an agent of its own under its id."""

Send = Callable[[str, bytes, Record], Awaitable[None]]
"""send(topic, key, record): queue one output (the worker produces it; a replay collects it)."""


@dataclass(frozen=True)
class Routes:
    """The topics the processors write to, and the wait-for graph's key."""

    resource_commands: str
    resource_events: str
    agent_inbox: str
    wait_edges: str
    saga_commands: str
    saga_events: str
    operator: str
    graph_key: bytes

    @classmethod
    def of(cls, topics: Topics, graph_key: str) -> Routes:
        """The routes for these topic names."""
        return cls(topics.resource_commands, topics.resource_events, topics.agent_inbox, topics.wait_edges,
                   topics.saga_commands, topics.saga_events, topics.operator, graph_key.encode())

    def reply_to(self, agent_id: str) -> str:
        """The topic an answer for ``agent_id`` goes to: a saga's answers go to the saga processor,
        beside the saga's other commands, in one order; an agent's to its inbox."""
        return self.saga_commands if agent_id.startswith(SAGA_PREFIX) else self.agent_inbox
