"""The fault campaigns: what each one does to the live setup, and what it checks afterwards.

A campaign runs beside the honest workload (``workload``) until the run says stop, then
``verify`` checks its own invariants on the run's whole log (read once, after the workers
processed everything). Every wait is on a condition (a grant, an event in the log, a
process gone, the broker answering), never on a clock; the only timers are the campaign's
schedule (``--every``).

- ``calm``: no faults (the baseline).
- ``worker-kill``: every ``--every`` seconds, SIGKILL a random worker and start a
  replacement at once, so the pool keeps its size.
- ``freeze-agent``: an agent in a child process takes a lease (renewed in the background),
  writes once, and is frozen (SIGSTOP) past its TTL. In odd cycles a rival takes the
  resource over (granted once the lease expired) and writes; in even ones nobody does, and
  the campaign waits for the expiry in the log (at least one cycle of each, however short
  the run). Then the frozen agent is woken (SIGCONT)
  and writes with its old token: it must be refused ``stale_fencing_token`` (someone newer
  was granted) or ``lease_not_live`` (nobody was), and nothing of it may reach the ledger.
- ``broker-restart``: SIGKILL the broker's JVM and start it again on the same data, every
  ``--every`` seconds after it came back; workers that die meanwhile are replaced.
- ``duplicates``: re-produce exact copies (same key, bytes and signature, same partition)
  of acquires, writes and releases the agents already sent, some long after and some right
  after the original; each id must be decided once and each write applied once.
- ``malformed``: bursts of malformed records into the three command topics (garbage bytes,
  truncated Avro, wrong schemas, unsigned, forged and tampered signatures, absurd values, a
  null key, another agent's name or resource); each must be dead-lettered or refused, no
  worker may stop, and every honest operation must still succeed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from arbiter.agents import ArbiterClient
from arbiter.edge.clock import now_ms
from arbiter.edge.kafkaio import Sender, sender_for
from arbiter.edge.tail import Tail
from arbiter.processes import settings_env
from arbiter.schemas import (
    Cause,
    DeadLetter,
    LockDenied,
    LockExpired,
    LockGranted,
    LockReleaseRequested,
    LockRequested,
    Record,
    SagaStep,
    ToolIntent,
    ToolRejected,
    default_codec,
)
from arbiter.schemas.identity import Signer
from arbiter.schemas.partitioning import partition_for
from arbiter.schemas.reasons import OUT_OF_WINDOW

from .rig import ChaosError, LogFollower, Rig, close_quietly
from .workload import Phase, Workload, percentile


@dataclass
class Check:
    """One invariant and whether the run kept it."""

    name: str
    ok: bool
    detail: str

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly."""
        return {"name": self.name, "ok": self.ok, "detail": self.detail}


@dataclass
class Campaign:
    """The calm baseline; the base of every campaign."""

    rig: Rig
    every: float
    seed: int
    name: str = "calm"
    faults: list[dict[str, Any]] = field(default_factory=list)
    rng: random.Random = field(init=False)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    workload: Workload | None = None
    phase: Phase | None = None
    """The campaign's phase of the workload (set when it starts)."""

    def __post_init__(self) -> None:
        self.rng = random.Random(f"{self.seed}/{self.name}")

    def agents(self) -> dict[str, list[str]]:
        """Agents of its own the campaign needs enrolled, with their prefixes."""
        return {}

    async def setup(self) -> None:
        """Before the workload starts."""

    async def run(self) -> None:
        """Inject faults until ``stop`` is set."""
        await self.stop.wait()

    async def teardown(self) -> None:
        """After the workload stopped (always called)."""

    def verify(self, log: Any) -> list[Check]:
        """The campaign's own invariants, on the run's whole log."""
        return []

    def rows(self) -> list[tuple[str, str]]:
        """The campaign's own rows of the table."""
        return [("faults injected", "none")]

    async def pause(self, seconds: float) -> bool:
        """Wait ``seconds`` (the campaign's schedule); True when told to stop meanwhile."""
        try:
            await asyncio.wait_for(self.stop.wait(), seconds)
        except TimeoutError:
            return False
        return True

    def at(self) -> float:
        """Seconds since the campaign's phase began."""
        return round(time.monotonic() - self.phase.started, 2) if self.phase else 0.0


# -- worker-kill -----------------------------------------------------------------------------


