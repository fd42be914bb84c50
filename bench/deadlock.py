"""Deadlock benchmarks: detection on a large graph in-process, and latency through Kafka."""

from __future__ import annotations

import asyncio
import random
import statistics
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from arbiter.edge.clock import now_ms
from arbiter.schemas import Cause, DeadlockDetected, Record, WaitEdgeAdded, WaitEdgeRemoved, default_codec
from arbiter.schemas.partitioning import partition_for
from arbiter.streams.cores.waitgraph import WaitGraph, detect, evolve

from .env import bench_arbiter, raw_signer
from .leases import percentiles

CAUSE = Cause(topic="bench", partition=0, offset=0)


def _edge(waiter: str, holder: str, n: int) -> WaitEdgeAdded:
    return WaitEdgeAdded(edge_id=f"e{n}", waiter=waiter, holder=holder, source="delegation", resource=None,
                         waiter_priority=0, waiter_registered_at_ms=n, at_ms=0)


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
    # Appended last, the closing edge's waiter is the youngest agent on the cycle: the one victim.
    (detection,) = detect(graph, closing, n, CAUSE)
    full = (time.perf_counter() - started) * 1000
    print(f"detection, graph of {agents:,} agents / {len(graph.edges):,} edges: insertion closing no cycle "
          f"{percentiles(samples)}; closing a {len(detection.cycle):,}-agent cycle: {full:.1f} ms")


