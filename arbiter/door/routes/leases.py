"""``/v1/leases``: acquire (optionally waiting in the queue), renew, release."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from arbiter.agents import LeaseDenied
from arbiter.schemas import LockDenied, LockRenewed
from arbiter.schemas.reasons import Reason

from ..bodies import AcquireBody, RenewBody, TokenBody
from ..calls import Creds, agent, unless_gone

router = APIRouter(prefix="/v1/leases", tags=["leases"])


@router.post("/acquire", summary="Acquire a lease (optionally waiting for it)")
async def acquire(body: AcquireBody, request: Request, credentials: Creds) -> Any:
    """Granted (200, with the fencing token), refused (409 ...), or the caller hung up (499: withdrawn)."""
    async with agent(request, credentials) as state:
        lease = await unless_gone(request, state.client.acquire(
            body.resource, ttl=body.ttl, mode=body.mode, priority=body.priority, wait=body.wait,
            saga_id=body.saga_id))
        if isinstance(lease, JSONResponse):
            return lease
        state.leases[(lease.resource, lease.token)] = lease
        return {"granted": True, "resource": lease.resource, "token": lease.token, "mode": lease.mode,
                "ttl_ms": lease.ttl_ms, "expires_at_ms": lease.expires_at_ms,
                "resource_version": lease.resource_version, "request_id": lease.request_id,
                "warnings": lease.warnings}


@router.post("/renew", summary="Extend a lease")
async def renew(body: RenewBody, request: Request, credentials: Creds) -> Any:
    """The new expiry, or the refusal (``lease_not_live``, ``stale_fencing_token`` ...)."""
    async with agent(request, credentials) as state:
        outcome = await state.client.renew_token(body.resource, body.token, body.ttl)
        if isinstance(outcome, LockRenewed):
            return {"renewed": True, "resource": body.resource, "token": body.token,
                    "expires_at_ms": outcome.expires_at_ms}
        raise LeaseDenied.from_event(outcome)


@router.post("/release", summary="Give a lease back")
async def release(body: TokenBody, request: Request, credentials: Creds) -> Any:
    """Released; or ``released: false`` when it was gone already (not an error)."""
    async with agent(request, credentials) as state:
        outcome = await state.client.release_token(body.resource, body.token)
        lease = state.leases.pop((body.resource, body.token), None)
        if lease is not None:
            state.client.forget(lease)
        if isinstance(outcome, LockDenied):
            if outcome.reason in (Reason.LEASE_NOT_LIVE, Reason.STALE_FENCING_TOKEN):
                return {"released": False, "resource": body.resource, "token": body.token,
                        "reason": outcome.reason, "detail": "the lease was already gone (not an error)"}
            raise LeaseDenied.from_event(outcome)
        return {"released": True, "resource": body.resource, "token": body.token}
