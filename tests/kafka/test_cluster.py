"""A three-node local Kafka (``arbiter kafka up --nodes 3``) under real agents and a real worker.

The cluster is the module's own: three KRaft nodes on free loopback ports in a temporary
home, started once for the module (three JVMs start slowly on a small machine), never the
shared broker. Each test runs agents (``ArbiterClient``) that acquire and release leases on
resources of both partitions through one real worker (``arbiter worker``), kills a node with
SIGKILL in the middle, and checks what a user relies on: every grant an agent saw is in the
log afterwards (on the decision topic and in the agent's inbox), no fencing token was handed
out twice and none skipped, the agents and the worker carried on by themselves, and the
audit of the whole log passes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.client import AIOKafkaClient, CoordinationType

from arbiter.agents import ArbiterClient
from arbiter.audit.log import read_log
from arbiter.edge.settings import Settings
from arbiter.kafka import LocalKafka, LocalKafkaError, local_cluster_settings
from arbiter.processes import WorkerPool, wait_until_served
from arbiter.schemas import LockGranted
from arbiter.schemas.partitioning import key_for_partition, partition_for
from arbiter.streams.runtime.topics import ensure_topics
from tests.conftest import assert_clean_audit, isolated_settings, share_broker_jars

pytestmark = [pytest.mark.kafka, pytest.mark.e2e]

FAILOVER_BUDGET = 10.0
"""Seconds from a node's SIGKILL until agents are granted leases again, by themselves."""


def _free_port_block(count: int) -> int:
    """The first of ``count`` consecutive loopback ports nobody listens on now."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20_000, 60_000, 2)
        with contextlib.ExitStack() as stack:
            try:
                for port in range(base, base + count):
                    sock = stack.enter_context(socket.socket())
                    sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return base
    raise RuntimeError(f"no {count} consecutive free ports on 127.0.0.1")


def _settings_for(home: Path, heap: str = "320m") -> Settings:
    base = _free_port_block(6)  # node i: client port base + 2(i-1), controller port base + 1 + 2(i-1)
    settings = Settings(home=home, kafka_port=base, kafka_controller_port=base + 1, bootstrap=f"127.0.0.1:{base}",
                        kafka_heap=heap, partitions=2)
    share_broker_jars(home)
    return settings


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalKafka]:
    """Three nodes of the module's own, started once; stopped (all of them) after the module."""
    local = LocalKafka(_settings_for(tmp_path_factory.mktemp("cluster") / "home"), nodes=3)
    try:
        local.up(timeout=240)
        yield local
    finally:
        local.down()


# -- no JVM needed -----------------------------------------------------------------------


def test_the_node_count_is_kept_and_changing_it_needs_a_reset(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path, kafka_port=9092, kafka_controller_port=9093)
    single = tmp_path / "kafka" / "data"
    single.mkdir(parents=True)
    (single / "meta.properties").write_text("cluster.id=abc\nnode.id=1\n")  # one node's data, from any version
    assert LocalKafka(settings).nodes == 1
    assert LocalKafka(settings).bootstrap == "127.0.0.1:9092", "one node keeps 9092/9093 exactly"
    with pytest.raises(LocalKafkaError, match=r"cannot start as a cluster of 3 nodes.*'arbiter kafka reset'"):
        LocalKafka(settings, nodes=3).up()
    assert local_cluster_settings(settings) is settings

    (single / "meta.properties").unlink()
    (tmp_path / "kafka" / "arbiter-nodes").write_text("3\n")
    local = LocalKafka(settings)
    assert local.nodes == 3, "a plain up, down, status or reset acts on the count the data was made with"
    assert local.bootstrap == "127.0.0.1:9092,127.0.0.1:9094,127.0.0.1:9096"
    assert [(n.port, n.controller_port) for n in local.node_list] == [(9092, 9093), (9094, 9095), (9096, 9097)]
    assert [n.data for n in local.node_list] == [tmp_path.resolve() / "kafka" / "nodes" / str(i) / "data"
                                                 for i in (1, 2, 3)]
    with pytest.raises(LocalKafkaError, match=r"cannot start as one node.*'arbiter kafka reset'"):
        LocalKafka(settings, nodes=1).up()
    reached = local_cluster_settings(settings)
    assert (reached.bootstrap, reached.replication_factor) == (local.bootstrap, 3)
    explicit = Settings(home=tmp_path, kafka_port=9092, kafka_controller_port=9093, replication_factor=2)
    assert local_cluster_settings(explicit).replication_factor == 2, "a factor that was set stays"