@dataclass
class WorkerKill(Campaign):
    """SIGKILL a random worker every ``every`` seconds; a replacement starts at once."""

    name: str = "worker-kill"
    kills: list[float] = field(default_factory=list)
    """When each kill was (monotonic)."""

    async def run(self) -> None:
        while not await self.pause(self.every):
            alive = [w.name for w in self.rig.pool.workers if w.proc.poll() is None]
            if not alive:
                continue
            victim = self.rng.choice(alive)
            self.kills.append(time.monotonic())
            self.rig.kill_worker(victim)
            self.rig.start_workers(1)
            self.faults.append({"at_s": self.at(), "fault": f"SIGKILL {victim}",
                                "replacement": self.rig.pool.workers[-1].name})
            self.rig.say(f"  {self.at():6.1f} s  SIGKILL {victim}; {self.rig.pool.workers[-1].name} replaces it")

    def resumed(self) -> list[float | None]:
        """Per kill: seconds until every partition had a grant again (None: not before the next kill)."""
        assert self.workload is not None
        ends = [*self.kills[1:], float("inf")]
        return [self.workload.resumed_after(k, end) for k, end in zip(self.kills, ends, strict=True)]

    def rows(self) -> list[tuple[str, str]]:
        resumed = self.resumed() if self.workload is not None else []
        known = [r for r in resumed if r is not None]
        return [("faults injected", f"{len(self.faults)} SIGKILLs of a worker (every {self.every:g} s), "
                                    f"each replaced at once"),
                ("after a kill: every partition granting again",
                 (f"p50 {percentile(known, 0.5):.2f} s, max {max(known):.2f} s" if known else "-")
                 + (f" ({len(resumed) - len(known)} not before the next kill)" if len(known) < len(resumed)
                    else ""))]

    def verify(self, log: Any) -> list[Check]:
        for fault, resumed in zip(self.faults, self.resumed(), strict=True):
            fault["every_partition_granting_again_after_s"] = None if resumed is None else round(resumed, 2)
        size = len(self.rig.pool.workers) if self.rig.pool.workers else None
        return [Check("workers killed", bool(self.faults),
                      f"{len(self.faults)} SIGKILLs" + ("" if size is None else f", pool size kept at {size}"))]


# -- freeze-agent ------------------------------------------------------------------------------


class Puppet:
    """The agent in a child process (``arbiter.chaos.puppet``), spoken to a JSON line at a time."""

    def __init__(self, rig: Rig, name: str) -> None:
        self.rig, self.name = rig, name
        self.proc: asyncio.subprocess.Process | None = None
        self.log = rig.folder / f"{name}.log"
        self.frozen = False

    async def start(self) -> None:
        env = settings_env(self.rig.identities[self.name])
        with self.log.open("ab") as err:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "arbiter.chaos.puppet", self.name, stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=err, env=env, start_new_session=True)
        ready = await self.answer(timeout=60)
        if not ready.get("ready"):
            raise ChaosError(f"the frozen agent did not start: {ready}")

    def send(self, command: dict[str, Any]) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(command) + "\n").encode())

    async def answer(self, timeout: float = 60.0) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = await asyncio.wait_for(self.proc.stdout.readline(), max(0.1, deadline - time.monotonic()))
            except TimeoutError:
                raise ChaosError(f"the frozen agent did not answer within {timeout:.0f} s; see {self.log}") from None
            if not line:
                raise ChaosError(f"the frozen agent exited (code {self.proc.returncode}); see {self.log}:\n"
                                 + self.log.read_text(errors="replace")[-2000:])
            try:
                answer: dict[str, Any] = json.loads(line)
            except ValueError:
                continue  # not a protocol line
            if "error" in answer:
                raise ChaosError(f"the frozen agent: {answer['error']}")
            return answer

    async def call(self, command: dict[str, Any], timeout: float = 60.0) -> dict[str, Any]:
        self.send(command)
        assert self.proc is not None and self.proc.stdin is not None
        await self.proc.stdin.drain()
        return await self.answer(timeout)

    def freeze(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)
        self.frozen = True

    def wake(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)
        self.frozen = False

    async def close(self) -> None:
        if self.proc is None or self.proc.returncode is not None:
            return
        if self.frozen:
            self.wake()
        with contextlib.suppress(ChaosError, OSError, ConnectionError):
            await self.call({"op": "quit"}, timeout=5)
        try:
            await asyncio.wait_for(self.proc.wait(), 10)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()


