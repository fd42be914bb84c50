"""`arbiter kafka up|down|reset` on a broker of the test's own (other ports, other folder)."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from arbiter.edge.settings import Settings
from arbiter.kafka import LocalKafka, LocalKafkaError, broker_answers
from arbiter.streams.runtime.topics import ensure_topics
from tests.conftest import share_broker_jars

pytestmark = [pytest.mark.kafka, pytest.mark.e2e]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def own_settings(tmp_path: Path) -> Settings:
    """A second broker's settings; it reuses the jars the main broker fetched."""
    port, controller = free_port(), free_port()
    settings = Settings(home=tmp_path / "home", kafka_port=port, kafka_controller_port=controller,
                        bootstrap=f"127.0.0.1:{port}", partitions=1, kafka_heap="256m")
    share_broker_jars(settings.home)
    return settings


@pytest.fixture
def broker(own_settings: Settings) -> Iterator[LocalKafka]:
    local = LocalKafka(own_settings)
    yield local
    local.down()


async def _produce(settings: Settings, value: bytes) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=settings.bootstrap, acks="all")
    await producer.start()
    try:
        await producer.send_and_wait(settings.topics.resource_events, key=b"k", value=value)
    finally:
        await producer.stop()


async def _consume_all(settings: Settings) -> list[bytes]:
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.bootstrap, group_id=None,
                                auto_offset_reset="earliest", enable_auto_commit=False)
    await consumer.start()
    try:
        tp = TopicPartition(settings.topics.resource_events, 0)
        consumer.assign([tp])
        end = (await consumer.end_offsets([tp]))[tp]
        values: list[bytes] = []
        while len(values) < end:
            for messages in (await consumer.getmany(tp, timeout_ms=5000)).values():
                values.extend(m.value for m in messages)
        return values
    finally:
        await consumer.stop()


def test_up_twice_down_up_keeps_messages_and_reset_wipes(broker: LocalKafka, own_settings: Settings) -> None:
    assert broker.up().startswith("started")
    first_pid = broker.pid()
    assert broker.up().startswith("already running")
    assert broker.pid() == first_pid

    asyncio.run(ensure_topics(own_settings))
    asyncio.run(_produce(own_settings, b"kept across restarts"))

    assert broker.down().startswith("stopped")
    assert broker.pid() is None
    assert not broker_answers(own_settings.bootstrap, timeout=1)
    assert broker.down() == "not running"

    assert broker.up().startswith("started")
    assert asyncio.run(_consume_all(own_settings)) == [b"kept across restarts"]

    assert "data wiped" in broker.reset()
    assert not (broker.data / "meta.properties").exists()
    broker.up()
    created = asyncio.run(ensure_topics(own_settings))
    assert all(state.created for state in created), "reset must have deleted the topics"


def test_port_in_use_is_a_clear_error(broker: LocalKafka, own_settings: Settings) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", own_settings.kafka_port))
        squatter.listen()
        with pytest.raises(LocalKafkaError, match=f"127.0.0.1:{own_settings.kafka_port} is already in use"):
            broker.up()
    assert broker.pid() is None


def test_failed_start_prints_the_log_tail_and_exits_non_zero(own_settings: Settings) -> None:
    env = dict(os.environ)
    env.update({
        "ARBITER_HOME": str(own_settings.home),
        "ARBITER_KAFKA_PORT": str(own_settings.kafka_port),
        "ARBITER_KAFKA_CONTROLLER_PORT": str(own_settings.kafka_controller_port),
        "ARBITER_KAFKA_HEAP": "not-a-size",
    })
    env.pop("ARBITER_BOOTSTRAP", None)
    proc = subprocess.run([sys.executable, "-m", "arbiter", "kafka", "up", "--timeout", "60"],
                          capture_output=True, text=True, env=env, timeout=120, check=False)
    assert proc.returncode == 1
    assert "error: the Kafka broker exited" in proc.stderr
    assert "Invalid" in proc.stderr and "heap size" in proc.stderr  # the JVM's own words, from the log tail
    assert not (own_settings.home / "kafka" / "kafka.pid").exists()


def test_the_broker_is_fetched_into_a_home_outside_the_checkout(tmp_path: Path) -> None:
    """The jars land in <home>/kafka/libs/<release> wherever the home is (the pom once pinned them to the
    checkout), with the slf4j binding the release logs through: no broker runs without its log."""
    settings = Settings(home=tmp_path / "elsewhere")
    local = LocalKafka(settings)
    local.fetch()
    libs = settings.home / "kafka" / "libs" / settings.kafka_version
    jars = sorted(p.name for p in libs.glob("*.jar"))
    assert f"kafka_2.13-{settings.kafka_version}.jar" in jars, jars
    assert any(name.startswith("log4j-slf4j-impl-") for name in jars), jars  # Kafka 4 logs through log4j 2
    assert (libs / ".pom-sha256").exists() and local.jars_current()