def test_three_nodes_refuse_secure_mode_and_overlapping_ports(tmp_path: Path) -> None:
    with pytest.raises(LocalKafkaError, match="secure mode runs one node only"):
        LocalKafka(Settings(home=tmp_path / "a"), nodes=3).up(secure=True)
    clash = Settings(home=tmp_path / "b", kafka_port=19000, kafka_controller_port=19002)
    with pytest.raises(LocalKafkaError, match="distinct ports"):
        LocalKafka(clash, nodes=3).up()


def test_each_node_is_configured_for_replication_and_fast_failover(tmp_path: Path) -> None:
    local = LocalKafka(Settings(home=tmp_path, kafka_port=9092, kafka_controller_port=9093), nodes=3)
    node = local.node_list[1]
    node.root.mkdir(parents=True)
    local._write_config(node)
    props = dict(line.split("=", 1) for line in node.config.read_text().splitlines())
    assert props["node.id"] == "2"
    assert props["controller.quorum.voters"] == "1@127.0.0.1:9093,2@127.0.0.1:9095,3@127.0.0.1:9097"
    assert props["listeners"] == "PLAINTEXT://127.0.0.1:9094,CONTROLLER://127.0.0.1:9095"
    assert props["log.dirs"] == str(node.data)
    for name, value in {"offsets.topic.replication.factor": "3", "transaction.state.log.replication.factor": "3",
                        "transaction.state.log.min.isr": "2", "default.replication.factor": "3",
                        "min.insync.replicas": "2", "group.min.session.timeout.ms": "1000",
                        "broker.session.timeout.ms": "2000", "controller.quorum.fetch.timeout.ms": "1000"}.items():
        assert props[name] == value, name

    one = LocalKafka(Settings(home=tmp_path / "one", kafka_port=9092, kafka_controller_port=9093))
    single = one.node_list[0]
    single.root.mkdir(parents=True)
    one._write_config(single)
    props = dict(line.split("=", 1) for line in single.config.read_text().splitlines())
    assert props["group.min.session.timeout.ms"] == "1000"
    assert props["controller.quorum.voters"] == "1@127.0.0.1:9093"
    assert props["offsets.topic.replication.factor"] == "1" and "min.insync.replicas" not in props
    assert single.config == tmp_path.resolve() / "one" / "kafka" / "server.properties", "the one-node layout stays"


# -- the running cluster -------------------------------------------------------------------


@dataclass
class Grant:
    """A grant an agent saw: when it asked, when the answer came."""

    agent: str
    resource: str
    token: int
    request_id: str
    sent: float
    at: float


@dataclass
class Swarm:
    """Agents that acquire and release leases in a loop, two per resource, on every partition."""

    settings: Settings
    pool: WorkerPool
    resources: list[str]
    grants: list[Grant] = field(default_factory=list)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def agent(self, name: str, resource: str, client: ArbiterClient) -> None:
        while not self.stop.is_set():
            sent = time.monotonic()
            lease = await client.acquire(resource, ttl=30, wait=60)
            self.grants.append(Grant(name, resource, lease.token, lease.request_id, sent, time.monotonic()))
            await client.release(lease, timeout=60)

    def since(self, moment: float, resources: set[str] | None = None) -> list[Grant]:
        """Grants of requests sent after ``moment`` (on ``resources``), in arrival order."""
        return [g for g in self.grants if g.sent > moment and (resources is None or g.resource in resources)]

    def agents_granted_since(self, moment: float) -> set[str]:
        return {g.agent for g in self.since(moment)}

    def all_granted_after(self, moment: float) -> float:
        """Seconds from ``moment`` until every agent had a grant of a request sent after it."""
        firsts: dict[str, float] = {}
        for g in self.since(moment):
            firsts.setdefault(g.agent, g.at)
        assert len(firsts) == len(self.tasks)
        return max(firsts.values()) - moment

    async def until(self, condition: Callable[[], bool], timeout: float, what: str) -> float:
        """Wait until ``condition`` holds (agents and worker alive meanwhile); returns how long it took."""
        started = time.monotonic()
        while not condition():
            self.pool.check_alive()
            for task in self.tasks:
                if task.done() and (error := task.exception()) is not None:
                    raise error
            assert time.monotonic() - started < timeout, f"{what}: not within {timeout:.0f} s"
            await asyncio.sleep(0.02)
        return time.monotonic() - started


