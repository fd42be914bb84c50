"""The ledger: accounts, refunds and documents in a real SQL database.

SQLite (a file) is the embedded default; a ``postgresql://`` DSN selects PostgreSQL.
Every tool runs in one database transaction that also records its intent in
``intent_results``: a redelivered intent (say, the worker died after the tool ran
but before its offset was committed) finds itself there and returns the recorded
result without applying anything again. An intent is its resource and its id, the
scope the gateway gives it too: the same id on two resources is two writes.

Money is integer cents. ``CHECK (balance >= 0)`` backs the rule that no balance goes
negative; ``invariants()`` checks it, money conservation and double refunds.

Input at the edges (zero, negative or huge amounts, an account opened twice, an unknown
account, a text PostgreSQL cannot store) is refused before it reaches SQL, with what was
wrong: ``LedgerError`` for the operator's ``add_accounts``, ``ToolError`` for a tool, and in
either case the transaction is rolled back, so nothing changed. A database's own error is
never the answer to bad input.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
import sqlite3
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, TypeVar, cast

from pydantic import BaseModel, ConfigDict, Field, field_validator

from arbiter.streams.tools.git import Repos
from arbiter.streams.tools.merges import Failpoint
from arbiter.streams.tools.registry import ToolCall, ToolError, ToolRegistry

T = TypeVar("T")
R = TypeVar("R")

SCHEMA = [
    """CREATE TABLE IF NOT EXISTS accounts (
        id TEXT PRIMARY KEY,
        balance BIGINT NOT NULL CHECK (balance >= 0))""",
    """CREATE TABLE IF NOT EXISTS intent_results (
        resource TEXT NOT NULL,
        intent_id TEXT NOT NULL,
        tool TEXT NOT NULL,
        result TEXT NOT NULL,
        PRIMARY KEY (resource, intent_id))""",
    """CREATE TABLE IF NOT EXISTS refunds (
        intent_id TEXT NOT NULL,
        account TEXT NOT NULL,
        order_id TEXT NOT NULL,
        amount BIGINT NOT NULL,
        reversed_by TEXT,
        PRIMARY KEY (account, intent_id))""",
    """CREATE TABLE IF NOT EXISTS documents (
        id TEXT PRIMARY KEY,
        revision BIGINT NOT NULL,
        body TEXT NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS ledger_meta (
        key TEXT PRIMARY KEY,
        value BIGINT NOT NULL)""",
]
PAYOUTS = "payouts"
"""The account refunds are paid into; it keeps money conserved."""
MAX_TOTAL = 10**18
"""The most money the ledger holds, in cents. Money is conserved, so no balance exceeds the total, and
the total plus any one tool's amount (at most ``MAX_AMOUNT``) stays within a 64-bit ``BIGINT``."""
MAX_AMOUNT = 10**12
"""The most cents one tool call moves."""
ACCOUNT_ID = re.compile(r"[A-Za-z0-9_.@:-]{1,128}")
"""What an account id is made of (its resource is ``account:<id>``)."""


class LedgerError(ValueError):
    """A change the ledger refuses, with why; nothing was changed."""


def account_problem(account: str) -> str | None:
    """Why ``account`` cannot be an account id (None: it can)."""
    if account.startswith("account:"):
        # Its resource would be account:account:<id>: a caller who wrote the resource's name where the
        # account's id goes, and would move money to (or open) an account it did not mean.
        return f"an account is named by its id, without 'account:' ({account[len('account:'):][:128]!r})"
    if ACCOUNT_ID.fullmatch(account):
        return None
    return "an account id is 1-128 letters, digits and _.@:- (the resource is account:<id>)"


def database_errors(integrity: bool = False) -> tuple[type[Exception], ...]:
    """The errors the ledger's databases raise (SQLite's, and PostgreSQL's when its driver is installed);
    ``integrity``: only those that say a constraint refused a row."""
    try:
        import psycopg
    except ImportError:
        return (sqlite3.IntegrityError if integrity else sqlite3.Error,)
    return (sqlite3.IntegrityError, psycopg.IntegrityError) if integrity else (sqlite3.Error, psycopg.Error)


class Ledger:
    """A connection to the ledger database. Thread-safe; async methods run in a thread."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self._lock = threading.Lock()
        self.postgres = dsn.startswith(("postgresql://", "postgres://"))
        if self.postgres:
            import psycopg

            self._conn: Any = psycopg.connect(dsn, autocommit=True)
        else:
            path = dsn.removeprefix("sqlite:///") if dsn.startswith("sqlite:///") else dsn
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30)
        self._create_schema()

    def _create_schema(self) -> None:
        # Several workers open one SQLite file at once; switching it to WAL needs a
        # moment alone with it, which SQLite refuses (rather than waits for) when busy.
        deadline = time.monotonic() + 30
        while True:
            try:
                if not self.postgres:
                    self._conn.execute("PRAGMA journal_mode=WAL")
                with self.transaction() as cur:
                    for statement in SCHEMA:
                        cur.run(statement)
                return
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def close(self) -> None:
        """Close the connection."""
        self._conn.close()

    def _sql(self, statement: str) -> str:
        return statement.replace("?", "%s") if self.postgres else statement

    @contextmanager
    def transaction(self) -> Iterator[Any]:
        """One serializable unit of work; a cursor whose ``run(sql, args)`` takes ``?`` placeholders."""
        with self._lock:
            cur = self._conn.cursor()
            cur.execute("BEGIN" if self.postgres else "BEGIN IMMEDIATE")
            try:
                yield _Cursor(cur, self._sql)
            except BaseException:
                cur.execute("ROLLBACK")
                raise
            else:
                cur.execute("COMMIT")
            finally:
                cur.close()

    async def call(self, fn: Callable[[Any], T]) -> T:
        """Run ``fn(cursor)`` in one transaction, in a thread."""

        def work() -> T:
            with self.transaction() as cur:
                return fn(cur)

        return await asyncio.to_thread(work)

    # -- setup and checks ----------------------------------------------------------

    def seed(self, balances: dict[str, int]) -> None:
        """Start over with these balances (plus an empty payouts account)."""
        with self.transaction() as cur:
            for table in ("accounts", "intent_results", "refunds", "documents", "ledger_meta"):
                cur.run(f"DELETE FROM {table}")
            for account, balance in sorted({**balances, PAYOUTS: balances.get(PAYOUTS, 0)}.items()):
                cur.run("INSERT INTO accounts (id, balance) VALUES (?, ?)", (account, balance))
            cur.run("INSERT INTO ledger_meta (key, value) VALUES ('total', ?)", (sum(balances.values()),))

    def add_accounts(self, balances: dict[str, int]) -> None:
        """Open new accounts with these balances (and ``payouts`` at 0 when it is not open yet), leaving
        every other account alone. ``LedgerError``, with nothing opened, when an id is not an account
        id, a balance is not an integer of 0 to ``MAX_TOTAL`` cents, an account is open already, or the
        ledger's total would pass ``MAX_TOTAL``."""
        problems = [f"{a!r}: {p}" for a in sorted(balances) if (p := account_problem(a))]
        problems += [f"{a}: a balance is an integer of 0 to {MAX_TOTAL} cents, not {b!r}"
                     for a, b in sorted(balances.items()) if type(b) is not int or not 0 <= b <= MAX_TOTAL]
        if problems:
            raise LedgerError("; ".join(problems))
        try:
            with self.transaction() as cur:
                self._open(cur, balances)
        except database_errors(integrity=True) as exc:
            # PostgreSQL reads committed: another process opened one of them since this one looked.
            raise LedgerError(f"an account was opened by someone else at the same moment ({exc})") from None

    def _open(self, cur: _Cursor, balances: dict[str, int]) -> None:
        existing = sorted(a for a in balances if cur.run("SELECT 1 FROM accounts WHERE id = ?", (a,)))
        if existing:
            raise LedgerError(f"account(s) {', '.join(existing)} exist already")
        recorded = cur.run("SELECT value FROM ledger_meta WHERE key = 'total'")
        total = int((recorded or cur.run("SELECT COALESCE(SUM(balance), 0) FROM accounts"))[0][0])
        if total + sum(balances.values()) > MAX_TOTAL:
            raise LedgerError(f"the ledger would hold {total + sum(balances.values())} cents, more than its "
                              f"{MAX_TOTAL}")
        if PAYOUTS not in balances:
            cur.run("INSERT INTO accounts (id, balance) VALUES (?, 0) ON CONFLICT (id) DO NOTHING", (PAYOUTS,))
        for account, balance in sorted(balances.items()):
            cur.run("INSERT INTO accounts (id, balance) VALUES (?, ?)", (account, balance))
        if recorded:
            cur.run("UPDATE ledger_meta SET value = value + ? WHERE key = 'total'", (sum(balances.values()),))
        else:
            cur.run("INSERT INTO ledger_meta (key, value) VALUES ('total', ?)", (total + sum(balances.values()),))

    def balances(self) -> dict[str, int]:
        """Every account's balance."""
        with self.transaction() as cur:
            return {row[0]: int(row[1]) for row in cur.run("SELECT id, balance FROM accounts ORDER BY id")}

    def refunds(self) -> list[dict[str, Any]]:
        """Every refund, in intent-id order."""
        with self.transaction() as cur:
            rows = cur.run("SELECT intent_id, account, order_id, amount, reversed_by FROM refunds ORDER BY intent_id")
            return [dict(zip(("intent_id", "account", "order_id", "amount", "reversed_by"), r, strict=True))
                    for r in rows]

    def applied(self, tool: str) -> list[str]:
        """Intent ids of every run of ``tool`` that applied (or was found applied), sorted."""
        with self.transaction() as cur:
            return [r[0] for r in cur.run("SELECT intent_id FROM intent_results WHERE tool = ? ORDER BY intent_id",
                                          (tool,))]

    def document(self, doc_id: str) -> tuple[int, dict[str, Any]] | None:
        """A document's revision and body."""
        with self.transaction() as cur:
            rows = cur.run("SELECT revision, body FROM documents WHERE id = ?", (doc_id,))
            return (int(rows[0][0]), json.loads(rows[0][1])) if rows else None

    def invariants(self) -> dict[str, Any]:
        """Money conserved, no negative balance, no order refunded twice."""
        with self.transaction() as cur:
            total = int(cur.run("SELECT COALESCE(SUM(balance), 0) FROM accounts")[0][0])
            expected_rows = cur.run("SELECT value FROM ledger_meta WHERE key = 'total'")
            expected = int(expected_rows[0][0]) if expected_rows else total
            negative = [r[0] for r in cur.run("SELECT id FROM accounts WHERE balance < 0")]
            doubles = [r[0] for r in cur.run(
                "SELECT order_id FROM refunds WHERE reversed_by IS NULL GROUP BY order_id HAVING COUNT(*) > 1")]
        return {"total": total, "expected_total": expected, "money_conserved": total == expected,
                "negative_balances": negative, "double_refunds": doubles,
                "ok": total == expected and not negative and not doubles}


class _Cursor:
    def __init__(self, cur: Any, sql: Callable[[str], str]) -> None:
        self._cur = cur
        self._sql = sql

    def run(self, statement: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        self._cur.execute(self._sql(statement), args)
        return list(self._cur.fetchall()) if self._cur.description else []

    @property
    def rowcount(self) -> int:
        return int(self._cur.rowcount)


def _account_of(resource: str) -> str:
    prefix, _, account = resource.partition(":")
    if prefix != "account" or account_problem(account):
        raise ToolError(f"{resource[:200]!r} is not an account resource ('account:<id>'; {account_problem(account)})"
                        if prefix == "account" else f"{resource[:200]!r} is not an account resource ('account:<id>')")
    return account


def _storable(call: ToolCall) -> None:
    """Refuse an intent whose resource or id the ledger cannot store (PostgreSQL's text holds no NUL)."""
    for what, text in (("resource", call.resource), ("intent id", call.intent_id)):
        if "\x00" in text:
            raise ToolError(f"the {what} holds a NUL character, which the ledger cannot store")


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return patch
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


Cents = Annotated[int, Field(gt=0, le=MAX_AMOUNT, strict=True)]
"""An amount: an integer of cents, never ``true``, ``"25"`` or ``25.0`` taken for one."""
Text = Annotated[str, Field(min_length=1, pattern=r"^[^\x00]*$")]
"""An id the ledger stores (PostgreSQL's text holds no NUL)."""


class RefundArgs(BaseModel):
    """Refund ``amount`` cents of ``order_id`` from the account the intent names."""

    model_config = ConfigDict(extra="forbid")
    order_id: Text = Field(max_length=128)
    amount: Cents


class ReverseRefundArgs(BaseModel):
    """Undo the refund made by intent ``refund_intent_id``."""

    model_config = ConfigDict(extra="forbid")
    refund_intent_id: Text


class TransferArgs(BaseModel):
    """Move ``amount`` cents from the intent's account to account ``to``."""

    model_config = ConfigDict(extra="forbid")
    to: str = Field(pattern=f"^{ACCOUNT_ID.pattern}$", description="an account id, without 'account:'")
    amount: Cents

    @field_validator("to")
    @classmethod
    def _an_account_id(cls, value: str) -> str:
        problem = account_problem(value)
        if problem is not None:
            raise ValueError(problem)
        return value


class CommitArgs(BaseModel):
    """Apply a JSON merge patch to the document the intent names."""

    model_config = ConfigDict(extra="forbid")
    patch: dict[str, Any]


async def _once(ledger: Ledger, call: ToolCall, tool: str,
                effect: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
    """In one transaction: apply ``effect(cursor)`` unless this intent already did, and
    record its result; a repeated intent gets the recorded result back."""

    _storable(call)

    def work(cur: Any) -> dict[str, Any]:
        done = cur.run("SELECT result FROM intent_results WHERE resource = ? AND intent_id = ?",
                       (call.resource, call.intent_id))
        if done:
            recorded: dict[str, Any] = json.loads(done[0][0])
            return recorded
        result = effect(cur)
        cur.run("INSERT INTO intent_results (resource, intent_id, tool, result) VALUES (?, ?, ?, ?)",
                (call.resource, call.intent_id, tool, json.dumps(result, sort_keys=True)))
        return result

    return await ledger.call(work)


def _move(cur: Any, source: str, target: str, amount: int) -> int:
    cur.run("UPDATE accounts SET balance = balance - ? WHERE id = ? AND balance >= ?", (amount, source, amount))
    if cur.rowcount != 1:
        rows = cur.run("SELECT balance FROM accounts WHERE id = ?", (source,))
        raise ToolError(f"account {source!r} has {rows[0][0]} cents, less than {amount}" if rows
                        else f"no account {source!r}")
    cur.run("UPDATE accounts SET balance = balance + ? WHERE id = ?", (amount, target))
    if cur.rowcount != 1:
        raise ToolError(f"no account {target!r}")
    return int(cur.run("SELECT balance FROM accounts WHERE id = ?", (source,))[0][0])


async def read(ledger: Ledger, resource: str) -> dict[str, Any] | None:
    """An account's balance, or a document's revision and body; None for anything else."""
    prefix, _, name = resource.partition(":")

    def work(cur: Any) -> dict[str, Any] | None:
        if prefix == "account" and name:
            rows = cur.run("SELECT balance FROM accounts WHERE id = ?", (name,))
            return {"account": name, "balance": int(rows[0][0])} if rows else None
        rows = cur.run("SELECT revision, body FROM documents WHERE id = ?", (resource,))
        return {"document": resource, "revision": int(rows[0][0]), "body": json.loads(rows[0][1])} \
            if rows else None

    return await ledger.call(work)


async def refund(ledger: Ledger, call: ToolCall) -> dict[str, Any]:
    """Pay a refund from the account into payouts."""
    args = call.arguments
    assert isinstance(args, RefundArgs)
    account = _account_of(call.resource)
    if account == PAYOUTS:
        raise ToolError(f"refunds are paid into {PAYOUTS!r}: a refund from it would pay itself")

    def apply(cur: Any) -> dict[str, Any]:
        balance = _move(cur, account, PAYOUTS, args.amount)
        cur.run("INSERT INTO refunds (intent_id, account, order_id, amount) VALUES (?, ?, ?, ?)",
                (call.intent_id, account, args.order_id, args.amount))
        return {"account": account, "order_id": args.order_id, "amount": args.amount, "balance": balance}

    return await _once(ledger, call, "refund", apply)


async def reverse_refund(ledger: Ledger, call: ToolCall) -> dict[str, Any]:
    """Take a refund back from payouts (the compensation of refund)."""
    args = call.arguments
    assert isinstance(args, ReverseRefundArgs)

    def apply(cur: Any) -> dict[str, Any]:
        rows = cur.run("SELECT account, amount, reversed_by FROM refunds WHERE intent_id = ? AND account = ?",
                       (args.refund_intent_id, _account_of(call.resource)))
        if not rows:
            return {"reversed": None, "note": "no such refund; nothing to undo"}
        account, amount, reversed_by = rows[0]
        if reversed_by:
            return {"reversed": args.refund_intent_id, "note": f"already reversed by {reversed_by}"}
        _move(cur, PAYOUTS, account, int(amount))
        cur.run("UPDATE refunds SET reversed_by = ? WHERE intent_id = ? AND account = ?",
                (call.intent_id, args.refund_intent_id, account))
        return {"reversed": args.refund_intent_id, "amount": int(amount)}

    return await _once(ledger, call, "reverse_refund", apply)


async def transfer(ledger: Ledger, call: ToolCall) -> dict[str, Any]:
    """Move money between accounts (the compensation is the transfer back)."""
    args = call.arguments
    assert isinstance(args, TransferArgs)
    account = _account_of(call.resource)
    if args.to == account:
        raise ToolError(f"a transfer from {account!r} to itself moves nothing: name another account in 'to'")

    def apply(cur: Any) -> dict[str, Any]:
        balance = _move(cur, account, args.to, args.amount)
        return {"from": account, "to": args.to, "amount": args.amount, "balance": balance}

    return await _once(ledger, call, "transfer", apply)


async def commit(ledger: Ledger, call: ToolCall) -> dict[str, Any]:
    """Apply a JSON merge patch to a document."""
    args = call.arguments
    assert isinstance(args, CommitArgs)
    doc_id = call.resource
    if doc_id.partition(":")[0] == "account":
        raise ToolError(f"{doc_id[:200]!r} is an account, not a document: move its money with refund or transfer")

    def apply(cur: Any) -> dict[str, Any]:
        rows = cur.run("SELECT revision, body FROM documents WHERE id = ?", (doc_id,))
        revision, body = (int(rows[0][0]), json.loads(rows[0][1])) if rows else (0, {})
        body = merge_patch(body, args.patch)
        if rows:
            cur.run("UPDATE documents SET revision = ?, body = ? WHERE id = ?",
                    (revision + 1, json.dumps(body, sort_keys=True), doc_id))
        else:
            cur.run("INSERT INTO documents (id, revision, body) VALUES (?, ?, ?)",
                    (doc_id, 1, json.dumps(body, sort_keys=True)))
        return {"document": doc_id, "revision": revision + 1}

    return await _once(ledger, call, "commit", apply)


def _on(ledger: Ledger, tool: Callable[[Ledger, T], Awaitable[R]]) -> Callable[[T], Awaitable[R]]:
    """``tool`` bound to ``ledger``, under the tool's own name and docstring (the registry lists a tool
    by its docstring)."""

    @functools.wraps(tool)
    async def run(argument: T) -> R:
        return await tool(ledger, argument)

    return run


def register_ledger_tools(registry: ToolRegistry, ledger: Ledger) -> None:
    """Register refund, reverse_refund, transfer and commit against ``ledger``, and its reader."""
    registry.reader(_on(ledger, read))
    registry.register("refund", RefundArgs, compensation="reverse_refund")(_on(ledger, refund))
    registry.register("reverse_refund", ReverseRefundArgs)(_on(ledger, reverse_refund))
    registry.register("transfer", TransferArgs, compensation="transfer")(_on(ledger, transfer))
    registry.register("commit", CommitArgs)(_on(ledger, commit))


def worker_tool_registry(ledger: Ledger | None, repos: Repos | None = None,
                         failpoint: Failpoint | None = None) -> ToolRegistry:
    """Every tool a worker runs: the ledger's and the git repositories' (``ledger`` None: bound to no
    database, for replay, whose outcomes come from the log)."""
    from arbiter.streams.tools.merges import no_failpoint
    from arbiter.streams.tools.repository import register_git_tools

    registry = ToolRegistry()
    register_ledger_tools(registry, cast(Ledger, ledger))
    register_git_tools(registry, repos or Repos({}), failpoint or no_failpoint)
    return registry


def ledger_tool_registry() -> ToolRegistry:
    """The ledger's tools with their names and argument schemas, bound to no database.

    For audit replay, which checks intents against the real schemas but takes each
    run's outcome from the log. Running one of these tools fails.
    """
    return worker_tool_registry(None)
