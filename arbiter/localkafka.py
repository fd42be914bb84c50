"""The local Apache Kafka broker: fetched from Maven Central, run with the machine's Java.

Theory of operation
-------------------
``broker/pom.xml`` pins the broker (``org.apache.kafka:kafka_2.13``). ``fetch``
copies its jars into ``<home>/kafka/libs`` with Maven, once (a stamp of the pom's
hash says when to fetch again). ``up`` writes a KRaft ``server.properties`` (one
node, combined broker and controller, 127.0.0.1 only), formats the storage on first
use, starts ``kafka.Kafka`` as a detached process whose pid is kept in a file, and
waits until the broker answers a metadata request. ``down`` sends SIGTERM (a clean
shutdown flushes the logs) and waits. ``reset`` stops the broker and deletes its data,
keeping the jars.

All state lives under ``<home>/kafka`` (``.arbiter/`` by default, git-ignored), so a
restart keeps every message.

Secure mode (``up(secure=True)``, ``arbiter kafka up --secure``)
------------------------------------------------------------------
Kafka's own access control is the outer wall of the trust boundary (README "Trust
boundary"). The client listener then takes SASL/SCRAM-SHA-512 only (SASL_PLAINTEXT, on
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

from contract.kafkaauth import PRINCIPALS, credentials_path
from contract.settings import Settings

POM = Path(__file__).resolve().parents[1] / "broker" / "pom.xml"
MIN_JAVA = 17


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

    ``options`` are aiokafka client options (``contract.kafkaauth.kafka_client_options``):
    a SASL listener answers only a client that logs in.
    """
    from aiokafka import AIOKafkaClient
    from aiokafka.errors import KafkaError

    # A probe that fails is an answer, not an error worth aiokafka's log lines.
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)

    async def probe() -> bool:
        client = AIOKafkaClient(bootstrap_servers=bootstrap, request_timeout_ms=int(timeout * 1000),
                                **dict(options or {}))
        try:
            await asyncio.wait_for(client.bootstrap(), timeout)
            return bool(client.cluster.brokers())
        except (TimeoutError, KafkaError, OSError):
            return False
        finally:
            await client.close()

    return asyncio.run(probe())


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


