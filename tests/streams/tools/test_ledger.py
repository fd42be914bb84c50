"""The ledger tools against real databases (SQLite and PostgreSQL): idempotent by intent id."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import pytest

from arbiter.schemas import ToolIntent
from arbiter.streams.tools.ledger import (
    MAX_TOTAL,
    PAYOUTS,
    Ledger,
    LedgerError,
    merge_patch,
    register_ledger_tools,
)
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
                      arguments_json=json.dumps(args), at_ms=0)


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


def everything(ledger: Ledger) -> dict[str, Any]:
    """Every row the ledger keeps: what a refused change must leave as it was."""
    with ledger.transaction() as cur:
        return {table: sorted(map(repr, cur.run(f"SELECT * FROM {table}")))
                for table in ("accounts", "intent_results", "refunds", "documents", "ledger_meta")}


def test_opening_payouts_on_a_fresh_ledger_opens_it(ledger_dsn: str) -> None:
    """Finding: 'arbiter ledger open payouts --balance 0' on a fresh ledger ended in an IntegrityError
    (payouts was opened twice in one transaction: once as the refunds' account, once as asked)."""
    ledger = Ledger(ledger_dsn)
    ledger.add_accounts({PAYOUTS: 0})
    assert ledger.balances() == {PAYOUTS: 0} and ledger.invariants()["ok"]
    ledger.add_accounts({"cust_1": 500})
    assert ledger.balances() == {PAYOUTS: 0, "cust_1": 500} and ledger.invariants()["total"] == 500


@pytest.mark.parametrize(("balances", "says"), [
    ({PAYOUTS: 0}, "exist already"),
    ({"cust_2": 5, "cust_1": 1}, "cust_1 exist already"),
    ({"cust_2": -1}, "an integer of 0 to"),
    ({"cust_2": MAX_TOTAL + 1}, "an integer of 0 to"),
    ({"cust_2": 2**63}, "an integer of 0 to"),
    ({"cust_2": True}, "an integer of 0 to"),
    ({"cust_2": 1.5}, "an integer of 0 to"),
    ({"cust_2": MAX_TOTAL - 100, "cust_3": 1}, "more than its"),
    ({"": 1}, "account id is 1-128"),
    ({"a b": 1}, "account id is 1-128"),
    ({"x" * 129: 1}, "account id is 1-128"),
    ({"nul\x00": 1}, "account id is 1-128"),
    ({"account:cust_2": 1}, "without 'account:'"),
])
def test_opening_accounts_refuses_edge_values_and_changes_nothing(ledger_dsn: str, balances: dict[str, Any],
                                                                  says: str) -> None:
    ledger = Ledger(ledger_dsn)
    ledger.add_accounts({"cust_1": 500})
    before = everything(ledger)
    with pytest.raises(LedgerError, match=re.escape(says)):
        ledger.add_accounts(balances)
    assert everything(ledger) == before


TOOL_EDGES: list[tuple[str, dict[str, Any], str, str, str]] = [
    # tool, arguments, resource, intent id, what the refusal says
    ("refund", {"order_id": "o", "amount": 0}, "account:cust_1", "e1", "greater than 0"),
    ("refund", {"order_id": "o", "amount": -5}, "account:cust_1", "e1", "greater than 0"),
    ("refund", {"order_id": "o", "amount": 10**12 + 1}, "account:cust_1", "e1", "less than or equal"),
    ("refund", {"order_id": "o", "amount": 2**70}, "account:cust_1", "e1", "less than or equal"),
    ("refund", {"order_id": "o", "amount": True}, "account:cust_1", "e1", "valid integer"),
    ("refund", {"order_id": "o", "amount": "25"}, "account:cust_1", "e1", "valid integer"),
    ("refund", {"order_id": "o", "amount": 25.0}, "account:cust_1", "e1", "valid integer"),
    ("refund", {"order_id": "", "amount": 1}, "account:cust_1", "e1", "at least 1 character"),
    ("refund", {"order_id": "o" * 129, "amount": 1}, "account:cust_1", "e1", "at most 128"),
    ("refund", {"order_id": "o\x00", "amount": 1}, "account:cust_1", "e1", "pattern"),
    ("refund", {"order_id": "o", "amount": 1}, "account:nobody", "e1", "no account 'nobody'"),
    ("refund", {"order_id": "o", "amount": 1}, "account:", "e1", "not an account resource"),
    ("refund", {"order_id": "o", "amount": 1}, "account:cust_1\x00", "e1", "not an account resource"),
    ("refund", {"order_id": "o", "amount": 1}, "doc:spec", "e1", "not an account resource"),
    ("refund", {"order_id": "o", "amount": 1}, "account:account:cust_1", "e1", "without 'account:'"),
    ("refund", {"order_id": "o", "amount": 1}, f"account:{PAYOUTS}", "e1", "would pay itself"),
    ("refund", {"order_id": "o", "amount": 501}, "account:cust_1", "e1", "less than 501"),
    ("refund", {"order_id": "o", "amount": 1}, "account:cust_1", "e\x00", "NUL"),
    ("transfer", {"to": "cust_1", "amount": 1}, "account:cust_1", "e1", "to itself"),
    ("transfer", {"to": "nobody", "amount": 1}, "account:cust_1", "e1", "no account 'nobody'"),
    ("transfer", {"to": "", "amount": 1}, "account:cust_1", "e1", "pattern"),
    ("transfer", {"to": "x\x00", "amount": 1}, "account:cust_1", "e1", "pattern"),
    ("transfer", {"to": "account:cust_8492", "amount": 1}, "account:cust_1", "e1", "without 'account:'"),
    ("transfer", {"to": "cust_8492", "amount": 1}, "account:nobody", "e1", "no account 'nobody'"),
    ("transfer", {"to": "cust_8492", "amount": 10**12}, "account:cust_1", "e1", "less than"),
    ("reverse_refund", {"refund_intent_id": ""}, "account:cust_1", "e1", "at least 1 character"),
    ("reverse_refund", {"refund_intent_id": "r\x00"}, "account:cust_1", "e1", "pattern"),
    ("commit", {"patch": {"balance": 10**9}}, "account:cust_1", "e1", "is an account, not a document"),
    ("commit", {"patch": {"title": "t"}}, "doc:\x00", "e1", "NUL"),
]


@pytest.mark.parametrize(("tool", "args", "resource", "intent_id", "says"), TOOL_EDGES)
def test_every_tool_refuses_edge_values_and_changes_nothing(ledger: Ledger, registry: ToolRegistry, tool: str,
                                                            args: dict[str, Any], resource: str, intent_id: str,
                                                            says: str) -> None:
    """A refusal names what was wrong, in the tool's words (never a database's exception), and every row
    of the ledger is as it was."""
    before = everything(ledger)
    call = intent(tool, args, resource, intent_id)
    parsed = registry.parse(call)
    if isinstance(parsed, str):
        error = parsed
    else:
        outcome = asyncio.run(registry.run(call, parsed))
        assert not outcome.ok, outcome
        error = outcome.error
    assert says in error, error
    assert not re.match(r"^\w+(Error|Exception|Violation)\b", error), f"a database's error, not a refusal: {error}"
    assert everything(ledger) == before
