"""``arbiter lock``: leases from a shell."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from arbiter.cli.answers import answer as _answer
from arbiter.cli.answers import lock_run as _lock_run
from arbiter.cli.terminal import say, settings_of


@click.group()
def lock() -> None:
    """Acquire, renew and release leases from a shell (for agents not written in Python).

    Every answer is one JSON object on stdout, whatever happens. Exit 0: done; 1: refused (the
    JSON is the diagnostic); 2: no answer in time (it may still be decided: retry with the same
    command); 3: Arbiter could not be reached (Kafka down: retry shortly); 4: this agent cannot
    act (no key for it, or a bad setting).
    """


def _lock_call(ctx: click.Context, agent: str, work: Callable[[Any], Any]) -> None:
    from arbiter.agents import ArbiterClient

    settings = settings_of(ctx)

    async def run() -> Any:
        async with ArbiterClient(agent, settings) as client:
            return await work(client)

    _answer(_lock_run(settings, run()))


_agent_option = click.option("--agent", required=True, help="The agent id that holds or asks for the lease.")


@lock.command("acquire")
@click.argument("resource")
@_agent_option
@click.option("--ttl", default=30.0, show_default=True, help="Lease TTL in seconds.")
@click.option("--mode", type=click.Choice(["exclusive", "shared"]), default="exclusive", show_default=True)
@click.option("--wait", default=0.0, show_default=True, help="Seconds to wait in the queue (0: try once).")
@click.option("--priority", default=0, show_default=True, help="Queue priority; higher is served first.")
@click.pass_context
def lock_acquire(ctx: click.Context, resource: str, agent: str, ttl: float, mode: str, wait: float,
                 priority: int) -> None:
    """Acquire a lease. Prints its token; renew it before the TTL runs out."""

    async def work(client: Any) -> dict[str, Any]:
        lease = await client.acquire(resource, ttl=ttl, mode=mode, wait=wait, priority=priority)
        return {"resource": resource, "agent_id": agent, "token": lease.token, "mode": lease.mode,
                "expires_at_ms": lease.expires_at_ms, "resource_version": lease.resource_version,
                "warnings": lease.warnings}

    _lock_call(ctx, agent, work)


def _token_outcome(outcome: Any) -> dict[str, Any]:
    from arbiter.agents import LeaseDenied
    from arbiter.schemas import LockDenied

    if isinstance(outcome, LockDenied):
        raise LeaseDenied.from_event(outcome)
    data: dict[str, Any] = outcome.model_dump(exclude={"cause"})
    return data


@lock.command("renew")
@click.argument("resource")
@_agent_option
@click.option("--token", type=int, required=True, help="The lease's fencing token.")
@click.option("--ttl", type=float, default=None, help="New TTL in seconds (default: the lease's own).")
@click.pass_context
def lock_renew(ctx: click.Context, resource: str, agent: str, token: int, ttl: float | None) -> None:
    """Extend a lease you hold."""

    async def work(client: Any) -> dict[str, Any]:
        return _token_outcome(await client.renew_token(resource, token, ttl))

    _lock_call(ctx, agent, work)


@lock.command("release")
@click.argument("resource")
@_agent_option
@click.option("--token", type=int, required=True, help="The lease's fencing token.")
@click.pass_context
def lock_release(ctx: click.Context, resource: str, agent: str, token: int) -> None:
    """Give a lease back."""

    async def work(client: Any) -> dict[str, Any]:
        from arbiter.schemas import LockDenied
        from arbiter.schemas.reasons import Reason

        outcome = await client.release_token(resource, token)
        if isinstance(outcome, LockDenied) and outcome.reason in (Reason.LEASE_NOT_LIVE, Reason.STALE_FENCING_TOKEN):
            # Already gone: not an error (the front door answers the same, 200 with released: false).
            return {"released": False, "resource": resource, "token": token, "reason": outcome.reason,
                    "detail": "the lease was already gone (not an error)"}
        return {"released": True, **_token_outcome(outcome)}

    _lock_call(ctx, agent, work)


@lock.command("revoke")
@click.argument("resource")
@click.option("--agent", required=True, help="The agent whose lease (or queued request) to take away.")
@click.option("--reason", required=True, help="Why: kept in the log, shown by the audit as a human action.")
@click.pass_context
def lock_revoke(ctx: click.Context, resource: str, agent: str, reason: str) -> None:
    """An operator's override: force-release AGENT's lease on RESOURCE (signed with the admin key)."""
    from arbiter.agents.identities import Operator

    settings = settings_of(ctx)
    async def revoke() -> str:  # (made inside: with no admin key here, the answer says so, as any refusal)
        return await Operator(settings).revoke(resource, agent, reason)

    request_id = _lock_run(settings, revoke())
    _answer({"requested": "revoke", "request_id": request_id, "resource": resource, "agent_id": agent,
             "reason": reason})


@lock.command("status")
@click.argument("resource")
@click.option("--agent", default=None, help="Show this agent's own tokens (other agents' are never shown).")
@click.option("--all-tokens", is_flag=True, help="Show every holder's token: for the operator (needs the "
                                                 "admin key in ARBITER_HOME).")
@click.pass_context
def lock_status(ctx: click.Context, resource: str, agent: str | None, all_tokens: bool) -> None:
    """Holders, waiters and the token high-water mark, folded from the event log. Other agents'
    tokens are shown as null."""
    from arbiter.history import lease_book

    settings = settings_of(ctx)
    if all_tokens and not (settings.home / "keys" / "admin.key").exists():
        _answer({"reason": "no_identity", "detail": "--all-tokens is for the operator: this home holds no admin key",
                 "what_to_do": "Run it where the admin key is, or leave out --all-tokens."}, "no_identity")
    skipped: list[str] = []
    book = _lock_run(settings, lease_book(settings, resource, skipped))
    for line in skipped:
        say(f"left out a decision no worker signed: {line}")
    _answer({
        "skipped_forged": len(skipped),
        "resource": resource,
        "high_water_token": book.last_token,
        "as_of_ms": book.clock_ms,
        "holders": [{"agent_id": h.agent_id, "token": h.token if all_tokens or h.agent_id == agent else None,
                     "mode": h.mode, "expires_at_ms": h.expires_at_ms} for h in book.holders.values()],
        "waiting": [{"agent_id": w.agent_id, "mode": w.mode, "priority": w.priority, "deadline_ms": w.deadline_ms}
                    for w in book.queue],
    })
