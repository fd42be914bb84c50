"""One node of the local Kafka: its ports and where its files live; how many nodes a local Kafka runs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

MAX_NODES = 9


@dataclass(frozen=True)
class Node:
    """One KRaft node (broker and controller) of the local Kafka: its ports and its files."""

    id: int
    port: int
    controller_port: int
    root: Path
    """Its config, pid file, data and logs: ``<home>/kafka`` alone, ``<home>/kafka/nodes/<id>`` in a cluster."""

    @property
    def address(self) -> str:
        """Where its clients connect: ``127.0.0.1:<port>``."""
        return f"127.0.0.1:{self.port}"

    @property
    def data(self) -> Path:
        """Its storage (``log.dirs``): every message it holds."""
        return self.root / "data"

    @property
    def logs(self) -> Path:
        """Its logs: ``server.log`` (log4j) and ``kafka.out`` (the JVM's output)."""
        return self.root / "logs"

    @property
    def config(self) -> Path:
        """Its KRaft ``server.properties``."""
        return self.root / "server.properties"

    @property
    def log4j(self) -> Path:
        """Its logging configuration for Kafka 3.x (log4j, through reload4j)."""
        return self.root / "log4j.properties"

    @property
    def log4j2(self) -> Path:
        """Its logging configuration for Kafka 4 (log4j 2)."""
        return self.root / "log4j2.properties"

    @property
    def pid_file(self) -> Path:
        """The pid of the broker process started for it."""
        return self.root / "kafka.pid"

    @property
    def version_file(self) -> Path:
        """The Kafka release that formatted (or last ran) this node's storage."""
        return self.data / "arbiter-kafka-version"