@dataclass
class FreezeAgent(Campaign):
    """Freeze a lease holder in a child process past its TTL; on waking, its writes must be refused."""

    name: str = "freeze-agent"
    ttl: float = 2.0
    puppet: Puppet | None = None
    rival: ArbiterClient | None = None
    follower: LogFollower | None = None
    cycles: list[dict[str, Any]] = field(default_factory=list)

    def agents(self) -> dict[str, list[str]]:
        prefix = [f"account:{self.rig.tag}-f"]
        return {"frozen": prefix, "rival": prefix}

    async def setup(self) -> None:
        self.follower = LogFollower(self.rig.settings, keep=(LockExpired,))
        await self.follower.start()
        self.rival = ArbiterClient("rival", self.rig.identities["rival"])
        await self.rival.start()
        self.puppet = Puppet(self.rig, "frozen")
        await self.puppet.start()

    async def teardown(self) -> None:
        if self.puppet is not None:
            await self.puppet.close()
        if self.rival is not None:
            await close_quietly(self.rival)
        if self.follower is not None:
            await self.follower.stop()

    async def run(self) -> None:
        k = 0
        while not self.stop.is_set() or k < 2:  # at least one cycle of each kind, however short the run
            k += 1
            await self._cycle(k, takeover=k % 2 == 1)

    async def _cycle(self, k: int, takeover: bool) -> None:
        assert self.puppet is not None and self.rival is not None and self.follower is not None
        resource = f"account:{self.rig.tag}-f{k}"
        held = await self.puppet.call({"op": "acquire", "resource": resource, "ttl": self.ttl})
        token = held["token"]
        before = await self.puppet.call({"op": "write", "intent_id": uuid.uuid4().hex, "order_id": f"frozen-{k}-a"})
        self.puppet.freeze()
        frozen_at = time.monotonic()
        cycle: dict[str, Any] = {"at_s": self.at(), "resource": resource, "token": token,
                                 "variant": "taken over" if takeover else "nobody took over",
                                 "write_before_freeze": "applied" if before["applied"] else before["reason"]}
        lease = None
        try:
            if takeover:
                # Granted only once the frozen agent's lease expired: it renews no more.
                lease = await self.rival.acquire(resource, ttl=30, wait=self.ttl * 4 + 30)
                cycle["rival_granted_after_s"] = round(time.monotonic() - frozen_at, 3)
                cycle["rival_token"] = lease.token
                wrote = await self.rival.execute(lease, "refund", {"order_id": f"rival-{k}", "amount": 1},
                                                 base_version=lease.resource_version, timeout=30)
                cycle["rival_write"] = "applied" if wrote.applied else wrote.reason
                expected = "stale_fencing_token"
            else:
                follower = self.follower
                assert follower is not None, "the campaign follows the log from its start"
                expired = await follower.wait(lambda: any(
                    isinstance(r, LockExpired) and r.resource == resource and r.token == token
                    for _t, r in follower.records), timeout=self.ttl * 4 + 30)
                if not expired:
                    raise ChaosError(f"the frozen agent's lease on {resource} never expired")
                cycle["expired_after_s"] = round(time.monotonic() - frozen_at, 3)
                expected = "lease_not_live"
            # The frozen agent wakes up and writes with the token it holds (the command waits in its stdin).
            self.puppet.send({"op": "write", "intent_id": uuid.uuid4().hex, "order_id": f"frozen-{k}-b"})
        finally:
            self.puppet.wake()
        cycle["frozen_s"] = round(time.monotonic() - frozen_at, 3)
        zombie = await self.puppet.answer()
        cycle["zombie_write"] = "APPLIED" if zombie["applied"] else zombie["reason"]
        cycle["expected"] = expected
        cycle["sdk_saw_lease_lost"] = zombie.get("lost")
        await self.puppet.call({"op": "release"})
        if lease is not None:
            await self.rival.release(lease)
        self.cycles.append(cycle)
        self.faults.append({"at_s": cycle["at_s"], "fault": f"SIGSTOP the lease holder of {resource} "
                                                            f"for {cycle['frozen_s']:.1f} s ({cycle['variant']})"})
        self.rig.say(f"  {cycle['at_s']:6.1f} s  froze the holder of {resource} (token {token}) for "
                     f"{cycle['frozen_s']:.1f} s, {cycle['variant']}; on waking its write: {cycle['zombie_write']}")

    def verify(self, log: Any) -> list[Check]:
        wrong = [c for c in self.cycles if c["zombie_write"] != c["expected"] or c["write_before_freeze"] != "applied"
                 or c.get("rival_write", "applied") != "applied"]
        reasons = Counter(c["zombie_write"] for c in self.cycles)
        return [Check("frozen agent's writes refused", bool(self.cycles) and not wrong,
                      f"{len(self.cycles)} freezes past the {self.ttl:g} s TTL; writes on waking: "
                      + ", ".join(f"{r} {n}" for r, n in sorted(reasons.items()))
                      + (f"; WRONG: {wrong}" if wrong else ""))]

    def rows(self) -> list[tuple[str, str]]:
        reasons = Counter(c["zombie_write"] for c in self.cycles)
        taken = [c["rival_granted_after_s"] for c in self.cycles if "rival_granted_after_s" in c]
        return [
            ("faults injected", f"{len(self.cycles)} SIGSTOPs of a lease holder (a child process) past its "
                                f"{self.ttl:g} s TTL, then SIGCONT"),
            ("frozen agent's writes on waking", ", ".join(f"{r} {n}" for r, n in sorted(reasons.items())) or "-"),
            ("takeover by a rival", f"{len(taken)} times, granted {min(taken):.2f}-{max(taken):.2f} s after the freeze"
             if taken else "-"),
        ]


