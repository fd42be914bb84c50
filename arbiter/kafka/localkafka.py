"""``LocalKafka``: the local broker, or cluster, under a home: ``fetch``, ``up``, ``down``, ``reset``,
and what it is (its nodes, its mode, its logins). The package's docstring is its theory of operation."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from arbiter.edge.kafkaauth import credentials_path
from arbiter.edge.kafkaconn import ephemeral_ports, in_ephemeral_range
from arbiter.edge.settings import Settings

from . import jvm
from .acls import create_acls, secure_acls
from .config import (
    cluster_properties,
    log4j2_properties,
    log4j_properties,
    properties_text,
    secure_properties,
    server_properties,
)
from .errors import LocalKafkaError
from .jars import POM, copy_jars, jar_stamp
from .nodes import MAX_NODES, Node
from .probe import broker_answers, broker_count, port_open
from .secure import (
    ADMIN,
    Mode,
    complete,
    login_options,
    new_passwords,
    read_passwords,
    write_credentials,
    write_private,
)
from .storage import check_release, cluster_id, scram_arguments, start_format


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

    @property
    def jar_stamp_file(self) -> Path:
        """Where ``fetch`` records which pom and release the jars in ``libs`` are of."""
        return self.libs / ".pom-sha256"

    def jars_current(self) -> bool:
        """The jars of this pom and release are in ``libs`` (nothing to fetch)."""
        stamp = self.jar_stamp_file
        return stamp.exists() and stamp.read_text().strip() == jar_stamp(self.version)

    def fetch(self) -> None:
        """Copy the broker's jars from Maven Central, unless the pinned ones are here."""
        if not POM.exists():
            raise LocalKafkaError(f"{POM} is missing; run Arbiter from its source tree (pip install -e .)")
        if self.jars_current():
            return
        want = jar_stamp(self.version)
        copy_jars(self.libs, self.version, self.say)
        # Stamped last: jars cut short by a failure are fetched again.
        self.jar_stamp_file.write_text(want + "\n")

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
        return read_passwords(self.credentials_file)

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
        if not complete(passwords):
            if (self.data / "meta.properties").exists():
                raise LocalKafkaError(
                    f"the secure broker's logins in {self.credentials_file} are missing or incomplete, and its "
                    "users were fixed when its data was formatted; restore the file, or delete all the data "
                    "with 'arbiter kafka reset' and run 'arbiter kafka up --secure' again"
                )
            passwords = new_passwords()
        write_credentials(self.credentials_file, self.bootstrap, passwords)
        return passwords

    def client_options(self, principal: str = ADMIN) -> dict[str, Any]:
        """aiokafka options to reach this broker as ``principal`` (none for a plain broker)."""
        if self.mode() != "secure":
            return {}
        return login_options(principal, self.credentials()[principal])

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
        return jvm.pid_of(node)

    def log_tail(self, lines: int = 40, node: Node | None = None) -> str:
        """The last lines of the broker's logs (of every node, or of ``node``), for error messages."""
        return jvm.log_tail([node] if node is not None else self.node_list, lines)

    def _write_config(self, node: Node, passwords: Mapping[str, str] | None = None) -> None:
        """Write ``node``'s server.properties; with ``passwords``, the secure (SASL + ACL) variant.
        Also its log4j and log4j 2 configurations."""
        props = server_properties(self.settings, node, self.node_list)
        if self.nodes > 1:
            props.update(cluster_properties(self.replication_factor))
        if passwords is None:
            node.config.write_text(properties_text(props))
        else:
            props.update(secure_properties(self.settings, passwords[ADMIN]))
            write_private(node.config, properties_text(props))
        node.log4j.write_text(properties_text(log4j_properties(node)))
        node.log4j2.write_text(properties_text(log4j2_properties(node)))

    def _classpath(self) -> str:
        return str(self.libs / "*")

    def _format_if_new(self, java: str, mode: Mode = "plain", passwords: Mapping[str, str] | None = None,
                       nodes: list[Node] | None = None) -> None:
        """Format the storage of each node (of ``nodes``) that has none yet, all with one cluster id."""
        todo = [node for node in (nodes or self.node_list) if not (node.data / "meta.properties").exists()]
        if not todo:
            return
        cluster, scram = cluster_id(self.node_list), scram_arguments(passwords)
        formats = []
        for node in todo:  # at once: each is a JVM start
            self.say(f"formatting Kafka storage in {node.data}" + (" (secure)" if mode == "secure" else ""))
            node.data.mkdir(parents=True, exist_ok=True)
            formats.append(start_format(java, self._classpath(), node, cluster, scram))
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
        self._check_distinct_ports()
        down = [node for node in self.node_list if self.pid_of(node) is None]
        if not down:
            if self._cluster_answers(options=options):
                return f"already running ({self._pids_text()}) on {self.bootstrap}"
            return self._wait_ready({}, timeout, options=options)
        self._check_ports_free(down)
        check_release(down, self.version, self.say)
        java = jvm.find_java()
        self.fetch()
        for node in down:
            for folder in (node.data, node.logs):
                folder.mkdir(parents=True, exist_ok=True)
            self._write_config(node, passwords)
        self._format_if_new(java, "secure" if secure else "plain", passwords, down)
        # Read again: a first secure start has only now written its mode next to the new data.
        options = self.client_options() if secure else {}
        self._warn_ephemeral(down)
        self._log_marks = {node.id: jvm.log_sizes(node) for node in down}
        started = {node.id: jvm.start(java, node, self._classpath(), self.settings.kafka_heap) for node in down}
        return self._wait_ready(started, timeout, options=options)

    def _check_distinct_ports(self) -> None:
        """Refuse ports of nodes that coincide (or do not exist), before anything is started."""
        ports = [port for node in self.node_list for port in (node.port, node.controller_port)]
        if len(set(ports)) < len(ports) or max(ports) > 65535:
            raise LocalKafkaError(
                f"{self.nodes} nodes need {len(ports)} distinct ports: node i listens on ARBITER_KAFKA_PORT + 2(i-1) "
                f"and ARBITER_KAFKA_CONTROLLER_PORT + 2(i-1), which give {', '.join(map(str, ports))}; "
                "set the controller port to the client port + 1")

    @staticmethod
    def _check_ports_free(down: list[Node]) -> None:
        """Refuse to start nodes whose ports another process holds (it may be another Kafka)."""
        for node in down:
            for port in (node.port, node.controller_port):
                if port_open(port):
                    hint = "; use --bootstrap to use it" if port == node.port else ""
                    raise LocalKafkaError(f"127.0.0.1:{port} is already in use by another process{hint}")

    def _warn_ephemeral(self, down: list[Node]) -> None:
        """Say so when a node's client port lies where the kernel picks outgoing connections' ports."""
        for node in down:
            if in_ephemeral_range(node.port):
                low, high = ephemeral_ports()
                self.say(f"note: port {node.port} lies in this host's ephemeral range ({low}-{high}), where the "
                         "kernel picks outgoing connections' source ports: another program's connection may hold "
                         "it (Arbiter's clients never connect to themselves); a port below "
                         f"{low} avoids that")

    def first_error(self, node: Node) -> str:
        """The first ERROR or FATAL line (with the lines that explain it) that ``node`` logged since this
        ``up`` started it: the cause of a failed start, where the log's tail is its shutdown."""
        return jvm.first_error(node, self._log_marks.get(node.id, {}))

    def _exited(self, node: Node, code: int | None) -> LocalKafkaError:
        """The error for a node that exited while starting: its first error of this start, not its log's tail."""
        return jvm.exited_error(node, code, self.first_error(node), self._label(node))

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
            self._raise_if_exited(started)
            if self._cluster_answers(timeout=2.0, options=options):
                return self._ready_text(started)
            time.sleep(0.3)
        self._stop([n for n in self.node_list if n.id in started] if started else self.node_list, 60.0)
        raise LocalKafkaError(f"the Kafka broker{'s' if self.nodes > 1 else ''} did not answer within {timeout:.0f}s",
                              self.log_tail(lines=40 if self.nodes == 1 else 15))

    def _raise_if_exited(self, started: dict[int, subprocess.Popen[bytes]]) -> None:
        """Fail the start when a node's broker has exited, stopping the others started with it."""
        for node in self.node_list:
            proc = started.get(node.id)
            if proc is not None and proc.poll() is not None:
                node.pid_file.unlink(missing_ok=True)
                self._stop([n for n in self.node_list if n.id in started and n.id != node.id], 30.0)
                raise self._exited(node, proc.returncode)
            if proc is None and self.pid_of(node) is None:
                raise self._exited(node, None)

    def _ready_text(self, started: dict[int, subprocess.Popen[bytes]]) -> str:
        """What ``up`` did, once every node answers: started (which nodes), or found running."""
        if self.nodes == 1:
            verb = "started" if started else "running"
            return f"{verb} ({self._pids_text()}) on {self.bootstrap}, data in {self.data}"
        what = ("running" if not started else "started" if len(started) == self.nodes
                else f"started {', '.join(f'node {i}' for i in started)} of")
        return (f"{what} {self.nodes} nodes ({self._pids_text()}) on {self.bootstrap}, "
                f"data in {self.root / 'nodes'}")

    def down(self, timeout: float = 60.0) -> str:
        """Stop the broker (every node) cleanly: SIGTERM, then SIGKILL after ``timeout``."""
        return self._stop(self.node_list, timeout)

    def _stop(self, nodes: list[Node], timeout: float) -> str:
        """Stop ``nodes`` (see ``down``) and say what happened."""
        running, killed = jvm.stop(nodes, timeout)
        if not running:
            return "not running"
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
