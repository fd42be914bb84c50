"""``arbiter agents add|list|rotate|revoke``: who may act, and with which key."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from typing import Any

import click

from arbiter.agents.identities import Registrar, ensure_identity
from arbiter.edge.kafkaio import KafkaIOError
from arbiter.edge.keys import identity_problem, key_file
from arbiter.edge.settings import Settings
from arbiter.schemas import IdentityRegistered
from arbiter.schemas.identity import ROLE_AGENT, ROLE_RUNNER, ROLE_WORKER, IdentityError

from .terminal import fail, say, settings_of


def _run(work: Any) -> Any:
    try:
        return asyncio.run(work)
    except IdentityError as exc:
        fail(str(exc))
    except KafkaIOError:
        raise  # the command group answers it as every verb does: no Kafka answers
    except RuntimeError as exc:
        fail(f"the registry could not be read: {exc}", "Are the topics created ('arbiter topics create')?")


def ensure_worker_identity(settings: Settings) -> None:
    """Before a worker starts: its key (issued with this home's admin key if there is none yet)."""
    name = settings.identity or ROLE_WORKER
    problem = identity_problem(name)
    if problem:
        fail(f"ARBITER_IDENTITY={name[:200]!r} cannot be a worker's identity: {problem}")
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
@click.option("--role", type=click.Choice([ROLE_AGENT, ROLE_WORKER, ROLE_RUNNER]), default=ROLE_AGENT,
              show_default=True)
@click.option("--print-key", is_flag=True, help="Print the private key once (for a secret store) instead of "
                                                "writing it under ARBITER_HOME/keys.")
@click.option("--print-api-key", is_flag=True, help="Also issue a front-door credential and print its API key "
                                                    "once (as 'arbiter agents api-key NAME' does).")
@click.pass_context
def agents_add(ctx: click.Context, name: str, tenant: str, allow: str, role: str, print_key: bool,
               print_api_key: bool) -> None:
    """Issue a key pair to NAME and register its public key (signed by the admin key)."""
    settings = settings_of(ctx)
    prefixes = [p.strip() for p in allow.split(",") if p.strip()]
    if print_api_key and role != ROLE_AGENT:
        fail("only agents use the front door: --print-api-key goes with --role agent")
    registrar = Registrar(settings)
    signer = _run(registrar.add(name, role=role, tenant=tenant, allow=prefixes, keep_key=not print_key))
    if print_key:
        click.echo(signer.private_pem().decode(), nl=False)
        say(f"added {role} {name!r} (key {signer.key_id[:16]}); the private key above is shown once: store it and "
            f"give it to the agent as ARBITER_IDENTITY_KEY")
    else:
        say(f"added {role} {name!r} (key {signer.key_id[:16]}); private key in {key_file(settings.home, name)}")
    if print_api_key:
        credential, entry = _run(registrar.issue_credential(name))
        click.echo(credential.api_key())
        _say_issued(entry)


def _say_issued(entry: IdentityRegistered) -> None:
    expiry = "no expiry" if entry.valid_until_ms is None else f"expires at {_when(entry.valid_until_ms)}"
    say(f"issued the front-door credential {entry.credential!r} of {entry.name!r} (key {entry.key_id[:16]}, "
        f"{expiry}, allow={','.join(entry.allow) or '*'}); the API key above is shown once: send it as "
        f"'Authorization: Bearer <key>' to the front door (or ARBITER_API_KEY for the SDK). Revoke it alone with "
        f"'arbiter agents revoke {entry.name} --credential {entry.credential}'")


def _when(at_ms: int) -> str:
    return datetime.fromtimestamp(at_ms / 1000, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@agents.command("api-key")
@click.argument("name")
@click.option("--label", default="", help="A name for this credential (default: a random one), to revoke it by.")
@click.option("--expires", default="", help="How long it is good for, e.g. 30m, 12h, 90d (default: until revoked).")
@click.option("--allow", default=None, help="Prefixes it may act on, within the agent's (comma separated; "
                                            "default: the agent's).")
@click.pass_context
def agents_api_key(ctx: click.Context, name: str, label: str, expires: str, allow: str | None) -> None:
    """Issue NAME a front-door credential and print its API key once.

    The API key is a key pair of its own, registered for NAME: the agent's own signing key never goes
    to a door. Each credential can be scoped, can expire, and is revoked alone."""
    settings = settings_of(ctx)
    try:
        seconds = _duration_s(expires) if expires else None
    except ValueError as exc:
        fail(str(exc))
    prefixes = None if allow is None else [p.strip() for p in allow.split(",") if p.strip()]
    credential, entry = _run(Registrar(settings).issue_credential(name, label=label, allow=prefixes,
                                                                  expires_in_s=seconds))
    click.echo(credential.api_key())
    _say_issued(entry)


def _duration_s(text: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    number, unit = text[:-1], text[-1:]
    if unit not in units or not number.replace(".", "", 1).isdigit() or float(number) <= 0:
        raise ValueError(f"--expires {text!r}: expected a positive number and a unit (s, m, h, d), e.g. 12h")
    return float(number) * units[unit]


@agents.command("list")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per key.")
@click.pass_context
def agents_list(ctx: click.Context, as_json: bool) -> None:
    """Every key in the registry: name, role, status, prefixes."""
    settings = settings_of(ctx)
    entries = _run(Registrar(settings).entries())
    for e in entries:
        row = {"name": e.name, "role": e.role, "status": e.status, "key_id": e.key_id[:16], "tenant": e.tenant,
               "allow": e.allow, "valid_from_ms": e.valid_from_ms, "valid_until_ms": e.valid_until_ms,
               "reason": e.reason,
               "credential": e.credential}
        if as_json:
            click.echo(json.dumps(row, sort_keys=True))
        else:
            allow = ",".join(e.allow) or "*"
            click.echo(f"{e.name:<24} {e.role:<7} {e.status:<8} {e.key_id[:16]}  allow={allow}"
                       + (f"  credential={e.credential}" if e.credential else "")
                       + (f"  ends={_when(e.valid_until_ms)}" if e.valid_until_ms is not None else "")
                       + (f"  tenant={e.tenant}" if e.tenant else "") + (f"  ({e.reason})" if e.reason else ""))
    if not entries and not as_json:
        say("no identities registered yet; add one with 'arbiter agents add NAME'")


@agents.command("rotate")
@click.argument("name")
@click.option("--print-key", is_flag=True, help="Print the new private key once instead of writing it.")
@click.pass_context
def agents_rotate(ctx: click.Context, name: str, print_key: bool) -> None:
    """Issue NAME a new key; returns two seconds later, once its old keys stop verifying (the new key
    file is written then, so an agent signs with the old key until it stops being good)."""
    settings = settings_of(ctx)
    signer = _run(Registrar(settings).rotate(name, keep_key=not print_key))
    if print_key:
        click.echo(signer.private_pem().decode(), nl=False)
    say(f"rotated {name!r}: new key {signer.key_id[:16]}; the old keys are refused from now on")


@agents.command("revoke")
@click.argument("name")
@click.option("--reason", default="revoked by an operator", show_default=True, help="Why (kept in the registry).")
@click.option("--credential", default="", help="Revoke only this front-door credential (its label or key id); "
                                               "the agent's own key and other credentials stay good.")
@click.pass_context
def agents_revoke(ctx: click.Context, name: str, reason: str, credential: str) -> None:
    """Revoke every key of NAME (its credentials too), or one credential: commands signed with it are
    refused from now on."""
    settings = settings_of(ctx)
    if credential:
        entry = _run(Registrar(settings).revoke_credential(name, credential, reason))
        say(f"revoked the credential {entry.credential!r} of {name!r} (key {entry.key_id[:16]}); calls with it are "
            "refused from now on, and the agent's other keys stay good")
        return
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
    from arbiter.agents.identities import Operator

    settings = settings_of(ctx)
    async def abort() -> None:  # (made inside: with no admin key here, the error line says so)
        await Operator(settings).abort_saga(saga_id, reason)

    _run(abort())
    say(f"asked to abort {saga_id} ({reason}); its completed steps are compensated")
