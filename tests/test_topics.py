"""`arbiter topics create` is idempotent and guards co-partitioning."""

from __future__ import annotations

from pathlib import Path

import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from arbiter.streams.runtime.topics import TopicError, ensure_topics

from .conftest import isolated_settings

pytestmark = pytest.mark.kafka


async def test_create_twice_is_harmless(bootstrap: str, tmp_path: Path) -> None:
    settings = isolated_settings(bootstrap, tmp_path, partitions=3)
    first = await ensure_topics(settings)
    second = await ensure_topics(settings)
    assert [s.created for s in first] == [True] * len(settings.topics.all())
    assert [s.created for s in second] == [False] * len(settings.topics.all())
    assert {s.partitions for s in first + second} == {3}

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        (described,) = await admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, settings.topics.resource_events)]
        )
        entries = {row[0]: row[1] for row in described.resources[0][4]}
        assert entries["retention.ms"] == "-1"
        assert entries["message.timestamp.type"] == "LogAppendTime"
    finally:
        await admin.close()


async def test_a_topic_with_another_partition_count_is_an_error(bootstrap: str, tmp_path: Path) -> None:
    settings = isolated_settings(bootstrap, tmp_path, partitions=2)
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(settings.topics.agent_inbox, 5, 1)])
    finally:
        await admin.close()
    with pytest.raises(TopicError, match=r"co-partitioned.*agent.inbox has 5"):
        await ensure_topics(settings)


async def test_existing_topics_get_the_append_time_config(bootstrap: str, tmp_path: Path) -> None:
    settings = isolated_settings(bootstrap, tmp_path, partitions=2)
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(settings.topics.resource_commands, 2, 1)])
        await ensure_topics(settings)
        (described,) = await admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, settings.topics.resource_commands)]
        )
        entries = {row[0]: row[1] for row in described.resources[0][4]}
        assert entries["message.timestamp.type"] == "LogAppendTime"
        assert entries["retention.ms"] == "-1"
    finally:
        await admin.close()
