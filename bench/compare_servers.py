"""The servers ``bench compare`` measures Arbiter against, each started here on loopback.

Every server runs from Debian's package (``./dev bench compare`` installs what is missing),
on ports of its own, with its data in the run's temporary directory, in a process group of
its own (``start_new_session``): ``stop`` signals the whole group, SIGTERM then SIGKILL, so
nothing is left running after the benchmark, whatever ended it. The system services those
packages install are never used.

Also here: the CPU seconds a process has used (``/proc/<pid>/stat``), and the pids that do
Arbiter's work (the local broker's and the workers').
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: list[int]) -> float:
    """user + system CPU seconds the processes ``pids`` have used so far (all their threads).
    A process that is gone counts nothing."""
    total = 0
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "; field 3 of stat is fields[0]
        total += int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of stat
    return total / _TICK


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def worker_pids(app_id: str) -> list[int]:
    """The pids of the ``arbiter worker`` processes of app ``app_id`` (``bench_arbiter``'s run):
    found by the ``ARBITER_APP_ID`` in their environment."""
    want = f"ARBITER_APP_ID={app_id}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            if b"arbiter" not in cmdline or b"worker" not in cmdline:
                continue
            if want in (entry / "environ").read_bytes().split(b"\0"):
                pids.append(int(entry.name))
        except OSError:
            continue
    return sorted(pids)


def broker_pid() -> int | None:
    """The local Kafka broker's pid (``arbiter kafka up`` records it); None for another broker."""
    from arbiter.edge.settings import load_settings
    from arbiter.kafka import LocalKafka

    settings = load_settings()
    kafka = LocalKafka(settings)
    if kafka.bootstrap != settings.bootstrap:
        return None
    return kafka.pid()


class ServerError(RuntimeError):
    pass


@dataclass
class Server:
    """One server process (group) started by the benchmark."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    port: int
    extra: dict[str, object] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> None:
        if self.proc.poll() is not None:
            raise ServerError(f"{self.name} exited with code {self.proc.returncode}:\n{self.tail()}")

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM to the process group, SIGKILL after ``timeout``; reaps the process."""
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait)
                # The leader is gone; anything else in its group goes too.
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                break
            except subprocess.TimeoutExpired:
                continue


def _spawn(name: str, argv: list[str], root: Path, port: int, env: dict[str, str] | None = None) -> Server:
    log = root / f"{name}.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=root,
                                env=env, start_new_session=True)  # own group: Ctrl-C is ours; killpg stops it
    return Server(name, proc, log, port)


def _binary(name: str, package: str) -> str:
    path = shutil.which(name) or (f"/usr/bin/{name}" if Path(f"/usr/bin/{name}").exists() else None)
    if path is None:
        raise ServerError(f"{name} is missing: install Debian's {package} (./dev bench compare does)")
    return path


def _wait_port(server: Server, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        server.alive()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.settimeout(0.5)
            if sock.connect_ex(("127.0.0.1", server.port)) == 0:
                return
        time.sleep(0.1)
    raise ServerError(f"{server.name} did not listen on 127.0.0.1:{server.port} within {timeout:.0f}s:\n"
                      f"{server.tail()}")


def start_etcd(root: Path) -> Server:
    """A one-member etcd cluster (Debian's etcd-server 3.4) on loopback; data in ``root/etcd``.
    Its defaults: every write fsynced to the WAL before it is acknowledged."""
    port, peer = free_port(), free_port()
    client_url, peer_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{peer}"
    server = _spawn("etcd", [
        _binary("etcd", "etcd-server"), "--name", "bench", "--data-dir", str(root / "etcd"),
        "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
        "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
        "--initial-cluster", f"bench={peer_url}", "--initial-cluster-state", "new",
        "--logger", "zap", "--log-outputs", "stderr", "--log-level", "warn",
    ], root, port, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
    _wait_port(server, 30)
    return server


ZOOKEEPER_JAR = Path("/usr/share/java/zookeeper.jar")  # Debian's: its manifest's Class-Path has the rest


def start_zookeeper(root: Path) -> Server:
    """A standalone ZooKeeper (Debian's zookeeperd 3.8) on loopback; data in ``root/zookeeper``.
    Its defaults: each transaction fsynced to the log before it is acknowledged (forceSync)."""
    if not ZOOKEEPER_JAR.exists():
        raise ServerError(f"{ZOOKEEPER_JAR} is missing: install Debian's zookeeperd (./dev bench compare does)")
    port = free_port()
    data = root / "zookeeper"
    data.mkdir()
    config = root / "zoo.cfg"
    config.write_text("\n".join([
        "tickTime=2000",
        f"dataDir={data}",
        f"clientPort={port}",
        "clientPortAddress=127.0.0.1",
        "maxClientCnxns=0",
        "admin.enableServer=false",
        "4lw.commands.whitelist=",  # no four-letter-word commands
        "",
    ]))
    server = _spawn("zookeeper", [
        _binary("java", "default-jre-headless"), "-Xmx512m", "-Djava.awt.headless=true",
        "-cp", f"{root}:{ZOOKEEPER_JAR}", "org.apache.zookeeper.server.quorum.QuorumPeerMain", str(config),
    ], root, port)
    _wait_port(server, 60)
    return server


def start_redis(root: Path) -> Server:
    """A Redis (Debian's redis-server 7.0) on loopback, persisting nothing (no RDB, no AOF)."""
    port = free_port()
    (root / "redis").mkdir()
    server = _spawn("redis", [
        _binary("redis-server", "redis-server"), "--port", str(port), "--bind", "127.0.0.1",
        "--save", "", "--appendonly", "no", "--dir", str(root / "redis"), "--daemonize", "no",
        "--loglevel", "warning", "--maxclients", "10000",
    ], root, port)
    _wait_port(server, 30)
    return server
