"""`arbiter topics create` is idempotent and guards co-partitioning."""

from __future__ import annotations

from pathlib import Path

import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from arbiter.edge.settings import Settings
from arbiter.streams.runtime.topics import TopicError, ensure_topics
from tests.conftest import isolated_settings

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


def test_a_kept_runs_topics_are_not_this_configurations_and_its_prefix_deletes_them_whole(
        bootstrap: str, tmp_path: Path) -> None:
    """Finding: 'topics list' called every kept demo run's changelogs "this configuration's" (the default
    app id 'arbiter' is a prefix of 'arbiter-demo-<run>'), and deleting the run's topics by their prefix
    left those changelogs behind. A run's changelogs are named under its topic prefix now, and a
    configuration's own are its tables' changelogs by exact name."""
    import asyncio
    import json
    import uuid

    from click.testing import CliRunner

    from arbiter.cli import main
    from arbiter.demo.runs import run_settings
    from arbiter.streams.runtime.common import TABLES
    from arbiter.streams.runtime.topics import delete_topics_named, ensure_changelogs, live_topics, topic_sizes

    ours = isolated_settings(bootstrap, tmp_path)
    kept = run_settings(ours, f"t-{uuid.uuid4().hex[:8]}", None)  # a demo run, named as the demo names it
    changelogs = [spec.changelog(kept.app_id) for spec in TABLES.values()]
    prefix = kept.topics.registry.rsplit(".", 1)[0] + "."
    runner = CliRunner(env={"ARBITER_BOOTSTRAP": bootstrap, "ARBITER_APP_ID": "arbiter"})
    try:
        asyncio.run(ensure_topics(kept))
        asyncio.run(ensure_changelogs(kept, changelogs))
        names = {*kept.topics.all(), *changelogs}
        listed: dict[str, bool] = {}
        for start in sorted({prefix, f"{kept.app_id}-"}):
            result = runner.invoke(main, ["topics", "list", "--json", "--prefix", start])
            assert result.exit_code == 0, result.output
            listed |= {row["name"]: row["in_use"] for row in map(json.loads, result.stdout.splitlines())}
        assert names <= set(listed), names - set(listed)
        assert not any(listed.values()), [n for n, in_use in listed.items() if in_use]
        result = runner.invoke(main, ["topics", "delete", prefix])
        assert result.exit_code == 0, result.output
        left = {t.name for start in (prefix, f"{kept.app_id}-") for t in asyncio.run(topic_sizes(kept, start))}
        assert not left & names, sorted(left & names)
        # The configuration's own topics and changelogs are still its own, and kept from a delete.
        assert {spec.changelog("arbiter") for spec in TABLES.values()} <= live_topics(Settings(app_id="arbiter"))
        asyncio.run(ensure_topics(ours))
        asyncio.run(ensure_changelogs(ours, [spec.changelog(ours.app_id) for spec in TABLES.values()]))
        env = {"ARBITER_BOOTSTRAP": bootstrap, "ARBITER_APP_ID": ours.app_id,
               **{f"ARBITER_TOPICS__{k.upper()}": v for k, v in ours.topics.model_dump().items()}}
        refused = CliRunner(env=env).invoke(main, ["topics", "delete", f"{ours.app_id}-"])
        assert refused.exit_code == 1 and "of this configuration's own topics" in refused.output, refused.output
    finally:
        asyncio.run(delete_topics_named(kept, (prefix, f"{kept.app_id}-")))
        asyncio.run(delete_topics_named(ours, (f"{ours.app_id}-",)))
