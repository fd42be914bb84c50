"""Worker processes started by commands that bring up a whole Arbiter (demo, tests, benchmarks)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from arbiter.edge.settings import Settings

if TYPE_CHECKING:
    from arbiter.agents import ArbiterClient


def _terminate(proc: subprocess.Popen[bytes], timeout: float) -> int:
    """SIGTERM, then SIGKILL after ``timeout``; the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


@dataclass
class WorkerProcess:
    """One ``arbiter worker`` child process, logging to a file."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM, then SIGKILL after ``timeout``. Returns the exit code."""
        return _terminate(self.proc, timeout)

    def kill(self) -> None:
        """SIGKILL: a crash, for failover tests."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def settings_env(settings: Settings) -> dict[str, str]:
    """Environment that gives a child process these settings."""
    env = dict(os.environ)
    for name, value in settings.model_dump(exclude={"topics", "worker_id"}).items():
        if value is None:  # unset: the child's default, as here (str(None) would be a value)
            env.pop(f"ARBITER_{name.upper()}", None)
            continue
        env[f"ARBITER_{name.upper()}"] = str(value.resolve() if isinstance(value, Path) else value)
    for name, topic in settings.topics.model_dump().items():
        env[f"ARBITER_TOPICS__{name.upper()}"] = topic
    return env


@dataclass
class WorkerPool:
    """Several workers of one app (one consumer group)."""

    settings: Settings
    workers: list[WorkerProcess] = field(default_factory=list)

    command: tuple[str, ...] = ("-m", "arbiter", "worker")
    """What runs a worker (``python`` and these arguments): the benchmarks start their faust baseline."""

    def start(self, count: int = 1, loglevel: str = "info", extra_env: dict[str, str] | None = None) -> None:
        """Start ``count`` more workers (``extra_env`` is added to their environment)."""
        logs = (self.settings.home / "logs").resolve()
        logs.mkdir(parents=True, exist_ok=True)
        for _ in range(count):
            env = settings_env(self.settings)
            env.update(extra_env or {})
            name = (extra_env or {}).get("ARBITER_WORKER_ID") or f"worker-{len(self.workers) + 1}"
            env["ARBITER_WORKER_ID"] = name
            log = logs / f"{self.settings.app_id}-{name}.log"
            with open(log, "ab") as out:
                proc = subprocess.Popen(
                    [sys.executable, *self.command, "--loglevel", loglevel],
                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                    start_new_session=True,  # a Ctrl-C at the terminal is for the parent to handle
                )
            self.workers.append(WorkerProcess(name, proc, log))

    def check_alive(self) -> None:
        """Raise if any worker has exited, with the tail of its log."""
        for w in self.workers:
            if w.proc.poll() is not None:
                tail = "\n".join(w.log.read_text(errors="replace").splitlines()[-30:])
                raise RuntimeError(f"{w.name} exited with code {w.proc.returncode}:\n{tail}")

    def stop(self) -> None:
        """Stop every worker (in parallel: each gets SIGTERM first)."""
        for w in self.workers:
            if w.proc.poll() is None:
                w.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 20
        for w in self.workers:
            try:
                w.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                w.kill()
        self.workers.clear()


async def wait_until_served(client: ArbiterClient, pool: WorkerPool, keys: list[str], timeout: float = 90) -> None:
    """Ping each key until a worker answers for it, and until every worker owns a partition
    (when there are enough): the consumer group has settled, no rebalance is due."""
    from arbiter.agents import ArbiterTimeout

    deadline = time.monotonic() + timeout
    want = min(len(pool.workers), len(keys))
    owners: dict[str, str] = {}
    while len(owners) < len(keys) or len(set(owners.values())) < want:
        pool.check_alive()
        if time.monotonic() > deadline:
            missing = sorted(set(keys) - set(owners))
            raise ArbiterTimeout(f"the workers did not settle within {timeout:.0f}s: no answer for {missing}, "
                                 f"{len(set(owners.values()))} of {want} workers own partitions")
        for key in keys:
            try:
                owners[key] = (await client.ping(key, timeout=2)).worker_id
            except ArbiterTimeout:
                owners.pop(key, None)


def free_port() -> int:
    """A TCP port on loopback nobody listens on right now."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class RunnerProcess:
    """One ``arbiter runner`` child process (the check runner), logging to a file."""

    settings: Settings
    name: str = "runner"
    depth: int = 4
    extra_env: dict[str, str] = field(default_factory=dict)
    trusted_agents: bool = False
    """One user that trusts its agents (the demo, the benchmarks, the tests): not root and with no check user
    set, its checks run as this very user, who can read the runner's key (``trusted_check_user``). As root,
    nothing changes: they run as ``nobody``."""
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None

    def start(self) -> RunnerProcess:
        """Start it (it reads the log from the start: it is ready when it has caught up)."""
        from arbiter.streams.tools.checks import trusted_check_user

        logs = (self.settings.home / "logs").resolve()
        logs.mkdir(parents=True, exist_ok=True)
        self.log = logs / f"runner-{self.name}.log"
        env = settings_env(self.settings)
        if self.trusted_agents:
            env["ARBITER_CHECK_USER"] = trusted_check_user(self.settings.check_user)
        env.update(self.extra_env)
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "arbiter", "runner", "--name", self.name, "--depth", str(self.depth)],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        return self

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM (its checks are stopped with it), then SIGKILL after ``timeout``."""
        return _terminate(self.proc, timeout) if self.proc is not None else 0

    def kill(self) -> None:
        """SIGKILL: a crash."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@dataclass
class DoorProcess:
    """One ``arbiter serve`` child process (the front door) on a loopback port, logging to a file."""

    settings: Settings
    port: int = 0
    log_dir: Path | None = None
    extra_env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None
    command: tuple[str, ...] = ("serve", "--loglevel", "info")
    """The ``arbiter`` command and its options (``--port`` is added): ``("console",)`` serves the console alone."""

    @property
    def url(self) -> str:
        """Where agents reach it."""
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> DoorProcess:
        """Start it and return once it serves (``/livez``: started; ``/healthz`` also wants a worker)."""
        import urllib.request

        self.port = self.port or free_port()
        log_dir = self.log_dir or self.settings.home / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log = log_dir / f"door-{self.port}.log"
        env = settings_env(self.settings)
        env.update(self.extra_env)
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "arbiter", *self.command, "--port", str(self.port)],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the front door exited with {self.proc.returncode}; see {self.log}:\n"
                                   + self.log.read_text()[-3000:])
            try:
                with urllib.request.urlopen(f"{self.url}/livez", timeout=1) as answer:
                    if answer.status == 200:
                        return self
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"the front door did not answer within {timeout}s; see {self.log}")
            time.sleep(0.1)

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM (sessions are told to resume elsewhere), then SIGKILL after ``timeout``."""
        return _terminate(self.proc, timeout) if self.proc is not None else 0

    def kill(self) -> None:
        """SIGKILL: a crashed door."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