@contextlib.asynccontextmanager
async def swarm(settings: Settings, pool: WorkerPool) -> AsyncIterator[Swarm]:
    """Start the worker and the agents (two per resource, three resources per partition); stop them after."""
    parts = settings.partitions
    resources = [key_for_partition(p, parts, prefix=f"busy:{i}-") for p in range(parts) for i in range(3)]
    run = Swarm(settings, pool, resources)
    pool.start(1)
    async with contextlib.AsyncExitStack() as stack:
        prober = await stack.enter_async_context(ArbiterClient("prober", settings))
        await wait_until_served(prober, pool, [key_for_partition(p, parts) for p in range(parts)])
        for i, resource in enumerate(resources):
            for j in range(2):
                name = f"agent-{i}-{j}"
                client = await stack.enter_async_context(ArbiterClient(name, settings))
                run.tasks.append(asyncio.create_task(run.agent(name, resource, client)))
        try:
            yield run
        finally:
            run.stop.set()
            done, pending = await asyncio.wait(run.tasks, timeout=90)
            for task in pending:
                task.cancel()
            for task in done:
                if not task.cancelled() and (error := task.exception()) is not None:
                    raise error
            assert not pending, f"{len(pending)} agents did not finish their last lease within 90 s"


async def _layout(settings: Settings, names: list[str]) -> dict[tuple[str, int], tuple[int, list[int], list[int]]]:
    """(leader, replicas, in-sync replicas) of every partition of ``names``. Each broker learns of a
    new topic on its own: ask until the one asked knows them all."""
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.bootstrap, request_timeout_ms=10_000)
    await admin.start()
    try:
        deadline = time.monotonic() + 15
        while True:
            topics = await admin.describe_topics(names)
            if all(t["error_code"] == 0 and t["partitions"] for t in topics) and len(topics) == len(names):
                return {(t["topic"], p["partition"]): (p["leader"], list(p["replicas"]), list(p["isr"]))
                        for t in topics for p in t["partitions"]}
            assert time.monotonic() < deadline, f"the brokers do not describe all of {names}: {topics}"
            await asyncio.sleep(0.1)
    finally:
        await admin.close()


async def _ours(settings: Settings) -> list[str]:
    """The test's topics and changelogs, and the consumer offsets."""
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.bootstrap, request_timeout_ms=10_000)
    await admin.start()
    try:
        prefix = settings.topics.resource_commands.split(".")[0] + "."
        return sorted(t for t in await admin.list_topics()
                      if t.startswith((prefix, f"{settings.app_id}-")) or t == "__consumer_offsets")
    finally:
        await admin.close()


