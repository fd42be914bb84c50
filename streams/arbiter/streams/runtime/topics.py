"""Create Arbiter's topics, co-partitioned and kept forever (the log is the audit record)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import KafkaError
from aiokafka.protocol.metadata import MetadataRequest

from arbiter.edge.kafkaauth import kafka_client_options
from arbiter.edge.kafkaconn import started
from arbiter.edge.settings import Settings

TOPIC_CONFIG = {
    # The log is the audit record; nothing ages out.
    "retention.ms": "-1",
    "retention.bytes": "-1",
    # Decisions use the broker's append time of a command as "now": the same on every
    # redelivery and in every replay, and never a client's clock.
    "message.timestamp.type": "LogAppendTime",
}


COMPACTED = {"cleanup.policy": "compact"}
"""Added for the registry: the latest record of every key, kept forever (old keys included)."""


def replication_config(settings: Settings) -> dict[str, str]:
    """What a new topic gets for its replication: with 3 replicas or more, ``min.insync.replicas=2``,
    so a write acknowledged to ``acks=all`` is on two nodes at least and one node may die."""
    return {"min.insync.replicas": "2"} if settings.replication_factor >= 3 else {}


def config_of(settings: Settings, name: str) -> dict[str, str]:
    """The config a topic gets."""
    base = {**TOPIC_CONFIG, **COMPACTED} if name == settings.topics.registry else TOPIC_CONFIG
    return {**base, **replication_config(settings)}


class TopicError(RuntimeError):
    """A topic exists with a shape Arbiter cannot use, or the broker refused to create it."""


@dataclass(frozen=True)
class TopicState:
    """What ``ensure_topics`` did to one topic."""

    name: str
    partitions: int
    created: bool


async def ensure_topics(settings: Settings) -> list[TopicState]:
    """Create every topic that is missing; check the ones that exist. Idempotent.

    Every topic gets ``settings.partitions`` partitions, so topics keyed by the same id
    are co-partitioned. An existing topic with another count would silently break that
    and is reported as an error rather than altered.
    """
    try:
        async with started(AIOKafkaAdminClient(bootstrap_servers=settings.bootstrap, request_timeout_ms=15000,
                                    **kafka_client_options(settings))) as admin:
            wanted = settings.topics.all()
            existing = await _partition_counts(admin, wanted)
            missing = [name for name in wanted if name not in existing]
            if missing:
                new = [
                    NewTopic(name, settings.partitions, settings.replication_factor,
                             topic_configs=config_of(settings, name))
                    for name in missing
                ]
                response = await admin.create_topics(new, timeout_ms=15000)
                for name, code, message in _topic_errors(response):
                    if code == 36:  # TOPIC_ALREADY_EXISTS: a concurrent create, or a broker that had not heard of it
                        missing.remove(name)
                    elif code != 0:
                        raise TopicError(f"creating {name} failed: error {code} {message or ''}".strip())
                existing.update(await _wait_for_leaders(admin, [n for n in wanted if n not in existing]))
            await _align_configs(admin, [n for n in wanted if n not in missing and n != settings.topics.registry])
            wrong = {n: c for n, c in existing.items() if c != settings.partitions}
            if wrong:
                detail = ", ".join(f"{n} has {c}" for n, c in sorted(wrong.items()))
                raise TopicError(
                    f"topics must all have {settings.partitions} partitions to stay co-partitioned, but {detail}; "
                    "set ARBITER_PARTITIONS to match, or recreate the topics"
                )
            return [TopicState(name, existing[name], name in missing) for name in wanted]
    except KafkaError as exc:
        if exc.retriable:
            raise  # unreachable, or not ready yet: the caller's to retry or report, not a refusal
        raise TopicError(f"the broker at {settings.bootstrap} refused: {exc}") from exc


async def _wait_for_leaders(admin: AIOKafkaAdminClient, names: list[str], timeout: float = 30.0) -> dict[str, int]:
    """Return once every broker knows every partition of ``names`` and its leader, so first use does not
    race creation (each broker of a cluster learns of a new topic on its own, and a client asks any
    of them); their partition counts."""
    deadline = time.monotonic() + timeout
    while True:
        counts = await _known_everywhere(admin, names)
        if counts is not None:
            return counts
        if time.monotonic() > deadline:
            raise TopicError(f"topics {', '.join(names)} have no partition leaders on every broker after "
                             f"{timeout:.0f}s")
        await asyncio.sleep(0.1)


async def _known_everywhere(admin: AIOKafkaAdminClient, names: list[str]) -> dict[str, int] | None:
    """Each of ``names``' partition count, when every broker describes them all with leaders; else None.

    (aiokafka's admin client asks whichever broker it likes; asking each one needs its client, the one
    private attribute of another package read here: ``tests/project/test_code_shape.py`` names it.)"""
    brokers = [broker.nodeId for broker in admin._client.cluster.brokers()]
    counts: dict[str, int] = {}
    for node in brokers or [admin._client.get_random_node()]:
        try:
            response = await admin._client.send(node, MetadataRequest(names))
        except KafkaError:  # a broker that just died (not fenced yet): ask the cluster who is there again
            await admin._client.force_metadata_update()
            return None
        topics = response.to_object()["topics"]
        for t in topics:
            if t.get("error_code", 0) != 0 or not t["partitions"] or any(p["leader"] < 0 for p in t["partitions"]):
                return None
            counts[t["topic"]] = len(t["partitions"])
        if not set(names) <= {t["topic"] for t in topics}:
            return None
    return counts


async def _align_configs(admin: AIOKafkaAdminClient, names: list[str]) -> None:
    """Set TOPIC_CONFIG on existing topics where it differs (topics from older versions)."""
    stale = await _stale_configs(admin, names)
    if not stale:
        return
    for response in await admin.alter_configs([ConfigResource(ConfigResourceType.TOPIC, n, TOPIC_CONFIG)
                                               for n in stale]):
        for row in response.resources:
            if row[0] != 0:
                raise TopicError(f"setting {TOPIC_CONFIG} on {row[3]} failed: error {row[0]} {row[1] or ''}")
    # The change travels through the controller's log: wait until the broker serves it.
    deadline = time.monotonic() + 30
    while stale := await _stale_configs(admin, stale):
        if time.monotonic() > deadline:
            raise TopicError(f"topics {', '.join(stale)} did not take the config {TOPIC_CONFIG} within 30s")
        await asyncio.sleep(0.1)


async def _stale_configs(admin: AIOKafkaAdminClient, names: list[str]) -> list[str]:
    if not names:
        return []
    stale = []
    for response in await admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, n) for n in names]):
        for resource in response.resources:
            name, entries = resource[3], {row[0]: row[1] for row in resource[4]}
            if any(entries.get(k) != v for k, v in TOPIC_CONFIG.items()):
                stale.append(name)
    return stale


async def _partition_counts(admin: AIOKafkaAdminClient, names: list[str]) -> dict[str, int]:
    present = set(await admin.list_topics())
    counts: dict[str, int] = {}
    query = [n for n in names if n in present]
    if not query:
        return counts
    for topic in await admin.describe_topics(query):
        if topic.get("error_code", 0) == 0:
            counts[topic["topic"]] = len(topic["partitions"])
    return counts


def _topic_errors(response: object) -> list[tuple[str, int, str | None]]:
    rows = getattr(response, "topic_errors", [])
    out = []
    for row in rows:
        name, code = row[0], row[1]
        message = row[2] if len(row) > 2 else None
        out.append((name, code, message))
    return out


CHANGELOG_CONFIG = {"cleanup.policy": "compact", "segment.ms": "60000", "min.cleanable.dirty.ratio": "0.1"}
"""A changelog keeps the latest state of every key; older values are compacted away. Kafka never
compacts the active segment, so it rolls every minute: a worker taking a partition over reads
its keys' last values plus at most about a minute of changes, not every change since it began
(failover time must not grow with the history)."""


async def ensure_changelogs(settings: Settings, names: list[str]) -> None:
    """Create the processors' changelog topics that are missing (compacted, co-partitioned with
    the inputs); an existing one with another partition count is an error."""
    try:
        async with started(AIOKafkaAdminClient(bootstrap_servers=settings.bootstrap, request_timeout_ms=15000,
                                    **kafka_client_options(settings))) as admin:
            existing = await _partition_counts(admin, names)
            missing = [n for n in names if n not in existing]
            if missing:
                response = await admin.create_topics(
                    [NewTopic(n, settings.partitions, settings.replication_factor,
                              topic_configs={**CHANGELOG_CONFIG, **replication_config(settings)})
                     for n in missing], timeout_ms=15000)
                for name, code, message in _topic_errors(response):
                    if code not in (0, 36):
                        raise TopicError(f"creating {name} failed: error {code} {message or ''}".strip())
                await _wait_for_leaders(admin, missing)
            wrong = {n: c for n, c in existing.items() if c != settings.partitions}
            if wrong:
                detail = ", ".join(f"{n} has {c}" for n, c in sorted(wrong.items()))
                raise TopicError(f"changelog topics must have {settings.partitions} partitions, like their inputs, "
                                 f"but {detail}")
    except KafkaError as exc:
        if exc.retriable:
            raise  # unreachable, or not ready yet: the caller's to retry or report, not a refusal
        raise TopicError(f"the broker at {settings.bootstrap} refused: {exc}") from exc


async def delete_topics_named(settings: Settings, prefixes: tuple[str, ...], batch: int = 500) -> int:
    """Delete every topic whose name starts with one of ``prefixes``; how many. For throwaway runs
    (tests, benchmarks): a broker that keeps every run's topics slows down and runs out of heap."""
    async with started(AIOKafkaAdminClient(bootstrap_servers=settings.bootstrap,
                                           **kafka_client_options(settings))) as admin:
        ours = sorted(t for t in await admin.list_topics() if t.startswith(prefixes))
        for start in range(0, len(ours), batch):
            await admin.delete_topics(ours[start:start + batch], timeout_ms=60_000)
        return len(ours)


