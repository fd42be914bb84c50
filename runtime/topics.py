"""Create Arbiter's topics, co-partitioned and kept forever (the log is the audit record)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import KafkaError

from contract.kafkaauth import kafka_client_options
from contract.settings import Settings

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


def config_of(settings: Settings, name: str) -> dict[str, str]:
    """The config a topic gets."""
    return {**TOPIC_CONFIG, **COMPACTED} if name == settings.topics.registry else TOPIC_CONFIG


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
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.bootstrap, request_timeout_ms=15000,
                                **kafka_client_options(settings))
    await admin.start()
    try:
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
                if code not in (0, 36):  # 36: TOPIC_ALREADY_EXISTS (a concurrent create)
                    raise TopicError(f"creating {name} failed: error {code} {message or ''}".strip())
            await _wait_for_leaders(admin, missing)
            existing.update(await _partition_counts(admin, missing))
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
        raise TopicError(f"the broker at {settings.bootstrap} refused: {exc}") from exc
    finally:
        await admin.close()


async def _wait_for_leaders(admin: AIOKafkaAdminClient, names: list[str], timeout: float = 30.0) -> None:
    """Return once every partition of ``names`` has a leader, so first use does not race creation."""
    deadline = time.monotonic() + timeout
    while True:
        topics = await admin.describe_topics(names)
        ready = all(
            t.get("error_code", 0) == 0 and t["partitions"] and all(p["leader"] >= 0 for p in t["partitions"])
            for t in topics
        )
        if ready:
            return
        if time.monotonic() > deadline:
            raise TopicError(f"topics {', '.join(names)} have no partition leaders after {timeout:.0f}s")
        await asyncio.sleep(0.1)


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


CHANGELOG_CONFIG = {"cleanup.policy": "compact"}
"""A changelog keeps the latest state of every key; older values are compacted away."""


async def ensure_changelogs(settings: Settings, names: list[str]) -> None:
    """Create the processors' changelog topics that are missing (compacted, co-partitioned with
    the inputs); an existing one with another partition count is an error."""
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.bootstrap, request_timeout_ms=15000,
                                **kafka_client_options(settings))
    await admin.start()
    try:
        existing = await _partition_counts(admin, names)
        missing = [n for n in names if n not in existing]
        if missing:
            response = await admin.create_topics(
                [NewTopic(n, settings.partitions, settings.replication_factor, topic_configs=CHANGELOG_CONFIG)
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
        raise TopicError(f"the broker at {settings.bootstrap} refused: {exc}") from exc
    finally:
        await admin.close()


async def delete_topics_named(settings: Settings, prefixes: tuple[str, ...], batch: int = 500) -> int:
    """Delete every topic whose name starts with one of ``prefixes``; how many. For throwaway runs
    (tests, benchmarks): a broker that keeps every run's topics slows down and runs out of heap."""
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.bootstrap, **kafka_client_options(settings))
    await admin.start()
    try:
        ours = sorted(t for t in await admin.list_topics() if t.startswith(prefixes))
        for start in range(0, len(ours), batch):
            await admin.delete_topics(ours[start:start + batch], timeout_ms=60_000)
        return len(ours)
    finally:
        await admin.close()
