"""A merge train: the merges of one repository checked speculatively, in parallel, landed in order.

``box.merge(message, check=...)`` alone is the serial queue: it holds the repository's lease while its
check runs, so each merge waits for the checks of every merge ahead of it. A ``MergeTrain`` does what
Zuul and Mergify do, with the gateway as the only writer::

    train = MergeTrain(depth=4)             # the check is the repository's (repos.toml)
    outcome = await box.merge("ann: login", train=train)   # from each agent, at once

- Entry *k*'s check runs on the merge of *k* on top of the merges of every entry ahead of it, so the
  first ``depth`` entries are checked at once while nothing holds the lease.
- Entries land in the order they joined, each through the gateway's ``merge`` tool with
  ``expect_head`` (the head its check assumed) and ``expect_tree`` (the tree its check ran on): what
  lands is exactly what was checked, or nothing. A head moved by a merge outside the train is a
  ``version_conflict`` the train answers by planning again.
- A failing check evicts only its entry (``check_failed``, with its output). The checks of the
  entries behind it ran on a result that included it, so they are dropped and run again without
  it; a check whose tree is still the one that lands is never run twice.
- An entry whose merge conflicts with those ahead of it waits until it is at the front, and then the
  tool answers it (the conflict with its paths, or the merge if what it conflicted with was evicted).

A train lives in one process (its agents share it): it is a checker and a queue in front of the
gateway, not a new authority. The gateway's lease, fencing and expected head still decide every
merge, so a train, or an agent outside it, can never land an unchecked or stale result.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from dataclasses import dataclass, field
from typing import Any

from arbiter.agents.outcomes import Outcome
from arbiter.agents.sandbox import Sandbox, check_failed
from arbiter.streams.tools.checks import CheckResult, run_check

REPLANS = 20
"""How many times one entry's landing may meet a moved head before the train gives it that answer."""


@dataclass(eq=False)
class _Entry:
    box: Sandbox
    message: str
    strategy: str
    intent_id: str
    done: asyncio.Future[Outcome]
    replans: int = 0


@dataclass
class TrainStats:
    """What a train did: checks started, checks cancelled as moot, entries landed and evicted."""

    checks_started: int = 0
    checks_cancelled: int = 0
    most_at_once: int = 0
    landed: list[str] = field(default_factory=list)
    """Intent ids, in the order they landed."""
    evicted: list[str] = field(default_factory=list)
    """Intent ids whose check failed."""


