"""A front door's Prometheus metrics (``/metrics``, no key needed, like ``/healthz``): its calls by
route and status, how long they took, and the agents, sessions and MCP tools it serves now. The
decisions themselves are counted by the workers (``arbiter.streams.runtime.metrics``)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from arbiter.streams.runtime.metrics import SECONDS

from .state import Door

NAMES = ("arbiter_door_requests_total", "arbiter_door_request_seconds", "arbiter_door_agents",
         "arbiter_door_sessions", "arbiter_door_mcp_agents", "arbiter_door_leases_renewed_for_agents")
"""Every metric a front door exports."""


class _State(Collector):
    def __init__(self, door: Door) -> None:
        self.door = door

    def collect(self) -> Iterator[GaugeMetricFamily]:
        states = list(self.door.agents.values())
        yield GaugeMetricFamily("arbiter_door_agents", "Agents with state on this door", len({s.name for s in states}))
        yield GaugeMetricFamily("arbiter_door_sessions", "WebSocket sessions open",
                                sum(len(s.sessions) for s in states))
        mcp = [s.mcp for s in states if s.mcp is not None]
        yield GaugeMetricFamily("arbiter_door_mcp_agents", "Agents using /mcp", len(mcp))
        yield GaugeMetricFamily("arbiter_door_leases_renewed_for_agents", "Leases /mcp keeps renewed for its agents",
                                sum(len(t.leases) for t in mcp))


class DoorMetrics:
    """The door's registry, and the middleware that counts its calls."""

    def __init__(self, door: Door) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("arbiter_door_requests", "Calls answered, by route, method and status",
                                ["route", "method", "status"], registry=self.registry)
        self.seconds = Histogram("arbiter_door_request_seconds", "How long calls took, by route", ["route"],
                                 buckets=SECONDS, registry=self.registry)
        self.registry.register(_State(door))


class CountCalls:
    """Middleware: count each HTTP call under its route's template (``/v1/resources/{resource}``), never
    its path (a resource name is user input: one series per resource would be unbounded)."""

    def __init__(self, app: ASGIApp, metrics: DoorMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = [500]

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            route = getattr(scope.get("route"), "path", None) or "other"
            self.metrics.requests.labels(route, scope.get("method", ""), str(status[0])).inc()
            self.metrics.seconds.labels(route).observe(time.perf_counter() - started)


def exposition(metrics: Any) -> tuple[bytes, str]:
    """The registry in Prometheus' text format, and its content type."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    return generate_latest(metrics.registry), CONTENT_TYPE_LATEST
