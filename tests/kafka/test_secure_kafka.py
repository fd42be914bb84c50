"""`arbiter kafka up --secure`: SASL/SCRAM logins and ACLs on a real broker of this module's own.

One secure broker (other ports, other home, the main broker's jars) serves every test here;
it is stopped at the end. Missing Java or jars is a failure, never a skip.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaConnectionError, TopicAuthorizationFailedError

from arbiter.edge.kafkaauth import KafkaAuthError, faust_credentials, kafka_client_options, load_credentials
from arbiter.edge.settings import Settings
from arbiter.kafka import LocalKafka, LocalKafkaError, broker_answers, secure_acls
from tests.conftest import share_broker_jars

pytestmark = [pytest.mark.kafka, pytest.mark.e2e]

AGENT, WORKER, ADMIN = "arbiter-agent", "arbiter-worker", "arbiter-admin"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A home of its own whose libs are the main broker's jars (no second download)."""
    home = tmp_path_factory.mktemp("secure") / "home"
    share_broker_jars(home)
    return home


@pytest.fixture(scope="module")
def base(home: Path) -> Settings:
    port = free_port()
    return Settings(home=home, kafka_port=port, kafka_controller_port=free_port(), bootstrap=f"127.0.0.1:{port}",
                    partitions=1, kafka_heap="256m")


@pytest.fixture(scope="module")
def broker(base: Settings) -> Iterator[LocalKafka]:
    local = LocalKafka(base)
    try:
        said = local.up(timeout=90, secure=True)
        assert said.startswith("started") and "secure" in said, said
        yield local
    finally:
        local.down()


def as_principal(base: Settings, principal: str, password: str | None = None) -> Settings:
    """Settings that log in as ``principal``, the way a user configures them (ARBITER_KAFKA_*)."""
    login = load_credentials(base.home, principal)
    return base.model_copy(update={
        "kafka_security_protocol": login["security_protocol"],
        "kafka_sasl_mechanism": login["mechanism"],
        "kafka_username": login["username"],
        "kafka_password": login["password"] if password is None else password,
    })


@pytest.fixture(scope="module")
def topics(broker: LocalKafka, base: Settings) -> Settings:
    """Every Arbiter topic, created by the worker principal (which may create ``arbiter.`` topics)."""
    worker = as_principal(base, WORKER)

    async def create() -> None:
        admin = AIOKafkaAdminClient(bootstrap_servers=worker.bootstrap, **kafka_client_options(worker))
        await admin.start()
        try:
            response = await admin.create_topics([NewTopic(name, 1, 1) for name in base.topics.all()])
            codes = {name: code for name, code, *_ in response.topic_errors}
            assert set(codes.values()) <= {0, 36}, codes
        finally:
            await admin.close()

    asyncio.run(create())
    return base


async def produce(settings: Settings, topic: str, value: bytes) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=settings.bootstrap, acks="all", request_timeout_ms=15000,
                                **kafka_client_options(settings))
    await producer.start()
    try:
        await producer.send_and_wait(topic, key=b"k", value=value)
    finally:
        await producer.stop()


async def read_all(settings: Settings, topic: str) -> list[bytes]:
    """Every message of partition 0, read without a consumer group (as the SDK reads its inbox)."""
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.bootstrap, group_id=None, enable_auto_commit=False,
                                auto_offset_reset="earliest", **kafka_client_options(settings))
    await consumer.start()
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        end = (await consumer.end_offsets([tp]))[tp]
        values: list[bytes] = []
        while len(values) < end:
            for messages in (await consumer.getmany(tp, timeout_ms=5000)).values():
                values.extend(m.value for m in messages)
        return values
    finally:
        await consumer.stop()


def test_credentials_are_private_and_complete(broker: LocalKafka, base: Settings) -> None:
    path = base.home / "secure" / "credentials.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(broker.config.stat().st_mode) == 0o600  # it holds the admin's password
    principals = json.loads(path.read_text())["principals"]
    assert set(principals) == {ADMIN, WORKER, AGENT}
    passwords = [p["password"] for p in principals.values()]
    assert len(set(passwords)) == 3 and all(len(p) >= 24 for p in passwords)
    with pytest.raises(KafkaAuthError, match="has no credentials for 'nobody'"):
        load_credentials(base.home, "nobody")
    with pytest.raises(KafkaAuthError, match="arbiter kafka up --secure"):
        load_credentials(base.home / "elsewhere", AGENT)


