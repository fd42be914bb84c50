"""``arbiter agents add|list|rotate|revoke``: who may act, and with which key."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import click
from aiokafka.errors import KafkaError

from agents.identities import Registrar, ensure_identity
from contract.identity import ROLE_AGENT, ROLE_WORKER, IdentityError, key_file, read_private_key
from contract.settings import Settings

from .console import fail, say, settings_of


def _run(work: Any) -> Any:
    try:
        return asyncio.run(work)
    except IdentityError as exc:
        fail(str(exc))
    except (KafkaError, RuntimeError) as exc:
        fail(f"the registry could not be reached: {exc}", "Is Kafka up ('arbiter kafka up') and are the topics "
             "created ('arbiter topics create')?")


def ensure_worker_identity(settings: Settings) -> None:
    """Before a worker starts: its key (issued with this home's admin key if there is none yet)."""
    name = settings.identity or ROLE_WORKER
    if settings.identity_key:
        return
    if not key_file(settings.home, name).exists():
        say(f"issuing the worker identity {name!r} (key in {key_file(settings.home, name)})")
    _run(ensure_identity(settings, name, role=ROLE_WORKER))


@click.group()
def agents() -> None:
    """Issue, list, rotate and revoke the keys agents and workers sign with."""


@agents.command("add")
@click.argument("name")
@click.option("--tenant", default="", help="The tenant the agent belongs to (shown in list and audit).")
@click.option("--allow", default="", help="Resource-name prefixes the agent may act on, comma separated "
                                          "(e.g. 'account:acme/,doc:acme/'). Default: every resource.")
@click.option("--role", type=click.Choice([ROLE_AGENT, ROLE_WORKER]), default=ROLE_AGENT, show_default=True)
@click.option("--print-key", is_flag=True, help="Print the private key once (for a secret store) instead of "
                                                "writing it under ARBITER_HOME/keys.")
@click.option("--print-api-key", is_flag=True, help="Print the agent's API key for the front door once "
                                                    "(arbiter serve) instead of writing the key file.")
@click.pass_context
def agents_add(ctx: click.Context, name: str, tenant: str, allow: str, role: str, print_key: bool,
               print_api_key: bool) -> None:
    """Issue a key pair to NAME and register its public key (signed by the admin key)."""
    settings = settings_of(ctx)
    prefixes = [p.strip() for p in allow.split(",") if p.strip()]
    if print_api_key and role != ROLE_AGENT:
        fail("only agents use the front door: --print-api-key goes with --role agent")
    signer = _run(Registrar(settings).add(name, role=role, tenant=tenant, allow=prefixes,
                                          keep_key=not (print_key or print_api_key)))
    if print_api_key:
        click.echo(signer.api_key())
        say(f"added agent {name!r} (key {signer.key_id[:16]}); the API key above is shown once: store it and send "
            f"it as 'Authorization: Bearer <key>' to the front door (or ARBITER_API_KEY for the SDK)")
    elif print_key:
        click.echo(signer.private_pem().decode(), nl=False)
        say(f"added {role} {name!r} (key {signer.key_id[:16]}); the private key above is shown once: store it and "
            f"give it to the agent as ARBITER_IDENTITY_KEY")
    else:
        say(f"added {role} {name!r} (key {signer.key_id[:16]}); private key in {key_file(settings.home, name)}")


@agents.command("api-key")
@click.argument("name")
@click.pass_context
def agents_api_key(ctx: click.Context, name: str) -> None:
    """Print NAME's API key for the front door, made from its key file under ARBITER_HOME/keys."""
    settings = settings_of(ctx)
    path = key_file(settings.home, name)
    if not path.exists():
        fail(f"no key file for {name!r} at {path}", f"issue one with 'arbiter agents add {name}'")
    try:
        click.echo(read_private_key(path, name).api_key())
    except IdentityError as exc:
        fail(str(exc))


@agents.command("list")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per key.")
@click.pass_context
def agents_list(ctx: click.Context, as_json: bool) -> None:
    """Every key in the registry: name, role, status, prefixes."""
    settings = settings_of(ctx)
    entries = _run(Registrar(settings).entries())
    for e in entries:
        row = {"name": e.name, "role": e.role, "status": e.status, "key_id": e.key_id[:16], "tenant": e.tenant,
               "allow": e.allow, "valid_from_ms": e.valid_from_ms, "ended_at_ms": e.ended_at_ms, "reason": e.reason}
        if as_json:
            click.echo(json.dumps(row, sort_keys=True))
        else:
            allow = ",".join(e.allow) or "*"
            click.echo(f"{e.name:<24} {e.role:<7} {e.status:<8} {e.key_id[:16]}  allow={allow}"
                       + (f"  tenant={e.tenant}" if e.tenant else "") + (f"  ({e.reason})" if e.reason else ""))
    if not entries and not as_json:
        say("no identities registered yet; add one with 'arbiter agents add NAME'")


@agents.command("rotate")
@click.argument("name")
@click.option("--print-key", is_flag=True, help="Print the new private key once instead of writing it.")
@click.pass_context
def agents_rotate(ctx: click.Context, name: str, print_key: bool) -> None:
    """Issue NAME a new key; its old keys stop verifying two seconds later."""
    settings = settings_of(ctx)
    signer = _run(Registrar(settings).rotate(name, keep_key=not print_key))
    if print_key:
        click.echo(signer.private_pem().decode(), nl=False)
    say(f"rotated {name!r}: new key {signer.key_id[:16]}; the old keys are refused from now on")


@agents.command("revoke")
@click.argument("name")
@click.option("--reason", default="revoked by an operator", show_default=True, help="Why (kept in the registry).")
@click.pass_context
def agents_revoke(ctx: click.Context, name: str, reason: str) -> None:
    """Revoke every key of NAME: its commands are refused from now on."""
    settings = settings_of(ctx)
    revoked = _run(Registrar(settings).revoke(name, reason))
    say(f"revoked {len(revoked)} key(s) of {name!r}; commands signed with them are refused from now on")


@click.group()
def saga() -> None:
    """Operators' actions on sagas."""


@saga.command("abort")
@click.argument("saga_id")
@click.option("--reason", required=True, help="Why: kept in the log, shown by the audit as a human action.")
@click.pass_context
def saga_abort(ctx: click.Context, saga_id: str, reason: str) -> None:
    """An operator's override: abort SAGA_ID, compensating its completed steps (signed with the admin key)."""
    from agents.identities import Operator

    settings = settings_of(ctx)
    _run(Operator(settings).abort_saga(saga_id, reason))
    say(f"asked to abort {saga_id} ({reason}); its completed steps are compensated")
