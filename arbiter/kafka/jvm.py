"""The broker's Java processes: the machine's Java, found and its version checked; a node's broker
started detached with its pid kept in a file, found again by that file, and stopped; and the node's
logs, which say why a start failed."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

from .errors import LocalKafkaError
from .nodes import Node

MIN_JAVA = 17

_LOGS = ("server.log", "kafka.out")
"""A node's log files: log4j's, and the JVM's own output (where a failure before logging starts shows)."""


def find_java() -> str:
    """The ``java`` of JAVA_HOME, or else of the PATH, when it is at least ``MIN_JAVA``."""
    java_home = os.environ.get("JAVA_HOME")
    java = str(Path(java_home) / "bin" / "java") if java_home else shutil.which("java")
    if not java or not Path(java).exists():
        raise LocalKafkaError(f"Java {MIN_JAVA}+ is needed to run the local Kafka broker; none found (set JAVA_HOME)")
    out = subprocess.run([java, "-version"], capture_output=True, text=True, check=False).stderr
    match = re.search(r'version "(\d+)', out)
    if not match or int(match.group(1)) < MIN_JAVA:
        raise LocalKafkaError(f"Java {MIN_JAVA}+ is needed to run the local Kafka broker; {java} says: {out.strip()}")
    return java


def start(java: str, node: Node, classpath: str, heap: str) -> subprocess.Popen[bytes]:
    """Start ``node``'s broker in a session of its own (it outlives this process) and keep its pid."""
    cmd = [
        java,
        f"-Xmx{heap}",
        f"-Xms{heap}",
        *(os.environ.get("ARBITER_KAFKA_JVM_OPTS", "").split() or ["-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20"]),
        "-Djava.awt.headless=true",
        f"-Dlog4j.configuration=file:{node.log4j}",
        f"-Dlog4j2.configurationFile={node.log4j2}",
        f"-Dkafka.logs.dir={node.logs}",
        "-cp",
        classpath,
        "kafka.Kafka",
        str(node.config),
    ]
    with open(node.logs / "kafka.out", "ab") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
    node.pid_file.write_text(f"{proc.pid}\n")
    return proc


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
    # A pid is reused once its process is gone: only a broker run with this node's config is ours.
    return pid if b"kafka.Kafka" in cmdline and str(node.config).encode() in cmdline else None


def stop(nodes: list[Node], timeout: float) -> tuple[list[tuple[Node, int]], list[tuple[Node, int]]]:
    """Stop ``nodes``' brokers: SIGTERM (a clean shutdown flushes the logs), SIGKILL to those still
    alive after ``timeout``; their pid files are removed. Returns the (node, pid) pairs that ran, and
    those of them that had to be killed."""
    running = [(node, pid) for node in nodes if (pid := pid_of(node)) is not None]
    if not running:
        for node in nodes:
            node.pid_file.unlink(missing_ok=True)
        return [], []
    for _node, pid in running:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(pid_of(node) is not None for node, _pid in running):
        time.sleep(0.1)
    killed = [(node, pid) for node, pid in running if pid_of(node) is not None]
    for node, pid in killed:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        while pid_of(node) is not None:
            time.sleep(0.05)
    for node, _pid in running:
        node.pid_file.unlink(missing_ok=True)
    return running, killed


def log_sizes(node: Node) -> dict[str, int]:
    """The sizes of ``node``'s logs now: where the lines of a start about to happen will begin."""
    return {name: (node.logs / name).stat().st_size if (node.logs / name).exists() else 0 for name in _LOGS}


def log_tail(nodes: list[Node], lines: int = 40) -> str:
    """The last lines of ``nodes``' logs, for error messages."""
    parts = []
    for each in nodes:
        for name in _LOGS:
            path = each.logs / name
            if path.exists():
                text = path.read_text(errors="replace").splitlines()[-lines:]
                parts.append(f"--- {path} ---\n" + "\n".join(text))
    return "\n".join(parts)


def first_error(node: Node, marks: Mapping[str, int]) -> str:
    """The first ERROR or FATAL line (with the lines that explain it) in ``node``'s logs after ``marks``
    (each log's size before a start, from ``log_sizes``): the cause of a failed start, where the log's
    tail is its shutdown."""
    for name in _LOGS:
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


def exited_error(node: Node, code: int | None, cause: str, label: str) -> LocalKafkaError:
    """The error for ``node``'s broker (``label``: how messages name it) that exited while starting,
    told by ``cause``, its first error of this start (``first_error``), not by its log's tail."""
    how = f"exited with code {code}" if code is not None else "exited"
    first = cause.splitlines()[0] if cause else ""
    bind = next((line for line in cause.splitlines() if "Address already in use" in line
                 or "BindException" in line), "")
    if bind:
        summary = (f"the Kafka broker{label} {how}: it could not bind its port "
                   f"({node.port} or {node.controller_port}) because another socket holds it")
    elif first:
        summary = f"the Kafka broker{label} {how}: {first.split('] ', 1)[-1][:300]}"
    else:
        summary = f"the Kafka broker{label} {how}"
    detail = (cause + "\n" if cause else "") + f"(the whole log: {node.logs / 'server.log'})"
    return LocalKafkaError(summary, detail if cause else log_tail([node]))
