"""``arbiter runner``: the check runner, its own process and identity, checking every repository's train.

Theory of operation
-------------------
The runner follows the resource events from the start (``Tail``), keeps only what a worker signed, and
folds each repository's train events through the train core (``arbiter.streams.cores.train.evolve``), as
the host does: its view of each train is the host's. After each batch that changed a train it plans, per
target: from the head the log recorded, each of the first ``depth`` entries is stacked on the ones ahead of
it (``merges.entry_commit``, the commit the host will land, made alike on both sides), and checked there
unless the log already holds a verdict of it on that base. A stacked entry whose verdict failed is left out
of the stack behind it (it will be evicted); one that is still being checked is assumed to pass. Checks no
plan wants any more are cancelled.

Each check runs as the repository's configuration says (``arbiter.streams.tools.checks``), in a scratch
copy of the merge commit, and ends with a signed ``CheckVerdict``: the tree, the check's digest, the exit
status and a digest of the output, on the repository's command partition, where the host records it in
the train's order. A merge that conflicts on its base is answered with a verdict naming the paths, and no
check runs.

The runner reads the repositories through a bare mirror of each (``<home>/runner/<name>.git``) that borrows
the repository's objects (git alternates): it reads them, never writes them, and makes its merge commits in
its own. It needs the repositories' disk, read-only. Checks never run on a worker's decision path.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from arbiter.agents import ArbiterClient
from arbiter.agents.identities import ensure_identity
from arbiter.edge.clock import now_ms
from arbiter.edge.keys import anchors_for
from arbiter.edge.registryfeed import RegistryFeed
from arbiter.edge.settings import Repository, Settings
from arbiter.edge.tail import Tail
from arbiter.schemas import CheckVerdict, MergeChecked, MergeQueued, MergeReplanned, ToolApplied, ToolRejected
from arbiter.schemas.identity import ROLE_RUNNER, ROLE_WORKER, Registry, Verified
from arbiter.streams.cores import train
from arbiter.streams.cores.train import CHECK_CHANGED, Entry, Train
from arbiter.streams.tools import merges
from arbiter.streams.tools.checks import CheckResult, run_check
from arbiter.streams.tools.git import git
from arbiter.streams.tools.registry import ToolError

log = logging.getLogger("arbiter.runner")

PR_SET_DUMPABLE = 4
"""prctl(2)'s option number (linux/prctl.h)."""
RETRY_SECONDS = 2.0
"""How soon a repository that could not be planned or checked is tried again."""
Key = tuple[str, str]
"""(entry's intent id, base): one check of one merge on one base."""


@dataclass
class Plan:
    """What one repository's trains need checked now: key -> (entry, base, commit, tree)."""

    checks: dict[Key, tuple[Entry, str, str, str]] = field(default_factory=dict)
    conflicts: dict[Key, tuple[Entry, str, list[str]]] = field(default_factory=dict)
    changed: dict[Key, tuple[Entry, str]] = field(default_factory=dict)
    """Entries that joined with another check than this runner's."""


def mirror_of(home: Path, name: str, repo: Path) -> Path:
    """A bare repository that reads ``repo``'s objects (alternates) and writes its own."""
    mirror = home / "runner" / f"{name}.git"
    if not (mirror / "objects").is_dir():
        mirror.parent.mkdir(parents=True, exist_ok=True)
        git(mirror.parent, "init", "-q", "--bare", str(mirror))
    common = git(repo, "rev-parse", "--path-format=absolute", "--git-common-dir").stdout.strip()
    (mirror / "objects" / "info").mkdir(parents=True, exist_ok=True)
    (mirror / "objects" / "info" / "alternates").write_text(str(Path(common) / "objects") + "\n")
    return mirror


def plan(trains: Train, mirror: Path, depth: int, digest: str, results: dict[Key, bool]) -> Plan:
    """Each target's first ``depth`` entries, stacked as the module's text says. Blocking (git)."""
    out = Plan()
    for target in sorted({e.target for e in trains.entries}):
        base = trains.heads[target]
        for entry in trains.queue(target)[:depth]:
            if entry.check_digest != digest:  # it cannot be checked here: it leaves the train (check_changed)
                log.warning("the merge %s joined with check %s, and this runner's configuration is %s: it is "
                            "answered check_changed (the host and the runner must read the same repos.toml)",
                            entry.intent_id, entry.check_digest, digest)
                out.changed[entry.intent_id, base] = (entry, base)
                continue
            key = (entry.intent_id, base)
            try:
                commit, tree = merges.entry_commit(mirror, base, entry)
            except ToolError as error:
                out.conflicts[key] = (entry, base, list(error.details.get("conflicts", [])) or [str(error)])
                continue
            out.checks[key] = (entry, base, commit, tree)
            if results.get(key) is not False:
                base = commit  # it passed, or may: the ones behind are checked on top of it
    return out


