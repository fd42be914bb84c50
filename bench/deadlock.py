"""Deadlock benchmarks: detection on a large graph in-process, and latency through Kafka."""

from __future__ import annotations

import asyncio
import random
import statistics
import time
import uuid

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from arbiter.history import partition_for
from contract import Cause, DeadlockDetected, Record, WaitEdgeAdded, WaitEdgeRemoved, default_codec
from cores.waitgraph import WaitGraph, detect, evolve

from .env import bench_arbiter
from .leases import percentiles

CAUSE = Cause(topic="bench", partition=0, offset=0)


def _edge(waiter: str, holder: str, n: int) -> WaitEdgeAdded:
    return WaitEdgeAdded(edge_id=f"e{n}", waiter=waiter, holder=holder, source="delegation", resource=None,
                         waiter_priority=0, waiter_registered_at_ms=n, added_at_ms=0)


def large_graph(agents: int = 10_000, fanout: int = 2) -> None:
    """Insertion cost on a graph of ``agents`` agents, and a cycle that spans all of them."""
    rng = random.Random(3)
    graph = WaitGraph()
    names = [f"agent-{i}" for i in range(agents)]
    n = 0
    # A chain through every agent (the long cycle to close later) plus random forward edges: a DAG.
    for i in range(agents - 1):
        evolve(graph, _edge(names[i], names[i + 1], n))
        n += 1
    for i in range(agents - 1):
        for _ in range(fanout - 1):
            j = rng.randrange(i + 1, agents)
            evolve(graph, _edge(names[i], names[j], n))
            n += 1
    samples = []
    for _ in range(2_000):  # edges that close no cycle: forward edges between random agents
        i = rng.randrange(agents - 1)
        j = rng.randrange(i + 1, agents)
        edge = _edge(names[i], names[j], n)
        n += 1
        started = time.perf_counter()
        found = detect(graph, edge, 0, CAUSE)
        evolve(graph, edge)
        samples.append((time.perf_counter() - started) * 1000)
        assert not found
    closing = _edge(names[-1], names[0], n)
    started = time.perf_counter()
    (detection,) = detect(graph, closing, 0, CAUSE)
    full = (time.perf_counter() - started) * 1000
    print(f"detection, graph of {agents:,} agents / {len(graph.edges):,} edges: insertion closing no cycle "
          f"{percentiles(samples)}; closing a {len(detection.cycle):,}-agent cycle: {full:.1f} ms")


async def detection_latency(rate: float, samples: int) -> None:
    """Edge that closes a cycle until its DeadlockDetected is in the log, under ``rate`` edges/s."""
    codec = default_codec()
    async with bench_arbiter() as settings:
        topic = settings.topics.wait_edges
        key = settings.graph_key.encode()
        tp = TopicPartition(topic, partition_for(key, settings.partitions))
        consumer = AIOKafkaConsumer(bootstrap_servers=settings.bootstrap, group_id=None, enable_auto_commit=False)
        producer = AIOKafkaProducer(bootstrap_servers=settings.bootstrap, linger_ms=0)
        await consumer.start()
        await producer.start()
        try:
            consumer.assign([tp])
            await consumer.seek_to_end(tp)
            await consumer.position(tp)
            sent: dict[str, float] = {}
            latencies: list[float] = []
            run = uuid.uuid4().hex[:6]
            interval = 1.0 / rate
            next_at = time.perf_counter()
            total = samples * 10  # one closing edge in ten: the rest is background load
            for n in range(total):
                a, b = f"{run}-{n}-a", f"{run}-{n}-b"
                if n % 10 == 9:  # close a two-agent cycle opened nine edges ago
                    a, b = f"{run}-{n - 9}-b", f"{run}-{n - 9}-a"
                    edge = WaitEdgeAdded(edge_id=f"{run}|{n}", waiter=a, holder=b, source="delegation",
                                         resource=None, waiter_priority=0, waiter_registered_at_ms=n, added_at_ms=0)
                    sent[edge.edge_id] = time.perf_counter()
                    await producer.send(topic, key=key, value=codec.encode(edge))
                elif n % 10 == 0:
                    await producer.send(topic, key=key, value=codec.encode(WaitEdgeAdded(
                        edge_id=f"{run}|{n}", waiter=a, holder=b, source="delegation", resource=None,
                        waiter_priority=0, waiter_registered_at_ms=n, added_at_ms=0)))
                else:  # background: add and remove edges that never close a cycle
                    await producer.send(topic, key=key, value=codec.encode(WaitEdgeRemoved(
                        edge_id=f"{run}|bg{n}", waiter=a, holder=b, source="delegation", removed_at_ms=0)))
                next_at += interval
                await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
                for messages in (await consumer.getmany(tp, timeout_ms=0)).values():
                    for m in messages:
                        record: Record = codec.decode(m.value)
                        if isinstance(record, DeadlockDetected):
                            edge_id = record.detection_id.split("|")[1] + "|" + record.detection_id.split("|")[2]
                            if edge_id in sent:
                                latencies.append((time.perf_counter() - sent.pop(edge_id)) * 1000)
            deadline = time.monotonic() + 30
            while sent and time.monotonic() < deadline:
                for messages in (await consumer.getmany(tp, timeout_ms=1000)).values():
                    for m in messages:
                        record = codec.decode(m.value)
                        if isinstance(record, DeadlockDetected):
                            edge_id = record.detection_id.split("|")[1] + "|" + record.detection_id.split("|")[2]
                            if edge_id in sent:
                                latencies.append((time.perf_counter() - sent.pop(edge_id)) * 1000)
        finally:
            await producer.stop()
            await consumer.stop()
    assert not sent, f"{len(sent)} cycles were never reported"
    print(f"detection latency at ~{rate:.0f} edge events/s, closing edge until DeadlockDetected is logged: "
          f"{percentiles(latencies)} (median of {statistics.median(latencies):.2f} ms)")
