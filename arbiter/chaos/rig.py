"""The live Arbiter a chaos campaign runs against, started for the run and torn down after it.

A run gets its own topics (``arbiter.chaos.<run>.*``, its own registry among them), its own
consumer group (``arbiter.chaos.<run>.app``, the prefix of its changelogs too) and its own SQLite ledger in
``<home>/chaos/<run>/``; it starts ``--workers`` worker processes and issues every agent a
key of its own (nothing is enrolled on first use). Which broker it uses:

- ``broker-restart`` kills the broker, so by default it starts a **private** one for the
  run (a temporary home, free ports, the broker jars linked from a home that has them) and
  deletes it afterwards: a shared broker is never killed. ``--broker-home DIR`` names a
  broker the campaign may kill instead (started there if it is not running).
- every other campaign uses the configured one (``--bootstrap``), or, with nothing
  configured, the local broker, started if it is not running (and stopped after);
  ``--private-broker`` gives it a private one too (the brokers' settings then are this
  Arbiter's, e.g. the minimum consumer session timeout the workers' failover needs).

At the end the run waits until the workers have committed every input sent before the
agents stopped, stops the workers (the audit reads a log at rest), audits the whole log,
keeps it as an archive (``log.jsonl``, with ``audit.html``) and deletes the run's topics.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from arbiter.agents import ArbiterClient, ArbiterError
from arbiter.edge.kafkaauth import kafka_client_options
from arbiter.edge.kafkaio import Fetch, Reader, Received, TopicPartition, reader_for
from arbiter.edge.settings import Settings, Topics
from arbiter.edge.tail import Tail
from arbiter.kafka import LocalKafka, LocalKafkaError, broker_answers
from arbiter.processes import WorkerPool, free_port
from arbiter.schemas import Record
from arbiter.schemas.identity import Signer
from arbiter.schemas.partitioning import key_for_partition
from arbiter.streams.runtime.topics import delete_topics_named, ensure_topics

REPO = Path(__file__).resolve().parents[2]
BALANCE = 10**12
"""Cents in each of the run's accounts: the workload never runs one dry."""


class ChaosError(RuntimeError):
    """The run could not be set up or brought to rest."""


@dataclass
class Broker:
    """The broker a run uses, and whether the run may kill it."""

    bootstrap: str
    killable: LocalKafka | None = None
    """The broker the run may kill and restart (broker-restart only)."""
    stop_after: LocalKafka | None = None
    """The broker the run started, and so stops at its end."""
    private_home: Path | None = None
    """The temporary home of a private broker (deleted after the run)."""

    def close(self, say: Callable[[str], None]) -> None:
        """Stop what the run started; delete a private broker's home."""
        if self.stop_after is not None:
            try:
                say(f"broker: {self.stop_after.down(timeout=30)}")
            except (OSError, LocalKafkaError) as exc:
                say(f"broker: could not stop it: {exc}")
        if self.private_home is not None:
            shutil.rmtree(self.private_home, ignore_errors=True)


class PrivateBroker(LocalKafka):
    """A broker of the run's own (broker-restart's default), tuned to come back quickly after a kill.

    A KRaft node killed with SIGKILL cannot register again until its controller has waited out the
    old incarnation's session (``broker.session.timeout.ms``, 9 s by default), and it retries with a
    doubling backoff meanwhile: measured here, 12 to 26 s before it served again. A single node has
    no other broker to fail over to, so this one uses a 2 s session (heartbeats every 0.5 s): it
    registers again about 3 s after it starts. Everything else is ``arbiter kafka up``'s broker."""

    TUNED = {"broker.session.timeout.ms": "2000", "broker.heartbeat.interval.ms": "500"}

    def _write_config(self, *args: Any, **kwargs: Any) -> None:
        super()._write_config(*args, **kwargs)
        with self.config.open("a") as config:  # a later line wins in a Java properties file
            config.write("".join(f"{k}={v}\n" for k, v in self.TUNED.items()))


def _link_jars(broker: LocalKafka, homes: list[Path]) -> None:
    """Give a private broker's home the broker jars (of its release) of a home that has them (fetching
    them once, with Maven, into the first home when none has)."""
    broker.libs.parent.mkdir(parents=True, exist_ok=True)
    for home in homes:
        other = LocalKafka(broker.settings.model_copy(update={"home": home.resolve()}))
        if other.jars_current():
            broker.libs.symlink_to(other.libs.resolve(), target_is_directory=True)
            return
    raise LocalKafkaError(f"no home has the jars of Kafka {broker.version} yet")


def open_broker(base: Settings, campaign: str, configured: bool, broker_home: Path | None, private: bool,
                say: Callable[[str], None]) -> Broker:
    """The broker for this run (see the module's docstring); ``private``: a private one for any campaign."""
    killing = campaign == "broker-restart"
    if killing and broker_home is not None:
        local = LocalKafka(base.model_copy(update={"home": broker_home.resolve()}), say=say)
        started = local.pid() is None
        if started:
            say(f"starting the broker of {broker_home} (the campaign will kill and restart it)...")
        say(f"broker: {local.up()}")
        return Broker(local.bootstrap, killable=local, stop_after=local if started else None)
    if killing or private:
        return _private_broker(base, killing, say)
    if not configured:
        local = LocalKafka(base, say=say)
        if local.pid() is None and not broker_answers(base.bootstrap, options=kafka_client_options(base)):
            say("starting the local Kafka broker...")
            say(f"broker: {local.up()}")
            return Broker(base.bootstrap, stop_after=local)
    return Broker(base.bootstrap)