class CheckRunner:
    """Checks every configured repository's train (see the module's text)."""

    def __init__(self, settings: Settings, name: str = "runner", depth: int = 4) -> None:
        if depth < 1:
            raise ValueError("a runner checks at least one merge at a time (depth >= 1)")
        self.settings = settings
        self.name = name
        self.depth = depth
        self.repositories = {f"repo:{n}": r for n, r in settings.repositories().items() if r.check is not None}
        self.mirrors: dict[str, Path] = {}
        self.trains: dict[str, Train] = {}
        self.results: dict[Key, bool] = {}
        """Per check, whether its verdict passed (recorded in the log, or sent by this runner)."""
        self.sent: set[Key] = set()
        self.jobs: dict[Key, tuple[str, asyncio.Task[None]]] = {}
        """The checks running: their repository and task."""
        self.checks_run = 0
        self._dirty: set[str] = set()
        self._retry_at: dict[str, float] = {}
        self._failing: dict[str, str] = {}
        self._registry: Registry | None = None
        self._client: ArbiterClient | None = None

    async def run(self, stop: asyncio.Event) -> None:
        """Follow the log and check until ``stop`` is set."""
        feed = None
        if self.settings.verify_signatures:
            self._registry = Registry(anchors_for(self.settings.home, self.settings.admin_public_keys))
            feed = RegistryFeed(self._registry, self.settings)
            await feed.start()
        tail = Tail(self.settings, [self.settings.topics.resource_events], start="beginning")
        try:
            async with ArbiterClient(self.name, self.settings) as client, tail:
                self._client = client
                log.info("runner %s checks %s, %d at once, from the start of %s", self.name,
                         ", ".join(sorted(self.repositories)) or "nothing", self.depth,
                         self.settings.topics.resource_events)
                while not stop.is_set():
                    for message, record in await tail.read(timeout_ms=200):
                        self._fold(message, record)
                    await self._replan()
        finally:
            running = [task for _, task in self.jobs.values()]
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            if feed is not None:
                await feed.stop()

    def _fold(self, message: Any, record: Any) -> None:
        if not isinstance(record, MergeQueued | MergeChecked | MergeReplanned | ToolApplied | ToolRejected):
            return
        if record.resource not in self.repositories or not self._from_worker(message):
            return
        if isinstance(record, ToolApplied | ToolRejected) and record.tool != "merge":
            return
        train.evolve(self.trains.setdefault(record.resource, Train()), record)
        if isinstance(record, MergeChecked):
            self.results[record.intent_id, record.base] = record.passed
        self._dirty.add(record.resource)

    def _from_worker(self, message: Any) -> bool:
        if self._registry is None:
            return True
        verdict = self._registry.verify(message.topic, message.key, message.value, message.headers,
                                        message.timestamp)
        return isinstance(verdict, Verified) and verdict.role == ROLE_WORKER

    async def _replan(self) -> None:
        """Plan each repository whose train changed; one that cannot be planned now (its folder missing,
        git failing) is logged and planned again after ``RETRY_SECONDS``, and blocks no other."""
        clock = time.monotonic()
        for resource in sorted(r for r in self._dirty if self._retry_at.get(r, 0.0) <= clock):
            self._dirty.discard(resource)
            trains = self.trains.get(resource)
            try:
                wanted = await self._plan(resource, trains) if trains is not None and trains.entries else set()
            except Exception as error:  # a repository's trouble is logged, never this runner's end
                self._later(resource, f"cannot plan its checks: {error}")
                continue
            self._failing.pop(resource, None)
            for key in [k for k, (r, _) in self.jobs.items() if r == resource and k not in wanted]:
                self.jobs.pop(key)[1].cancel()  # its merge left, or the train moved on: the check is moot

    async def _plan(self, resource: str, trains: Train) -> set[Key]:
        repository = self.repositories[resource]
        mirror = self.mirrors.get(resource)
        if mirror is None:
            mirror = self.mirrors[resource] = await asyncio.to_thread(mirror_of, self.settings.home, repository.name,
                                                                      repository.path)
        todo = await asyncio.to_thread(plan, trains, mirror, self.depth, repository.check_digest(), self.results)
        for key, (entry, base, paths) in todo.conflicts.items():
            if key not in self.sent and key not in self.results:
                await self._send_refusal(resource, entry, base, repository, conflicts=paths)
        for key, (entry, base) in todo.changed.items():
            if key not in self.sent and key not in self.results:
                await self._send_refusal(resource, entry, base, repository, stopped=CHECK_CHANGED)
        for key, (entry, base, commit, tree) in todo.checks.items():
            if key not in self.sent and key not in self.results and key not in self.jobs:
                task = asyncio.create_task(self._check(resource, repository, entry, base, commit, tree))
                self.jobs[key] = (resource, task)
        return set(todo.checks)

    def _later(self, resource: str, why: str) -> None:
        """Try ``resource`` again in ``RETRY_SECONDS``; say why once for each new reason."""
        self._dirty.add(resource)
        self._retry_at[resource] = time.monotonic() + RETRY_SECONDS
        if self._failing.get(resource) != why:
            self._failing[resource] = why
            log.warning("%s: %s; trying again every %g s", resource, why, RETRY_SECONDS)

    async def _check(self, resource: str, repository: Repository, entry: Entry, base: str, commit: str,
                     tree: str) -> None:
        key = (entry.intent_id, base)
        try:
            mirror = self.mirrors[resource]
            result = await run_check(mirror, commit, repository, check_user=self.settings.check_user)
            self.checks_run += 1
            await self._send(_verdict(self.name, resource, entry, base, commit, tree, result, repository))
            self.sent.add(key)
            self.results[key] = result.passed
            self._dirty.add(resource)  # the ones behind may stack differently now
        except asyncio.CancelledError:
            raise
        except Exception as error:  # checked again after RETRY_SECONDS
            self._later(resource, f"checking {entry.intent_id} on {base[:12]} failed ({error})")
        finally:
            self.jobs.pop(key, None)

    async def _send_refusal(self, resource: str, entry: Entry, base: str, repository: Repository, *,
                            conflicts: list[str] | None = None, stopped: str = "") -> None:
        """A verdict that ran no check: the merge conflicts on ``base``, or joined with another check."""
        await self._send(CheckVerdict(
            verdict_id=uuid.uuid4().hex, runner_id=self.name, resource=resource, intent_id=entry.intent_id, base=base,
            commit="", tree="", check_digest=repository.check_digest(), command=repository.check_text(), passed=False,
            conflicts=conflicts or [],
            exit_code=None, stopped=stopped, output_digest="", output_bytes=0, output_tail="", seconds_ms=0,
            at_ms=now_ms()))
        self.sent.add((entry.intent_id, base))
        self.results[entry.intent_id, base] = False

    async def _send(self, verdict: CheckVerdict) -> None:
        assert self._client is not None
        await self._client.transport.send(self.settings.topics.resource_commands, verdict.resource, verdict)


