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
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path

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


def broker_answers(bootstrap: str, timeout: float = 3.0) -> bool:
    """True when a Kafka broker at ``bootstrap`` answers a metadata request."""
    from aiokafka import AIOKafkaClient
    from aiokafka.errors import KafkaError

    # A probe that fails is an answer, not an error worth aiokafka's log lines.
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)

    async def probe() -> bool:
        client = AIOKafkaClient(bootstrap_servers=bootstrap, request_timeout_ms=int(timeout * 1000))
        try:
            await asyncio.wait_for(client.bootstrap(), timeout)
            return bool(client.cluster.brokers())
        except (TimeoutError, KafkaError, OSError):
            return False
        finally:
            await client.close()

    return asyncio.run(probe())


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

    def _write_config(self) -> None:
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
        self.config.write_text("".join(f"{k}={v}\n" for k, v in props.items()))
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

    def _classpath(self) -> str:
        return str(self.libs / "*")

    def _format_if_new(self, java: str) -> None:
        if (self.data / "meta.properties").exists():
            return
        self.say(f"formatting Kafka storage in {self.data}")
        self.data.mkdir(parents=True, exist_ok=True)
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
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            raise LocalKafkaError("formatting the Kafka storage failed", proc.stdout + proc.stderr)

    def up(self, timeout: float = 90.0) -> str:
        """Start the broker (harmless when it already runs). Returns what happened."""
        if self.pid() is not None:
            if broker_answers(self.bootstrap):
                return f"already running (pid {self.pid()}) on {self.bootstrap}"
            return self._wait_ready(self.pid() or 0, timeout, started_now=False)
        for port in (self.settings.kafka_port, self.settings.kafka_controller_port):
            if _port_open(port):
                hint = "; use --bootstrap to use it" if port == self.settings.kafka_port else ""
                raise LocalKafkaError(f"127.0.0.1:{port} is already in use by another process{hint}")
        java = _java()
        self.fetch()
        for folder in (self.data, self.logs):
            folder.mkdir(parents=True, exist_ok=True)
        self._write_config()
        self._format_if_new(java)
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
        return self._wait_ready(proc.pid, timeout, started_now=True, proc=proc)

    def _wait_ready(
        self, pid: int, timeout: float, started_now: bool, proc: subprocess.Popen[bytes] | None = None
    ) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                self.pid_file.unlink(missing_ok=True)
                raise LocalKafkaError(f"the Kafka broker exited with code {proc.returncode}", self.log_tail())
            if proc is None and self.pid() is None:
                raise LocalKafkaError("the Kafka broker exited", self.log_tail())
            if broker_answers(self.bootstrap, timeout=2.0):
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
        """Stop the broker and delete every message it holds (the jars stay)."""
        stopped = self.down()
        if self.data.exists():
            shutil.rmtree(self.data)
        return f"{stopped}; data wiped"