def test_client_options_follow_the_settings(base: Settings) -> None:
    assert kafka_client_options(base) == {}
    assert faust_credentials(base) is None
    agent = as_principal(base, AGENT)
    assert kafka_client_options(agent) == {
        "security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "SCRAM-SHA-512",
        "sasl_plain_username": AGENT, "sasl_plain_password": agent.kafka_password,
    }
    assert faust_credentials(agent) == {"username": AGENT, "password": agent.kafka_password,
                                        "mechanism": "SCRAM-SHA-512", "ssl": False}
    with pytest.raises(KafkaAuthError, match="ARBITER_KAFKA_USERNAME"):
        kafka_client_options(base.model_copy(update={"kafka_security_protocol": "SASL_PLAINTEXT"}))


def test_agent_cannot_write_the_event_log(topics: Settings) -> None:
    agent = as_principal(topics, AGENT)
    with pytest.raises(TopicAuthorizationFailedError):
        asyncio.run(produce(agent, topics.topics.resource_events, b"a forged decision"))
    with pytest.raises(TopicAuthorizationFailedError):
        asyncio.run(produce(agent, topics.topics.saga_events, b"a forged saga decision"))
    with pytest.raises(TopicAuthorizationFailedError):
        asyncio.run(produce(agent, topics.topics.agent_inbox, b"a forged answer to another agent"))


def test_agent_sends_commands_and_reads_its_inbox_and_the_registry(topics: Settings) -> None:
    agent, worker = as_principal(topics, AGENT), as_principal(topics, WORKER)
    asyncio.run(produce(agent, topics.topics.resource_commands, b"acquire"))
    asyncio.run(produce(agent, topics.topics.saga_commands, b"saga step"))
    asyncio.run(produce(worker, topics.topics.agent_inbox, b"granted"))
    asyncio.run(produce(worker, topics.topics.registry, b"a public key"))
    assert asyncio.run(read_all(agent, topics.topics.agent_inbox)) == [b"granted"]
    assert asyncio.run(read_all(agent, topics.topics.registry)) == [b"a public key"]


def test_worker_writes_events_and_reads_commands(topics: Settings) -> None:
    worker = as_principal(topics, WORKER)
    asyncio.run(produce(worker, topics.topics.resource_events, b"a decision"))
    assert b"a decision" in asyncio.run(read_all(worker, topics.topics.resource_events))
    assert b"acquire" in asyncio.run(read_all(worker, topics.topics.resource_commands))


def test_wrong_password_and_no_login_are_turned_away(topics: Settings, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="aiokafka")
    wrong = as_principal(topics, AGENT, password="not-the-password")
    with pytest.raises(KafkaConnectionError):
        asyncio.run(produce(wrong, topics.topics.resource_commands, b"x"))
    assert "SaslAuthenticationFailed" in caplog.text or "invalid credentials" in caplog.text, caplog.text
    assert not broker_answers(topics.bootstrap, timeout=2)  # PLAINTEXT: no answer at all
    assert broker_answers(topics.bootstrap, timeout=5, options=kafka_client_options(as_principal(topics, ADMIN)))


def test_acls_are_what_the_security_page_says(base: Settings) -> None:
    agent = {(a.name, a.operation) for a in secure_acls(base) if a.principal == AGENT}
    t = base.topics
    assert {name for name, op in agent if op == "write"} == {t.resource_commands, t.saga_commands, t.wait_edges}
    assert {name for name, op in agent if op == "read"} == {t.agent_inbox, t.registry}
    assert t.resource_events not in {name for name, _ in agent}


def test_the_mode_is_kept_and_switching_needs_a_reset(broker: LocalKafka, topics: Settings) -> None:
    with pytest.raises(LocalKafkaError, match="arbiter kafka reset"):
        broker.up(secure=False)
    assert broker.mode() == "secure"
    assert broker.down().startswith("stopped")
    with pytest.raises(LocalKafkaError, match="arbiter kafka reset"):
        broker.up(secure=False)
    # Plain `arbiter kafka up` (no flag) restarts it as it was: secure, same logins, same messages.
    env = dict(os.environ)
    env.update({"ARBITER_HOME": str(topics.home), "ARBITER_KAFKA_PORT": str(topics.kafka_port),
                "ARBITER_KAFKA_CONTROLLER_PORT": str(topics.kafka_controller_port), "ARBITER_KAFKA_HEAP": "256m"})
    env.pop("ARBITER_BOOTSTRAP", None)
    proc = subprocess.run([sys.executable, "-m", "arbiter", "kafka", "up", "--timeout", "90"],
                          capture_output=True, text=True, env=env, timeout=150, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "secure" in proc.stdout and str(topics.home / "secure" / "credentials.json") in proc.stdout
    for login in json.loads((topics.home / "secure" / "credentials.json").read_text())["principals"].values():
        assert login["password"] not in proc.stdout + proc.stderr
    agent = as_principal(topics, AGENT)
    with pytest.raises(TopicAuthorizationFailedError):
        asyncio.run(produce(agent, topics.topics.resource_events, b"still forbidden"))
    assert asyncio.run(read_all(agent, topics.topics.agent_inbox)) == [b"granted"]

