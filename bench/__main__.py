"""``python -m bench [codec|roundtrip|all]``: print Arbiter's measured figures.

- codec: Avro single-object encode and decode rates, in-process.
- roundtrip: Ping -> worker -> Pong latency through the real broker and one worker
  process, at a steady request rate.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from arbiter.contract import Cause, Holder, LockGranted, default_codec


def bench_codec(seconds: float) -> None:
    codec = default_codec()
    holder = Holder(agent_id="alpha", request_id="r1", token=7, mode="exclusive", expires_at_ms=30_000)
    record = LockGranted(request_id="r1", agent_id="alpha", resource="ticket:cust_8492", token=7, mode="exclusive",
                         expires_at_ms=30_000, holders=[holder], resource_version=3, decided_at_ms=1,
                         cause=Cause(topic="arbiter.resource.commands", partition=0, offset=41))
    data = codec.encode(record)
    cases: list[tuple[str, Callable[[], object]]] = [
        ("encode", lambda: codec.encode(record)),
        ("decode", lambda: codec.decode(data)),
    ]
    for label, fn in cases:
        count, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < seconds:
            for _ in range(1000):
                fn()
            count += 1000
        print(f"codec {label:6s} LockGranted ({len(data)} bytes): {count / elapsed:>10,.0f} msgs/s")


async def _roundtrip(rate: float, count: int) -> list[float]:
    from agents import ArbiterClient
    from arbiter.demo import key_for_partition
    from arbiter.processes import WorkerPool, wait_until_served
    from arbiter.settings import Settings, Topics, load_settings
    from arbiter.topics import ensure_topics

    run = f"bench{int(time.time())}"
    base = load_settings()
    with tempfile.TemporaryDirectory() as home:
        settings = Settings(bootstrap=base.bootstrap, home=Path(home), app_id=run,
                            topics=Topics(**{n: f"{run}.{n}" for n in Topics.model_fields}))
        await ensure_topics(settings)
        pool = WorkerPool(settings)
        pool.start(1, loglevel="warning")
        try:
            keys = [key_for_partition(p, settings.partitions) for p in range(settings.partitions)]
            async with ArbiterClient("bench", settings) as client:
                await wait_until_served(client, pool, keys)
                rtts = []
                interval = 1.0 / rate
                next_at = time.perf_counter()
                for i in range(count):
                    rtts.append((await client.ping(keys[i % len(keys)], timeout=10)).rtt_ms)
                    next_at += interval
                    await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
                return rtts
        finally:
            pool.stop()


def bench_roundtrip(rate: float, count: int) -> None:
    rtts = asyncio.run(_roundtrip(rate, count))
    q = statistics.quantiles(rtts, n=100)
    print(f"round trip Ping->worker->Pong, {count} at ~{rate:.0f}/s, one worker: "
          f"p50 {q[49]:.2f} ms  p99 {q[98]:.2f} ms  max {max(rtts):.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("which", nargs="?", default="all", choices=["codec", "roundtrip", "all"])
    parser.add_argument("--seconds", type=float, default=2.0, help="time per in-process figure")
    parser.add_argument("--rate", type=float, default=100.0, help="round trips per second")
    parser.add_argument("--count", type=int, default=2000, help="round trips to measure")
    args = parser.parse_args()
    print(f"# {platform.node()}: {platform.processor() or platform.machine()}, Python {platform.python_version()}")
    if args.which in ("codec", "all"):
        bench_codec(args.seconds)
    if args.which in ("roundtrip", "all"):
        bench_roundtrip(args.rate, args.count)


if __name__ == "__main__":
    main()
