"""The local Apache Kafka broker: fetched from Maven Central, run with the machine's Java.

Theory of operation
-------------------
``arbiter/kafka/pom.xml`` names the broker (``org.apache.kafka:kafka_2.13``) at the release
``settings.kafka_version`` gives (4.4.0 by default; 3.9.x for older clusters). ``fetch``
copies its jars into ``<home>/kafka/libs/<version>`` with Maven, once (a stamp of the pom's
hash and the version says when to fetch again). Kafka 4 logs through log4j 2, 3.x through
reload4j: both configurations are written, and the pom takes the matching slf4j binding.
The release a node's storage was formatted by is written next to it
(``data/arbiter-kafka-version``; none means 3.9.1, the release before this was recorded):
a newer release starts on it (Kafka upgrades a KRaft log from 3.3 on in place), an older one
is refused with the two ways out. ``up`` writes a KRaft ``server.properties`` (one
node, combined broker and controller, 127.0.0.1 only), formats the storage on first
use, starts ``kafka.Kafka`` as a detached process whose pid is kept in a file, and
waits until the broker answers a metadata request. ``down`` sends SIGTERM (a clean
shutdown flushes the logs) and waits. ``reset`` stops the broker and deletes its data,
keeping the jars.

All state lives under ``<home>/kafka`` (``.arbiter/`` by default, git-ignored), so a
restart keeps every message.

Several nodes (``up(nodes=3)``, ``arbiter kafka up --nodes 3``)
-----------------------------------------------------------------
A cluster on loopback: N KRaft nodes, each a combined broker and controller, all
formatted with one cluster id, ``controller.quorum.voters`` naming them all. Node ``i``
(1..N) listens for clients on ``kafka_port + 2*(i-1)`` and for the controllers on
``kafka_controller_port + 2*(i-1)`` (9092/9093, 9094/9095, 9096/9097 by default), and
keeps its config, pid, data and logs in ``<home>/kafka/nodes/<i>/``. The one-node
layout stays where it always was (``<home>/kafka/data`` ...). The count is written to
``<home>/kafka/arbiter-nodes`` when the storage is formatted, so ``down``, ``status``,
``reset`` and a later plain ``up`` act on every node; asking for another count on
existing data is an error that names ``arbiter kafka reset``. With three nodes or more,
internal topics get replication factor 3, ``min.insync.replicas`` is 2 (so is
``transaction.state.log.min.isr``), and a dead node is fenced after 2 s without
heartbeats (``broker.session.timeout.ms``; Kafka's default is 9 s) and a dead active
controller replaced within 1.5 s (quorum fetch and election timeouts), so its partitions'
leadership moves within seconds. ``up`` also restarts the nodes of a cluster that are
down (their data kept) and waits until every node answers and sees all N brokers.
``local_cluster_settings`` gives the settings that reach such a cluster (its bootstrap
list, replication factor 3): the ``arbiter`` commands use them when no bootstrap is given.
The secure mode runs one node only.

Secure mode (``up(secure=True)``, ``arbiter kafka up --secure``)
------------------------------------------------------------------
Kafka's own access control is the outer wall of the trust boundary (see
docs/security.md). The client listener then takes SASL/SCRAM-SHA-512 only (SASL_PLAINTEXT, on
127.0.0.1 alone), the broker runs ``StandardAuthorizer`` with no access for anyone an ACL
does not name, and three SCRAM users are created when the storage is formatted
(``--add-scram``, KIP-900): ``arbiter-admin`` (the only super user; the broker itself
logs in as it), ``arbiter-worker`` and ``arbiter-agent``. Their random passwords are
written to ``<home>/secure/credentials.json`` (0600, in a 0700 folder) and nowhere else
but the broker's own config (also 0600). Once the broker answers, the admin creates the
ACLs of ``secure_acls`` (idempotent, so every ``up`` brings them in line with the topic
names of the settings). The controller listener, which the broker alone uses, takes
SASL/PLAIN as the admin (SCRAM credentials live in the metadata log the controller
serves, so KRaft cannot use SCRAM there).

The mode is written next to the data (``data/arbiter-mode``), so ``down`` and ``up``
keep it; asking for the other mode on existing data is an error that names
``arbiter kafka reset``. ``reset`` wipes the data and the mode but keeps the credentials
file, whose passwords a later ``--secure`` format reuses.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from arbiter.edge.kafkaauth import PRINCIPALS, credentials_path
from arbiter.edge.kafkaconn import ephemeral_ports, in_ephemeral_range
from arbiter.edge.settings import Settings

POM = Path(__file__).resolve().parent / "pom.xml"
MIN_JAVA = 17


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def _log_binding(version: str) -> list[str]:
    """Maven properties for the broker's slf4j binding: log4j 2 from Kafka 4 on, reload4j before."""
    if _release(version) >= (4,):
        # The slf4j 1.7 binding: Kafka 4 still logs through slf4j-api 1.7.36, as its distribution ships.
        group, artifact, at = "org.apache.logging.log4j", "log4j-slf4j-impl", "2.25.5"
    else:
        group, artifact, at = "org.slf4j", "slf4j-reload4j", "1.7.36"
    return [f"-Dlog.groupId={group}", f"-Dlog.artifactId={artifact}", f"-Dlog.version={at}"]