def _verdict(runner: str, resource: str, entry: Entry, base: str, commit: str, tree: str, result: CheckResult,
             repository: Repository) -> CheckVerdict:
    return CheckVerdict(
        verdict_id=uuid.uuid4().hex, runner_id=runner, resource=resource, intent_id=entry.intent_id, base=base,
        commit=commit, tree=tree, check_digest=repository.check_digest(), command=repository.check_text(),
        passed=result.passed, conflicts=[],
        exit_code=result.exit_code, stopped=result.stopped, output_digest=result.output_digest,
        output_bytes=result.output_bytes, output_tail=result.output[-4000:], seconds_ms=round(result.seconds * 1000),
        at_ms=now_ms())


def undumpable() -> None:
    """Make this process undumpable (``prctl(PR_SET_DUMPABLE, 0)``; Linux only, best effort). Its key may be
    in its memory and its environment (handed over as a secret store would), and a process of the same user
    (a check, when one user trusts its agents) could otherwise read ``/proc/<pid>/environ`` or ptrace it and
    sign its own pass: undumpable, those are root's alone. Its children get their own flag back at exec."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)


async def serve(settings: Settings, name: str, depth: int, stop: asyncio.Event | None = None) -> None:
    """Run a check runner until ``stop`` (or for ever); its identity (role ``runner``) is issued first in a
    home that holds the admin key."""
    undumpable()
    if not settings.identity_key:
        await ensure_identity(settings, name, role=ROLE_RUNNER)
    runner = CheckRunner(settings, name, depth)
    if not runner.repositories:
        log.warning("no repository with a check is configured (repos.toml): this runner has nothing to check")
    with contextlib.suppress(asyncio.CancelledError):
        await runner.run(stop or asyncio.Event())
