"""Each node's config files, as ordered property tables: its KRaft ``server.properties`` (one node's,
with what a cluster and the secure mode add) and its logging for log4j (Kafka 3.x) and log4j 2 (Kafka 4)."""

from __future__ import annotations

from collections.abc import Mapping

from arbiter.edge.settings import Settings

from .nodes import Node
from .secure import ADMIN, SCRAM_MECHANISM, SECURE_PROTOCOL

BROKER_SESSION_TIMEOUT_MS = 2000
"""A cluster's active controller fences a node this long after its last heartbeat (Kafka: 9 s): its
partitions get new leaders and its replicas leave the in-sync sets. The largest part of a client's
wait after a node dies."""


def properties_text(props: Mapping[str, str]) -> str:
    """A Java properties file: one ``key=value`` line per entry, in order."""
    return "".join(f"{k}={v}\n" for k, v in props.items())


def server_properties(settings: Settings, node: Node, voters: list[Node]) -> dict[str, str]:
    """``node``'s server.properties as one plain node of the quorum of ``voters``."""
    s = settings
    return {
        "process.roles": "broker,controller",
        "node.id": str(node.id),
        "controller.quorum.voters": ",".join(f"{n.id}@127.0.0.1:{n.controller_port}" for n in voters),
        "listeners": f"PLAINTEXT://127.0.0.1:{node.port},CONTROLLER://127.0.0.1:{node.controller_port}",
        "advertised.listeners": f"PLAINTEXT://127.0.0.1:{node.port}",
        "controller.listener.names": "CONTROLLER",
        "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
        "inter.broker.listener.name": "PLAINTEXT",
        "log.dirs": str(node.data),
        "num.partitions": str(s.partitions),
        "offsets.topic.replication.factor": "1",
        "offsets.topic.num.partitions": "4",
        "transaction.state.log.replication.factor": "1",
        "transaction.state.log.min.isr": "1",
        "transaction.state.log.num.partitions": "4",
        # Local brokers, no one to wait for: start consumer groups at once.
        "group.initial.rebalance.delay.ms": "0",
        # Workers use short session timeouts (fast failover: ARBITER_SESSION_TIMEOUT, 2 s);
        # Kafka's default minimum is 6 s.
        "group.min.session.timeout.ms": "1000",
        # The same for workers on KIP-848's consumer protocol, whose session is the broker's.
        "group.consumer.min.session.timeout.ms": "1000",
        "group.consumer.session.timeout.ms": "1200",
        "group.consumer.min.heartbeat.interval.ms": "300",
        "group.consumer.heartbeat.interval.ms": "300",
        # Topics are created by `arbiter topics create`, never by a typo.
        "auto.create.topics.enable": "false",
        "message.max.bytes": str(2 * s.max_message_bytes),
        # The log is the audit record: keep it.
        "log.retention.ms": "-1",
    }


def cluster_properties(replicas: int) -> dict[str, str]:
    """What a node of a cluster overrides and adds, its topics replicated ``replicas`` times."""
    in_sync = "2" if replicas >= 3 else "1"
    return {
        # Every write acknowledged (acks=all) is on at least two nodes: one may die.
        "offsets.topic.replication.factor": str(replicas),
        "transaction.state.log.replication.factor": str(replicas),
        "transaction.state.log.min.isr": in_sync,
        "default.replication.factor": str(replicas),
        "min.insync.replicas": in_sync,
        # A dead node is fenced (and its partitions led elsewhere, its replicas dropped from
        # the in-sync sets acks=all waits for) after 2 s, not 9; when it was the active
        # controller, the others elect a new one within 1.5 s, not 3 (the new one then gives
        # every broker a fresh session).
        "broker.session.timeout.ms": str(BROKER_SESSION_TIMEOUT_MS),
        "broker.heartbeat.interval.ms": str(BROKER_SESSION_TIMEOUT_MS // 4),
        "controller.quorum.fetch.timeout.ms": "1000",
        "controller.quorum.election.timeout.ms": "500",
        "controller.quorum.election.backoff.max.ms": "500",
    }


def secure_properties(settings: Settings, admin_password: str) -> dict[str, str]:
    """What the secure mode overrides and adds: SASL listeners, the admin's logins, the authorizer."""
    s = settings
    scram = f'org.apache.kafka.common.security.scram.ScramLoginModule required username="{ADMIN}" ' \
            f'password="{admin_password}";'
    plain = f'org.apache.kafka.common.security.plain.PlainLoginModule required username="{ADMIN}" ' \
            f'password="{admin_password}" user_{ADMIN}="{admin_password}";'
    return {
        "listeners": f"CLIENT://127.0.0.1:{s.kafka_port},CONTROLLER://127.0.0.1:{s.kafka_controller_port}",
        "advertised.listeners": f"CLIENT://127.0.0.1:{s.kafka_port}",
        "listener.security.protocol.map": f"CLIENT:{SECURE_PROTOCOL},CONTROLLER:{SECURE_PROTOCOL}",
        "inter.broker.listener.name": "CLIENT",
        # Clients (and the broker to itself): SCRAM-SHA-512, users kept in the metadata log.
        "sasl.enabled.mechanisms": SCRAM_MECHANISM,
        "sasl.mechanism.inter.broker.protocol": SCRAM_MECHANISM,
        "listener.name.client.sasl.enabled.mechanisms": SCRAM_MECHANISM,
        "listener.name.client.scram-sha-512.sasl.jaas.config": scram,
        # The controller listener (the broker only): PLAIN as the admin.
        "sasl.mechanism.controller.protocol": "PLAIN",
        "listener.name.controller.sasl.enabled.mechanisms": "PLAIN",
        "listener.name.controller.plain.sasl.jaas.config": plain,
        "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
        "super.users": f"User:{ADMIN}",
        "allow.everyone.if.no.acl.found": "false",
    }


def log4j_properties(node: Node) -> dict[str, str]:
    """``node``'s logging for Kafka 3.x: ``server.log``, rolled at 20 MB, three kept."""
    return {
        "log4j.rootLogger": "INFO, file",
        "log4j.appender.file": "org.apache.log4j.RollingFileAppender",
        "log4j.appender.file.File": str(node.logs / "server.log"),
        "log4j.appender.file.MaxFileSize": "20MB",
        "log4j.appender.file.MaxBackupIndex": "3",
        "log4j.appender.file.layout": "org.apache.log4j.PatternLayout",
        "log4j.appender.file.layout.ConversionPattern": "[%d] %p %m (%c)%n",
        "log4j.logger.kafka": "INFO",
        "log4j.logger.org.apache.kafka": "INFO",
        "log4j.logger.state.change.logger": "WARN",
    }


def log4j2_properties(node: Node) -> dict[str, str]:
    """``node``'s logging for Kafka 4: the same file, size and levels in log4j 2's terms."""
    return {
        "status": "warn",
        "appender.file.type": "RollingFile",
        "appender.file.name": "file",
        "appender.file.fileName": str(node.logs / "server.log"),
        "appender.file.filePattern": str(node.logs / "server.log.%i"),
        "appender.file.layout.type": "PatternLayout",
        "appender.file.layout.pattern": "[%d] %p %m (%c)%n",
        "appender.file.policies.type": "Policies",
        "appender.file.policies.size.type": "SizeBasedTriggeringPolicy",
        "appender.file.policies.size.size": "20MB",
        "appender.file.strategy.type": "DefaultRolloverStrategy",
        "appender.file.strategy.max": "3",
        "rootLogger.level": "INFO",
        "rootLogger.appenderRef.file.ref": "file",
        "logger.state.name": "state.change.logger",
        "logger.state.level": "WARN",
    }
