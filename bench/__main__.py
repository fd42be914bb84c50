"""``python -m bench [NAME ...]``: print Arbiter's measured figures.

Names: codec, core (and queue and history), queue (a hand-off's cost, 1 to 1,000 waiters), history (a
decision's cost after 10 and after 4,000 hand-offs, decide/evolve and step), roundtrip, grant, handoff,
throughput, ceiling (leases and faust);
check, intent, checks (the gateway); graph, detection (deadlocks); replay (audit, no broker);
trust-crypto (signing and verifying, no broker), trust-latency (grants with verification on
versus off); sdk-scale (1, 8, 64 agents in one process). Default: all.
``python -m bench compare [--reps N] [--quick]``: Arbiter side by side with etcd, ZooKeeper and
Redis (``bench.compare``; ``./dev bench compare`` installs them), run only when named.
``python -m bench door [--sizes 10,64,100,1000] [--seconds N] [--via ws,rest,sdk]``: N agents
through one front door (``arbiter serve``) beside the direct-Kafka SDK (``bench.door``), run only when named.
``python -m bench failover [--kills 20] [--workers 3]``: failover time after a worker's SIGKILL
(``bench.failover``), run only when named.
``python -m bench checkpoint [--messages 200000] [--after 5000,20000,50000]``: an audit resumed from a
checkpoint beside one from zero (``bench.checkpoint``, no broker), run only when named.
``python -m bench merges [--agents 4] [--rounds 3] [--sizes 100,1000,10000]``: the merge queue's
merges/s with and without a 1 s check, and git merge-tree's preflight time against repository size
(``bench.merges``), run only when named.
``python -m bench metrics``: a worker's metrics' CPU per input (``bench.metrics``), run only when named.
``python -m bench console [--rate 100] [--seconds 20]``: the live console's CPU cost on the front door per
1,000 decisions, and its page's update latency in headless Chromium (``bench.console``), run only when named.
The Kafka benchmarks need a broker (``./dev bench`` starts the local one) and start
their own worker processes on topics of their own.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import sys
import time
from collections.abc import Callable

from arbiter.schemas import Cause, Holder, LockGranted, default_codec

from . import deadlock, gateway, leases, replay, runtime, sdk, trust
from .env import bench_arbiter, key_for_partition


def bench_codec(seconds: float) -> None:
    codec = default_codec()
    holder = Holder(agent_id="alpha", request_id="r1", token=7, mode="exclusive", expires_at_ms=30_000)
    record = LockGranted(request_id="r1", agent_id="alpha", resource="ticket:cust_8492", token=7, mode="exclusive",
                         expires_at_ms=30_000, holders=[holder], resource_version=3, at_ms=1,
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


async def bench_roundtrip(rate: float, count: int) -> None:
    from arbiter.agents import ArbiterClient

    async with bench_arbiter() as settings, ArbiterClient("bench", settings) as client:
        keys = [key_for_partition(p, settings.partitions) for p in range(settings.partitions)]
        rtts = []
        interval, next_at = 1.0 / rate, time.perf_counter()
        for i in range(count):
            rtts.append((await client.ping(keys[i % len(keys)], timeout=10)).rtt_ms)
            next_at += interval
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
    q = statistics.quantiles(rtts, n=100, method="inclusive")
    print(f"round trip Ping->worker->Pong, {count} at ~{rate:.0f}/s, one worker: "
          f"p50 {q[49]:.2f} ms  p99 {q[98]:.2f} ms  max {max(rtts):.2f} ms")


NAMES = ["codec", "core", "queue", "history", "roundtrip", "grant", "handoff", "throughput", "ceiling", "check",
         "intent", "checks", "graph", "detection", "replay", "trust-crypto", "trust-latency", "sdk-scale", "runtime",
         "messages", "scaling", "floor"]


def main() -> None:
    if sys.argv[1:2] == ["compare"]:  # side by side with etcd, ZooKeeper, Redis: its own options
        from . import compare
        compare.main(sys.argv[2:])
        return
    if sys.argv[1:2] == ["door"]:  # N agents through one front door: its own options
        from . import door
        door.main(sys.argv[2:])
        return
    if sys.argv[1:2] == ["checkpoint"]:  # audit from a checkpoint: cost per new message, no broker
        from . import checkpoint
        checkpoint.main(sys.argv[2:])
        return
    if sys.argv[1:2] == ["metrics"]:  # what counting costs a worker per input
        from . import metrics
        metrics.main()
        return
    if sys.argv[1:2] == ["console"]:  # the live console's cost on the door, and its page's update latency
        from . import console
        console.main(sys.argv[2:])
        return
    if sys.argv[1:2] == ["merges"]:  # coding agents' merge queue, and preflight time against repository size
        from . import merges
        merges.main(sys.argv[2:])
        return
    if sys.argv[1:2] == ["failover"]:  # SIGKILLed workers, time until their resources are granted again
        from . import failover
        failover.main(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"any of: {', '.join(NAMES)}")
    parser.add_argument("--seconds", type=float, default=2.0, help="time per in-process figure")
    parser.add_argument("--rate", type=float, default=100.0, help="requests per second for latency figures")
    parser.add_argument("--count", type=int, default=1000, help="samples per latency figure")
    parser.add_argument("--burst", type=int, default=20_000, help="acquires in the throughput burst")
    parser.add_argument("--reps", type=int, default=1, help="interleaved rounds of the runtime comparison")
    parser.add_argument("--log-messages", type=int, default=200_000, help="messages in the log the replay "
                        "benchmark generates and audits")
    args = parser.parse_args()
    unknown = sorted(set(args.names) - set(NAMES))
    if unknown:
        parser.error(f"unknown benchmark {', '.join(unknown)}; choose from {', '.join(NAMES)}")
    names = args.names or NAMES
    print(f"# {platform.node()}: {platform.machine()}, Python {platform.python_version()}")
    if "codec" in names:
        bench_codec(args.seconds)
    if "core" in names:
        leases.core(args.seconds)
    else:
        if "queue" in names:
            leases.queue_cost(args.seconds)
        if "history" in names:
            leases.history_cost()
    if "roundtrip" in names:
        asyncio.run(bench_roundtrip(args.rate, args.count))
    if "grant" in names:
        asyncio.run(leases.grant_latency(args.rate, args.count))
    if "handoff" in names:
        asyncio.run(leases.handoff_latency(min(args.count, 300)))
    if "throughput" in names:
        asyncio.run(leases.grant_throughput(args.burst))
    if "ceiling" in names:
        asyncio.run(leases.faust_ceiling(args.burst))
    if "check" in names:
        gateway.pure_check(args.seconds)
    if "intent" in names:
        asyncio.run(gateway.round_trip(args.rate, min(args.count, 500)))
    if "checks" in names:
        asyncio.run(gateway.check_throughput(args.burst))
    if "graph" in names:
        deadlock.large_graph()
    if "runtime" in names:
        asyncio.run(runtime.side_by_side(min(args.burst, 10_000), min(args.count, 300), args.reps))
    if "messages" in names:
        asyncio.run(runtime.messages(min(args.count, 200)))
    if "scaling" in names:
        asyncio.run(runtime.scaling(args.burst))
    if "floor" in names:
        asyncio.run(runtime.kafka_floor(min(args.count, 500)))
    if "detection" in names:
        asyncio.run(deadlock.detection_latency(1_000.0, min(args.count, 500)))
    if "replay" in names:
        replay.audit_throughput(args.log_messages)
    if "trust-crypto" in names:
        trust.crypto(args.seconds)
    if "trust-latency" in names:
        asyncio.run(trust.latency(args.rate, min(args.count, 600)))
    if "sdk-scale" in names:
        asyncio.run(sdk.scale(5 * args.seconds))


if __name__ == "__main__":
    main()
