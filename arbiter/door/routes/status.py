"""``/v1/status`` (this agent on this door) and ``/healthz`` (for a load balancer)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query, Request

from ..calls import Creds, agent, door_of

router = APIRouter(tags=["status"])


@router.get("/v1/status", summary="This agent on this door; ping a worker")
async def status(request: Request, credentials: Creds,
                 ping: bool = Query(False, description="Round-trip through a worker.")) -> Any:
    """The agent's leases and sessions here; with ``ping``, a round trip through a worker."""
    async with agent(request, credentials, charge=ping) as state:
        body: dict[str, Any] = {
            "agent": state.name, "door": door_of(request).id, "sessions": len(state.sessions),
            "leases": [{"resource": lease.resource, "token": lease.token, "expires_at_ms": lease.expires_at_ms}
                       for lease in state.leases.values() if not lease.lost],
            "sagas": sorted(state.sagas)}
        if ping:
            result = await state.client.ping()
            body["worker"] = {"worker_id": result.worker_id, "rtt_ms": round(result.rtt_ms, 2),
                              "partition": result.partition}
        return body


@router.get("/healthz", summary="Liveness, for a load balancer (no key needed)")
async def healthz(request: Request) -> Any:
    """The door's id, its agents and sessions."""
    door = door_of(request)
    return {"door": door.id, "agents": len({s.name for s in door.agents.values()}),
            "sessions": sum(len(s.sessions) for s in door.agents.values())}