class LocalKafkaError(RuntimeError):
    """The local broker could not be fetched, started or stopped. ``log_tail`` says why."""

    def __init__(self, message: str, log_tail: str = "") -> None:
        super().__init__(message)
        self.log_tail = log_tail


def _java() -> str:
    java_home = os.environ.get("JAVA_HOME")
    java = str(Path(java_home) / "bin" / "java") if java_home else shutil.which("java")
    if not java or not Path(java).exists():
        raise LocalKafkaError(f"Java {MIN_JAVA}+ is needed to run the local Kafka broker; none found (set JAVA_HOME)")
    out = subprocess.run([java, "-version"], capture_output=True, text=True, check=False).stderr
    match = re.search(r'version "(\d+)', out)
    if not match or int(match.group(1)) < MIN_JAVA:
        raise LocalKafkaError(f"Java {MIN_JAVA}+ is needed to run the local Kafka broker; {java} says: {out.strip()}")
    return java


def broker_answers(bootstrap: str, timeout: float = 3.0, options: Mapping[str, Any] | None = None) -> bool:
    """True when a Kafka broker at ``bootstrap`` answers a metadata request.

    ``options`` are aiokafka client options (``arbiter.edge.kafkaauth.kafka_client_options``):
    a SASL listener answers only a client that logs in.
    """
    return broker_count(bootstrap, timeout, options) > 0


def broker_count(bootstrap: str, timeout: float = 3.0, options: Mapping[str, Any] | None = None) -> int:
    """How many brokers the metadata of the first broker at ``bootstrap`` that answers names (0: none answers)."""
    from aiokafka import AIOKafkaClient
    from aiokafka.errors import KafkaError

    # A probe that fails is an answer, not an error worth aiokafka's log lines, nor the connection
    # guard's "unreachable, reconnecting" (the caller says no Kafka answers, once, and does not retry).
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    guard = logging.getLogger("arbiter.kafka")
    level = guard.level

    async def probe() -> int:
        client = AIOKafkaClient(bootstrap_servers=bootstrap, request_timeout_ms=int(timeout * 1000),
                                **dict(options or {}))
        try:
            await asyncio.wait_for(client.bootstrap(), timeout)
            return len(client.cluster.brokers())
        except (TimeoutError, KafkaError, OSError):
            return 0
        finally:
            await client.close()

    guard.setLevel(max(level, logging.ERROR))
    try:
        return asyncio.run(probe())
    finally:
        guard.setLevel(level)


Mode = Literal["plain", "secure"]

ADMIN, WORKER, AGENT = PRINCIPALS
SCRAM_MECHANISM = "SCRAM-SHA-512"
SECURE_PROTOCOL = "SASL_PLAINTEXT"

# Kafka's wire codes for ACLs (org.apache.kafka.common.acl / resource).
_RESOURCE_TYPES = {"topic": 2, "group": 3, "cluster": 4, "transactional_id": 5}
_PATTERN_TYPES = {"literal": 3, "prefixed": 4}
_OPERATIONS = {"read": 3, "write": 4, "create": 5, "describe": 8, "describe_configs": 10}
_ALLOW = 3


Operation = Literal["read", "write", "create", "describe", "describe_configs"]


@dataclass(frozen=True)
class Acl:
    """One ALLOW entry: ``principal`` may do ``operation`` on the resource, from any host."""

    principal: str
    resource_type: Literal["topic", "group", "transactional_id"]
    pattern: Literal["literal", "prefixed"]
    name: str
    operation: Operation

    def __str__(self) -> str:
        return (f"User:{self.principal} {self.operation.upper()} {self.resource_type} "
                f"{self.name}{'*' if self.pattern == 'prefixed' else ''}")