class LocalKafka:
    """The single-node KRaft broker under ``settings.home``."""

    def __init__(self, settings: Settings, say: Callable[[str], None] = lambda _msg: None) -> None:
        self.settings = settings
        self.say = say
        self.root = (settings.home / "kafka").resolve()
        self.libs = self.root / "libs"
        self.data = self.root / "data"
        self.logs = self.root / "logs"
        self.config = self.root / "server.properties"
        self.pid_file = self.root / "kafka.pid"
        self.mode_file = self.data / "arbiter-mode"
        self.credentials_file = credentials_path(settings.home.resolve())
        self.bootstrap = f"127.0.0.1:{settings.kafka_port}"

    # -- fetch -----------------------------------------------------------------------

    def fetch(self) -> None:
        """Copy the broker's jars from Maven Central, unless the pinned ones are here."""
        if not POM.exists():
            raise LocalKafkaError(f"{POM} is missing; run Arbiter from its source tree (pip install -e .)")
        stamp = self.libs / ".pom-sha256"
        want = hashlib.sha256(POM.read_bytes()).hexdigest()
        if stamp.exists() and stamp.read_text().strip() == want:
            return
        mvn = shutil.which("mvn")
        if not mvn:
            raise LocalKafkaError("Maven (mvn) is needed once, to fetch the Kafka broker's jars; install it")
        self.say("fetching the Kafka broker's jars from Maven Central (once)...")
        if self.libs.exists():
            shutil.rmtree(self.libs)
        self.libs.mkdir(parents=True)
        proc = subprocess.run(
            [mvn, "-B", "-q", "-f", str(POM), "dependency:copy-dependencies", f"-Darbiter.libs={self.libs}"],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            raise LocalKafkaError("Maven could not fetch the broker's jars", (proc.stdout + proc.stderr)[-4000:])
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
        return broker_answers(self.bootstrap, timeout, options)

    # -- process ---------------------------------------------------------------------

    def pid(self) -> int | None:
        """The broker's pid, if the process we started is still alive."""
        try:
            pid = int(self.pid_file.read_text().strip())
        except (FileNotFoundError, ValueError):
            return None
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (FileNotFoundError, PermissionError, ProcessLookupError):
            return None
        return pid if b"kafka.Kafka" in cmdline and str(self.config).encode() in cmdline else None

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of the broker's logs, for error messages."""
        parts = []
        for name in ("server.log", "kafka.out"):
            path = self.logs / name
            if path.exists():
                text = path.read_text(errors="replace").splitlines()[-lines:]
                parts.append(f"--- {path} ---\n" + "\n".join(text))
        return "\n".join(parts)

    def _write_config(self, passwords: Mapping[str, str] | None = None) -> None:
        """Write server.properties; with ``passwords``, the secure (SASL + ACL) variant."""
        s = self.settings
        props = {
            "process.roles": "broker,controller",
            "node.id": "1",
            "controller.quorum.voters": f"1@127.0.0.1:{s.kafka_controller_port}",
            "listeners": f"PLAINTEXT://127.0.0.1:{s.kafka_port},CONTROLLER://127.0.0.1:{s.kafka_controller_port}",
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{s.kafka_port}",
            "controller.listener.names": "CONTROLLER",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "inter.broker.listener.name": "PLAINTEXT",
            "log.dirs": str(self.data),
            "num.partitions": str(s.partitions),
            "offsets.topic.replication.factor": "1",
            "offsets.topic.num.partitions": "4",
            "transaction.state.log.replication.factor": "1",
            "transaction.state.log.min.isr": "1",
            "transaction.state.log.num.partitions": "4",
            # One broker, no one to wait for: start consumer groups at once.
            "group.initial.rebalance.delay.ms": "0",
            # Topics are created by `arbiter topics create`, never by a typo.
            "auto.create.topics.enable": "false",
            "message.max.bytes": str(2 * s.max_message_bytes),
            # The log is the audit record: keep it.
            "log.retention.ms": "-1",
        }
        if passwords is None:
            self.config.write_text("".join(f"{k}={v}\n" for k, v in props.items()))
        else:
            props.update(self._secure_props(passwords[ADMIN]))
            _write_private(self.config, "".join(f"{k}={v}\n" for k, v in props.items()))
        log4j = {
            "log4j.rootLogger": "INFO, file",
            "log4j.appender.file": "org.apache.log4j.RollingFileAppender",
            "log4j.appender.file.File": str(self.logs / "server.log"),
            "log4j.appender.file.MaxFileSize": "20MB",
            "log4j.appender.file.MaxBackupIndex": "3",
            "log4j.appender.file.layout": "org.apache.log4j.PatternLayout",
            "log4j.appender.file.layout.ConversionPattern": "[%d] %p %m (%c)%n",
            "log4j.logger.kafka": "INFO",
            "log4j.logger.org.apache.kafka": "INFO",
            "log4j.logger.state.change.logger": "WARN",
        }
        (self.root / "log4j.properties").write_text("".join(f"{k}={v}\n" for k, v in log4j.items()))

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

    def _format_if_new(self, java: str, mode: Mode = "plain", passwords: Mapping[str, str] | None = None) -> None:
        if (self.data / "meta.properties").exists():
            return
        self.say(f"formatting Kafka storage in {self.data}" + (" (secure)" if mode == "secure" else ""))
        self.data.mkdir(parents=True, exist_ok=True)
        scram: list[str] = []
        for name, password in (passwords or {}).items():
            scram += ["--add-scram", f"{SCRAM_MECHANISM}=[name={name},password={password}]"]
        proc = subprocess.run(
            [
                java,
                f"-Dlog4j.configuration=file:{self.root / 'log4j.properties'}",
                "-cp",
                self._classpath(),
                "kafka.tools.StorageTool",
                "format",
                "-t",
                uuid.uuid4().hex[:22],
                "-c",
                str(self.config),
                *scram,
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            raise LocalKafkaError("formatting the Kafka storage failed", proc.stdout + proc.stderr)
        self.mode_file.write_text(f"{mode}\n")

    def up(self, timeout: float = 90.0, secure: bool | None = None) -> str:
        """Start the broker (harmless when it already runs). Returns what happened.

        ``secure``: True for SASL/SCRAM and ACLs, False for the plain broker, None for
        whatever the data was formatted as (plain when there is none yet).
        """
        mode = self._resolve_mode(secure)
        if mode == "secure":
            return self._secure_up(timeout)
        return self._up(timeout)

    def _secure_up(self, timeout: float) -> str:
        passwords = self._ensure_credentials()
        what = self._up(timeout, passwords)
        asyncio.run(create_acls(self.bootstrap, self.client_options(), secure_acls(self.settings)))
        return f"{what}; secure: SASL/SCRAM-SHA-512 and ACLs, logins in {self.credentials_file}"

    def _up(self, timeout: float, passwords: Mapping[str, str] | None = None) -> str:
        """Start the broker: plain, or secure with these passwords (written to the credentials file)."""
        secure = passwords is not None
        options = self.client_options() if secure and self.mode() == "secure" else {}
        if self.pid() is not None:
            if broker_answers(self.bootstrap, options=options):
                return f"already running (pid {self.pid()}) on {self.bootstrap}"
            return self._wait_ready(self.pid() or 0, timeout, started_now=False, options=options)
        for port in (self.settings.kafka_port, self.settings.kafka_controller_port):
            if _port_open(port):
                hint = "; use --bootstrap to use it" if port == self.settings.kafka_port else ""
                raise LocalKafkaError(f"127.0.0.1:{port} is already in use by another process{hint}")
        java = _java()
        self.fetch()
        for folder in (self.data, self.logs):
            folder.mkdir(parents=True, exist_ok=True)
        self._write_config(passwords)
        self._format_if_new(java, "secure" if secure else "plain", passwords)
        options = self.client_options() if secure else {}
        cmd = [
            java,
            f"-Xmx{self.settings.kafka_heap}",
            f"-Xms{self.settings.kafka_heap}",
            "-XX:+UseG1GC",
            "-XX:MaxGCPauseMillis=20",
            "-Djava.awt.headless=true",
            f"-Dlog4j.configuration=file:{self.root / 'log4j.properties'}",
            f"-Dkafka.logs.dir={self.logs}",
            "-cp",
            self._classpath(),
            "kafka.Kafka",
            str(self.config),
        ]
        with open(self.logs / "kafka.out", "ab") as out:
            proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        self.pid_file.write_text(f"{proc.pid}\n")
        return self._wait_ready(proc.pid, timeout, started_now=True, proc=proc, options=options)

    def _wait_ready(
        self, pid: int, timeout: float, started_now: bool, proc: subprocess.Popen[bytes] | None = None,
        options: Mapping[str, Any] | None = None,
    ) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                self.pid_file.unlink(missing_ok=True)
                raise LocalKafkaError(f"the Kafka broker exited with code {proc.returncode}", self.log_tail())
            if proc is None and self.pid() is None:
                raise LocalKafkaError("the Kafka broker exited", self.log_tail())
            if broker_answers(self.bootstrap, timeout=2.0, options=options):
                verb = "started" if started_now else "running"
                return f"{verb} (pid {pid}) on {self.bootstrap}, data in {self.data}"
            time.sleep(0.3)
        self.down()
        raise LocalKafkaError(f"the Kafka broker did not answer within {timeout:.0f}s", self.log_tail())

    def down(self, timeout: float = 60.0) -> str:
        """Stop the broker cleanly (SIGTERM, then SIGKILL after ``timeout``)."""
        pid = self.pid()
        if pid is None:
            self.pid_file.unlink(missing_ok=True)
            return "not running"
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.pid() is not None:
            time.sleep(0.1)
        if self.pid() is not None:
            os.kill(pid, signal.SIGKILL)
            while self.pid() is not None:
                time.sleep(0.05)
            self.pid_file.unlink(missing_ok=True)
            return f"killed (pid {pid}) after {timeout:.0f}s without a clean shutdown"
        self.pid_file.unlink(missing_ok=True)
        return f"stopped (pid {pid})"

    def reset(self) -> str:
        """Stop the broker and delete every message it holds, and its mode (the jars stay,
        and so does a secure broker's credentials file, for the next ``--secure`` format)."""
        stopped = self.down()
        if self.data.exists():
            shutil.rmtree(self.data)
        return f"{stopped}; data wiped"
