"""Failover: how long after a worker is SIGKILLed its resources are granted again.

``python -m bench failover [--kills 20] [--workers 3] [--partitions 6] [--every 4]``

Workers share the partitions; one agent per partition acquires and releases a resource
of that partition in a loop, and every grant's time is kept. Before each kill, a ping
through each partition says which worker owns it. Then a random worker is SIGKILLed and
replaced, and the benchmark reports, per kill:

- **failover**: from the kill until every partition the killed worker owned has a grant
  again (the group must notice the death, a session timeout, then rebalance, restore the
  partition's state from its changelog and decide the waiting requests);
- **others' gap**: the longest time without a grant on the partitions other workers
  owned, from the kill to the end of the failover (a rebalance pauses them too).

Medians and p99 over all kills; the target is failover p99 <= 3 s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import random
import statistics
import time
from collections import defaultdict
from typing import Any

from arbiter.agents import ArbiterClient, ArbiterError
from arbiter.processes import wait_until_served
from arbiter.streams.runtime.topics import delete_topics_named

from .env import bench_workers, key_for_partition


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def run(kills: int, workers: int, partitions: int, every: float, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    async with bench_workers(workers, partitions=partitions) as (settings, pool):
        keys = [key_for_partition(p, partitions, prefix="failover:") for p in range(partitions)]
        grants: dict[int, list[float]] = defaultdict(list)
        asked: dict[int, list[float]] = defaultdict(list)
        """When each granted acquire was sent (same order as ``grants``)."""
        stop = asyncio.Event()
        clients = [ArbiterClient(f"agent-{p}", settings) for p in range(partitions)]
        for client in clients:
            await client.start()

        async def loop(p: int) -> None:
            client = clients[p]
            while not stop.is_set():
                try:
                    sent = time.monotonic()
                    lease = await client.acquire(keys[p], ttl=30, wait=60)
                    grants[p].append(time.monotonic())
                    asked[p].append(sent)
                    await client.release(lease, timeout=30)
                except ArbiterError:
                    await asyncio.sleep(0.05)  # the release or acquire was lost with its worker: go on

        loops = [asyncio.create_task(loop(p)) for p in range(partitions)]
        probe = clients[0]
        results: list[dict[str, Any]] = []
        started = 0
        try:
            await asyncio.sleep(2)
            for i in range(kills):
                owners = {p: (await probe.ping(keys[p], timeout=30)).worker_id for p in range(partitions)}
                live = [w for w in pool.workers if w.name in owners.values()]
                victim = rng.choice(live)
                theirs = [p for p, w in owners.items() if w == victim.name]
                killed_at = time.monotonic()
                victim.kill()
                pool.workers.remove(victim)
                deadline = killed_at + 60
                # A grant that was on its way when the worker died proves nothing: wait, on each of its
                # partitions, for the grant of an acquire sent after the kill (one round trip later
                # than the first decision the new owner makes).
                def regained(p: int, since: float = killed_at) -> float | None:
                    after = [g for s, g in zip(asked[p], grants[p], strict=True) if s > since]
                    return after[0] if after else None

                while not all(regained(p) is not None for p in theirs):
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"kill {i + 1}: partitions {theirs} not granted within 60 s")
                    await asyncio.sleep(0.01)
                failover = max(regained(p) or 0.0 for p in theirs) - killed_at
                end = killed_at + failover
                others = [p for p in range(partitions) if p not in theirs]
                gaps = []
                for p in others:
                    times = [killed_at] + [t for t in grants[p] if killed_at < t <= end] + [end]
                    gaps.append(max(b - a for a, b in itertools.pairwise(times)))
                results.append({"failover_s": failover, "others_gap_s": max(gaps, default=0.0),
                                "partitions_moved": len(theirs)})
                print(f"kill {i + 1}/{kills}: {victim.name} owned {len(theirs)} partition(s); granted again "
                      f"after {failover:.2f} s; others' longest gap {max(gaps, default=0.0):.2f} s", flush=True)
                # A replacement joins (another rebalance), then the next kill waits for a calm moment.
                started += 1
                name = f"worker-r{started}"
                pool.start(1, loglevel="info", extra_env={"ARBITER_WORKER_ID": name})
                await wait_until_served(probe, pool, keys)
                await asyncio.sleep(every)
        except Exception:
            for worker in pool.workers:  # what the workers said, before their folder goes
                print(f"--- {worker.name} ---\n" + "\n".join(
                    worker.log.read_text(errors="replace").splitlines()[-25:]), flush=True)
            raise
        finally:
            stop.set()
            for task in loops:
                task.cancel()
            await asyncio.gather(*loops, return_exceptions=True)
            for client in clients:
                with contextlib.suppress(Exception):
                    await client.close()
            with contextlib.suppress(Exception):
                await delete_topics_named(settings, (f"{settings.app_id}.", f"{settings.app_id}-"))
        failovers = [r["failover_s"] for r in results]
        gaps = [r["others_gap_s"] for r in results]
        return {"kills": len(results), "session_timeout_s": settings.session_timeout,
                "failover_p50_s": statistics.median(failovers), "failover_p99_s": _p(failovers, 0.99),
                "failover_max_s": max(failovers), "others_gap_p50_s": statistics.median(gaps),
                "others_gap_p99_s": _p(gaps, 0.99), "grants": sum(len(v) for v in grants.values())}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench failover", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--partitions", type=int, default=6)
    parser.add_argument("--every", type=float, default=3.0, help="Seconds of calm after each replacement joined.")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    out = asyncio.run(run(args.kills, args.workers, args.partitions, args.every, args.seed))
    print(f"\nfailover over {out['kills']} SIGKILLs of one of {args.workers} workers ({args.partitions} partitions, "
          f"session timeout {out['session_timeout_s']:g} s, {out['grants']} grants in all):")
    print("| Figure | p50 | p99 | max |\n|---|---|---|---|")
    print(f"| killed worker's resources granted again | {out['failover_p50_s']:.2f} s | "
          f"{out['failover_p99_s']:.2f} s | {out['failover_max_s']:.2f} s |")
    print(f"| other workers' resources, longest gap meanwhile | {out['others_gap_p50_s']:.2f} s | "
          f"{out['others_gap_p99_s']:.2f} s | |")