def secure_acls(settings: Settings) -> list[Acl]:
    """What each principal may do on the secure broker; everything else is denied.

    - ``arbiter-agent`` writes only the topics agents send on (lock and saga commands,
      and wait-for edges, which the SDK's ``delegate``/``waiting_on`` send) and reads only
      its inbox and the identity registry (to verify decisions). Not the event topics.
    - ``arbiter-worker`` reads, writes, creates and describes every ``arbiter.`` topic and
      every faust changelog (``<app_id>-``), joins the ``<app_id>`` consumer group and owns
      the ``<app_id>`` transactional ids (exactly-once).
    - ``arbiter-admin`` is a super user and needs no ACL.
    """
    t = settings.topics
    acls: list[Acl] = []
    for topic in (t.resource_commands, t.saga_commands, t.wait_edges):
        acls += [Acl(AGENT, "topic", "literal", topic, op) for op in ("write", "describe")]
    for topic in (t.agent_inbox, t.registry):
        acls += [Acl(AGENT, "topic", "literal", topic, op) for op in ("read", "describe")]
    prefixes = sorted({"arbiter.", f"{settings.app_id}-"})
    literal = [name for name in t.all() if not any(name.startswith(p) for p in prefixes)]
    worker_ops: tuple[Operation, ...] = ("read", "write", "describe", "create", "describe_configs")
    for prefix in prefixes:
        acls += [Acl(WORKER, "topic", "prefixed", prefix, op) for op in worker_ops]
    for topic in literal:
        acls += [Acl(WORKER, "topic", "literal", topic, op) for op in worker_ops]
    acls += [Acl(WORKER, "group", "prefixed", settings.app_id, op) for op in ("read", "describe")]
    acls += [Acl(WORKER, "transactional_id", "prefixed", settings.app_id, op) for op in ("write", "describe")]
    return acls


async def create_acls(bootstrap: str, options: Mapping[str, Any], acls: list[Acl]) -> None:
    """Create ``acls`` as the principal of ``options`` (a super user). Existing ones are kept."""
    from aiokafka import AIOKafkaClient
    from aiokafka.errors import KafkaError
    from aiokafka.protocol.admin import CreateAclsRequest

    client = AIOKafkaClient(bootstrap_servers=bootstrap, request_timeout_ms=15000, **dict(options))
    try:
        await client.bootstrap()
        node = client.get_random_node()
        for acl in acls:
            request = CreateAclsRequest(
                resource_type=_RESOURCE_TYPES[acl.resource_type],
                resource_name=acl.name,
                resource_pattern_type_filter=_PATTERN_TYPES[acl.pattern],
                principal=f"User:{acl.principal}",
                host="*",
                operation=_OPERATIONS[acl.operation],
                permission_type=_ALLOW,
            )
            response = await client.send(node, request)
            for code, message in response.creation_responses:
                if code != 0:
                    raise LocalKafkaError(f"the broker refused the ACL {acl}: error {code} {message or ''}")
    except KafkaError as exc:
        raise LocalKafkaError(f"creating the ACLs at {bootstrap} as {options.get('sasl_plain_username')} "
                              f"failed: {exc}") from exc
    finally:
        await client.close()


def _write_private(path: Path, text: str) -> None:
    """Write a file only its owner may read (it holds passwords)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        os.fchmod(out.fileno(), 0o600)
        out.write(text)


def _port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


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
        return f"127.0.0.1:{self.port}"

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def config(self) -> Path:
        return self.root / "server.properties"

    @property
    def log4j(self) -> Path:
        return self.root / "log4j.properties"

    @property
    def log4j2(self) -> Path:
        return self.root / "log4j2.properties"

    @property
    def pid_file(self) -> Path:
        return self.root / "kafka.pid"

    @property
    def version_file(self) -> Path:
        """The Kafka release that formatted (or last ran) this node's storage."""
        return self.data / "arbiter-kafka-version"


MAX_NODES = 9

UNRECORDED_RELEASE = "3.9.1"
"""The release that wrote a node's storage when no ``version_file`` says: the last one before it was recorded."""

BROKER_SESSION_TIMEOUT_MS = 2000
"""A cluster's active controller fences a node this long after its last heartbeat (Kafka: 9 s): its
partitions get new leaders and its replicas leave the in-sync sets. The largest part of a client's
wait after a node dies."""


