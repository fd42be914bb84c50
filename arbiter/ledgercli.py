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
from typing import Any

import click

from .console import fail, settings_of

_ACCOUNT = re.compile(r"^[A-Za-z0-9_.@:-]{1,128}$")


def _ledger(ctx: click.Context) -> Any:
    from arbiter.streams.tools.ledger import Ledger

    dsn = settings_of(ctx).ledger_url()
    try:
        return Ledger(dsn)
    except Exception as exc:  # a wrong DSN, an unreachable PostgreSQL, a file it cannot create
        fail(f"cannot open the ledger {_safe(dsn)}: {exc}", "set ARBITER_LEDGER_DSN (postgresql://...) or "
             "ARBITER_HOME (the SQLite file is <home>/ledger.sqlite3)")


def _safe(dsn: str) -> str:
    """A DSN without its password."""
    return re.sub(r"://([^:/@]+):[^@]*@", r"://\1:***@", dsn)


def _account_id(name: str) -> str:
    account = name.removeprefix("account:")
    if not _ACCOUNT.match(account):
        fail(f"account {name!r}: an account id is 1-128 letters, digits and _.@:- (the resource is account:<id>)")
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

    Refuses, and opens none, when one of them exists already. Prints what it opened as JSON."""
    ids = sorted({_account_id(a) for a in accounts})
    book = _ledger(ctx)
    try:
        existing = sorted(set(ids) & set(book.balances()))
        if existing:
            fail(f"account(s) {', '.join(existing)} exist already: nothing opened",
                 "'arbiter ledger show' lists the accounts; money moves only through the gateway's tools")
        book.add_accounts({account: balance for account in ids})
        click.echo(json.dumps({"opened": [{"resource": f"account:{a}", "balance": balance} for a in ids]}))
    finally:
        book.close()


@ledger.command("show")
@click.argument("resource", required=False)
@click.pass_context
def show(ctx: click.Context, resource: str | None) -> None:
    """Every account's balance and the ledger's invariants as JSON; or one RESOURCE's content
    (``account:<id>`` or a document's name). Exit 1 when the resource does not exist."""
    book = _ledger(ctx)
    try:
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
    finally:
        book.close()


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