async def group_session_bounds(settings: Settings) -> tuple[float, float] | None:
    """The session timeouts (seconds) the brokers accept from a consumer group, as
    (``group.min.session.timeout.ms``, ``group.max.session.timeout.ms``) of one broker; None when
    they cannot be read (a principal without DescribeConfigs on the cluster)."""
    try:
        async with started(AIOKafkaAdminClient(bootstrap_servers=settings.bootstrap,
                                               **kafka_client_options(settings))) as admin:
            brokers = (await admin.describe_cluster()).get("brokers") or []
            if not brokers:
                return None
            node = str(min(b["node_id"] for b in brokers))
            for response in await admin.describe_configs([ConfigResource(ConfigResourceType.BROKER, node)]):
                for resource in response.resources:
                    entries = {row[0]: row[1] for row in resource[4]}
                    low = entries.get("group.min.session.timeout.ms")
                    high = entries.get("group.max.session.timeout.ms")
                    if low is not None and high is not None:
                        return int(low) / 1000, int(high) / 1000
            return None
    except (KafkaError, ValueError, TypeError, IndexError):
        return None


@dataclass(frozen=True)
class TopicSize:
    """One topic as ``arbiter topics list`` shows it."""

    name: str
    partitions: int
    records: int | None
    """Records still in the log (end offsets less first offsets, summed over partitions); None when the
    broker did not say in time (a topic being deleted, a partition without a leader)."""