class LocalKafka:
    """The local KRaft broker under ``settings.home``: one node, or a cluster of ``nodes`` on loopback.

    ``nodes``: how many to run; None for as many as the data was formatted with (1 when none yet).
    """

    def __init__(self, settings: Settings, say: Callable[[str], None] = lambda _msg: None,
                 nodes: int | None = None) -> None:
        self.settings = settings
        self.say = say
        self.root = (settings.home / "kafka").resolve()
        self.version = settings.kafka_version
        self.libs = self.root / "libs" / self.version
        self.nodes_file = self.root / "arbiter-nodes"
        self._log_marks: dict[int, dict[str, int]] = {}
        """Per node started by this ``up``, its logs' sizes before: where this start's lines begin."""
        if nodes is not None and not 1 <= nodes <= MAX_NODES:
            raise LocalKafkaError(f"a local Kafka runs 1 to {MAX_NODES} nodes, not {nodes}")
        self.nodes = nodes or self.recorded_nodes() or 1
        """How many nodes this broker is (the count asked for, or the one its data was formatted with)."""
        self.node_list = [self._node(i) for i in range(1, self.nodes + 1)]
        first = self.node_list[0]
        self.data = first.data
        self.logs = first.logs
        self.config = first.config
        self.pid_file = first.pid_file
        self.mode_file = self.data / "arbiter-mode"
        self.credentials_file = credentials_path(settings.home.resolve())
        self.bootstrap = ",".join(node.address for node in self.node_list)

    def _node(self, node_id: int) -> Node:
        s, step = self.settings, 2 * (node_id - 1)
        root = self.root if self.nodes == 1 else self.root / "nodes" / str(node_id)
        return Node(node_id, s.kafka_port + step, s.kafka_controller_port + step, root)

    def recorded_nodes(self) -> int | None:
        """How many nodes the data was formatted with; None before the first ``up``."""
        try:
            text = self.nodes_file.read_text().strip()
        except FileNotFoundError:
            # Data from before clusters existed is one node's.
            return 1 if (self.root / "data" / "meta.properties").exists() else None
        return int(text) if text.isdigit() and 1 <= int(text) <= MAX_NODES else None

    @property
    def replication_factor(self) -> int:
        """The replication factor this broker's topics should have: 3, or fewer when it has fewer nodes."""
        return min(self.nodes, 3)

    # -- fetch -----------------------------------------------------------------------

    def _jar_stamp(self) -> str:
        return hashlib.sha256(POM.read_bytes() + self.version.encode()).hexdigest()

    @property
    def jar_stamp_file(self) -> Path:
        """Where ``fetch`` records which pom and release the jars in ``libs`` are of."""
        return self.libs / ".pom-sha256"

    def jars_current(self) -> bool:
        """The jars of this pom and release are in ``libs`` (nothing to fetch)."""
        stamp = self.jar_stamp_file
        return stamp.exists() and stamp.read_text().strip() == self._jar_stamp()

    def fetch(self) -> None:
        """Copy the broker's jars from Maven Central, unless the pinned ones are here."""
        if not POM.exists():
            raise LocalKafkaError(f"{POM} is missing; run Arbiter from its source tree (pip install -e .)")
        if self.jars_current():
            return
        stamp, want = self.jar_stamp_file, self._jar_stamp()
        mvn = shutil.which("mvn")
        if not mvn:
            raise LocalKafkaError("Maven (mvn) is needed once, to fetch the Kafka broker's jars; install it")
        self.say(f"fetching the jars of Kafka {self.version} from Maven Central (once)...")
        if self.libs.exists():
            shutil.rmtree(self.libs)
        self.libs.mkdir(parents=True)
        proc = subprocess.run(
            [mvn, "-B", "-q", "-f", str(POM), "dependency:copy-dependencies", f"-Darbiter.libs={self.libs}",
             f"-Dkafka.version={self.version}", *_log_binding(self.version)],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            raise LocalKafkaError(f"Maven could not fetch the jars of Kafka {self.version} (ARBITER_KAFKA_VERSION)",
                                  (proc.stdout + proc.stderr)[-4000:])
        if not list(self.libs.glob("kafka_*.jar")):
            raise LocalKafkaError(f"Maven ran, but no broker jar arrived in {self.libs}",
                                  (proc.stdout + proc.stderr)[-4000:])
        stamp.write_text(want + "\n")

    # -- mode and credentials ------------------------------------------------------------

    def mode(self) -> Mode | None:
        """The mode the data was formatted in; None before the first ``up``."""
        try:
            text = self.mode_file.read_text().strip()
        except FileNotFoundError:
            # Data from before modes existed was always plain.
            return "plain" if (self.data / "meta.properties").exists() else None
        if text not in ("plain", "secure"):
            raise LocalKafkaError(f"{self.mode_file} says {text!r}, not plain or secure; "
                                  "run 'arbiter kafka reset' to start over")
        return "secure" if text == "secure" else "plain"

    def _resolve_mode(self, secure: bool | None) -> Mode:
        have = self.mode()
        if secure is None:
            return have or "plain"
        want: Mode = "secure" if secure else "plain"
        if have is not None and have != want:
            again = "arbiter kafka up --secure" if secure else "arbiter kafka up"
            raise LocalKafkaError(
                f"the Kafka data in {self.data} belongs to a {have} broker, so it cannot start {want}. "
                f"Start it as it was ('arbiter kafka up'), or delete all its data with "
                f"'arbiter kafka reset' and then run '{again}'"
            )
        return want

    def credentials(self) -> dict[str, str]:
        """Each principal's password, from the credentials file."""
        data = json.loads(self.credentials_file.read_text())
        return {name: entry["password"] for name, entry in data["principals"].items()}

    def _ensure_credentials(self) -> dict[str, str]:
        """The principals' passwords: the file's if it has them all, else new random ones
        (only before the storage is formatted: the broker's users are fixed then)."""
        folder = self.credentials_file.parent
        folder.mkdir(parents=True, exist_ok=True)
        folder.chmod(0o700)
        try:
            passwords = self.credentials()
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            passwords = {}
        if set(passwords) != set(PRINCIPALS) or not all(passwords.values()):
            if (self.data / "meta.properties").exists():
                raise LocalKafkaError(
                    f"the secure broker's logins in {self.credentials_file} are missing or incomplete, and its "
                    "users were fixed when its data was formatted; restore the file, or delete all the data "
                    "with 'arbiter kafka reset' and run 'arbiter kafka up --secure' again"
                )
            passwords = {name: secrets.token_urlsafe(24) for name in PRINCIPALS}
        document = {
            "about": "SASL/SCRAM logins of the local secure Kafka broker ('arbiter kafka up --secure'); "
                     "keep private. Use as ARBITER_KAFKA_SECURITY_PROTOCOL, ARBITER_KAFKA_SASL_MECHANISM, "
                     "ARBITER_KAFKA_USERNAME, ARBITER_KAFKA_PASSWORD.",
            "bootstrap": self.bootstrap,
            "principals": {
                name: {"username": name, "password": passwords[name], "mechanism": SCRAM_MECHANISM,
                       "security_protocol": SECURE_PROTOCOL, "bootstrap": self.bootstrap}
                for name in PRINCIPALS
            },
        }
        _write_private(self.credentials_file, json.dumps(document, indent=2) + "\n")
        return passwords

    def client_options(self, principal: str = ADMIN) -> dict[str, Any]:
        """aiokafka options to reach this broker as ``principal`` (none for a plain broker)."""
        if self.mode() != "secure":
            return {}
        return {"security_protocol": SECURE_PROTOCOL, "sasl_mechanism": SCRAM_MECHANISM,
                "sasl_plain_username": principal, "sasl_plain_password": self.credentials()[principal]}

    def answers(self, timeout: float = 3.0) -> bool:
        """True when this broker answers (logging in as the admin when it is secure)."""
        try:
            options = self.client_options()
        except (OSError, ValueError, KeyError):
            return False
        return self._cluster_answers(timeout, options)

    # -- process ---------------------------------------------------------------------

    def pid(self) -> int | None:
        """The broker's pid (the first node's, in a cluster), if the process we started is still alive."""
        return self.pid_of(self.node_list[0])

    def pids(self) -> dict[int, int | None]:
        """Each node's pid (None: not running), by node id."""
        return {node.id: self.pid_of(node) for node in self.node_list}

    @staticmethod
    def pid_of(node: Node) -> int | None:
        """The pid of ``node``'s broker, if the process we started is still alive."""
        try:
            pid = int(node.pid_file.read_text().strip())
        except (FileNotFoundError, ValueError):
            return None
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (FileNotFoundError, PermissionError, ProcessLookupError):
            return None
        return pid if b"kafka.Kafka" in cmdline and str(node.config).encode() in cmdline else None

    def log_tail(self, lines: int = 40, node: Node | None = None) -> str:
        """The last lines of the broker's logs (of every node, or of ``node``), for error messages."""
        parts = []
        for each in [node] if node is not None else self.node_list:
            for name in ("server.log", "kafka.out"):
                path = each.logs / name
                if path.exists():
                    text = path.read_text(errors="replace").splitlines()[-lines:]
                    parts.append(f"--- {path} ---\n" + "\n".join(text))
        return "\n".join(parts)

    def _write_config(self, node: Node, passwords: Mapping[str, str] | None = None) -> None:
        """Write ``node``'s server.properties; with ``passwords``, the secure (SASL + ACL) variant."""
        s = self.settings
        props = {
            "process.roles": "broker,controller",
            "node.id": str(node.id),
            "controller.quorum.voters": ",".join(f"{n.id}@127.0.0.1:{n.controller_port}" for n in self.node_list),
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
        if self.nodes > 1:
            replicas = self.replication_factor
            in_sync = "2" if replicas >= 3 else "1"
            props.update({
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
            })
        if passwords is None:
            node.config.write_text("".join(f"{k}={v}\n" for k, v in props.items()))
        else:
            props.update(self._secure_props(passwords[ADMIN]))
            _write_private(node.config, "".join(f"{k}={v}\n" for k, v in props.items()))
        log4j = {
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
        node.log4j.write_text("".join(f"{k}={v}\n" for k, v in log4j.items()))
        log4j2 = {  # Kafka 4: the same file, size and levels in log4j 2's terms
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
        node.log4j2.write_text("".join(f"{k}={v}\n" for k, v in log4j2.items()))

    def _secure_props(self, admin_password: str) -> dict[str, str]:
        s = self.settings
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

    def _classpath(self) -> str:
        return str(self.libs / "*")

    def _cluster_id(self) -> str:
        """The id to format a node's storage with: the one its fellow nodes have, or a new one."""
        for node in self.node_list:
            try:
                lines = (node.data / "meta.properties").read_text().splitlines()
            except FileNotFoundError:
                continue
            for line in lines:
                key, _, value = line.partition("=")
                if key.strip() == "cluster.id" and value.strip():
                    return value.strip()
        return uuid.uuid4().hex[:22]

    def _format_if_new(self, java: str, mode: Mode = "plain", passwords: Mapping[str, str] | None = None,
                       nodes: list[Node] | None = None) -> None:
        """Format the storage of each node (of ``nodes``) that has none yet, all with one cluster id."""
        todo = [node for node in (nodes or self.node_list) if not (node.data / "meta.properties").exists()]
        if not todo:
            return
        cluster_id = self._cluster_id()
        scram: list[str] = []
        for name, password in (passwords or {}).items():
            scram += ["--add-scram", f"{SCRAM_MECHANISM}=[name={name},password={password}]"]
        formats = []
        for node in todo:  # at once: each is a JVM start
            self.say(f"formatting Kafka storage in {node.data}" + (" (secure)" if mode == "secure" else ""))
            node.data.mkdir(parents=True, exist_ok=True)
            formats.append(subprocess.Popen(
                [
                    java,
                    f"-Dlog4j.configuration=file:{node.log4j}",
                    f"-Dlog4j2.configurationFile={node.log4j2}",
                    "-cp",
                    self._classpath(),
                    "kafka.tools.StorageTool",
                    "format",
                    "-t",
                    cluster_id,
                    "-c",
                    str(node.config),
                    *scram,
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            ))
        for node, proc in zip(todo, formats, strict=True):
            out, _ = proc.communicate()
            if proc.returncode != 0:
                raise LocalKafkaError(f"formatting the Kafka storage{self._label(node)} failed", out)
        for node in todo:
            node.version_file.write_text(f"{self.version}\n")
        self.mode_file.write_text(f"{mode}\n")
        self.nodes_file.write_text(f"{self.nodes}\n")

    def up(self, timeout: float = 90.0, secure: bool | None = None) -> str:
        """Start the broker, or every node of the cluster that is not running (harmless when all run).
        Returns what happened.

        ``secure``: True for SASL/SCRAM and ACLs, False for the plain broker, None for
        whatever the data was formatted as (plain when there is none yet).
        """
        recorded = self.recorded_nodes()
        if recorded is not None and recorded != self.nodes:
            raise LocalKafkaError(
                f"the Kafka data in {self.root} belongs to {_count(recorded)}, so it cannot start as "
                f"{_count(self.nodes)}. Start it as it was ('arbiter kafka up'), or delete all its data with "
                f"'arbiter kafka reset' and then run 'arbiter kafka up --nodes {self.nodes}'"
            )
        mode = self._resolve_mode(secure)
        if mode == "secure":
            if self.nodes > 1:
                raise LocalKafkaError(f"the secure mode runs one node only, not {self.nodes}: "
                                      "run 'arbiter kafka up --secure' without --nodes")
            return self._secure_up(timeout)
        return self._up(timeout)

    def _secure_up(self, timeout: float) -> str:
        passwords = self._ensure_credentials()
        what = self._up(timeout, passwords)
        asyncio.run(create_acls(self.bootstrap, self.client_options(), secure_acls(self.settings)))
        return f"{what}; secure: SASL/SCRAM-SHA-512 and ACLs, logins in {self.credentials_file}"

    def _up(self, timeout: float, passwords: Mapping[str, str] | None = None) -> str:
        """Start the nodes that are not running: plain, or secure with these passwords (written to the
        credentials file)."""
        secure = passwords is not None
        options = self.client_options() if secure and self.mode() == "secure" else {}
        ports = [port for node in self.node_list for port in (node.port, node.controller_port)]
        if len(set(ports)) < len(ports) or max(ports) > 65535:
            raise LocalKafkaError(
                f"{self.nodes} nodes need {len(ports)} distinct ports: node i listens on ARBITER_KAFKA_PORT + 2(i-1) "
                f"and ARBITER_KAFKA_CONTROLLER_PORT + 2(i-1), which give {', '.join(map(str, ports))}; "
                "set the controller port to the client port + 1")
        down = [node for node in self.node_list if self.pid_of(node) is None]
        if not down:
            if self._cluster_answers(options=options):
                return f"already running ({self._pids_text()}) on {self.bootstrap}"
            return self._wait_ready({}, timeout, options=options)
        for node in down:
            for port in (node.port, node.controller_port):
                if _port_open(port):
                    hint = "; use --bootstrap to use it" if port == node.port else ""
                    raise LocalKafkaError(f"127.0.0.1:{port} is already in use by another process{hint}")
        self._check_version(down)
        java = _java()
        self.fetch()
        for node in down:
            for folder in (node.data, node.logs):
                folder.mkdir(parents=True, exist_ok=True)
            self._write_config(node, passwords)
        self._format_if_new(java, "secure" if secure else "plain", passwords, down)
        options = self.client_options() if secure else {}
        for node in down:
            if in_ephemeral_range(node.port):
                low, high = ephemeral_ports()
                self.say(f"note: port {node.port} lies in this host's ephemeral range ({low}-{high}), where the "
                         "kernel picks outgoing connections' source ports: another program's connection may hold "
                         "it (Arbiter's clients never connect to themselves); a port below "
                         f"{low} avoids that")
        self._log_marks = {node.id: self._log_sizes(node) for node in down}
        started = {node.id: self._start(java, node) for node in down}
        return self._wait_ready(started, timeout, options=options)

    def _check_version(self, nodes: list[Node]) -> None:
        """Refuse to start a release older than the one a node's storage was formatted (or last run) by."""
        for node in nodes:
            if not (node.data / "meta.properties").exists():
                continue
            stamp = node.version_file
            recorded = stamp.read_text().strip() if stamp.exists() else UNRECORDED_RELEASE
            if _release(recorded) > _release(self.version):
                raise LocalKafkaError(
                    f"the Kafka data in {node.data} was written by Kafka {recorded}, and {self.version} is older: "
                    f"set ARBITER_KAFKA_VERSION={recorded}, or delete the data with `arbiter kafka reset`")
            if recorded != self.version:
                self.say(f"upgrading the Kafka data in {node.data} from {recorded} to {self.version} (in place)")
                stamp.write_text(f"{self.version}\n")

    @staticmethod
    def _log_sizes(node: Node) -> dict[str, int]:
        return {name: (node.logs / name).stat().st_size if (node.logs / name).exists() else 0
                for name in ("server.log", "kafka.out")}

    def first_error(self, node: Node) -> str:
        """The first ERROR or FATAL line (with the lines that explain it) that ``node`` logged since this
        ``up`` started it: the cause of a failed start, where the log's tail is its shutdown."""
        marks = self._log_marks.get(node.id, {})
        for name in ("server.log", "kafka.out"):
            path = node.logs / name
            if not path.exists():
                continue
            with path.open("rb") as f:
                f.seek(marks.get(name, 0))
                lines = f.read().decode(errors="replace").splitlines()
            for i, line in enumerate(lines):
                if " ERROR " in line or " FATAL " in line or "Exception" in line or "Address already in use" in line:
                    cause = [line]
                    for more in lines[i + 1:i + 8]:
                        if more.startswith("[") and " INFO " in more:
                            break
                        cause.append(more)
                    return "\n".join(cause)
        return ""

    def _exited(self, node: Node, code: int | None) -> LocalKafkaError:
        """The error for a node that exited while starting: its first error of this start, not its log's tail."""
        cause = self.first_error(node)
        how = f"exited with code {code}" if code is not None else "exited"
        first = cause.splitlines()[0] if cause else ""
        bind = next((line for line in cause.splitlines() if "Address already in use" in line
                     or "BindException" in line), "")
        if bind:
            summary = (f"the Kafka broker{self._label(node)} {how}: it could not bind its port "
                       f"({node.port} or {node.controller_port}) because another socket holds it")
        elif first:
            summary = f"the Kafka broker{self._label(node)} {how}: {first.split('] ', 1)[-1][:300]}"
        else:
            summary = f"the Kafka broker{self._label(node)} {how}"
        detail = (cause + "\n" if cause else "") + f"(the whole log: {node.logs / 'server.log'})"
        return LocalKafkaError(summary, detail if cause else self.log_tail(node=node))

    def _start(self, java: str, node: Node) -> subprocess.Popen[bytes]:
        cmd = [
            java,
            f"-Xmx{self.settings.kafka_heap}",
            f"-Xms{self.settings.kafka_heap}",
            "-XX:+UseG1GC",
            "-XX:MaxGCPauseMillis=20",
            "-Djava.awt.headless=true",
            f"-Dlog4j.configuration=file:{node.log4j}",
            f"-Dlog4j2.configurationFile={node.log4j2}",
            f"-Dkafka.logs.dir={node.logs}",
            "-cp",
            self._classpath(),
            "kafka.Kafka",
            str(node.config),
        ]
        with open(node.logs / "kafka.out", "ab") as out:
            proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        node.pid_file.write_text(f"{proc.pid}\n")
        return proc

    def _cluster_answers(self, timeout: float = 3.0, options: Mapping[str, Any] | None = None) -> bool:
        """The broker answers; in a cluster, every node answers and sees every node's broker."""
        if self.nodes == 1:
            return broker_answers(self.bootstrap, timeout, options)
        return all(broker_count(node.address, timeout, options) >= self.nodes for node in self.node_list)

    def _label(self, node: Node) -> str:
        return f" (node {node.id})" if self.nodes > 1 else ""

    def _pids_text(self) -> str:
        pids = self.pids()
        if self.nodes == 1:
            return f"pid {pids[1]}"
        return ", ".join(f"node {i}: pid {pid}" if pid else f"node {i}: not running" for i, pid in pids.items())

    def _wait_ready(self, started: dict[int, subprocess.Popen[bytes]], timeout: float,
                    options: Mapping[str, Any] | None = None) -> str:
        """Wait until the broker (every node) answers; ``started``: the processes started now, by node id."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for node in self.node_list:
                proc = started.get(node.id)
                if proc is not None and proc.poll() is not None:
                    node.pid_file.unlink(missing_ok=True)
                    self._stop([n for n in self.node_list if n.id in started and n.id != node.id], 30.0)
                    raise self._exited(node, proc.returncode)
                if proc is None and self.pid_of(node) is None:
                    raise self._exited(node, None)
            if self._cluster_answers(timeout=2.0, options=options):
                if self.nodes == 1:
                    verb = "started" if started else "running"
                    return f"{verb} ({self._pids_text()}) on {self.bootstrap}, data in {self.data}"
                what = ("running" if not started else "started" if len(started) == self.nodes
                        else f"started {', '.join(f'node {i}' for i in started)} of")
                return (f"{what} {self.nodes} nodes ({self._pids_text()}) on {self.bootstrap}, "
                        f"data in {self.root / 'nodes'}")
            time.sleep(0.3)
        self._stop([n for n in self.node_list if n.id in started] if started else self.node_list, 60.0)
        raise LocalKafkaError(f"the Kafka broker{'s' if self.nodes > 1 else ''} did not answer within {timeout:.0f}s",
                              self.log_tail(lines=40 if self.nodes == 1 else 15))

    def down(self, timeout: float = 60.0) -> str:
        """Stop the broker (every node) cleanly: SIGTERM, then SIGKILL after ``timeout``."""
        return self._stop(self.node_list, timeout)

    def _stop(self, nodes: list[Node], timeout: float) -> str:
        running = [(node, pid) for node in nodes if (pid := self.pid_of(node)) is not None]
        if not running:
            for node in nodes:
                node.pid_file.unlink(missing_ok=True)
            return "not running"
        for _node, pid in running:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(self.pid_of(node) is not None for node, _pid in running):
            time.sleep(0.1)
        killed = [(node, pid) for node, pid in running if self.pid_of(node) is not None]
        for node, pid in killed:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            while self.pid_of(node) is not None:
                time.sleep(0.05)
        for node, _pid in running:
            node.pid_file.unlink(missing_ok=True)
        if self.nodes == 1:
            pid = running[0][1]
            if killed:
                return f"killed (pid {pid}) after {timeout:.0f}s without a clean shutdown"
            return f"stopped (pid {pid})"
        said = "stopped " + ", ".join(f"node {node.id} (pid {pid})" for node, pid in running)
        if killed:
            said += (f"; killed {', '.join(f'node {node.id}' for node, _pid in killed)} after {timeout:.0f}s "
                     "without a clean shutdown")
        return said

    def reset(self) -> str:
        """Stop the broker (every node) and delete every message it holds, its mode and its node count
        (the jars stay, and so does a secure broker's credentials file, for the next ``--secure`` format)."""
        stopped = self.down()
        for folder in [self.root / "data", *sorted((self.root / "nodes").glob("*/data"))]:
            if folder.exists():
                shutil.rmtree(folder)
        self.nodes_file.unlink(missing_ok=True)
        return f"{stopped}; data wiped"


def _count(nodes: int) -> str:
    return "one node" if nodes == 1 else f"a cluster of {nodes} nodes"


def local_cluster_settings(settings: Settings) -> Settings:
    """``settings`` to reach the local Kafka cluster of ``settings.home``, when it has several nodes:
    its bootstrap list, and a replication factor of 3 (fewer with fewer nodes) unless one was set.
    Unchanged for a single node or no local Kafka. For commands given no bootstrap."""
    local = LocalKafka(settings)
    if local.nodes == 1:
        return settings
    update: dict[str, object] = {"bootstrap": local.bootstrap}
    if "replication_factor" not in settings.model_fields_set:
        update["replication_factor"] = local.replication_factor
    return settings.model_copy(update=update)