async def _min_insync(settings: Settings, names: list[str]) -> dict[str, str]:
    """Each topic's ``min.insync.replicas`` (asking again while the broker asked does not know a topic yet)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.bootstrap, request_timeout_ms=10_000)
    await admin.start()
    try:
        found: dict[str, str] = {}
        deadline = time.monotonic() + 15
        while set(found) < set(names):
            assert time.monotonic() < deadline, f"no config for {sorted(set(names) - set(found))}"
            request = [ConfigResource(ConfigResourceType.TOPIC, n) for n in names if n not in found]
            for response in await admin.describe_configs(request):
                for error, _message, _type, name, entries in response.resources:
                    if error == 0:
                        found[name] = {row[0]: row[1] for row in entries}["min.insync.replicas"]
            await asyncio.sleep(0.1)
        return found
    finally:
        await admin.close()


async def _group_coordinator(settings: Settings) -> int:
    client = AIOKafkaClient(bootstrap_servers=settings.bootstrap, request_timeout_ms=10_000)
    await client.bootstrap()
    try:
        return int(await client.coordinator_lookup(CoordinationType.GROUP, settings.app_id))
    finally:
        await client.close()


def _kafka_status(cluster: LocalKafka) -> subprocess.CompletedProcess[str]:
    """``arbiter kafka status`` on the cluster's home, as its operator runs it."""
    s = cluster.settings
    env = {**os.environ, "ARBITER_HOME": str(s.home), "ARBITER_KAFKA_PORT": str(s.kafka_port),
           "ARBITER_KAFKA_CONTROLLER_PORT": str(s.kafka_controller_port)}
    env.pop("ARBITER_BOOTSTRAP", None)
    return subprocess.run([sys.executable, "-m", "arbiter", "kafka", "status"], capture_output=True, text=True,
                          env=env, timeout=60, check=False)


async def _kill(cluster: LocalKafka, node_id: int) -> float:
    """SIGKILL one node; returns the moment, once the process is gone."""
    node = cluster.node_list[node_id - 1]
    pid = cluster.pid_of(node)
    assert pid is not None, f"node {node_id} is not running"
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    while cluster.pid_of(node) is not None:
        assert time.monotonic() - killed_at < 10, f"node {node_id} survived SIGKILL"
        await asyncio.sleep(0.02)
    return killed_at


async def _check_the_log(settings: Settings, run: Swarm) -> None:
    """Every grant an agent saw is in the log (decision topic and inbox); tokens never repeat or skip."""
    log = await read_log(settings)
    decided = {(e.record.agent_id, e.record.resource, e.record.token, e.record.request_id)
               for e in log.of(settings.topics.resource_events) if isinstance(e.record, LockGranted)}
    told = {(e.record.agent_id, e.record.resource, e.record.token, e.record.request_id)
            for e in log.of(settings.topics.agent_inbox) if isinstance(e.record, LockGranted)}
    seen = {(g.agent, g.resource, g.token, g.request_id) for g in run.grants}
    assert seen - decided == set(), f"grants agents saw are missing from the decision log: {sorted(seen - decided)}"
    assert seen - told == set(), f"grants agents saw are missing from their inboxes: {sorted(seen - told)}"
    by_resource: dict[str, set[int]] = defaultdict(set)
    for _agent, resource, token, _request in decided:
        by_resource[resource].add(token)
    for resource, tokens in by_resource.items():
        assert sorted(tokens) == list(range(1, len(tokens) + 1)), f"{resource}: tokens skip: {sorted(tokens)}"
    holders: dict[tuple[str, int], set[str]] = defaultdict(set)
    for agent, resource, token, _request in decided:
        holders[(resource, token)].add(agent)
    assert all(len(agents) == 1 for agents in holders.values()), "a token was granted to two agents"


