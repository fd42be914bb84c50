"""The SDK's saga facade without a broker: what a ``Saga`` asks of its host and tells the processor."""

from __future__ import annotations

import ast
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from arbiter import agents
from arbiter.agents.errors import SagaAborted, SagaStepRejected
from arbiter.agents.leases import Lease
from arbiter.agents.outcomes import Outcome
from arbiter.agents.sagas import Saga, SagaMessage
from arbiter.schemas import CompensationRequested, SagaStep
from arbiter.schemas.reasons import RETRIABLE, Reason

AGENTS = Path(agents.__file__).parent


class FakeHost:
    """Just what ``arbiter.agents.sagas.SagaHost`` names; records every call."""

    def __init__(self, applied: bool = True) -> None:
        self.agent_id = "refunder"
        self.applied = applied
        self.executed: list[dict[str, Any]] = []
        self.sent: list[tuple[str, SagaMessage]] = []
        self.delegated: list[tuple[str, str | None]] = []
        self.leased: list[tuple[str, dict[str, Any]]] = []

    async def execute(self, lease: Lease | str, tool: str, args: dict[str, Any], *, base_version: int | None = None,
                      saga_id: str | None = None, step: int | None = None) -> Outcome:
        self.executed.append({"resource": lease, "tool": tool, "args": args, "saga_id": saga_id, "step": step})
        if self.applied:
            return Outcome(f"i{step}", str(lease), tool, True, version=1, result={"id": "refund-1"})
        return Outcome(f"i{step}", str(lease), tool, False, reason="version_conflict")

    @contextlib.asynccontextmanager
    async def delegate(self, to: str, task: str = "", priority: int = 0,
                       saga_id: str | None = None) -> AsyncIterator[None]:
        self.delegated.append((to, saga_id))
        yield

    @contextlib.asynccontextmanager
    async def lease(self, resource: str, **options: Any) -> AsyncIterator[Lease]:
        self.leased.append((resource, options))
        yield Lease(resource, self.agent_id, "r1", 1, "exclusive", 30_000, 0, 0)

    async def send(self, saga_id: str, message: SagaMessage) -> None:
        self.sent.append((saga_id, message))


async def test_a_step_runs_through_the_host_and_is_told_keyed_by_the_saga() -> None:
    host = FakeHost()
    saga = Saga(host, "saga:refund:1", host.send)
    outcome = await saga.step("ledger:cust_1", "refund", {"amount": 120},
                              compensate=lambda o: ("void_refund", {"id": o.result["id"]}))
    assert outcome.applied
    assert host.executed == [{"resource": "ledger:cust_1", "tool": "refund", "args": {"amount": 120},
                              "saga_id": "saga:refund:1", "step": 0}]
    [(key, message)] = host.sent
    assert key == "saga:refund:1"
    assert isinstance(message, SagaStep)
    assert (message.saga_id, message.step, message.status, message.agent_id) == ("saga:refund:1", 0, "completed",
                                                                                  "refunder")
    assert (message.compensate_tool, message.compensate_arguments_json) == ("void_refund", '{"id": "refund-1"}')
    assert message.at_ms > 0


async def test_complete_is_public_and_says_saga_completed() -> None:
    host = FakeHost()
    saga = Saga(host, "saga:refund:2", host.send)
    await saga.complete()
    [(key, message)] = host.sent
    assert key == "saga:refund:2"
    assert isinstance(message, SagaStep)
    assert (message.step, message.status) == (-1, "saga_completed")


async def test_abort_asks_for_compensation_and_stops_further_steps() -> None:
    host = FakeHost()
    saga = Saga(host, "saga:refund:3", host.send)
    await saga.abort("gave_up")
    [(key, message)] = host.sent
    assert key == "saga:refund:3"
    assert isinstance(message, CompensationRequested)
    assert (message.reason, message.requested_by) == ("gave_up", "refunder")
    with pytest.raises(SagaAborted):
        await saga.step("ledger:cust_1", "refund", {})
    assert host.executed == []


async def test_a_rejected_step_is_told_as_failed_and_raised() -> None:
    host = FakeHost(applied=False)
    saga = Saga(host, "saga:refund:4", host.send)
    with pytest.raises(SagaStepRejected) as error:
        await saga.step("ledger:cust_1", "refund", {"amount": 1})
    assert error.value.outcome.reason == "version_conflict"
    [(_, message)] = host.sent
    assert isinstance(message, SagaStep) and message.status == "failed"


async def test_delegate_and_lease_name_the_saga() -> None:
    host = FakeHost()
    saga = Saga(host, "saga:refund:5", host.send)
    async with saga.delegate("testing-agent"):
        pass
    async with saga.lease("ledger:cust_1", ttl=5):
        pass
    assert host.delegated == [("testing-agent", "saga:refund:5")]
    assert host.leased == [("ledger:cust_1", {"saga_id": "saga:refund:5", "ttl": 5})]


def test_lease_denied_retriable_reads_the_one_reason_table() -> None:
    for reason in Reason:
        assert agents.LeaseDenied(reason.value, {}).retriable is (reason in RETRIABLE), reason
    assert agents.LeaseDenied("no_such_reason", {}).retriable is False


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            names.add("." * node.level + (node.module or ""))
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_the_facade_sits_on_top_sagas_and_transport_never_import_it() -> None:
    assert "arbiter.agents.client" not in _imports(AGENTS / "sagas.py")
    assert not {"arbiter.agents.client", "arbiter.agents.sagas"} & _imports(AGENTS / "transport.py")
    assert {"arbiter.agents.transport", "arbiter.agents.sagas"} <= _imports(AGENTS / "client.py")
    assert not any(name.startswith("aiokafka") for name in _imports(AGENTS / "client.py"))
