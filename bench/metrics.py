"""``python -m bench metrics``: what counting costs a worker, per input (no broker: the counting alone).

``WorkerMetrics.observe`` is called as a worker calls it after each decision, for a grant and a release
by turns (a grant is counted, its TTL, wait and latency observed; a release counted, its hold observed).
"""

from __future__ import annotations

import time

from arbiter.schemas import Cause, LockGranted, LockReleased
from arbiter.streams.runtime.metrics import WorkerMetrics


def main(count: int = 100_000, reps: int = 3) -> None:
    metrics = WorkerMetrics()
    cause = Cause(topic="t", partition=0, offset=1)
    grant = LockGranted(request_id="r1", agent_id="a", resource="doc:1", token=1, mode="exclusive",
                        expires_at_ms=31_000, holders=[], resource_version=1, request_sent_at_ms=900,
                        at_ms=1_000, cause=cause)
    release = LockReleased(request_id="r2", agent_id="a", resource="doc:1", token=1, request_sent_at_ms=1_500,
                           at_ms=1_600, cause=cause)
    for _ in range(reps):
        started = time.perf_counter()
        for _i in range(count):
            metrics.observe("resource", 1_000, (grant, grant), None, "decided", now_ms=1_005)
            metrics.observe("resource", 1_500, (release,), None, "decided", now_ms=1_605)
        took = time.perf_counter() - started
        print(f"metrics: {took / (2 * count) * 1e6:5.1f} us of CPU per input counted (a grant and a release by "
              f"turns, {2 * count:,} inputs)")
