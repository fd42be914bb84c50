"""Whether a front door can serve: Kafka answers, and a worker is in the workers' group.

``/healthz`` answers 200 only then (503 with the reason otherwise), so a load balancer stops sending a
door calls it could only answer 503; ``/livez`` answers 200 while the process runs. A check costs one
DescribeGroups request, made at most once a second however many probes come (they share it).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError

from arbiter.edge.kafkaauth import kafka_client_options
from arbiter.edge.kafkaconn import close_client, describe
from arbiter.edge.settings import Settings

CHECK_EVERY = 1.0
"""Seconds a readiness answer is reused for."""
CHECK_TIMEOUT = 3.0
"""Seconds one check may take before Kafka counts as unreachable."""


@dataclass(frozen=True)
class Ready:
    ready: bool
    kafka: str
    """``reachable`` or ``unreachable``."""
    workers: int
    """Members of the workers' consumer group (0 when unknown)."""
    why: str = ""

    def body(self) -> dict[str, Any]:
        out: dict[str, Any] = {"ready": self.ready, "kafka": self.kafka, "workers": self.workers}
        if self.why:
            out["why"] = self.why
        return out


class Readiness:
    """The door's view of its dependencies, checked on demand."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._admin: AIOKafkaAdminClient | None = None
        self._last: tuple[float, Ready] | None = None
        self._lock = asyncio.Lock()

    async def check(self) -> Ready:
        last = self._last
        if last is not None and time.monotonic() - last[0] < CHECK_EVERY:
            return last[1]  # (the common case, on every call: no lock)
        async with self._lock:
            if self._last is not None and time.monotonic() - self._last[0] < CHECK_EVERY:
                return self._last[1]
            answer = await self._check()
            self._last = (time.monotonic(), answer)
            return answer

    async def _check(self) -> Ready:
        s = self.settings
        try:
            async with asyncio.timeout(CHECK_TIMEOUT):
                if self._admin is None:
                    admin = AIOKafkaAdminClient(bootstrap_servers=s.bootstrap, request_timeout_ms=round(
                        CHECK_TIMEOUT * 1000), **kafka_client_options(s))
                    try:
                        await admin.start()
                    except BaseException:
                        await close_client(admin)
                        raise
                    self._admin = admin
                responses = await self._admin.describe_consumer_groups([s.app_id])
        except (KafkaError, OSError, TimeoutError) as exc:
            await self.close()  # a fresh client next time: one that failed to start is no use
            return Ready(False, "unreachable", 0, f"Kafka at {s.bootstrap} does not answer ({describe(exc)})")
        groups = [g for r in responses for g in r.to_object()["groups"] if g["group"] == s.app_id]
        members = len(groups[0]["members"]) if groups else 0
        if members == 0:
            return Ready(False, "reachable", 0, f"no worker is in the workers' group {s.app_id!r}: "
                                                "start one with 'arbiter worker'")
        return Ready(True, "reachable", members)

    async def close(self) -> None:
        admin, self._admin = self._admin, None
        if admin is not None:
            await close_client(admin)
