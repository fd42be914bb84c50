"""The deadlock and saga processors' decisions, with their outputs, minus the tables.

The worker (``runtime.worker``) keeps the state in changelogged tables and calls these
with a ``send`` that produces to Kafka; audit and replay (``arbiter.audit``) call the
very same functions with dictionaries and a ``send`` that collects. So the log is
replayed through exactly the code that wrote it.
"""

from __future__ import annotations

from dataclasses import dataclass

from contract import (
    Cause,
    CompensationRequested,
    ContractError,
    DeadlockDetected,
    LockReleaseRequested,
    LockRequested,
    LockTick,
    Record,
    SagaFinished,
    SnapshotRequested,
    ToolIntent,
    WaitEdgeAdded,
    WaitEdgeRemoved,
)
from cores import saga as saga_core
from cores.leases import RESOURCE_LOCK_COMMANDS
from cores.saga import Saga
from cores.waitgraph import VictimPolicy, WaitGraph, detect, revocations
from cores.waitgraph import evolve as evolve_graph

from .resource import SAGA_PREFIX, ResourceShell, Send


@dataclass(frozen=True)
class Routes:
    """The topics the deadlock and saga processors write to."""

    resource_commands: str
    agent_inbox: str
    wait_edges: str
    saga_commands: str
    saga_events: str


async def on_resource_command(shell: ResourceShell, key: bytes, command: Record, now_ms: int, cause: Cause,
                              generation: int | None) -> ContractError | None:
    """Decide one message of the resource-command topic; an error says why it must be dead-lettered."""
    if isinstance(command, LockTick):
        await shell.tick(command, now_ms, cause, generation)
        return None
    if not isinstance(command, (*RESOURCE_LOCK_COMMANDS, ToolIntent, SnapshotRequested)):
        return ContractError("unsupported_command", f"{type(command).__name__} has no handler in this worker")
    if key != command.resource.encode():
        # Decided under another key, the resource would have two orders.
        return ContractError("key_mismatch", f"message key {key!r} is not the resource {command.resource!r}")
    if isinstance(command, ToolIntent):
        await shell.execute(key, command, now_ms, cause)
    elif isinstance(command, SnapshotRequested):
        await shell.snapshot(key, command, now_ms, cause)
    else:
        await shell.decide(key, command, now_ms, cause)
    return None


def edge_problem(edge: Record) -> ContractError | None:
    """Why a message does not belong on the wait-edge topic (None: it does)."""
    if isinstance(edge, WaitEdgeAdded | WaitEdgeRemoved | DeadlockDetected):
        return None
    return ContractError("unsupported_command", f"{type(edge).__name__} does not belong on the wait-edge topic")


def saga_key_problem(key: bytes | None, record: Record) -> ContractError | None:
    """Why a saga message cannot be decided under its key (None: it can)."""
    try:
        saga_id = (key or b"").decode()
    except UnicodeDecodeError:
        saga_id = ""
    if not saga_id.startswith(SAGA_PREFIX) or getattr(record, "saga_id", saga_id) != saga_id:
        return ContractError("key_mismatch", f"saga messages are keyed by a saga id starting with {SAGA_PREFIX!r}; "
                                             f"got {key!r} for {type(record).__name__}")
    return None


async def on_edge(graph: WaitGraph, key: bytes, edge: WaitEdgeAdded | WaitEdgeRemoved, now_ms: int, cause: Cause,
                  routes: Routes, send: Send, victim_policy: VictimPolicy = "priority") -> list[DeadlockDetected]:
    """Fold one wait-for edge into ``graph`` (in place) and act on the deadlocks it closes."""
    found = detect(graph, edge, now_ms, cause, victim_policy) if isinstance(edge, WaitEdgeAdded) else []
    evolve_graph(graph, edge)
    for detection in found:
        for revoke in revocations(graph, detection, now_ms):
            await send(routes.resource_commands, revoke.resource.encode(), revoke)
        evolve_graph(graph, detection)
        if detection.saga_id:
            # The detector starts the victim's compensation itself: the victim may be
            # stuck, or gone, and must not be trusted to do it.
            await send(routes.saga_commands, detection.saga_id.encode(), CompensationRequested(
                saga_id=detection.saga_id, reason="deadlock_victim", requested_by="deadlock-detector",
                at_ms=now_ms, cause=cause))
        await send(routes.wait_edges, key, detection)
        await send(routes.agent_inbox, detection.victim.encode(), detection)
    return found


async def on_saga(saga: Saga, key: bytes, record: Record, now_ms: int, cause: Cause, routes: Routes,
                  send: Send) -> None:
    """Decide one saga message (in place): an agent's step or abort, or an answer to the saga's own agent."""
    outputs = saga_core.decide(saga, record, now_ms, cause)  # type: ignore[arg-type]
    saga_core.evolve(saga, record)
    for output in outputs:
        saga_core.evolve(saga, output)
        if isinstance(output, LockRequested | LockReleaseRequested | ToolIntent):
            await send(routes.resource_commands, output.resource.encode(), output)
        else:
            await send(routes.saga_events, key, output)
            if isinstance(output, SagaFinished) and saga.agent_id:
                await send(routes.agent_inbox, saga.agent_id.encode(), output)