class MergeTrain:
    """A speculative merge queue for one repository (see the module's text)."""

    def __init__(self, *, depth: int = 4, ttl: float = 60.0, wait: float = 600.0) -> None:
        if depth < 1:
            raise ValueError("a merge train checks at least one merge at a time (depth >= 1)")
        self.depth = depth
        self.ttl = ttl
        self.wait = wait
        self.stats = TrainStats()
        self._entries: list[_Entry] = []
        self._checks: dict[str, asyncio.Task[CheckResult]] = {}
        self._changed = asyncio.Event()
        self._runner: asyncio.Task[None] | None = None

    async def merge(self, box: Sandbox, message: str, *, strategy: str = "merge",
                    intent_id: str | None = None) -> Outcome:
        """Join the train with ``box``'s branch; returns its merge's outcome once it landed or was refused.
        Cancelling the call leaves the train, unless its merge is already being sent."""
        if self._entries and self._entries[0].box.repository != box.repository:
            raise ValueError(f"this train merges into {self._entries[0].box.repository}, not {box.repository}")
        if box.config is None or box.config.check is None:
            raise ValueError(f"{box.repository} has no check configured here (repos.toml): a train has nothing "
                             "to check; merge with box.merge(message)")
        entry = _Entry(box, message, strategy, intent_id or uuid.uuid4().hex,
                       asyncio.get_running_loop().create_future())
        self._entries.append(entry)
        self._changed.set()
        if self._runner is None or self._runner.done():
            self._runner = asyncio.create_task(self._run())
        try:
            return await asyncio.shield(entry.done)
        except asyncio.CancelledError:
            if not entry.done.done() and entry in self._entries[1:]:
                self._entries.remove(entry)
                self._changed.set()
            raise

    async def close(self) -> None:
        """Stop the train: cancel its checks; entries still waiting are answered ``cancelled``."""
        if self._runner is not None:
            self._runner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._runner
        await self._prune(set())
        for entry in self._entries:
            if not entry.done.done():
                entry.done.set_exception(asyncio.CancelledError("the merge train was closed"))
        self._entries.clear()

    async def __aenter__(self) -> MergeTrain:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _plan(self, head: str, entries: list[_Entry]) -> list[tuple[_Entry, str | None, str | None]]:
        """Each entry's (tree, commit) stacked on the ones ahead of it that merge cleanly; (None, None)
        for an entry that conflicts there or brings nothing (the tool answers it at the front). Blocking."""
        plan: list[tuple[_Entry, str | None, str | None]] = []
        top = head
        for entry in entries:
            got = entry.box.candidate(top, entry.strategy)
            if got is None:
                plan.append((entry, None, None))
                continue
            tree, commit = got
            plan.append((entry, tree, commit))
            top = commit
        return plan

    async def _check(self, entry: _Entry, commit: str) -> CheckResult:
        running = sum(1 for task in self._checks.values() if not task.done())
        self.stats.most_at_once = max(self.stats.most_at_once, running)
        config = entry.box.config
        assert config is not None
        return await run_check(entry.box.path, commit, config, check_user=entry.box.check_user)

    async def _prune(self, wanted: set[str]) -> None:
        """Forget the checks of trees no plan needs any more, killing those still running."""
        dropped = [self._checks.pop(tree) for tree in list(self._checks) if tree not in wanted]
        for task in dropped:
            if not task.done():
                task.cancel()
                self.stats.checks_cancelled += 1
        for task in dropped:
            with contextlib.suppress(BaseException):
                await task

    def _finish(self, entry: _Entry, outcome: Outcome) -> None:
        with contextlib.suppress(ValueError):
            self._entries.remove(entry)
        if not entry.done.done():
            entry.done.set_result(outcome)

    async def _run(self) -> None:
        try:
            while self._entries:
                await self._step()
        except Exception as error:  # a broken train answers every waiting entry, never hangs them
            for entry in list(self._entries):
                if not entry.done.done():
                    entry.done.set_exception(error)
            self._entries.clear()
            await self._prune(set())

    async def _step(self) -> None:
        self._changed.clear()
        front = self._entries[0]
        head = await front.box.head()
        plan = await asyncio.to_thread(self._plan, head, list(self._entries))
        wanted: set[str] = set()
        for entry, tree, commit in plan[: self.depth]:
            if tree is None or commit is None:
                continue
            wanted.add(tree)
            if tree not in self._checks:
                self._checks[tree] = asyncio.create_task(self._check(entry, commit))
                self.stats.checks_started += 1
        await self._prune(wanted)
        _, tree, _ = plan[0]
        result: CheckResult | None = None
        if tree is not None:
            task = self._checks[tree]
            if not task.done():
                changed = asyncio.create_task(self._changed.wait())
                await asyncio.wait({task, changed}, return_when=asyncio.FIRST_COMPLETED)
                changed.cancel()
                if not task.done():
                    return  # an entry joined or left: plan again (the running checks go on)
            result = task.result()
            if not result.passed:
                self._checks.pop(tree, None)
                self.stats.evicted.append(front.intent_id)
                self._finish(front, check_failed(front.intent_id, front.box.repository, result))
                return
        outcome = await self._land(front, head, result)
        if (not outcome.applied and outcome.reason == "version_conflict" and "conflicts" not in outcome.diagnostic
                and front.replans < REPLANS):
            front.replans += 1  # the head moved under the train (a merge from outside it): plan again
            return
        if outcome.applied:
            self.stats.landed.append(outcome.intent_id)
            front.box.merged.append(outcome)
        self._finish(front, outcome)

    async def _land(self, entry: _Entry, head: str, result: CheckResult | None) -> Outcome:
        box = entry.box
        args: dict[str, Any] = {"message": entry.message, "target": box.target, "strategy": entry.strategy,
                                "base": box.base, "expect_head": head}
        if result is not None:
            args |= {"expect_tree": result.tree, "check": result.command[:2000]}
        # A retry after a moved head is a new intent: the gateway answers a reused id with its first answer.
        intent = entry.intent_id if not entry.replans else f"{entry.intent_id}-retry-{entry.replans}"
        async with box.client.lease(box.repository, ttl=self.ttl, wait=self.wait, mode="exclusive") as lease:
            return await box.client.execute(lease, "merge", args, intent_id=intent)