async def test_killing_the_leader_of_a_busy_partition_loses_no_acknowledged_grant(
        cluster: LocalKafka, tmp_path: Path) -> None:
    settings = isolated_settings(cluster.bootstrap, tmp_path, replication_factor=3)
    await ensure_topics(settings)
    layout = await _layout(settings, settings.topics.all())
    assert {len(replicas) for _leader, replicas, _isr in layout.values()} == {3}, "topics have 3 replicas"
    assert set((await _min_insync(settings, settings.topics.all())).values()) == {"2"}
    pool = WorkerPool(settings)
    try:
        async with swarm(settings, pool) as run:
            await run.until(lambda: len(run.grants) >= 40, 90, "40 grants before the kill")
            busy = (settings.topics.resource_commands, 0)
            leader = (await _layout(settings, [busy[0]]))[busy][0]
            victims = {r for r in run.resources if partition_for(r.encode(), settings.partitions) == 0}
            killed_at = await _kill(cluster, leader)
            first = await run.until(lambda: bool(run.since(killed_at, victims)), 60,
                                    "a grant on the dead leader's partition")
            await run.until(lambda: len(run.agents_granted_since(killed_at)) == len(run.tasks), 60,
                            "every agent granted again")
            everyone = run.all_granted_after(killed_at)
            status = await asyncio.to_thread(_kafka_status, cluster)
            assert status.returncode == 0 and "the cluster serves (2 of 3 nodes; it needs 2)" in status.stdout, (
                "with one node of three down, grants flow and 'arbiter kafka status' says so", status.stdout,
                status.stderr)
            assert f"{leader} not running" in status.stdout, status.stdout
            moved = (await _layout(settings, [busy[0]]))[busy][0]
            before = len(run.grants)
            await run.until(lambda: len(run.grants) >= before + 40, 60, "40 more grants")
        pool.check_alive()  # the same worker process throughout: it carried on by itself
        print(f"\nnode {leader} (leader of {busy[0]}[0]) SIGKILLed: first grant on that partition "
              f"{first:.2f} s after, every agent granted again after {everyone:.2f} s; new leader node {moved}; "
              f"{len(run.grants)} grants in all")
        assert moved not in (leader, -1)
        assert first < FAILOVER_BUDGET, f"the first grant after the kill took {first:.1f} s"
        assert everyone < FAILOVER_BUDGET, f"every agent was granted again only after {everyone:.1f} s"
        # Read with the node still dead: what was acknowledged is on the two that live.
        await _check_the_log(settings, run)
        await assert_clean_audit(settings)
    finally:
        pool.stop()
        await asyncio.to_thread(cluster.up)  # the killed node comes back, its data kept, for the next test


async def test_a_node_killed_and_restarted_loses_nothing(cluster: LocalKafka, tmp_path: Path) -> None:
    settings = isolated_settings(cluster.bootstrap, tmp_path, replication_factor=3)
    await ensure_topics(settings)
    pool = WorkerPool(settings)
    try:
        async with swarm(settings, pool) as run:
            await run.until(lambda: len(run.grants) >= 40, 90, "40 grants before the kill")
            victim = await _group_coordinator(settings)  # the worker's group moves too
            node = cluster.node_list[victim - 1]
            cluster_id = (node.data / "meta.properties").read_text()
            killed_at = await _kill(cluster, victim)
            await run.until(lambda: len(run.agents_granted_since(killed_at)) == len(run.tasks), 60,
                            "every agent granted with a node down")
            everyone = run.all_granted_after(killed_at)
            started = time.monotonic()
            said = await asyncio.to_thread(cluster.up)
            assert said.startswith(f"started node {victim} of 3 nodes"), said
            restart = time.monotonic() - started
            assert (node.data / "meta.properties").read_text() == cluster_id, "the node kept its data"
            names = await _ours(settings)

            async def in_sync() -> bool:
                return all(len(isr) == 3 for _leader, _replicas, isr in (await _layout(settings, names)).values())

            caught_up = time.monotonic()
            while not await in_sync():  # the restarted node caught up with every partition it holds
                run.pool.check_alive()
                assert time.monotonic() - caught_up < 60, "the restarted node is not back in sync within 60 s"
                await asyncio.sleep(0.2)
            caught_up = time.monotonic() - caught_up
            back = time.monotonic()
            await run.until(lambda: len(run.agents_granted_since(back)) == len(run.tasks), 60,
                            "every agent granted after the restart")
            after = run.all_granted_after(back)
        pool.check_alive()
        print(f"\nnode {victim} (the group's coordinator) SIGKILLed: every agent granted again after {everyone:.2f} s; "
              f"restarted in {restart:.1f} s, in sync {caught_up:.1f} s later, every agent granted again "
              f"{after:.2f} s after that; {len(run.grants)} grants in all")
        assert everyone < FAILOVER_BUDGET, f"every agent was granted again only after {everyone:.1f} s"
        await _check_the_log(settings, run)
        await assert_clean_audit(settings)
    finally:
        pool.stop()
        await asyncio.to_thread(cluster.up)
