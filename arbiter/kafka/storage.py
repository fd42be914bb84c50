"""Each node's storage: formatted once (all nodes with one cluster id; the secure mode's SCRAM users
with it), and the release that wrote it, which a newer release upgrades in place and an older one
must not start on."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Callable, Mapping

from .errors import LocalKafkaError
from .jars import release
from .nodes import Node
from .secure import SCRAM_MECHANISM

UNRECORDED_RELEASE = "3.9.1"
"""The release that wrote a node's storage when no ``version_file`` says: the last one before it was recorded."""


def cluster_id(nodes: list[Node]) -> str:
    """The id to format a node's storage with: the one its fellow nodes have, or a new one."""
    for node in nodes:
        try:
            lines = (node.data / "meta.properties").read_text().splitlines()
        except FileNotFoundError:
            continue
        for line in lines:
            key, _, value = line.partition("=")
            if key.strip() == "cluster.id" and value.strip():
                return value.strip()
    return uuid.uuid4().hex[:22]


def scram_arguments(passwords: Mapping[str, str] | None) -> list[str]:
    """The storage tool's arguments that create a SCRAM user per principal (KIP-900); none for plain."""
    scram: list[str] = []
    for name, password in (passwords or {}).items():
        scram += ["--add-scram", f"{SCRAM_MECHANISM}=[name={name},password={password}]"]
    return scram


def start_format(java: str, classpath: str, node: Node, cluster: str, scram: list[str]) -> subprocess.Popen[str]:
    """Start formatting ``node``'s storage as a node of ``cluster``; its output is piped, for the error."""
    return subprocess.Popen(
        [
            java,
            f"-Dlog4j.configuration=file:{node.log4j}",
            f"-Dlog4j2.configurationFile={node.log4j2}",
            "-cp",
            classpath,
            "kafka.tools.StorageTool",
            "format",
            "-t",
            cluster,
            "-c",
            str(node.config),
            *scram,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def check_release(nodes: list[Node], version: str, say: Callable[[str], None]) -> None:
    """Refuse to start a release older than the one a node's storage was formatted (or last run) by;
    record a newer one (Kafka upgrades the storage in place as it starts)."""
    for node in nodes:
        if not (node.data / "meta.properties").exists():
            continue
        stamp = node.version_file
        recorded = stamp.read_text().strip() if stamp.exists() else UNRECORDED_RELEASE
        if release(recorded) > release(version):
            raise LocalKafkaError(
                f"the Kafka data in {node.data} was written by Kafka {recorded}, and {version} is older: "
                f"set ARBITER_KAFKA_VERSION={recorded}, or delete the data with `arbiter kafka reset`")
        if recorded != version:
            say(f"upgrading the Kafka data in {node.data} from {recorded} to {version} (in place)")
            stamp.write_text(f"{version}\n")
