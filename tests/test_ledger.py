"""The ledger tools against real databases (SQLite and PostgreSQL): idempotent by intent id."""

from __future__ import annotations

import asyncio
import json

import pytest

from arbiter.schemas import ToolIntent
from arbiter.streams.tools.ledger import Ledger, merge_patch, register_ledger_tools
from arbiter.streams.tools.registry import ToolRegistry


@pytest.fixture
def ledger(ledger_dsn: str) -> Ledger:
    ledger = Ledger(ledger_dsn)
    ledger.seed({"cust_8492": 10_000, "cust_1": 500})
    return ledger


@pytest.fixture
def registry(ledger: Ledger) -> ToolRegistry:
    registry = ToolRegistry()
    register_ledger_tools(registry, ledger)
    return registry


def intent(tool: str, args: dict[str, object], resource: str = "account:cust_8492", intent_id: str = "i1"
           ) -> ToolIntent:
    return ToolIntent(intent_id=intent_id, agent_id="a", resource=resource, token=1, tool=tool,
                      arguments_json=json.dumps(args), sent_at_ms=0)


def run(registry: ToolRegistry, i: ToolIntent) -> tuple[bool, object]:
    parsed = registry.parse(i)
    assert not isinstance(parsed, str), parsed
    outcome = asyncio.run(registry.run(i, parsed))
    return outcome.ok, json.loads(outcome.result_json) if outcome.ok else outcome.error


def test_a_refund_runs_once_per_intent_id(ledger: Ledger, registry: ToolRegistry) -> None:
    first = run(registry, intent("refund", {"order_id": "o-1", "amount": 2_500}))
    again = run(registry, intent("refund", {"order_id": "o-1", "amount": 2_500}))
    assert first == again == (True, {"account": "cust_8492", "order_id": "o-1", "amount": 2_500,
                                     "balance": 7_500})
    assert ledger.balances()["cust_8492"] == 7_500
    assert len(ledger.refunds()) == 1
    assert ledger.invariants()["ok"]


def test_insufficient_balance_fails_and_changes_nothing(ledger: Ledger, registry: ToolRegistry) -> None:
    ok, error = run(registry, intent("refund", {"order_id": "o-2", "amount": 999}, "account:cust_1"))
    assert not ok and "less than 999" in str(error)
    assert ledger.balances()["cust_1"] == 500 and ledger.refunds() == []
    ok, error = run(registry, intent("transfer", {"to": "nobody", "amount": 1}, "account:cust_1", "i2"))
    assert not ok and "no account 'nobody'" in str(error)
    assert ledger.balances()["cust_1"] == 500


def test_reverse_refund_restores_and_is_idempotent(ledger: Ledger, registry: ToolRegistry) -> None:
    run(registry, intent("refund", {"order_id": "o-3", "amount": 1_000}, intent_id="r1"))
    first = run(registry, intent("reverse_refund", {"refund_intent_id": "r1"}, intent_id="c1"))
    second = run(registry, intent("reverse_refund", {"refund_intent_id": "r1"}, intent_id="c2"))
    assert first == (True, {"reversed": "r1", "amount": 1_000})
    assert second[1]["note"].startswith("already reversed")  # type: ignore[index]
    assert ledger.balances()["cust_8492"] == 10_000
    assert ledger.invariants()["ok"]


def test_invariants_catch_a_double_refund(ledger: Ledger, registry: ToolRegistry) -> None:
    run(registry, intent("refund", {"order_id": "o-4", "amount": 100}, intent_id="x1"))
    run(registry, intent("refund", {"order_id": "o-4", "amount": 100}, intent_id="x2"))
    report = ledger.invariants()
    assert report["double_refunds"] == ["o-4"] and not report["ok"]
    assert report["money_conserved"]


def test_documents_take_merge_patches(ledger: Ledger, registry: ToolRegistry) -> None:
    run(registry, intent("commit", {"patch": {"title": "Arbiter", "tags": ["a"]}}, "doc:spec", "d1"))
    run(registry, intent("commit", {"patch": {"tags": None, "body": "Leases"}}, "doc:spec", "d2"))
    assert ledger.document("doc:spec") == (2, {"title": "Arbiter", "body": "Leases"})


def test_arguments_are_checked_against_the_tool_schema(registry: ToolRegistry) -> None:
    assert "amount" in str(registry.parse(intent("refund", {"order_id": "o", "amount": -5})))
    assert "Extra inputs" in str(registry.parse(intent("refund", {"order_id": "o", "amount": 5, "x": 1})))
    assert registry.parse(intent("nope", {})) == "unknown tool 'nope'"


def test_merge_patch_follows_rfc_7386() -> None:
    assert merge_patch({"a": "b"}, {"a": "c"}) == {"a": "c"}
    assert merge_patch({"a": "b"}, {"a": None}) == {}
    assert merge_patch({"a": {"b": "c"}}, {"a": {"b": "d", "c": None}}) == {"a": {"b": "d"}}
    assert merge_patch({"a": [1]}, {"a": [2]}) == {"a": [2]}
    assert merge_patch([1, 2], {"a": 1}) == {"a": 1}


def test_many_workers_can_open_one_sqlite_ledger_at_once(tmp_path: object) -> None:
    import threading
    from pathlib import Path

    path = str(Path(str(tmp_path)) / "shared.sqlite3")
    errors: list[BaseException] = []

    def open_ledger() -> None:
        try:
            Ledger(path).close()
        except BaseException as exc:  # collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=open_ledger) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_an_intent_is_its_resource_and_its_id_as_at_the_gateway(ledger: Ledger, registry: ToolRegistry) -> None:
    """The same intent id on two resources is two writes (the gateway decides them on two resources): both
    run, each once; neither is answered with the other's result."""
    here = run(registry, intent("refund", {"order_id": "o-1", "amount": 100}, resource="account:cust_8492"))
    there = run(registry, intent("refund", {"order_id": "o-9", "amount": 100}, resource="account:cust_1"))
    assert here[0] and there[0] and here != there
    assert ledger.balances()["cust_8492"] == 9_900 and ledger.balances()["cust_1"] == 400
    again = run(registry, intent("refund", {"order_id": "o-9", "amount": 100}, resource="account:cust_1"))
    assert again == there and ledger.balances()["cust_1"] == 400
    undone = run(registry, intent("reverse_refund", {"refund_intent_id": "i1"}, resource="account:cust_1",
                                  intent_id="undo-1"))
    assert undone == (True, {"reversed": "i1", "amount": 100})
    assert ledger.balances()["cust_1"] == 500 and ledger.balances()["cust_8492"] == 9_900
    assert ledger.invariants()["ok"]