def _private_broker(base: Settings, killable: bool, say: Callable[[str], None]) -> Broker:
    """A broker of the run's own: a temporary home, free ports, deleted after the run."""
    home = Path(tempfile.mkdtemp(prefix="arbiter-chaos-broker-"))
    private = base.model_copy(update={"home": home, "kafka_port": free_port(), "kafka_controller_port": free_port()})
    local = PrivateBroker(private, say=say)
    homes = [base.home, Path(os.environ.get("ARBITER_HOME", ".arbiter")), REPO / ".arbiter"]
    try:
        try:
            _link_jars(local, homes)
        except LocalKafkaError:
            LocalKafka(base, say=say).fetch()  # once, into the configured home
            _link_jars(local, [base.home])
        say(f"starting a private broker for the run in {home}...")
        say(f"broker: {local.up()}")
    except BaseException:
        with contextlib.suppress(Exception):
            local.down(timeout=10)
        shutil.rmtree(home, ignore_errors=True)
        raise
    return Broker(local.bootstrap, killable=local if killable else None, stop_after=local, private_home=home)


def run_settings(base: Settings, run: str, bootstrap: str) -> Settings:
    """This run's topics (its own registry among them), consumer group and ledger."""
    topics = Topics(**{name: f"arbiter.chaos.{run}.{name}" for name in Topics.model_fields})
    folder = (base.home / "chaos" / run).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    return base.model_copy(update={
        "bootstrap": bootstrap, "topics": topics, "app_id": f"arbiter.chaos.{run}.app", "auto_enroll": False,
        "ledger_dsn": str(folder / "ledger.sqlite3"),
    })


class LogFollower:
    """Decisions and dead letters as they are appended (read-only, no consumer group), for campaigns
    that wait on the log: ``wait(ready)`` re-checks ``ready()`` each time something arrives."""

    def __init__(self, settings: Settings, keep: tuple[type[Record], ...]) -> None:
        self.keep = keep
        """The record types to keep (the rest is read past)."""
        self.records: list[tuple[str, Record]] = []
        t = settings.topics
        self._tail = Tail(settings, [t.resource_events, t.dead_letter], isolation_level="read_uncommitted",
                          on_message=self._keep)

    def _keep(self, message: Received, record: Record | None) -> None:
        if isinstance(record, self.keep):
            self.records.append((message.topic, record))

    async def start(self) -> None:
        """Read from the topics' current ends on."""
        await self._tail.start()

    async def stop(self) -> None:
        """Stop reading."""
        await self._tail.stop()

    async def wait(self, ready: Callable[[], bool], timeout: float) -> bool:
        """Whether ``ready()`` came to hold within ``timeout`` seconds."""
        return await self._tail.wait_for(ready, timeout)