# -- broker-restart ------------------------------------------------------------------------------


@dataclass
class BrokerRestart(Campaign):
    """SIGKILL the broker and start it again on the same data."""

    name: str = "broker-restart"

    async def run(self) -> None:
        broker = self.rig.broker
        if broker is None:
            raise ChaosError("broker-restart needs a broker it may kill")
        while not await self.pause(self.every):
            pid = broker.pid()
            if pid is None:
                raise ChaosError("the campaign's broker is not running")
            at = self.at()
            os.kill(pid, signal.SIGKILL)
            killed = time.monotonic()
            await asyncio.to_thread(_gone, broker, pid)
            await asyncio.to_thread(broker.up, 120)
            up = time.monotonic()
            answered = up - killed
            served = await self.rig.wait_served(timeout=120)
            assert self.workload is not None
            resumed = await self.workload.first_grant_after(up, timeout=60)  # after the restart
            fault = {"at_s": at, "fault": f"SIGKILL the broker (pid {pid}), restart it",
                     "broker_answered_after_s": round(answered, 2),
                     "every_partition_served_after_s": round(answered + served, 2),
                     "agents_granted_again_after_s": None if resumed is None else round(resumed - killed, 2)}
            self.faults.append(fault)
            self.rig.say(f"  {at:6.1f} s  SIGKILL the broker; it answered again after {answered:.1f} s, "
                         f"every partition served after {answered + served:.1f} s")

    def verify(self, log: Any) -> list[Check]:
        resumed = [f["agents_granted_again_after_s"] for f in self.faults]
        ok = bool(resumed) and None not in resumed
        return [Check("grants resume after each broker restart", ok,
                      f"{len(resumed)} restarts; the agents' first grant after each kill came after "
                      + ", ".join("never (60 s)" if r is None else f"{r:.1f} s" for r in resumed))]

    def rows(self) -> list[tuple[str, str]]:
        back = [f["every_partition_served_after_s"] for f in self.faults]
        answered = [f["broker_answered_after_s"] for f in self.faults]
        resumed = [f["agents_granted_again_after_s"] for f in self.faults if f["agents_granted_again_after_s"]]
        return [("faults injected", f"{len(self.faults)} SIGKILLs of the broker (every {self.every:g} s after it "
                                    "came back), each restarted on its data"),
                ("after a kill: broker answers / every partition served",
                 f"{min(answered):.1f}-{max(answered):.1f} s / {min(back):.1f}-{max(back):.1f} s" if back else "-"),
                ("after a kill: the agents' first grant", f"{min(resumed):.1f}-{max(resumed):.1f} s" if resumed
                 else "-"),
                ("workers that died meanwhile (replaced)", str(len(self.rig.unexpected_exits)))]


