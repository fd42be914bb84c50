"""``arbiter ledger``: the workers' SQL ledger for an operator: open accounts, read it, list its tools.

The ledger is the store the workers' tools write (``arbiter.streams.tools.ledger``): the same
database the workers open (``ARBITER_LEDGER_DSN``, else ``<home>/ledger.sqlite3``). Opening an
account is an operator's act outside the log, like funding a bank account: agents only move
money that is there, through the gateway. Documents need no opening: a document's first
``commit`` (at base version 0) creates it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import click

from .terminal import fail, settings_of


@contextmanager
def _ledger(ctx: click.Context) -> Iterator[Any]:
    """The ledger, closed after; what its database answers with an error is a refusal, not a traceback."""
    from arbiter.streams.tools.ledger import Ledger, database_errors

    dsn = settings_of(ctx).ledger_url()
    try:
        book = Ledger(dsn)
    except Exception as exc:  # a wrong DSN, an unreachable PostgreSQL, a file it cannot create
        fail(f"cannot open the ledger {_safe(dsn)}: {exc}", "set ARBITER_LEDGER_DSN (postgresql://...) or "
             "ARBITER_HOME (the SQLite file is <home>/ledger.sqlite3)")
    try:
        yield book
    except database_errors() as exc:
        fail(f"the ledger {_safe(dsn)} refused: {exc}", "nothing was changed")
    finally:
        book.close()


def _safe(dsn: str) -> str:
    """A DSN without its password."""
    return re.sub(r"://([^:/@]+):[^@]*@", r"://\1:***@", dsn)


def _account_id(name: str) -> str:
    from arbiter.streams.tools.ledger import account_problem

    account = name.removeprefix("account:")
    problem = account_problem(account)
    if problem:
        fail(f"account {name!r}: {problem}")
    return account


@click.group()
def ledger() -> None:
    """The workers' SQL ledger: open accounts, show balances and documents, list the tools agents call."""


@ledger.command("open")
@click.argument("accounts", nargs=-1, required=True)
@click.option("--balance", type=click.IntRange(min=0), required=True, help="Opening balance, in cents.")
@click.pass_context
def open_accounts(ctx: click.Context, accounts: tuple[str, ...], balance: int) -> None:
    """Open ACCOUNTS (ids, or account:<id> resource names) with --balance cents each.

    Refuses, and opens none, when one of them exists already, is named twice, or the balance is more
    than the ledger holds. Prints what it opened as JSON."""
    from arbiter.streams.tools.ledger import LedgerError

    ids = [_account_id(a) for a in accounts]
    twice = sorted({a for a in ids if ids.count(a) > 1})
    if twice:
        fail(f"account(s) {', '.join(twice)} named more than once: nothing opened")
    with _ledger(ctx) as book:
        try:
            book.add_accounts(dict.fromkeys(ids, balance))
        except LedgerError as exc:
            fail(f"{exc}: nothing opened", "'arbiter ledger show' lists the accounts; money moves only through "
                 "the gateway's tools")
        click.echo(json.dumps({"opened": [{"resource": f"account:{a}", "balance": balance} for a in sorted(ids)]}))


@ledger.command("show")
@click.argument("resource", required=False)
@click.pass_context
def show(ctx: click.Context, resource: str | None) -> None:
    """Every account's balance and the ledger's invariants as JSON; or one RESOURCE's content
    (``account:<id>`` or a document's name). Exit 1 when the resource does not exist."""
    with _ledger(ctx) as book:
        if resource is None:
            click.echo(json.dumps({"accounts": book.balances(), "invariants": book.invariants()}))
            return
        if resource.startswith("account:"):
            balance = book.balances().get(_account_id(resource))
            found: dict[str, Any] | None = None if balance is None else \
                {"account": resource.removeprefix("account:"), "balance": balance}
        else:
            doc = book.document(resource)
            found = None if doc is None else {"document": resource, "revision": doc[0], "body": doc[1]}
        if found is None:
            fail(f"no {resource!r} in the ledger", "open an account with 'arbiter ledger open'; a document "
                 "exists once its first commit applied")
        click.echo(json.dumps(found))


@ledger.command("tools")
def tools() -> None:
    """The tools agents call through the gateway: name, what it does, its arguments (JSON Schema),
    and the tool that undoes it in a saga."""
    from arbiter.streams.tools.ledger import ledger_tool_registry

    registry = ledger_tool_registry()
    listing = []
    for name in sorted(registry.names()):
        tool = registry.get(name)
        assert tool is not None
        schema = tool.arguments.model_json_schema()
        listing.append({"tool": name, "does": tool.doc, "compensation": tool.compensation,
                        "arguments": schema.get("properties", {}), "required": schema.get("required", [])})
    click.echo(json.dumps(listing, indent=2))