@dataclass
class Rig:
    """A running Arbiter for one campaign: its settings, workers, ledger and agents' keys."""

    settings: Settings
    run: str
    folder: Path
    say: Callable[[str], None]
    pool: WorkerPool = field(init=False)
    identities: dict[str, Settings] = field(default_factory=dict)
    probe: ArbiterClient | None = None
    broker: LocalKafka | None = None
    """The broker the campaign may kill (broker-restart only)."""
    started_workers: int = 0
    unexpected_exits: list[str] = field(default_factory=list)
    """Workers that exited without the campaign killing them (each was replaced)."""

    def __post_init__(self) -> None:
        self.pool = WorkerPool(self.settings)

    @property
    def tag(self) -> str:
        """This run's part of every resource name."""
        return "c" + self.run.replace("-", "_")

    # -- workers -----------------------------------------------------------------------

    def start_workers(self, count: int) -> None:
        """Start ``count`` more workers, each with a name never used before in this run."""
        for _ in range(count):
            self.started_workers += 1
            name = f"worker-{self.started_workers}"
            self.pool.start(1, loglevel="warning", extra_env={"ARBITER_WORKER_ID": name})
            self.pool.workers[-1].name = name

    def kill_worker(self, name: str) -> None:
        """SIGKILL one worker (a crash) and take it out of the pool."""
        victim = next(w for w in self.pool.workers if w.name == name)
        victim.kill()
        self.pool.workers.remove(victim)

    def supervise(self) -> None:
        """Replace each worker that exited on its own (a supervisor's job); note each exit."""
        for worker in list(self.pool.workers):
            if worker.proc.poll() is not None:
                tail = " | ".join(worker.log.read_text(errors="replace").splitlines()[-3:])
                self.unexpected_exits.append(f"{worker.name} exited with code {worker.proc.returncode}: {tail}")
                self.say(f"  {worker.name} exited (code {worker.proc.returncode}); starting a replacement")
                self.pool.workers.remove(worker)
                self.start_workers(1)

    async def wait_served(self, timeout: float = 120.0, settled: bool = False) -> float:
        """Ping every partition until a worker answers for each (``settled``: and every worker owns one,
        when there are enough partitions); replaces workers that exit meanwhile. Returns the seconds it took."""
        assert self.probe is not None
        started = time.monotonic()
        keys = [key_for_partition(p, self.settings.partitions) for p in range(self.settings.partitions)]
        owners: dict[str, str] = {}
        while True:
            self.supervise()
            want = min(len(self.pool.workers), len(keys)) if settled else 1
            if len(owners) == len(keys) and len(set(owners.values())) >= want:
                return time.monotonic() - started
            if time.monotonic() - started > timeout:
                raise ChaosError(f"the workers did not serve every partition within {timeout:.0f} s "
                                 f"(answered: {sorted(owners)})")
            for key in keys:
                try:
                    owners[key] = (await self.probe.ping(key, timeout=2)).worker_id
                except ArbiterError:
                    owners.pop(key, None)

    # -- identities ----------------------------------------------------------------------

    async def enroll(self, agents: dict[str, list[str]]) -> dict[str, Settings]:
        """Issue each agent a key allowed only its prefixes, registered in this run's registry; the
        settings its SDK signs with (the key is handed over in memory: no key file is left)."""
        from arbiter.agents.identities import Registrar

        async def one(name: str, allow: list[str]) -> tuple[str, Settings]:
            signer = await Registrar(self.settings).add(name, allow=allow, keep_key=False)
            return name, self.settings.model_copy(update={"identity": name,
                                                          "identity_key": signer.private_pem().decode()})

        enrolled = dict(await asyncio.gather(*(one(n, a) for n, a in agents.items())))
        self.identities.update(enrolled)
        return enrolled

    def signer(self, name: str) -> Signer:
        """The key an enrolled agent signs with."""
        return Signer.from_text(name, self.identities[name].identity_key)

    # -- bringing the run to rest ------------------------------------------------------------

    async def input_ends(self) -> dict[TopicPartition, int]:
        """The input topics' end offsets now."""
        t = self.settings.topics
        tps = [TopicPartition(topic, p) for topic in (t.resource_commands, t.wait_edges, t.saga_commands)
               for p in range(self.settings.partitions)]
        async with _reading(self.settings) as reader:
            return {tp: await reader.end_offset(*tp) for tp in tps}

    async def wait_processed(self, ends: dict[TopicPartition, int], timeout: float = 120.0) -> float:
        """Wait until the workers' consumer group has committed every input up to ``ends`` (replacing
        workers that exit meanwhile). Returns the seconds it took."""
        async with _reading(self.settings) as reader:
            began = time.monotonic()
            while True:
                self.supervise()
                committed = await reader.committed(self.settings.app_id, list(ends))
                behind = {f"{tp.topic}[{tp.partition}]": end - committed.get(tp, 0) for tp, end in ends.items()}
                if all(lag <= 0 for lag in behind.values()):
                    return time.monotonic() - began
                if time.monotonic() - began > timeout:
                    raise ChaosError(f"the workers did not process every input within {timeout:.0f} s: "
                                     + ", ".join(f"{k} {v} behind" for k, v in behind.items() if v > 0))
                await asyncio.sleep(0.2)  # between two reads of the committed offsets

    async def audit(self) -> tuple[Any, dict[str, Any]]:
        """Read the run's whole log, keep it as an archive and an HTML report, audit it: (log, report)."""
        from arbiter.audit import audit
        from arbiter.audit.html import render
        from arbiter.audit.log import read_log, write_archive

        log = await read_log(self.settings)
        write_archive(self.folder / "log.jsonl", log)
        report = await audit(log, self.settings, complete=True)
        (self.folder / "audit.html").write_text(render(report), encoding="utf-8")
        return log, report

    async def delete_topics(self) -> int:
        """Delete the run's topics and changelogs (the archive keeps the log); how many."""
        return await delete_topics_named(self.settings, (f"arbiter.chaos.{self.run}.", f"{self.settings.app_id}-"))


@contextlib.asynccontextmanager
async def _reading(settings: Settings) -> AsyncIterator[Reader]:
    """A reader that reads no records: for the ends of partitions and a group's offsets. Its ends are after
    every record written (``read_uncommitted``), an open transaction's too: the inputs sent are all waited for."""
    reader = reader_for(settings, Fetch(isolation_level="read_uncommitted"))
    try:
        await reader.start()
        yield reader
    finally:
        await reader.stop()


async def close_quietly(*clients: ArbiterClient) -> None:
    """Close SDK clients on the way out, whatever state Kafka is in (a broker the campaign killed may
    still be down when a run fails): a failure to close is not the run's result."""
    for client in clients:
        try:
            await client.close()
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # the run itself is being cancelled
        except Exception:  # see above
            continue


async def create_topics(settings: Settings) -> int:
    """Create the run's topics; how many."""
    return len(await ensure_topics(settings))