def _gone(broker: Any, pid: int) -> None:
    """Return once the killed broker's process has exited and its port is closed (a killed JVM takes a
    moment to tear down; its sockets close last)."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)  # the run started it: reap it
    port = int(broker.bootstrap.split(",")[0].rsplit(":", 1)[1])
    while True:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError, IndexError):
            state = "gone"
        if state in ("gone", "Z", "X"):
            with socket.socket() as probe:
                probe.settimeout(0.5)
                if probe.connect_ex(("127.0.0.1", port)) != 0:
                    return
        time.sleep(0.02)


# -- duplicates -----------------------------------------------------------------------------------

_COPIED = (LockRequested, ToolIntent, LockReleaseRequested)


@dataclass
class Duplicates(Campaign):
    """Re-produce exact copies of commands the agents already sent."""

    name: str = "duplicates"
    per_burst: int = 15
    sent: list[tuple[str, int, bytes | None, bytes, list[tuple[str, bytes]], Record]] = field(default_factory=list)
    copies: list[dict[str, Any]] = field(default_factory=list)
    _tail: Tail | None = None
    _sender: Sender | None = None

    async def setup(self) -> None:
        s = self.rig.settings
        self._tail = Tail(s, [s.topics.resource_commands], start="beginning", isolation_level="read_uncommitted",
                          on_message=self._keep)
        await self._tail.start()
        self._sender = sender_for(s)
        await self._sender.start()

    def _keep(self, m: Any, record: Record | None) -> None:
        if isinstance(record, _COPIED) and record.agent_id.startswith("agent-") and m.headers:
            self.sent.append((m.topic, m.partition, m.key, m.value, [(k, bytes(v)) for k, v in m.headers], record))

    async def teardown(self) -> None:
        if self._tail is not None:
            await self._tail.stop()
        if self._sender is not None:
            await self._sender.stop()

    async def run(self) -> None:
        assert self._sender is not None
        while not await self.pause(self.every):
            if not self.sent:
                continue
            recent = self.sent[-5:]
            older = self.rng.sample(self.sent, min(self.per_burst - len(recent), len(self.sent)))
            for topic, partition, key, value, headers, record in [*older, *recent]:
                at, offset = await self._sender.append(topic, key, value, headers, partition=partition)
                self.copies.append({"kind": type(record).__name__, "id": _id_of(record),
                                    "copy_at": f"{topic}[{at}]@{offset}"})
            self.faults.append({"at_s": self.at(), "fault": f"{len(older) + len(recent)} copies re-produced"})

    def verify(self, log: Any) -> list[Check]:
        copied = {c["id"] for c in self.copies}
        twice = [i for i in decided_twice(log) if i in copied]
        return [Check("each copied id decided once", bool(self.copies) and not twice,
                      f"{len(self.copies)} copies of {len(copied)} ids" + (f"; decided twice: {twice[:5]}" if twice
                                                                           else ""))]

    def rows(self) -> list[tuple[str, str]]:
        kinds = Counter(c["kind"] for c in self.copies)
        return [("faults injected", f"{len(self.copies)} copies of signed commands already sent, in "
                                    f"{len(self.faults)} bursts ("
                                    + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())) + ")")]


def _id_of(record: Record) -> str:
    return str(getattr(record, "intent_id", None) or getattr(record, "request_id", ""))


_FINAL = ("LockGranted", "LockDenied", "LockWaitTimedOut", "LockCancelled", "ToolApplied", "ToolRejected")
"""The answers of which an acquire (or an intent) gets exactly one."""


def decided_twice(log: Any) -> list[str]:
    """Ids (of acquires, releases, renewals and writes) the workers decided more than once: two different
    decisions of one type for one id, or two final answers to one acquire or intent. A repeat that is answered
    again with its first answer (an identical copy) is fine; so is a refusal for the send time alone
    (``request_expired`` for a repeat whose id was forgotten, ``clock_skew`` for one sent too far ahead):
    it decides nothing."""
    from arbiter.audit.log import identity

    seen: dict[tuple[str, str], set[tuple[str, str]]] = {}
    for entry in log.of(log.topics.resource_events):
        record = entry.record
        if record is None or getattr(record, "reason", None) in OUT_OF_WINDOW:
            continue
        ident = getattr(record, "intent_id", None) or getattr(record, "request_id", None)
        if not ident or isinstance(record, LockExpired):
            continue
        kind = type(record).__name__
        seen.setdefault((ident, "final" if kind in _FINAL else kind), set()).add(identity(record))
    return sorted({ident for (ident, _kind), found in seen.items() if len(found) > 1})


# -- malformed --------------------------------------------------------------------------------------


@dataclass
class Malformed(Campaign):
    """Bursts of malformed, unsigned, forged and misdirected records into the command topics."""

    name: str = "malformed"
    injected: dict[str, str] = field(default_factory=dict)
    """Position (``topic[p]@offset``) -> what was injected there."""
    _sender: Sender | None = None
    refusals: dict[str, str] = field(default_factory=dict)

    def agents(self) -> dict[str, list[str]]:
        return {"intruder": [f"account:{self.rig.tag}-x"]}

    async def setup(self) -> None:
        self._sender = sender_for(self.rig.settings)
        await self._sender.start()

    async def teardown(self) -> None:
        if self._sender is not None:
            await self._sender.stop()

    def _records(self) -> list[tuple[str, str, bytes | None, bytes, list[tuple[str, bytes]] | None, int | None]]:
        """One of each kind: (what, topic, key, value, headers, partition: None for the key's own)."""
        s, rng = self.rig.settings, self.rng
        t = s.topics
        codec = default_codec(s.max_message_bytes)
        intruder = self.rig.signer("intruder")
        own = f"account:{self.rig.tag}-x0"
        victim, theirs = "agent-1", f"account:{self.rig.tag}-w0"

        def request(agent: str, resource: str, ttl_ms: int = 5000) -> LockRequested:
            return LockRequested(request_id=uuid.uuid4().hex, agent_id=agent, resource=resource, mode="exclusive",
                                 ttl_ms=ttl_ms, wait_ms=0, at_ms=now_ms())

        def signed(signer: Signer, topic: str, key: bytes | None, value: bytes) -> list[tuple[str, bytes]]:
            return signer.sign(topic, key, value, now_ms())

        out: list[tuple[str, str, bytes | None, bytes, list[tuple[str, bytes]] | None, int | None]] = []

        def add(what: str, topic: str, key: bytes | None, value: bytes, signer: Signer | None,
                partition: int | None = None) -> None:
            out.append((what, topic, key, value, signed(signer, topic, key, value) if signer else None, partition))

        garbage = rng.randbytes(rng.randint(1, 200))
        add("garbage bytes, unsigned", rng.choice([t.resource_commands, t.wait_edges, t.saga_commands]),
            theirs.encode(), garbage, None)
        add("garbage bytes, signed by the intruder", t.resource_commands, own.encode(), garbage, intruder)
        whole = codec.encode(request("intruder", own))
        add("truncated Avro, signed by the intruder", t.resource_commands, own.encode(),
            whole[:rng.randint(1, len(whole) - 1)], intruder)
        granted = LockGranted(request_id=uuid.uuid4().hex, agent_id="intruder", resource=own, token=1_000_000,
                              mode="exclusive", expires_at_ms=now_ms() + 3_600_000, holders=[],
                              resource_version=0, at_ms=now_ms(), cause=Cause(topic="x", partition=0, offset=0))
        add("wrong schema: a decision (LockGranted) on the command topic", t.resource_commands, own.encode(),
            codec.encode(granted), intruder)
        step = SagaStep(saga_id="saga:intruder/x", step=1, agent_id="intruder", status="applied",
                        intent_id=uuid.uuid4().hex, resource=own, tool="refund", arguments_json="{}",
                        at_ms=now_ms())
        add("wrong schema: a saga step on the lease topic", t.resource_commands, own.encode(), codec.encode(step),
            intruder)
        add("wrong topic: a lease request on the saga topic", t.saga_commands, own.encode(),
            codec.encode(request("intruder", own)), intruder)
        add(f"unsigned lease request naming {victim}", t.resource_commands, theirs.encode(),
            codec.encode(request(victim, theirs)), None)
        intent = ToolIntent(intent_id=uuid.uuid4().hex, agent_id=victim, resource=theirs, token=1, base_version=0,
                            tool="refund", arguments_json=json.dumps({"order_id": "forged", "amount": 1}),
                            at_ms=now_ms())
        add(f"unsigned write naming {victim}", t.resource_commands, theirs.encode(), codec.encode(intent), None)
        add(f"forged signature: a key nobody registered, as {victim}", t.resource_commands, theirs.encode(),
            codec.encode(request(victim, theirs)), Signer.generate(victim))
        add(f"the intruder's own key, naming {victim}", t.resource_commands, theirs.encode(),
            codec.encode(request(victim, theirs)), intruder)
        original = codec.encode(request("intruder", own))
        out.append(("tampered: signed, then the value changed", t.resource_commands, own.encode(),
                    codec.encode(request("intruder", own, ttl_ms=3_600_000)),
                    signed(intruder, t.resource_commands, own.encode(), original), None))
        add("absurd values: a TTL of -1 ms", t.resource_commands, own.encode(),
            codec.encode(request("intruder", own, ttl_ms=-1)), intruder)
        add("a null key", t.resource_commands, None, codec.encode(request("intruder", own)), intruder)
        request_value = codec.encode(request("intruder", own))
        add("signed, on a partition its key does not hash to", t.resource_commands, own.encode(), request_value,
            intruder, partition=(partition_for(own.encode(), s.partitions) + 1) % s.partitions)
        add("outside its prefixes: a lease on an honest agent's account", t.resource_commands, theirs.encode(),
            codec.encode(request("intruder", theirs)), intruder)
        return out

    async def run(self) -> None:
        sender = self._sender
        assert sender is not None
        while not await self.pause(self.every):
            burst = self._records() + self._records()
            # (in flight together, as a burst is: not each waiting for the one before)
            placed = await asyncio.gather(*(sender.append(topic, key, value, headers, partition=partition)
                                            for _what, topic, key, value, headers, partition in burst))
            for (what, topic, *_), (partition, offset) in zip(burst, placed, strict=True):
                self.injected[f"{topic}[{partition}]@{offset}"] = what
            self.faults.append({"at_s": self.at(), "fault": f"{len(burst)} malformed records"})

    def verify(self, log: Any) -> list[Check]:
        t = log.topics
        for entry in log.of(t.dead_letter):
            if isinstance(entry.record, DeadLetter):
                source = entry.record.source
                self.refusals.setdefault(f"{source.topic}[{source.partition}]@{source.offset}",
                                         f"dead letter: {entry.record.reason}")
        for entry in log.of(t.resource_events):
            record = entry.record
            if isinstance(record, LockDenied | ToolRejected):
                cause = record.cause
                self.refusals.setdefault(f"{cause.topic}[{cause.partition}]@{cause.offset}",
                                         f"refused: {record.reason}")
        missed = {where: what for where, what in self.injected.items() if where not in self.refusals}
        honest = self.phase
        checks = [
            Check("every malformed record dead-lettered or refused", bool(self.injected) and not missed,
                  f"{len(self.injected) - len(missed)} of {len(self.injected)}"
                  + (f"; NOT refused: {list(missed.items())[:5]}" if missed else "")),
        ]
        if honest is not None:
            ok = honest.attempted > 0 and honest.succeeded == honest.attempted
            checks.append(Check("honest operations kept succeeding", ok,
                                f"{honest.succeeded} of {honest.attempted} during the bursts"))
        return checks

    def rows(self) -> list[tuple[str, str]]:
        reasons = Counter(self.refusals.get(where, "NOT REFUSED") for where in self.injected)
        return [("faults injected", f"{len(self.injected)} malformed records in {len(self.faults)} bursts "
                                    f"({len(self._records())} kinds)"),
                ("how they were refused", ", ".join(f"{r} {n}" for r, n in reasons.most_common()) or "-")]


CAMPAIGNS: dict[str, type[Campaign]] = {
    "calm": Campaign,
    "worker-kill": WorkerKill,
    "freeze-agent": FreezeAgent,
    "broker-restart": BrokerRestart,
    "duplicates": Duplicates,
    "malformed": Malformed,
}

DEFAULT_EVERY = {"calm": 5.0, "worker-kill": 5.0, "freeze-agent": 0.0, "broker-restart": 10.0,
                 "duplicates": 2.0, "malformed": 2.0}
"""Seconds between faults when ``--every`` is not given (freeze-agent's cycles follow each other)."""

SHORT = {"calm": 5.0, "worker-kill": 10.0, "freeze-agent": 6.0, "broker-restart": 8.0,
         "duplicates": 6.0, "malformed": 6.0}
"""``--short``: the campaign's duration (seconds): a couple of faults each, for CI."""

SHORT_EVERY = {"worker-kill": 4.0, "broker-restart": 3.0}


__all__ = ["CAMPAIGNS", "DEFAULT_EVERY", "SHORT", "SHORT_EVERY", "Campaign", "Check", "decided_twice",
           "percentile"]