async def detection_latency(rate: float, samples: int, agents: int = 400, standing: int = 400,
                            probe_every: int = 10, burst: int = 5_000) -> None:
    """Edge that closes a cycle until its DeadlockDetected is in the log, under ``rate`` edge events/s.

    The load is real: a wait-for graph of ``agents`` agents holding about ``standing``
    edges (each agent waits on at most two others). Every background event either adds
    a new edge or removes one that is present; edges only run from an agent to a
    later one, so the background alone never closes a cycle. One event in
    ``probe_every`` is a probe: an edge from ``v`` back to ``u``, where the graph
    already holds a path ``u -> ... -> v``, so the cycle runs through the standing graph.
    The probe's waiter has the lowest priority, so it is the victim and its waits (the
    probe among them) leave the graph: the graph stays acyclic. The graph the worker
    holds is mirrored here through the same core, which is how each event is known to be
    a real change, and how every detection is known to be expected. Last, a burst of
    ``burst`` such events without pauses measures how many the worker decides per second.
    """
    codec = default_codec()
    rng = random.Random(11)
    run = uuid.uuid4().hex[:6]
    names = [f"{run}-agent{i:04d}" for i in range(agents)]
    mirror = WaitGraph()  # the worker's graph, folded here from what is sent
    load = _Load()
    probes: dict[str, float] = {}  # probe edge id -> perf_counter when sent
    appended: dict[str, int] = {}  # probe edge id -> broker append time (ms)
    latencies: list[float] = []
    broker_latencies: list[float] = []
    cycles: list[int] = []
    unexpected: list[str] = []

    def background() -> WaitEdgeAdded | WaitEdgeRemoved:
        if len(mirror.edges) < standing:
            while True:
                i = rng.randrange(agents - 1)
                j = rng.randrange(i + 1, agents)
                waits = mirror.out.get(names[i], {})
                if len(waits) < 2 and all(e.holder != names[j] for e in waits.values()):
                    break
            load.n += 1
            return WaitEdgeAdded(edge_id=f"{run}|b{load.n}", waiter=names[i], holder=names[j], source="delegation",
                                 resource=None, waiter_priority=1, waiter_registered_at_ms=i, at_ms=0)
        edge = mirror.edges[rng.choice(list(mirror.edges))]
        return WaitEdgeRemoved(edge_id=edge.edge_id, waiter=edge.waiter, holder=edge.holder, source=edge.source,
                               at_ms=0)

    def probe(edge_id: str) -> WaitEdgeAdded:
        start = node = rng.choice(sorted(mirror.out))
        for _ in range(rng.randint(1, 4)):  # walk 1-4 waits down the graph: the cycle to close
            waits = mirror.out.get(node)
            if not waits:
                break
            node = mirror.edges[rng.choice(sorted(waits))].holder
        return WaitEdgeAdded(edge_id=edge_id, waiter=node, holder=start, source="delegation",
                             resource=None, waiter_priority=0, waiter_registered_at_ms=agents, at_ms=0)

    def fold(event: WaitEdgeAdded | WaitEdgeRemoved, is_probe: bool) -> None:
        """What the worker will do with ``event``, done to the mirror; count whether it changes the graph."""
        if isinstance(event, WaitEdgeAdded):
            real = event.edge_id not in mirror.edges and event.edge_id not in mirror.cancelled
            found = detect(mirror, event, 0, CAUSE)
            load.count("probe" if is_probe else "add", real)
        else:
            real = event.edge_id in mirror.edges
            found = []
            load.count("remove", real)
        evolve(mirror, event)
        for detection in found:
            load.cancelled += len(mirror.out.get(detection.victim, {})) - 1  # the victim's other waits
            evolve(mirror, detection)
        if len(found) != (1 if is_probe else 0) or (found and found[0].victim != event.waiter):
            raise AssertionError(f"the background closed a cycle, or a probe closed none: {event}")
        load.sizes.append(len(mirror.edges))
        load.waiting.append(len(mirror.out))

    async with bench_arbiter() as settings:
        topic = settings.topics.wait_edges
        key = settings.graph_key.encode()
        tp = TopicPartition(topic, partition_for(key, settings.partitions))
        consumer = AIOKafkaConsumer(bootstrap_servers=settings.bootstrap, group_id=None, enable_auto_commit=False)
        producer = AIOKafkaProducer(bootstrap_servers=settings.bootstrap, linger_ms=0)
        await consumer.start()
        await producer.start()

        signer = raw_signer(settings)
        marks = (f"{run}|p".encode(), b"deadlock|")  # in probes and detections only
        timed: set[str] = set()
        detected: dict[str, float] = {}

        async def follow() -> None:
            """Read the graph's partition: probes' append times, and the detections."""
            while True:
                batch = await consumer.getmany(tp, timeout_ms=100)
                now = time.perf_counter()
                for m in batch.get(tp, []):
                    if not any(mark in m.value for mark in marks):
                        continue  # background: not worth decoding (this process shares the cores)
                    record: Record = codec.decode(m.value)
                    if isinstance(record, WaitEdgeAdded) and record.edge_id in probes:
                        appended[record.edge_id] = m.timestamp
                    elif isinstance(record, DeadlockDetected):
                        edge_id = record.detection_id.split("|", 1)[1].rsplit("|", 1)[0]
                        sent = probes.pop(edge_id, None)
                        if sent is None or edge_id not in appended:
                            unexpected.append(record.detection_id)
                            continue
                        detected[edge_id] = now
                        if edge_id in timed:
                            latencies.append((now - sent) * 1000)
                            broker_latencies.append(float(m.timestamp - appended[edge_id]))
                            cycles.append(len(record.cycle))

        async def send(event: WaitEdgeAdded | WaitEdgeRemoved, is_probe: bool = False) -> None:
            fold(event, is_probe)
            if is_probe:
                probes[event.edge_id] = time.perf_counter()
            value = codec.encode(event)
            await producer.send(topic, key=key, value=value, headers=signer.sign(topic, key, value, now_ms()))

        async def settle(deadline_s: float) -> None:
            deadline = time.monotonic() + deadline_s
            while probes and time.monotonic() < deadline:
                if reader is not None and reader.done():
                    reader.result()  # the reader failed: say why
                await asyncio.sleep(0.005)

        reader: asyncio.Task[None] | None = None
        try:
            consumer.assign([tp])
            await consumer.seek_to_end(tp)
            await consumer.position(tp)
            reader = asyncio.create_task(follow())
            while len(mirror.edges) < standing:  # the standing graph, as fast as it goes
                await send(background())
            await send(probe(f"{run}|pwarm"), is_probe=True)
            await settle(60)  # the worker has folded the whole standing graph
            assert not probes, "the warm-up cycle was never reported"

            load.reset()
            interval = 1.0 / rate
            started = next_at = time.perf_counter()
            for n in range(samples * probe_every):
                if n % probe_every == probe_every - 1:
                    timed.add(f"{run}|p{n}")
                    await send(probe(f"{run}|p{n}"), is_probe=True)
                else:
                    await send(background())
                next_at += interval
                await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
            measured = load.describe(agents, time.perf_counter() - started)
            await settle(30)
            assert not probes, f"{len(probes)} cycles were never reported"

            # How many such events the worker can decide at all: a burst, then one probe.
            load.reset()
            started = time.perf_counter()
            for _ in range(burst):
                await send(background())
            await send(probe(f"{run}|plast"), is_probe=True)
            await producer.flush()
            produced = time.perf_counter() - started
            await settle(120)
            assert not probes, "the probe after the burst was never reported"
            decided = detected[f"{run}|plast"] - started
            changed = sum(load.real.values()) / sum(load.events.values())
        finally:
            if reader is not None:
                reader.cancel()
            await producer.stop()
            await consumer.stop()
    assert not unexpected, f"detections nobody closed a cycle for: {unexpected[:3]}"
    print(f"detection under load: {measured}; cycles of {min(cycles)}-{max(cycles)} agents "
          f"(median {statistics.median(cycles):.0f})")
    print(f"detection latency at ~{rate:.0f} edge events/s, closing edge until DeadlockDetected is logged: "
          f"{percentiles(latencies)}")
    print(f"  the same on the broker's clock (append time of the edge to append time of the detection): "
          f"{percentiles(broker_latencies)}")
    print(f"detection, one worker's capacity on that graph: a burst of {burst + 1:,} edge events "
          f"({changed:.1%} changed the graph) produced in {produced:.2f} s, all decided after {decided:.2f} s: "
          f"{(burst + 1) / decided:,.0f} edge events/s")


@dataclass
class _Load:
    """What the background load did, counted against the mirrored graph."""

    n: int = 0
    events: Counter[str] = field(default_factory=Counter)
    real: Counter[str] = field(default_factory=Counter)
    cancelled: int = 0
    sizes: list[int] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)

    def count(self, kind: str, real: bool) -> None:
        self.events[kind] += 1
        self.real[kind] += real

    def describe(self, agents: int, seconds: float) -> str:
        """The graph and the events sent since the last reset, in words."""
        total = sum(self.events.values())
        real = sum(self.real.values())
        return (f"graph of {agents} agents, {min(self.sizes)}-{max(self.sizes)} edges standing "
                f"(mean {statistics.mean(self.sizes):.0f}), {statistics.mean(self.waiting):.0f} agents waiting; "
                f"{total:,} edge events at {total / seconds:,.0f}/s ({self.events['add']:,} adds, "
                f"{self.events['remove']:,} removes, {self.events['probe']:,} cycle-closing edges): "
                f"{real / total:.1%} changed the graph; {self.cancelled:,} more edges left with their victims")

    def reset(self) -> None:
        self.events.clear()
        self.real.clear()
        self.cancelled = 0
        self.sizes.clear()
        self.waiting.clear()