async def topic_sizes(settings: Settings, prefix: str = "") -> list[TopicSize]:
    """Every topic whose name starts with ``prefix`` (Kafka's own ``__`` topics left out), with its size."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    async with started(AIOKafkaAdminClient(bootstrap_servers=settings.bootstrap,
                                           **kafka_client_options(settings))) as admin:
        names = sorted(t for t in await admin.list_topics() if t.startswith(prefix) and not t.startswith("__"))
        counts = await _partition_counts(admin, names) if names else {}
    if not counts:
        return []
    async with started(AIOKafkaConsumer(bootstrap_servers=settings.bootstrap, group_id=None,
                                        request_timeout_ms=SIZE_TIMEOUT_MS, **kafka_client_options(settings))
                       ) as consumer:
        async def size(name: str, partitions: int) -> int | None:
            tps = [TopicPartition(name, p) for p in range(partitions)]
            try:
                ends, starts = await consumer.end_offsets(tps), await consumer.beginning_offsets(tps)
            except KafkaError:  # one topic that cannot say (being deleted, say) does not hide the others
                return None
            return int(sum(ends[tp] - starts[tp] for tp in tps))

        sizes = await asyncio.gather(*(size(n, c) for n, c in counts.items()))
    return [TopicSize(n, c, records) for (n, c), records in zip(counts.items(), sizes, strict=True)]


SIZE_TIMEOUT_MS = 10_000
"""How long ``topic_sizes`` waits for one topic's offsets."""


def live_topics(settings: Settings) -> set[str]:
    """The topics this configuration's workers use: its own set, and its tables' changelogs, by their
    exact names (another configuration's app id may start with this one's: ``arbiter-x`` with
    ``arbiter``)."""
    from arbiter.streams.runtime.common import TABLES

    return {*settings.topics.all(), *(spec.changelog(settings.app_id) for spec in TABLES.values())}
