"""``/v1/status`` (this agent on this door), ``/healthz`` (for a load balancer) and ``/metrics``."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response

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


@router.get("/healthz", summary="Readiness, for a load balancer (no key needed)",
            responses={503: {"description": "Not ready: Kafka does not answer, or no worker is in the group"}})
async def healthz(request: Request) -> Any:
    """200 when this door can serve: Kafka answers and a worker is in the workers' group; else 503
    with ``why`` and ``Retry-After``. With the door's id, its agents and sessions."""
    door = door_of(request)
    ready = await door.readiness.check()
    body = {**ready.body(), "door": door.id, "agents": len({s.name for s in door.agents.values()}),
            "sessions": sum(len(s.sessions) for s in door.agents.values())}
    if not ready.ready:
        return JSONResponse(body, status_code=503, headers={"Retry-After": "1"})
    return body


@router.get("/livez", summary="Liveness (no key needed): 200 while the door's process serves")
async def livez(request: Request) -> Any:
    """The door's id; says nothing about Kafka (``/healthz`` does)."""
    return {"door": door_of(request).id, "live": True}


@router.get("/metrics", summary="Prometheus metrics (no key needed): this door's calls, agents and sessions",
            response_class=Response)
async def metrics(request: Request) -> Response:
    """The door's metrics in Prometheus' text format; the workers export the decisions' own."""
    from ..metrics import exposition

    body, content_type = exposition(request.app.state.metrics)
    return Response(body, media_type=content_type)
